//! The `workers` table: which roles each worker claims, and when it was last seen (for
//! capability gaps).

use std::collections::HashMap;

use sqlx::Row;
use troupe_proto::v1 as pb;

use super::{Store, corrupt};
use crate::Error;
use crate::lifecycle::routing::{self, Offer};

impl Store {
    /// Records that `worker_id` claims `roles` (empty: every role).
    pub(crate) async fn touch_worker(
        &self,
        worker_id: &str,
        roles: &[pb::Role],
        backends: Option<&[String]>,
        now: i64,
    ) -> Result<(), Error> {
        let roles: Vec<i32> = roles.iter().map(|role| *role as i32).collect();
        // An offer of no backend is stored as `||`, apart from NULL (declares none).
        let backends =
            backends.map(|offer| routing::to_column(offer).unwrap_or_else(|| "||".into()));
        sqlx::query(
            "INSERT INTO workers (worker_id, roles, last_seen, backends) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (worker_id) DO UPDATE SET roles = excluded.roles, \
             last_seen = excluded.last_seen, backends = excluded.backends",
        )
        .bind(worker_id)
        .bind(serde_json::to_string(&roles).map_err(corrupt)?)
        .bind(now)
        .bind(backends)
        .execute(&mut *self.autocommit().await?)
        .await?;
        Ok(())
    }

    /// Returns, per role, when a worker serving it was last seen (workers serving every role
    /// count for each), among workers seen after `since`.
    pub(crate) async fn role_last_seen(&self, since: i64) -> Result<HashMap<pb::Role, i64>, Error> {
        let rows = sqlx::query("SELECT roles, last_seen FROM workers WHERE last_seen > $1")
            .bind(since)
            .fetch_all(&self.reader)
            .await?;
        let all = [
            pb::Role::Executor,
            pb::Role::Validator,
            pb::Role::TestRunner,
        ];
        let mut seen: HashMap<pb::Role, i64> = HashMap::new();
        for row in rows {
            let roles: Vec<i32> =
                serde_json::from_str(&row.try_get::<String, _>("roles")?).map_err(corrupt)?;
            let last: i64 = row.try_get("last_seen")?;
            let roles: Vec<pb::Role> = if roles.is_empty() {
                all.to_vec()
            } else {
                roles
                    .into_iter()
                    .filter_map(|role| pb::Role::try_from(role).ok())
                    .collect()
            };
            for role in roles {
                let entry = seen.entry(role).or_insert(last);
                *entry = (*entry).max(last);
            }
        }
        Ok(seen)
    }

    /// The backends offered by each worker serving `role` (or every role) seen after `since`
    /// (see [`routing::Offer`]).
    pub(crate) async fn offers(&self, role: pb::Role, since: i64) -> Result<Vec<Offer>, Error> {
        let rows = sqlx::query("SELECT roles, backends FROM workers WHERE last_seen > $1")
            .bind(since)
            .fetch_all(&self.reader)
            .await?;
        let mut out = Vec::new();
        for row in rows {
            let roles: Vec<i32> =
                serde_json::from_str(&row.try_get::<String, _>("roles")?).map_err(corrupt)?;
            if !roles.is_empty() && !roles.contains(&(role as i32)) {
                continue;
            }
            let backends: Option<String> = row.try_get("backends")?;
            out.push(backends.map(|column| routing::from_column(Some(&column))));
        }
        Ok(out)
    }
}

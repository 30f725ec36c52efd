//! The `workers` table: which roles each worker claims, and when it was last seen (for
//! capability gaps).

use std::collections::HashMap;

use sqlx::Row;
use troupe_proto::v1 as pb;

use super::{Store, corrupt};
use crate::Error;

impl Store {
    /// Records that `worker_id` claims `roles` (empty: every role).
    pub(crate) async fn touch_worker(
        &self,
        worker_id: &str,
        roles: &[pb::Role],
        now: i64,
    ) -> Result<(), Error> {
        let roles: Vec<i32> = roles.iter().map(|role| *role as i32).collect();
        sqlx::query(
            "INSERT INTO workers (worker_id, roles, last_seen) VALUES ($1, $2, $3) \
             ON CONFLICT (worker_id) DO UPDATE SET roles = excluded.roles, last_seen = excluded.last_seen",
        )
        .bind(worker_id)
        .bind(serde_json::to_string(&roles).map_err(corrupt)?)
        .bind(now)
        .execute(&self.writer)
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
}

//! Ready tasks across sessions: which session a claim goes to, and which tasks wait for a
//! role or a backend (the capability-gap scan).

use std::collections::HashMap;

use sqlx::Row;
use troupe_proto::v1::{self as pb, SessionState, TaskState};

use super::tasks::{QUALIFIED_COLUMNS, ReadyTask, role_filter, task_from_row};
use super::{Store, corrupt};
use crate::Error;
use crate::lifecycle::routing::{self, Filter, Offer};
use crate::task::Task;

impl Store {
    /// Of the active sessions with a ready task of `roles` (any when empty) that a worker
    /// offering `offer` can run, the `limit` served least recently, in that order
    /// (`updated_at`, which each claim and completion moves), read without locks: so sessions
    /// take turns (see [`crate::picks`]). The claim then
    /// queues on its group (see [`crate::group_commit`]), which takes its best ready tasks
    /// under the lock. At most one index probe per active session (`sessions_served`, then
    /// `tasks_session_ready`). A worker never picks a session for tasks it cannot run (they
    /// would stay its pick forever, and its claims come back empty).
    pub(crate) async fn pick_sessions(
        &self,
        (roles, offer): Filter<'_>,
        limit: usize,
    ) -> Result<Vec<String>, Error> {
        let role_filter = role_filter("t.role", roles, 1);
        let (routing, patterns) = routing::sql_filter("t.backends", offer, 1 + roles.len());
        // The states are constants written into the statement, not parameters: PostgreSQL's
        // generic plans (see `open_postgres`) then still know how few rows they select. A
        // scalar subquery, not `EXISTS`: PostgreSQL turns an `EXISTS` (dropping its `LIMIT`)
        // into a join over every ready task once its statistics know how many there are (20 ms
        // a pick at 50,000 ready tasks: 0.8k tasks/s instead of 3k). The order of
        // `tasks_session_ready` keeps it off reading the table until a ready task turns up: it
        // probes that index session by session, in turn order, and stops at the first hit.
        let sql = format!(
            "SELECT s.id FROM sessions s WHERE s.state = {} AND (SELECT 1 FROM tasks t \
             WHERE t.session_id = s.id AND t.state = {}{role_filter}{routing} \
             ORDER BY t.role, t.priority, t.path_ms DESC, t.created_at, t.position LIMIT 1) = 1 \
             ORDER BY s.updated_at, s.id LIMIT {limit}",
            SessionState::Active as i32,
            TaskState::Ready as i32,
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for role in roles {
            query = query.bind(*role as i32);
        }
        for pattern in patterns {
            query = query.bind(pattern);
        }
        let rows = query.fetch_all(&self.reader).await?;
        Ok(rows
            .iter()
            .map(|row| row.try_get("id"))
            .collect::<Result<_, _>>()?)
    }

    /// The ready tasks of active sessions that may be capability gaps, as (session id, task
    /// id, role, the backends a worker must offer one of): every one of `unserved` roles,
    /// and those of the roles in `offers` that name backends none of the role's live workers
    /// offers (all of them declare backends: a worker declaring none runs any task). So a
    /// busy role's ready tasks (all of a large session's, say) are not read every scan.
    pub(crate) async fn ready_tasks(
        &self,
        unserved: &[pb::Role],
        offers: &HashMap<pb::Role, Vec<Offer>>,
    ) -> Result<Vec<ReadyTask>, Error> {
        let mut parts = Vec::new();
        let mut roles: Vec<i32> = Vec::new();
        let mut patterns: Vec<String> = Vec::new();
        if !unserved.is_empty() {
            parts.push(role_filter("t.role", unserved, 1).replacen(" AND ", "", 1));
            roles.extend(unserved.iter().map(|role| *role as i32));
        }
        let mut next = 1 + roles.len();
        let mut routed: Vec<(i32, Vec<String>)> = Vec::new();
        for (role, live) in offers {
            let Some(union) = live
                .iter()
                .map(|offer| offer.as_deref())
                .collect::<Option<Vec<&[String]>>>()
            else {
                continue;
            };
            let mut names: Vec<String> = union.concat();
            names.sort();
            names.dedup();
            routed.push((*role as i32, names));
        }
        routed.sort();
        let mut routed_binds: Vec<(i32, Vec<String>)> = Vec::new();
        for (role, names) in routed {
            let mut clause = format!("(t.role = ${next} AND t.backends IS NOT NULL");
            next += 1;
            if !names.is_empty() {
                let likes: Vec<String> = (next..next + names.len())
                    .map(|i| format!("t.backends LIKE ${i}"))
                    .collect();
                next += names.len();
                clause.push_str(&format!(" AND NOT ({})", likes.join(" OR ")));
            }
            clause.push(')');
            parts.push(clause);
            routed_binds.push((role, names));
        }
        if parts.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!(
            "SELECT t.session_id, t.id, t.role, t.backends FROM tasks t \
             JOIN sessions s ON s.id = t.session_id \
             WHERE t.state = {} AND s.state = {} AND ({}) ORDER BY t.session_id, t.position",
            TaskState::Ready as i32,
            SessionState::Active as i32,
            parts.join(" OR ")
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for role in roles {
            query = query.bind(role);
        }
        for (role, names) in routed_binds {
            query = query.bind(role);
            for name in names {
                patterns.push(format!("%|{name}|%"));
            }
            for pattern in patterns.drain(..) {
                query = query.bind(pattern);
            }
        }
        let rows = query.fetch_all(&self.reader).await?;
        rows.iter()
            .map(|row| {
                Ok((
                    row.try_get("session_id")?,
                    row.try_get("id")?,
                    pb::Role::try_from(row.try_get::<i32, _>("role")?).map_err(corrupt)?,
                    routing::from_column(row.try_get::<Option<String>, _>("backends")?.as_deref()),
                ))
            })
            .collect()
    }

    /// The ready and running tasks of active sessions, without their plan objects (what the
    /// provider quotas are rebuilt from, twice a second, see [`crate::quota`]: a task's backend
    /// is its stored routes). Sessions paused keep their running tasks out.
    pub(crate) async fn live_tasks(&self) -> Result<Vec<Task>, Error> {
        // One state a half, as constants: each half is then a range of its partial index
        // (`tasks_ready`, `tasks_lease`), whose condition a parameter would not match.
        let columns = QUALIFIED_COLUMNS.replace("t.spec,", "'{}' AS spec,");
        let half = |state: TaskState| {
            format!(
                "SELECT {columns} FROM tasks t JOIN sessions s ON s.id = t.session_id \
                 WHERE t.state = {} AND s.state = {}",
                state as i32,
                SessionState::Active as i32,
            )
        };
        let sql = format!(
            "{} UNION ALL {}",
            half(TaskState::Ready),
            half(TaskState::Running)
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(&self.reader)
            .await?;
        rows.iter().map(task_from_row).collect()
    }
}

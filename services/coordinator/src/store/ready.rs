//! Ready tasks across sessions: which session a claim goes to, and which tasks wait for a
//! role (the capability-gap scan).

use sqlx::Row;
use troupe_proto::v1::{self as pb, SessionState, TaskState};

use super::tasks::role_filter;
use super::{Store, corrupt};
use crate::Error;

impl Store {
    /// Of the active sessions with a ready task of `roles` (any when empty), the one served
    /// least recently (`updated_at`, which each claim and completion moves), read without
    /// locks: so sessions take turns. The claim then queues on its group (see
    /// [`crate::group_commit`]), which takes its best ready tasks under the lock. At most one
    /// index probe per active session (`sessions_served`, then `tasks_session_state`).
    pub(crate) async fn pick_session(&self, roles: &[pb::Role]) -> Result<Option<String>, Error> {
        let role_filter = role_filter("t.role", roles, 1);
        // The states are constants written into the statement, not parameters: PostgreSQL's
        // generic plans (see `open_postgres`) then still know how few rows they select.
        let sql = format!(
            "SELECT s.id FROM sessions s WHERE s.state = {} AND EXISTS (SELECT 1 FROM tasks t \
             WHERE t.session_id = s.id AND t.state = {}{role_filter}) \
             ORDER BY s.updated_at, s.id LIMIT 1",
            SessionState::Active as i32,
            TaskState::Ready as i32,
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for role in roles {
            query = query.bind(*role as i32);
        }
        let row = query.fetch_optional(&self.reader).await?;
        Ok(row.map(|row| row.try_get("id")).transpose()?)
    }

    /// The ready tasks of `roles` in active sessions, as (session id, task id, role).
    pub(crate) async fn ready_tasks(
        &self,
        roles: &[pb::Role],
    ) -> Result<Vec<(String, String, pb::Role)>, Error> {
        let sql = format!(
            "SELECT t.session_id, t.id, t.role FROM tasks t JOIN sessions s ON s.id = t.session_id \
             WHERE t.state = {} AND s.state = {}{} ORDER BY t.session_id, t.position",
            TaskState::Ready as i32,
            SessionState::Active as i32,
            role_filter("t.role", roles, 1)
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for role in roles {
            query = query.bind(*role as i32);
        }
        let rows = query.fetch_all(&self.reader).await?;
        rows.iter()
            .map(|row| {
                Ok((
                    row.try_get("session_id")?,
                    row.try_get("id")?,
                    pb::Role::try_from(row.try_get::<i32, _>("role")?).map_err(corrupt)?,
                ))
            })
            .collect()
    }
}

//! What a session's check reads: aggregates, and no more task rows than its bounded reply
//! shows (issue 21: a check must not read every task of a large session).

use std::collections::{BTreeSet, HashMap};

use sqlx::Row;
use troupe_proto::v1::{self as pb, SessionState, TaskState};

use super::sessions::{SessionRow, load_counts, load_repos, load_session};
use super::tasks::{lite_columns, task_from_row};
use super::{Store, Tx, corrupt, to_u32};
use crate::Error;
use crate::check::MAX_LISTED;
use crate::task::Task;

/// States a bounded status graph shows ahead of the others (see [`crate::check`]).
const NOTEWORTHY: [TaskState; 5] = [
    TaskState::Running,
    TaskState::Failed,
    TaskState::TimedOut,
    TaskState::Blocked,
    TaskState::WaitingApproval,
];

/// Dependency ids looked up per statement.
const CHUNK: usize = 500;

/// The rows a session's check needs.
#[derive(Debug)]
pub(crate) struct CheckRows {
    pub(crate) session: SessionRow,
    pub(crate) repos: Vec<pb::SessionRepo>,
    /// Every task, by state.
    pub(crate) counts: pb::TaskCounts,
    /// Tasks no fix round superseded.
    pub(crate) active: u32,
    /// Task count per wave, by wave.
    pub(crate) waves: Vec<(u32, u32)>,
    /// The graph's nodes in plan order: every running task, then the first others that need
    /// attention (failed, timed out, blocked, at an approval gate), then the first of the rest,
    /// up to `max_graph` in all.
    pub(crate) shown: Vec<Task>,
    /// Whether anything can still move (see [`crate::task::stall`]).
    pub(crate) moving: bool,
    /// When nothing moves: the first [`MAX_LISTED`] pending or blocked tasks.
    pub(crate) stuck: Vec<Task>,
    /// The state of each dependency of `shown` and `stuck` (absent: no such task).
    pub(crate) dep_states: HashMap<String, TaskState>,
}

fn states_sql(states: &[TaskState]) -> String {
    states
        .iter()
        .map(|state| (*state as i32).to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Store {
    /// Reads what [`crate::check::status`] reports of a session, with at most `max_graph`
    /// non-noteworthy tasks and [`MAX_LISTED`] stuck ones.
    pub(crate) async fn check_rows(
        &self,
        session_id: &str,
        max_graph: usize,
        now_ms: i64,
    ) -> Result<CheckRows, Error> {
        let mut tx = self.begin_read().await?;
        let session = load_session(&mut tx, session_id).await?;
        let repos = load_repos(&mut tx, session_id).await?;
        let counts = load_counts(&mut tx, session_id).await?;
        let active: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM tasks WHERE session_id = $1 AND superseded_by = ''",
        )
        .bind(session_id)
        .fetch_one(&mut *tx)
        .await?;
        let waves = sqlx::query(
            "SELECT wave, COUNT(*) AS n FROM tasks WHERE session_id = $1 GROUP BY wave ORDER BY wave",
        )
        .bind(session_id)
        .fetch_all(&mut *tx)
        .await?
        .iter()
        .map(|row| Ok((to_u32(row.try_get("wave")?), to_u32(row.try_get("n")?))))
        .collect::<Result<Vec<_>, Error>>()?;
        // Every running task (one per busy worker), then the others that need attention, then
        // the rest, up to `max_graph` in all.
        let mut shown = select_tasks(
            &mut tx,
            session_id,
            &format!("state = {}", TaskState::Running as i32),
            None,
        )
        .await?;
        let attention = states_sql(&NOTEWORTHY[1..]);
        for condition in [
            format!("state IN ({attention})"),
            format!("state NOT IN ({})", states_sql(&NOTEWORTHY)),
        ] {
            let room = max_graph.saturating_sub(shown.len());
            if room > 0 {
                shown.extend(select_tasks(&mut tx, session_id, &condition, Some(room)).await?);
            }
        }
        shown.sort_by_key(|task| task.position);
        let moving = counts.ready + counts.running + counts.waiting_approval > 0
            || {
                let waiting: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM tasks WHERE session_id = $1 AND state = $2 AND not_before > $3",
            )
            .bind(session_id)
            .bind(TaskState::Pending as i32)
            .bind(now_ms)
            .fetch_one(&mut *tx)
            .await?;
                waiting > 0
            };
        let stuck = if moving
            || matches!(
                session.state,
                SessionState::Completed | SessionState::Cancelled
            ) {
            Vec::new()
        } else {
            let states = states_sql(&[TaskState::Pending, TaskState::Blocked]);
            select_tasks(
                &mut tx,
                session_id,
                &format!("state IN ({states})"),
                Some(MAX_LISTED),
            )
            .await?
        };
        let deps: BTreeSet<&str> = shown
            .iter()
            .chain(&stuck)
            .flat_map(|task| task.depends_on.iter().map(String::as_str))
            .collect();
        let dep_states = dep_states(&mut tx, session_id, &deps).await?;
        tx.commit().await?;
        Ok(CheckRows {
            session,
            repos,
            counts,
            active: to_u32(active),
            waves,
            shown,
            moving,
            stuck,
            dep_states,
        })
    }

    /// The ready tasks of a session per role: role and count.
    pub(crate) async fn ready_roles(
        &self,
        session_id: &str,
    ) -> Result<Vec<(pb::Role, u32)>, Error> {
        let rows = sqlx::query(
            "SELECT role, COUNT(*) AS n FROM tasks WHERE session_id = $1 AND state = $2 GROUP BY role ORDER BY role",
        )
        .bind(session_id)
        .bind(TaskState::Ready as i32)
        .fetch_all(&self.reader)
        .await?;
        rows.iter()
            .map(|row| {
                let role = pb::Role::try_from(row.try_get::<i32, _>("role")?).map_err(corrupt)?;
                Ok((role, to_u32(row.try_get("n")?)))
            })
            .collect()
    }

    /// The routes (`backends` column, `None` for none) of a role's ready tasks in a session,
    /// with how many tasks have each.
    pub(crate) async fn ready_routes(
        &self,
        session_id: &str,
        role: pb::Role,
    ) -> Result<Vec<(Option<String>, u32)>, Error> {
        let rows = sqlx::query(
            "SELECT backends, COUNT(*) AS n FROM tasks WHERE session_id = $1 AND state = $2 \
             AND role = $3 GROUP BY backends",
        )
        .bind(session_id)
        .bind(TaskState::Ready as i32)
        .bind(role as i32)
        .fetch_all(&self.reader)
        .await?;
        rows.iter()
            .map(|row| Ok((row.try_get("backends")?, to_u32(row.try_get("n")?))))
            .collect()
    }

    /// The first `limit` ready tasks of a role in a session in plan order, those with the
    /// routes column `backends` only when given: (position, id).
    pub(crate) async fn ready_ids(
        &self,
        session_id: &str,
        role: pb::Role,
        backends: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(i64, String)>, Error> {
        let route = if backends.is_some() {
            " AND backends = $5"
        } else {
            ""
        };
        let mut query = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT position, id FROM tasks WHERE session_id = $1 AND state = $2 AND role = $3{route} \
             ORDER BY position LIMIT $4"
        )))
        .bind(session_id)
        .bind(TaskState::Ready as i32)
        .bind(role as i32)
        .bind(i64::try_from(limit).unwrap_or(i64::MAX));
        if let Some(backends) = backends {
            query = query.bind(backends);
        }
        let rows = query.fetch_all(&self.reader).await?;
        rows.iter()
            .map(|row| Ok((row.try_get("position")?, row.try_get("id")?)))
            .collect()
    }
}

/// A session's tasks (without specs) matching `condition`, in plan order, at most `limit`.
async fn select_tasks(
    tx: &mut Tx,
    session_id: &str,
    condition: &str,
    limit: Option<usize>,
) -> Result<Vec<Task>, Error> {
    let columns = lite_columns();
    let limit = limit.map_or(String::new(), |limit| format!(" LIMIT {limit}"));
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {columns} FROM tasks WHERE session_id = $1 AND {condition} ORDER BY position{limit}"
    )))
    .bind(session_id)
    .fetch_all(&mut **tx)
    .await?;
    rows.iter().map(task_from_row).collect()
}

/// The states of the tasks `ids` of a session that exist.
async fn dep_states(
    tx: &mut Tx,
    session_id: &str,
    ids: &BTreeSet<&str>,
) -> Result<HashMap<String, TaskState>, Error> {
    let ids: Vec<&str> = ids.iter().copied().collect();
    let mut states = HashMap::new();
    for chunk in ids.chunks(CHUNK) {
        let params: Vec<String> = (0..chunk.len()).map(|i| format!("${}", i + 2)).collect();
        let mut query = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT id, state FROM tasks WHERE session_id = $1 AND id IN ({})",
            params.join(", ")
        )))
        .bind(session_id);
        for id in chunk {
            query = query.bind(*id);
        }
        for row in query.fetch_all(&mut **tx).await? {
            let state = TaskState::try_from(row.try_get::<i32, _>("state")?).map_err(corrupt)?;
            states.insert(row.try_get("id")?, state);
        }
    }
    Ok(states)
}

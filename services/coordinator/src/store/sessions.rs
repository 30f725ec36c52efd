//! The `sessions` table, with each session's repositories (`session_repos`) and the plan
//! assets it names (`plan_assets`).

use std::collections::HashMap;

use sqlx::Row;
use sqlx::any::AnyRow;
use troupe_plan::{Mode, OnFailure};
use troupe_proto::v1::{self as pb, SessionState, TaskState, session_event::Kind};

use super::events::append_event;
use super::tasks::{TaskFilter, list_tasks, repo_stats};
use super::{Dialect, Store, Tx, corrupt, to_u32};
use crate::Error;
use crate::task::Task;
use crate::task::session_state_name;

const SESSION_COLUMNS: &str =
    "id, name, description, state, mode, on_failure, plan_dir, last_seq, created_at, updated_at";

/// A session row.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SessionRow {
    pub(crate) id: String,
    pub(crate) name: String,
    pub(crate) description: String,
    pub(crate) state: SessionState,
    pub(crate) mode: Mode,
    pub(crate) on_failure: OnFailure,
    pub(crate) plan_dir: String,
    pub(crate) last_seq: u64,
    pub(crate) created_at: i64,
    pub(crate) updated_at: i64,
}

/// Everything a new session stores.
#[derive(Debug)]
pub(crate) struct NewSession {
    pub(crate) session: SessionRow,
    pub(crate) plan_json: String,
    pub(crate) repos: Vec<pb::SessionRepo>,
    /// The plan's files: their digest and encoded bundle (see `troupe_grpc::assets`).
    pub(crate) assets: Option<(String, Vec<u8>)>,
    /// Tasks in topological order: pending, or completed when imported so.
    pub(crate) tasks: Vec<Task>,
}

/// What never changes about a stored session and every claim hands out.
#[derive(Debug, Clone)]
pub(crate) struct Fixed {
    pub(crate) repos: Vec<pb::SessionRepo>,
    pub(crate) assets_digest: String,
    /// Whether the plan asked for any approval gate (they are stored at intake only): a
    /// session without one skips looking them up whenever a task becomes ready.
    pub(crate) gated: bool,
}

/// A session with its repositories and tasks (topological order).
#[derive(Debug)]
pub(crate) struct SessionView {
    pub(crate) session: SessionRow,
    pub(crate) repos: Vec<pb::SessionRepo>,
    pub(crate) tasks: Vec<Task>,
}

/// A session with its repositories (their counts and heads filled in), the counts of all its
/// tasks, and one page of them.
#[derive(Debug)]
pub(crate) struct SessionPage {
    pub(crate) session: SessionRow,
    pub(crate) repos: Vec<pb::SessionRepo>,
    pub(crate) counts: pb::TaskCounts,
    pub(crate) tasks: Vec<Task>,
    /// More tasks follow: the position of the page's last task.
    pub(crate) next: Option<i64>,
}

/// A session with its repositories and task counts.
#[derive(Debug)]
pub(crate) struct SessionSummary {
    pub(crate) session: SessionRow,
    pub(crate) repos: Vec<pb::SessionRepo>,
    pub(crate) counts: pb::TaskCounts,
}

impl Store {
    /// A session's repositories, assets digest and whether it has gates, from the cache once
    /// read (they never change).
    pub(crate) async fn fixed(&self, tx: &mut Tx, session_id: &str) -> Result<Fixed, Error> {
        if let Some(fixed) = self.cached_repos().get(session_id) {
            return Ok(fixed.clone());
        }
        let repos = load_repos(tx, session_id).await?;
        let assets_digest: String =
            sqlx::query_scalar("SELECT assets_digest FROM sessions WHERE id = $1")
                .bind(session_id)
                .fetch_one(&mut **tx)
                .await?;
        let gates: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM gates WHERE session_id = $1")
            .bind(session_id)
            .fetch_one(&mut **tx)
            .await?;
        let fixed = Fixed {
            repos,
            assets_digest,
            gated: gates > 0,
        };
        self.remember_fixed(session_id, fixed.clone());
        Ok(fixed)
    }

    /// Keeps what [`Self::fixed`] returns for a session, as stored (an intake knows it: the
    /// session's first claims then read nothing of it).
    pub(crate) fn remember_fixed(&self, session_id: &str, fixed: Fixed) {
        let mut cache = self.cached_repos();
        // Bounded: finished sessions' entries are dropped wholesale now and then.
        if cache.len() >= 4096 {
            cache.clear();
        }
        cache.insert(session_id.to_owned(), fixed);
    }

    fn cached_repos(&self) -> std::sync::MutexGuard<'_, HashMap<String, Fixed>> {
        // A poisoned cache holds nothing wrong: the data is immutable.
        self.repos
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The bundle of plan assets stored under `digest`, encoded, if there is one.
    pub(crate) async fn plan_assets(&self, digest: &str) -> Result<Option<Vec<u8>>, Error> {
        use base64::Engine;
        let mut tx = self.begin().await?;
        let bundle: Option<String> =
            sqlx::query_scalar("SELECT bundle FROM plan_assets WHERE digest = $1")
                .bind(digest)
                .fetch_optional(&mut *tx)
                .await?;
        tx.commit().await?;
        bundle
            .map(|text| {
                base64::engine::general_purpose::STANDARD
                    .decode(text)
                    .map_err(corrupt)
            })
            .transpose()
    }

    /// A session with its counts and the first `max_tasks` of its tasks, reading no more
    /// than that page of tasks whole.
    pub(crate) async fn session_page(
        &self,
        session_id: &str,
        max_tasks: usize,
    ) -> Result<SessionPage, Error> {
        let mut tx = self.begin_read().await?;
        let session = load_session(&mut tx, session_id).await?;
        let mut repos = load_repos(&mut tx, session_id).await?;
        let counts = load_counts(&mut tx, session_id).await?;
        let mut stats = repo_stats(&mut tx, session_id).await?;
        for repo in &mut repos {
            let (counts, _, head) = stats.remove(&repo.name).unwrap_or_default();
            repo.counts = Some(counts);
            repo.head = head;
        }
        let (tasks, more) =
            list_tasks(&mut tx, session_id, &TaskFilter::default(), None, max_tasks).await?;
        tx.commit().await?;
        let next = more
            .then(|| tasks.last().map(|task| task.position))
            .flatten();
        Ok(SessionPage {
            session,
            repos,
            counts,
            tasks,
            next,
        })
    }

    /// A page of a session's tasks matching `filter` (see [`list_tasks`]); NOT_FOUND for an
    /// unknown session.
    pub(crate) async fn task_page(
        &self,
        session_id: &str,
        filter: &TaskFilter,
        after: Option<i64>,
        limit: usize,
    ) -> Result<(Vec<Task>, Option<i64>), Error> {
        let mut tx = self.begin_read().await?;
        load_session(&mut tx, session_id).await?;
        let (tasks, more) = list_tasks(&mut tx, session_id, filter, after, limit).await?;
        tx.commit().await?;
        let next = more
            .then(|| tasks.last().map(|task| task.position))
            .flatten();
        Ok((tasks, next))
    }

    /// Lists sessions, newest first.
    pub(crate) async fn list_sessions(
        &self,
        state: Option<SessionState>,
        limit: u32,
    ) -> Result<Vec<SessionSummary>, Error> {
        let mut tx = self.begin_read().await?;
        let rows = match state {
            Some(state) => {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT {SESSION_COLUMNS} FROM sessions WHERE state = $1 ORDER BY created_at DESC, id DESC LIMIT $2"
                )))
                .bind(state as i32)
                .bind(i64::from(limit))
                .fetch_all(&mut *tx)
                .await?
            }
            None => {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT {SESSION_COLUMNS} FROM sessions ORDER BY created_at DESC, id DESC LIMIT $1"
                )))
                .bind(i64::from(limit))
                .fetch_all(&mut *tx)
                .await?
            }
        };
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let session = session_from_row(&row)?;
            let repos = load_repos(&mut tx, &session.id).await?;
            let counts = load_counts(&mut tx, &session.id).await?;
            out.push(SessionSummary {
                session,
                repos,
                counts,
            });
        }
        tx.commit().await?;
        Ok(out)
    }

    /// Returns a session's state and last sequence.
    pub(crate) async fn session_head(
        &self,
        session_id: &str,
    ) -> Result<(SessionState, u64), Error> {
        let mut conn = self.reader.acquire().await?;
        let row = sqlx::query("SELECT state, last_seq FROM sessions WHERE id = $1")
            .bind(session_id)
            .fetch_optional(&mut *conn)
            .await?
            .ok_or_else(|| Error::NotFound(format!("session {session_id} not found")))?;
        let state = SessionState::try_from(row.try_get::<i32, _>("state")?).map_err(corrupt)?;
        let last: i64 = row.try_get("last_seq")?;
        Ok((state, u64::try_from(last).unwrap_or(0)))
    }
}

/// Inserts a new session's row (active), its repositories and its plan assets (stored once
/// per digest); its tasks and events are the caller's.
pub(crate) async fn insert_session(tx: &mut Tx, new: &NewSession, now: i64) -> Result<(), Error> {
    let session = &new.session;
    sqlx::query(
        "INSERT INTO sessions (id, name, description, state, mode, on_failure, plan_dir, last_seq, msg_counter, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, 0, 0, $8, $8)",
    )
    .bind(&session.id)
    .bind(&session.name)
    .bind(&session.description)
    .bind(SessionState::Active as i32)
    .bind(session.mode.as_str())
    .bind(session.on_failure.as_str())
    .bind(&session.plan_dir)
    .bind(now)
    .execute(&mut **tx)
    .await?;
    // Apart from the row every batch reads and writes (see migration 12).
    sqlx::query("INSERT INTO session_plans (session_id, plan_json) VALUES ($1, $2)")
        .bind(&session.id)
        .bind(&new.plan_json)
        .execute(&mut **tx)
        .await?;
    if let Some((digest, bundle)) = &new.assets {
        use base64::Engine;
        sqlx::query(
            "INSERT INTO plan_assets (digest, bundle, size, created_at) VALUES ($1, $2, $3, $4) ON CONFLICT (digest) DO NOTHING",
        )
        .bind(digest)
        .bind(base64::engine::general_purpose::STANDARD.encode(bundle))
        .bind(i64::try_from(bundle.len()).unwrap_or(i64::MAX))
        .bind(now)
        .execute(&mut **tx)
        .await?;
        sqlx::query("UPDATE sessions SET assets_digest = $1 WHERE id = $2")
            .bind(digest)
            .bind(&session.id)
            .execute(&mut **tx)
            .await?;
    }
    for (position, repo) in new.repos.iter().enumerate() {
        sqlx::query(
            "INSERT INTO session_repos (session_id, name, position, path, base_commit, branch, url, access) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(&session.id)
        .bind(&repo.name)
        .bind(i64::try_from(position).unwrap_or(i64::MAX))
        .bind(&repo.path)
        .bind(&repo.base_commit)
        .bind(&repo.branch)
        .bind(&repo.url)
        .bind(repo.access)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

pub(crate) async fn load_session(tx: &mut Tx, session_id: &str) -> Result<SessionRow, Error> {
    lock_and_load_session(tx, session_id, "").await
}

/// [`lock_session`] and [`load_session`] in one statement.
pub(crate) async fn lock_and_load_session(
    tx: &mut Tx,
    session_id: &str,
    lock: &str,
) -> Result<SessionRow, Error> {
    // Its `last_seq` counts the events held back so far.
    tx.flush_events(Some(session_id)).await?;
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {SESSION_COLUMNS} FROM sessions WHERE id = $1{lock}"
    )))
    .bind(session_id)
    .fetch_optional(&mut **tx)
    .await?
    .ok_or_else(|| Error::NotFound(format!("session {session_id} not found")))?;
    let session = session_from_row(&row)?;
    // Held from here to the commit: SQLite's writer holds the whole database; PostgreSQL
    // holds the row when it was read `FOR UPDATE`.
    let held = match tx.dialect {
        Dialect::Sqlite => tx.writes,
        Dialect::Postgres => lock.contains("FOR UPDATE"),
    };
    if held {
        tx.sequences.insert(session_id.to_owned(), session.last_seq);
    }
    Ok(session)
}

/// The session's `last_seq` once `tx`'s held-back events of it are written: the sequence what
/// `tx` wrote is as of, when it commits.
pub(crate) async fn sequence_after(tx: &mut Tx, session_id: &str) -> Result<u64, Error> {
    tx.flush_events(Some(session_id)).await?;
    let last: i64 = sqlx::query_scalar("SELECT last_seq FROM sessions WHERE id = $1")
        .bind(session_id)
        .fetch_one(&mut **tx)
        .await?;
    u64::try_from(last).map_err(corrupt)
}

/// [`load_session`] with the number of the session's tasks, in one statement.
pub(crate) async fn load_session_sized(
    tx: &mut Tx,
    session_id: &str,
) -> Result<(SessionRow, usize), Error> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {SESSION_COLUMNS}, (SELECT COUNT(*) FROM tasks WHERE session_id = $1) AS task_count \
         FROM sessions WHERE id = $1"
    )))
    .bind(session_id)
    .fetch_optional(&mut **tx)
    .await?
    .ok_or_else(|| Error::NotFound(format!("session {session_id} not found")))?;
    let count: i64 = row.try_get("task_count")?;
    Ok((
        session_from_row(&row)?,
        usize::try_from(count).map_err(corrupt)?,
    ))
}

/// Checks a session exists and, in write transactions on PostgreSQL, locks its row: every
/// writer of a session takes this lock first (claims take several in id order), so writers
/// of one session are serialised and never wait on each other crosswise.
pub(crate) async fn lock_session(tx: &mut Tx, session_id: &str, lock: &str) -> Result<(), Error> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM sessions WHERE id = $1{lock}"
    )))
    .bind(session_id)
    .fetch_optional(&mut **tx)
    .await?
    .ok_or_else(|| Error::NotFound(format!("session {session_id} not found")))?;
    Ok(())
}

fn session_from_row(row: &AnyRow) -> Result<SessionRow, Error> {
    let mode: String = row.try_get("mode")?;
    let on_failure: String = row.try_get("on_failure")?;
    Ok(SessionRow {
        id: row.try_get("id")?,
        name: row.try_get("name")?,
        description: row.try_get("description")?,
        state: SessionState::try_from(row.try_get::<i32, _>("state")?).map_err(corrupt)?,
        mode: Mode::parse(&mode).ok_or_else(|| corrupt(format!("mode {mode}")))?,
        on_failure: OnFailure::parse(&on_failure)
            .ok_or_else(|| corrupt(format!("on_failure {on_failure}")))?,
        plan_dir: row.try_get("plan_dir")?,
        last_seq: u64::try_from(row.try_get::<i64, _>("last_seq")?).map_err(corrupt)?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
    })
}

/// A session as it now stands in this transaction, with its repositories and task counts.
pub(crate) async fn load_summary(tx: &mut Tx, session_id: &str) -> Result<SessionSummary, Error> {
    Ok(SessionSummary {
        session: load_session(tx, session_id).await?,
        repos: load_repos(tx, session_id).await?,
        counts: load_counts(tx, session_id).await?,
    })
}

pub(super) async fn load_repos(
    tx: &mut Tx,
    session_id: &str,
) -> Result<Vec<pb::SessionRepo>, Error> {
    let rows = sqlx::query(
        "SELECT name, path, base_commit, branch, url, access FROM session_repos WHERE session_id = $1 ORDER BY position",
    )
    .bind(session_id)
    .fetch_all(&mut **tx)
    .await?;
    rows.iter()
        .map(|row| {
            Ok(pb::SessionRepo {
                name: row.try_get("name")?,
                path: row.try_get("path")?,
                base_commit: row.try_get("base_commit")?,
                branch: row.try_get("branch")?,
                url: row.try_get("url")?,
                access: row.try_get("access")?,
                ..pb::SessionRepo::default()
            })
        })
        .collect()
}

pub(super) async fn load_counts(tx: &mut Tx, session_id: &str) -> Result<pb::TaskCounts, Error> {
    let rows =
        sqlx::query("SELECT state, COUNT(*) AS n FROM tasks WHERE session_id = $1 GROUP BY state")
            .bind(session_id)
            .fetch_all(&mut **tx)
            .await?;
    counts_from_rows(&rows)
}

fn counts_from_rows(rows: &[AnyRow]) -> Result<pb::TaskCounts, Error> {
    let mut counts = pb::TaskCounts::default();
    for row in rows {
        let state = TaskState::try_from(row.try_get::<i32, _>("state")?).map_err(corrupt)?;
        let n = to_u32(row.try_get::<i64, _>("n")?);
        add_count(&mut counts, state, n);
    }
    Ok(counts)
}

/// Adds `n` tasks in `state` to `counts`.
pub(crate) fn add_count(counts: &mut pb::TaskCounts, state: TaskState, n: u32) {
    counts.total += n;
    let slot = match state {
        TaskState::Pending => &mut counts.pending,
        TaskState::Ready => &mut counts.ready,
        TaskState::Running => &mut counts.running,
        TaskState::Completed => &mut counts.completed,
        TaskState::Failed => &mut counts.failed,
        TaskState::Skipped => &mut counts.skipped,
        TaskState::Cancelled => &mut counts.cancelled,
        TaskState::TimedOut => &mut counts.timed_out,
        TaskState::Blocked => &mut counts.blocked,
        TaskState::WaitingApproval => &mut counts.waiting_approval,
        TaskState::Unspecified => return,
    };
    *slot += n;
}

pub(crate) async fn set_session_state(
    tx: &mut Tx,
    session: &mut SessionRow,
    to: SessionState,
    reason: &str,
    now: i64,
) -> Result<(), Error> {
    let from = session.state;
    if tx.sequences.contains_key(&session.id) {
        // Its counter known, the write of the event below moves the session's sequence: the
        // state goes out with it (no statement of its own, which an optimistic write could
        // not send). Every read of the session's row in `tx` writes the events first.
        tx.states.insert(session.id.clone(), to);
    } else {
        sqlx::query("UPDATE sessions SET state = $2, updated_at = $3 WHERE id = $1")
            .bind(&session.id)
            .bind(to as i32)
            .bind(now)
            .execute(&mut **tx)
            .await?;
    }
    session.state = to;
    append_event(
        tx,
        &session.id,
        now,
        Kind::Session(pb::SessionTransition {
            from: from as i32,
            to: to as i32,
            reason: reason.to_owned(),
        }),
    )
    .await?;
    tracing::info!(session_id = %session.id, from = session_state_name(from), to = session_state_name(to), reason, "session transition");
    Ok(())
}

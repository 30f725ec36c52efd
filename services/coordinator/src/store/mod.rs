//! The store: every SQL statement of the coordinator lives here, behind [`Store`], one module
//! per table: [`sessions`] (with their repositories and plan assets), [`tasks`], [`events`],
//! [`messages`] (with role state) and [`workers`]; [`migrations`] is the schema and
//! [`transactions`] the transaction they all run in.
//!
//! One set of statements (sqlx `Any`, `$n` parameters, `ON CONFLICT`, `RETURNING`) and one set
//! of migrations serve SQLite and PostgreSQL. SQLite (the default) runs in WAL mode with one
//! writer connection (SQLite serialises writers anyway; `BEGIN IMMEDIATE` never waits on
//! ourselves) and a small reader pool. PostgreSQL has one shared pool, and several
//! coordinators may use the same database: every writer of a session first locks the session
//! row (`FOR UPDATE`; a claim first picks its session without locks, then locks it and
//! re-reads its ready tasks), and `pg_notify` wakes the other coordinators' long polls. Each
//! state change is one transaction that also appends its events with the session's gap-free
//! sequence (`sessions.last_seq`, moved under the row lock); events are held back in the
//! [`Tx`] and written once, just before the commit.

use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

use prost::Message as _;
use serde_json::{Map, Value};
use sqlx::AnyPool;
use sqlx::ConnectOptions as _;
use sqlx::Row as _;
use sqlx::any::AnyPoolOptions;
use sqlx::sqlite::SqliteConnectOptions;
use troupe_proto::v1::{self as pb, SessionState, TaskState, session_event::Kind};

use crate::Error;
use crate::rounds;
use crate::task::{self, Task, session_state_name};

mod cache;
pub(crate) mod events;
mod lifecycle;
pub(crate) mod messages;
mod migrations;
pub(crate) mod sessions;
pub(crate) mod tasks;
mod transactions;
mod workers;

pub(crate) use cache::{TaskCache, load_cache_in};
use events::*;
use messages::*;
use sessions::*;
use tasks::*;
use transactions::Conn;
pub(crate) use transactions::Tx;

/// Which database a [`Store`] talks to; the few statements that differ ask it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dialect {
    /// SQLite in WAL mode: one writer connection, `BEGIN IMMEDIATE` serialises writers.
    Sqlite,
    /// PostgreSQL: a shared pool; row locks (`FOR UPDATE`) serialise writers
    /// per session, so several coordinators can share one database.
    Postgres,
}

/// The store over SQLite or PostgreSQL (sqlx `Any`, so one set of statements serves both).
#[derive(Debug, Clone)]
pub(crate) struct Store {
    writer: AnyPool,
    reader: AnyPool,
    dialect: Dialect,
    /// The PostgreSQL URL, for the change listener.
    url: Option<String>,
    /// Each session's repositories and plan assets digest, which never change once stored:
    /// claims skip the queries.
    repos: std::sync::Arc<std::sync::Mutex<HashMap<String, Fixed>>>,
}

/// Channel of the PostgreSQL notifications that wake other coordinators' long polls.
pub(crate) const CHANGES_CHANNEL: &str = "troupe_changes";

impl Store {
    /// Opens (creating if needed) the database at a `sqlite:` URL and applies migrations.
    pub(crate) async fn open_url(url: &str) -> Result<Self, Error> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            return Self::open_postgres(url).await;
        }
        Self::open_sqlite(SqliteConnectOptions::from_str(url)?).await
    }

    /// Opens (creating if needed) the SQLite database file at `path` and applies migrations.
    pub(crate) async fn open_file(path: &std::path::Path) -> Result<Self, Error> {
        Self::open_sqlite(SqliteConnectOptions::new().filename(path)).await
    }

    async fn open_sqlite(options: SqliteConnectOptions) -> Result<Self, Error> {
        sqlx::any::install_default_drivers();
        // `Any` connects by URL; the SQLite URL keeps the file name percent-encoded.
        let url = options.create_if_missing(true).to_url_lossy().to_string();
        let pragmas = |pool: AnyPoolOptions| {
            pool.after_connect(|conn, _meta| {
                Box::pin(async move {
                    sqlx::raw_sql(
                        "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; \
                         PRAGMA busy_timeout = 10000; PRAGMA foreign_keys = ON;",
                    )
                    .execute(&mut *conn)
                    .await?;
                    Ok(())
                })
            })
        };
        // No ping before each acquire (sqlx's default): it costs a round trip per transaction,
        // and a dead connection fails its statement just the same.
        let writer = pragmas(AnyPoolOptions::new().test_before_acquire(false))
            .max_connections(1)
            .min_connections(1)
            .acquire_timeout(Duration::from_secs(30))
            .connect(&url)
            .await?;
        let store = Self {
            writer: writer.clone(),
            reader: writer.clone(),
            dialect: Dialect::Sqlite,
            url: None,
            repos: Default::default(),
        };
        store.migrate().await?;
        let reader = pragmas(AnyPoolOptions::new().test_before_acquire(false))
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(30))
            .connect(&url)
            .await?;
        Ok(Self { reader, ..store })
    }

    async fn open_postgres(url: &str) -> Result<Self, Error> {
        sqlx::any::install_default_drivers();
        // No ping before each acquire (see `open_sqlite`). Generic plans: every statement is
        // prepared once per connection and its shape fixes its index, so re-planning it for
        // each execution's values (PostgreSQL's first five, and whenever a custom plan looks
        // cheaper) only costs time; S1 measured 20 to 25% more throughput without it.
        let pool = AnyPoolOptions::new()
            .test_before_acquire(false)
            .after_connect(|conn, _meta| {
                Box::pin(async move {
                    sqlx::raw_sql("SET plan_cache_mode = force_generic_plan")
                        .execute(&mut *conn)
                        .await?;
                    Ok(())
                })
            })
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(30))
            .connect(url)
            .await?;
        let store = Self {
            writer: pool.clone(),
            reader: pool,
            dialect: Dialect::Postgres,
            url: Some(url.to_owned()),
            repos: Default::default(),
        };
        store.migrate().await?;
        Ok(store)
    }

    pub(crate) fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// Returns the PostgreSQL URL (for the change listener), `None` on SQLite.
    pub(crate) fn postgres_url(&self) -> Option<&str> {
        self.url.as_deref()
    }

    /// Tells other coordinators on the same PostgreSQL that something changed; `origin`
    /// (the payload) lets this coordinator ignore its own notifications.
    pub(crate) async fn publish_change(&self, origin: &str) -> Result<(), Error> {
        if self.dialect == Dialect::Postgres {
            sqlx::query("SELECT pg_notify($1, $2)")
                .bind(CHANGES_CHANNEL)
                .bind(origin)
                .execute(&self.writer)
                .await?;
        }
        Ok(())
    }

    /// Row-lock suffix of a `SELECT` inside a write transaction: PostgreSQL locks the rows,
    /// SQLite already holds the database's write lock (`BEGIN IMMEDIATE`).
    pub(crate) fn for_update(&self) -> &'static str {
        match self.dialect {
            Dialect::Sqlite => "",
            Dialect::Postgres => " FOR UPDATE",
        }
    }
}

fn corrupt(what: impl std::fmt::Display) -> Error {
    Error::Corrupt(what.to_string())
}

fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn to_u32(value: i64) -> u32 {
    u32::try_from(value).unwrap_or(0)
}

fn parse_object(text: &str) -> Result<Map<String, Value>, Error> {
    match serde_json::from_str::<Value>(text).map_err(corrupt)? {
        Value::Object(object) => Ok(object),
        other => Err(corrupt(format!("expected a json object, got {other}"))),
    }
}

// ----- state changes (moving to `crate::lifecycle`) ---------------------------------

/// A task a claim handed out.
#[derive(Debug)]
pub(crate) struct Claimed {
    pub(crate) task: Task,
    pub(crate) repo: Option<pb::SessionRepo>,
    /// Every repository of the session.
    pub(crate) repos: Vec<pb::SessionRepo>,
    /// The digest of the session's plan assets ('' for none).
    pub(crate) assets_digest: String,
    pub(crate) plan_dir: String,
    pub(crate) upstream: Vec<Task>,
}

/// Puts a ready task under a new lease for `claim`: the next attempt and fencing token.
fn lease(task: &mut Task, claim: &ClaimRequest) -> pb::TaskTransition {
    task.attempt += 1;
    task.fencing_token += 1;
    task.worker_id = claim.worker_id.clone();
    task.lease_ms = claim.lease_ms;
    task.started_at = Some(claim.now);
    task.progress.clear();
    let transition = task::transition(task, TaskState::Running, "claimed", claim.now);
    task.lease_expires_at = Some(claim.now + claim.lease_ms);
    transition
}

/// One `ClaimTasks` as the store sees it.
#[derive(Debug, Clone)]
pub(crate) struct ClaimRequest {
    pub(crate) worker_id: String,
    /// Any role when empty.
    pub(crate) roles: Vec<pb::Role>,
    pub(crate) max: u32,
    pub(crate) lease_ms: i64,
    pub(crate) now: i64,
}

fn stale(task: &Task, token: u64) -> Error {
    Error::FailedPrecondition(format!(
        "stale fencing token {token} for task {} (state {}, current token {})",
        task.id,
        task::state_name(task.state),
        task.fencing_token
    ))
}

impl Store {
    /// Stores a new session with its repos and tasks and releases its first tasks, atomically.
    pub(crate) async fn insert_session(&self, new: NewSession, now: i64) -> Result<(), Error> {
        let mut tx = self.begin().await?;
        let session = &new.session;
        sqlx::query(
            "INSERT INTO sessions (id, name, description, state, mode, on_failure, plan_json, plan_dir, last_seq, msg_counter, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 0, 0, $9, $9)",
        )
        .bind(&session.id)
        .bind(&session.name)
        .bind(&session.description)
        .bind(SessionState::Active as i32)
        .bind(session.mode.as_str())
        .bind(session.on_failure.as_str())
        .bind(&new.plan_json)
        .bind(&session.plan_dir)
        .bind(now)
        .execute(&mut *tx)
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
            .execute(&mut *tx)
            .await?;
            sqlx::query("UPDATE sessions SET assets_digest = $1 WHERE id = $2")
                .bind(digest)
                .bind(&session.id)
                .execute(&mut *tx)
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
            .execute(&mut *tx)
            .await?;
        }
        append_event(
            &mut tx,
            &session.id,
            now,
            Kind::Session(pb::SessionTransition {
                from: SessionState::Unspecified as i32,
                to: SessionState::Active as i32,
                reason: "session created".to_owned(),
            }),
        )
        .await?;
        let mut transitions = Vec::new();
        for task in &new.tasks {
            insert_task(&mut tx, task).await?;
            transitions.push(pb::TaskTransition {
                task_id: task.id.clone(),
                from: TaskState::Unspecified as i32,
                to: task.state as i32,
                attempt: 0,
                worker_id: String::new(),
                reason: if task.state == TaskState::Completed {
                    "task imported as completed".to_owned()
                } else {
                    "task created".to_owned()
                },
            });
        }
        let mut active = session.clone();
        active.state = SessionState::Active;
        let before = new.tasks.clone();
        let mut tasks = new.tasks;
        save(&mut tx, &mut active, &before, &mut tasks, transitions, now).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Cancels every non-terminal task and the session.
    pub(crate) async fn cancel_session(
        &self,
        session_id: &str,
        reason: &str,
        now: i64,
    ) -> Result<SessionSummary, Error> {
        let mut tx = self.begin().await?;
        let mut session = lock_and_load_session(&mut tx, session_id, self.for_update()).await?;
        let before = load_tasks_lite(&mut tx, session_id).await?;
        match session.state {
            SessionState::Cancelled => {}
            SessionState::Completed | SessionState::Failed => {
                return Err(Error::FailedPrecondition(format!(
                    "session {session_id} already ended ({})",
                    session_state_name(session.state)
                )));
            }
            _ => {
                let reason = if reason.is_empty() {
                    "cancelled by user"
                } else {
                    reason
                };
                let mut tasks = before.clone();
                let mut transitions = Vec::new();
                for task in tasks
                    .iter_mut()
                    .filter(|task| !task::is_terminal(task.state))
                {
                    transitions.push(task::transition(task, TaskState::Cancelled, reason, now));
                }
                set_session_state(&mut tx, &mut session, SessionState::Cancelled, reason, now)
                    .await?;
                save(&mut tx, &mut session, &before, &mut tasks, transitions, now).await?;
            }
        }
        let summary = load_summary(&mut tx, session_id).await?;
        tx.commit().await?;
        Ok(summary)
    }

    /// Takes a session's best ready tasks for several claims at once, with the session locked
    /// and loaded, inside a transaction the caller commits: for the claims that
    /// [`Store::complete_eager`] does not serve (waves mode, a session no longer active, claims
    /// of one group asking for different roles). Claims are served in the order given, each up
    /// to its `max`; one query per distinct role filter, one update and one event append for
    /// all. Returns each claim's tasks (none when the session is not active or ran dry).
    pub(crate) async fn claim_in(
        &self,
        tx: &mut Tx,
        session: &SessionRow,
        claims: &[ClaimRequest],
    ) -> Result<Vec<Vec<Claimed>>, Error> {
        let session_id = session.id.as_str();
        let mut taken: Vec<(usize, Task)> = Vec::new();
        if session.state == SessionState::Active {
            let mut filters: Vec<&[pb::Role]> = Vec::new();
            for claim in claims {
                if !filters.contains(&claim.roles.as_slice()) {
                    filters.push(&claim.roles);
                }
            }
            for roles in filters {
                let serves: Vec<usize> = (0..claims.len())
                    .filter(|&i| claims[i].roles.as_slice() == roles)
                    .collect();
                let wanted: usize = serves.iter().map(|&i| claims[i].max as usize).sum();
                // Tasks another filter already took are skipped, so ask for that many more.
                let ready: Vec<Task> = load_claimable(tx, session_id, roles, wanted + taken.len())
                    .await?
                    .into_iter()
                    .filter(|task| !taken.iter().any(|(_, known)| known.id == task.id))
                    .collect();
                let mut ready = ready.into_iter();
                for &i in &serves {
                    for task in ready.by_ref().take(claims[i].max as usize) {
                        taken.push((i, task));
                    }
                }
            }
        }
        if taken.is_empty() {
            return Ok(claims.iter().map(|_| Vec::new()).collect());
        }
        let before: Vec<Task> = taken.iter().map(|(_, task)| task.clone()).collect();
        let transitions = taken
            .iter_mut()
            .map(|(i, task)| lease(task, &claims[*i]))
            .collect();
        let tasks: Vec<Task> = taken.iter().map(|(_, task)| task.clone()).collect();
        let now = claims
            .iter()
            .map(|claim| claim.now)
            .max()
            .unwrap_or_default();
        // A claim changes nothing else in the graph: no settling needed.
        write_changes(tx, session_id, &before, &tasks, transitions, now).await?;
        self.hand_out(tx, session, claims.len(), taken).await
    }

    /// What the claims get: each claimed task (`(claim, task)`, already written) with its
    /// repository and upstream results, grouped per claim.
    async fn hand_out(
        &self,
        tx: &mut Tx,
        session: &SessionRow,
        claims: usize,
        taken: Vec<(usize, Task)>,
    ) -> Result<Vec<Vec<Claimed>>, Error> {
        let mut out: Vec<Vec<Claimed>> = (0..claims).map(|_| Vec::new()).collect();
        if taken.is_empty() {
            return Ok(out);
        }
        let tasks: Vec<Task> = taken.iter().map(|(_, task)| task.clone()).collect();
        let mut upstream_of = load_upstream(tx, &session.id, &tasks).await?;
        let fixed = self.fixed(tx, &session.id).await?;
        for (i, task) in taken {
            let upstream = upstream_of.remove(&task.id).unwrap_or_default();
            let repo = fixed
                .repos
                .iter()
                .find(|repo| repo.name == task.repo)
                .cloned();
            out[i].push(Claimed {
                task,
                repo,
                repos: fixed.repos.clone(),
                assets_digest: fixed.assets_digest.clone(),
                plan_dir: session.plan_dir.clone(),
                upstream,
            });
        }
        Ok(out)
    }

    /// Fails an attempt: back to pending with a retry time while attempts remain and the error
    /// is retryable, else terminal (downstream skipped or blocked).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn fail(
        &self,
        session_id: &str,
        task_id: &str,
        token: u64,
        error: pb::TaskError,
        partial: Option<pb::TaskResult>,
        backoff: impl FnOnce(u32) -> Duration,
        now: i64,
    ) -> Result<(Task, Option<i64>), Error> {
        let mut tx = self.begin().await?;
        let mut session = lock_and_load_session(&mut tx, session_id, self.for_update()).await?;
        let before = load_tasks_lite(&mut tx, session_id).await?;
        let mut tasks = before.clone();
        let task = find_task_mut(&mut tasks, task_id, session_id)?;
        if task.fencing_token != token {
            return Err(stale(task, token));
        }
        // A cancelled task's worker is told to stop and report; keep its error, change nothing.
        if task.state == TaskState::Cancelled {
            task.last_error = Some(error);
            let task = task.clone();
            update_task(&mut tx, &task).await?;
            tx.commit().await?;
            return Ok((task, None));
        }
        if task.state != TaskState::Running {
            return Err(stale(task, token));
        }
        let reason = error.message.clone();
        let timed_out = error.kind() == pb::ErrorKind::Timeout;
        let retry = error.retryable && task.attempt < task.max_attempts;
        let loop_inputs = (!retry && !timed_out).then(|| (error.clone(), partial.clone()));
        task.last_error = Some(error);
        if let Some(partial) = &partial {
            write_back_convergence(&mut tx, session_id, task_id, partial).await?;
        }
        if partial.is_some() {
            task.result = partial;
        }
        let mut retry_at = None;
        let transition = if retry {
            let delay = backoff(task.attempt);
            let at = now + i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
            retry_at = Some(at);
            let transition = task::transition(task, TaskState::Pending, reason, now);
            task.not_before = Some(at);
            task.worker_id.clear();
            transition
        } else {
            let to = if timed_out {
                TaskState::TimedOut
            } else {
                TaskState::Failed
            };
            task::transition(task, to, reason, now)
        };
        let mut transitions = vec![transition];
        let mut before = before;
        if let Some((error, partial)) = loop_inputs
            && !task::is_session_terminal(session.state)
        {
            transitions.extend(
                fix_round(
                    &mut tx,
                    &mut before,
                    &mut tasks,
                    task_id,
                    &error,
                    partial.as_ref(),
                    now,
                )
                .await?,
            );
        }
        save(&mut tx, &mut session, &before, &mut tasks, transitions, now).await?;
        let task = load_task(&mut tx, session_id, task_id).await?;
        tx.commit().await?;
        Ok((task, retry_at))
    }

    /// Returns expired leases (ready again while attempts remain, else timed out) and releases
    /// retries whose backoff elapsed. Returns how many sessions changed.
    pub(crate) async fn reap(&self, now: i64) -> Result<usize, Error> {
        let mut conn = self.reader.acquire().await?;
        let due = sqlx::query(
            "SELECT DISTINCT session_id FROM tasks WHERE (state = $1 AND lease_expires_at < $2) \
             OR (state = $3 AND not_before IS NOT NULL AND not_before <= $2)",
        )
        .bind(TaskState::Running as i32)
        .bind(now)
        .bind(TaskState::Pending as i32)
        .fetch_all(&mut *conn)
        .await?;
        drop(conn);
        let mut changed = 0;
        for row in due {
            let session_id: String = row.try_get("session_id")?;
            let mut tx = self.begin().await?;
            lock_session(&mut tx, &session_id, self.for_update()).await?;
            let before = load_tasks_lite(&mut tx, &session_id).await?;
            let mut session = load_session(&mut tx, &session_id).await?;
            let mut tasks = before.clone();
            let mut transitions = Vec::new();
            for task in tasks.iter_mut() {
                let expired = task.state == TaskState::Running
                    && task.lease_expires_at.is_some_and(|at| at < now);
                if !expired {
                    continue;
                }
                tracing::warn!(session_id = %session_id, task_id = %task.id, worker_id = %task.worker_id, attempt = task.attempt, "lease expired");
                if task.attempt < task.max_attempts {
                    transitions.push(task::transition(
                        task,
                        TaskState::Ready,
                        "lease expired",
                        now,
                    ));
                } else {
                    task.last_error = Some(pb::TaskError {
                        kind: pb::ErrorKind::Timeout as i32,
                        message: format!(
                            "lease of worker {} expired on the last attempt",
                            task.worker_id
                        ),
                        retryable: false,
                        details: Vec::new(),
                    });
                    transitions.push(task::transition(
                        task,
                        TaskState::TimedOut,
                        "lease expired on the last attempt",
                        now,
                    ));
                }
                task.worker_id.clear();
            }
            let before_len = transitions.len();
            let total = save(&mut tx, &mut session, &before, &mut tasks, transitions, now).await?;
            tx.commit().await?;
            if total > 0 || before_len > 0 {
                changed += 1;
            }
        }
        Ok(changed)
    }

    /// Reconciles a session (ccw-reference 4.3) and advances it, in one transaction: orphaned
    /// running tasks (lease expired) become ready, failed / timed-out tasks pending with one
    /// more attempt, blocked / skipped tasks pending; a paused or failed session becomes active.
    pub(crate) async fn resume(
        &self,
        session_id: &str,
        now: i64,
    ) -> Result<Vec<pb::TaskTransition>, Error> {
        let mut tx = self.begin().await?;
        lock_session(&mut tx, session_id, self.for_update()).await?;
        let before = load_tasks_lite(&mut tx, session_id).await?;
        let mut session = load_session(&mut tx, session_id).await?;
        match session.state {
            SessionState::Cancelled => {
                return Err(Error::FailedPrecondition(format!(
                    "session {session_id} was cancelled and cannot be resumed"
                )));
            }
            SessionState::Completed => {
                tx.rollback().await?;
                return Ok(Vec::new());
            }
            _ => {}
        }
        let mut tasks = before.clone();
        let mut transitions = Vec::new();
        for task in &mut tasks {
            let reason = match task.state {
                TaskState::Running if task.lease_expires_at.is_some_and(|at| at < now) => {
                    task.max_attempts = task.max_attempts.max(task.attempt + 1);
                    let transition = task::transition(
                        task,
                        TaskState::Ready,
                        "resumed: lease expired (orphaned)",
                        now,
                    );
                    task.worker_id.clear();
                    transitions.push(transition);
                    continue;
                }
                // A fix round replaced it; its re-run is what gets retried.
                TaskState::Failed if !task.superseded_by.is_empty() => continue,
                TaskState::Failed | TaskState::TimedOut => {
                    task.max_attempts = task.max_attempts.max(task.attempt + 1);
                    "resumed: retrying"
                }
                TaskState::Blocked | TaskState::Skipped => "resumed: dependency retried",
                _ => continue,
            };
            task.not_before = None;
            task.finished_at = None;
            task.worker_id.clear();
            transitions.push(task::transition(task, TaskState::Pending, reason, now));
        }
        if matches!(session.state, SessionState::Paused | SessionState::Failed) {
            set_session_state(&mut tx, &mut session, SessionState::Active, "resumed", now).await?;
        }
        let reconciled = transitions.clone();
        save(&mut tx, &mut session, &before, &mut tasks, transitions, now).await?;
        tx.commit().await?;
        Ok(reconciled)
    }
}

/// Extends a lease and records progress under the session lock, inside a transaction the
/// caller commits (see [`crate::group_commit`]); returns the new expiry and whether the task was
/// cancelled.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn heartbeat_in(
    tx: &mut Tx,
    session_id: &str,
    task_id: &str,
    token: u64,
    progress: &str,
    lease_ms: Option<i64>,
    now: i64,
    cache: Option<&mut TaskCache>,
) -> Result<(i64, bool), Error> {
    let before = load_task(tx, session_id, task_id).await?;
    if before.fencing_token != token {
        return Err(stale(&before, token));
    }
    if before.state == TaskState::Cancelled {
        return Ok((now, true));
    }
    if before.state != TaskState::Running {
        return Err(stale(&before, token));
    }
    let mut task = before.clone();
    if let Some(lease_ms) = lease_ms {
        task.lease_ms = lease_ms;
    }
    let expires_at = now + task.lease_ms;
    task.lease_expires_at = Some(expires_at);
    if !progress.is_empty() && progress != task.progress {
        task.progress = progress.to_owned();
        append_event(
            tx,
            session_id,
            now,
            Kind::Progress(pb::TaskProgress {
                task_id: task_id.to_owned(),
                note: progress.to_owned(),
                worker_id: task.worker_id.clone(),
            }),
        )
        .await?;
    }
    update_task(tx, &task).await?;
    if let Some(cache) = cache {
        cache.put(task);
    }
    Ok((expires_at, false))
}

/// One `CompleteTask` as the store sees it.
#[derive(Debug, Clone)]
pub(crate) struct Completion {
    pub(crate) task_id: String,
    pub(crate) token: u64,
    pub(crate) result: pb::TaskResult,
}

/// Completes a running task under its current fencing token, with the session locked and
/// loaded, inside a transaction the caller commits (see [`crate::group_commit`]), reading the whole
/// graph: for sessions that are not active and eager (see [`Store::complete_eager`]).
pub(crate) async fn complete_in(
    tx: &mut Tx,
    session: &mut SessionRow,
    completion: Completion,
    now: i64,
) -> Result<Task, Error> {
    // Owned: `session` is passed on mutably (see [`finish`]).
    let session_id = session.id.clone();
    let session_id = session_id.as_str();
    let task_id = completion.task_id.as_str();
    let before = load_tasks_lite(tx, session_id).await?;
    let mut tasks = before.clone();
    let task = find_task_mut(&mut tasks, task_id, session_id)?;
    if task.state != TaskState::Running || task.fencing_token != completion.token {
        return Err(stale(task, completion.token));
    }
    write_back_convergence(tx, session_id, task_id, &completion.result).await?;
    task.result = Some(completion.result);
    let transition = task::transition(task, TaskState::Completed, "completed", now);
    save(tx, session, &before, &mut tasks, vec![transition], now).await?;
    let task = load_task(tx, session_id, task_id).await?;
    Ok(task)
}

/// What [`Store::complete_eager`] did.
pub(crate) struct EagerBatch {
    /// The completed tasks, in the order given.
    pub(crate) tasks: Vec<Task>,
    /// Each claim's tasks, in the order given.
    pub(crate) claimed: Vec<Vec<Claimed>>,
    /// `Some(transitions)` when it completed tasks and left no task of the session ready or
    /// running: the session may have ended or stalled, which [`check_end`] decides.
    pub(crate) check_end: Option<usize>,
}

impl Store {
    /// Completes several running tasks of an active eager session and serves claims of it, at
    /// once (a group commit's; one completion alone is a batch of one). All `claims` must ask
    /// for the same roles. One read fetches the completed tasks, their pending dependents and
    /// the session's best ready tasks; settling and the claims (which also see the tasks the
    /// completions just readied) happen in memory; one update writes every change. So the
    /// batch costs the same few statements however many operations it holds, and the graph is
    /// never read whole (a completion can only make its own pending dependents ready). With
    /// `cache` (an optimistic group's copy of the session's tasks) there is no read, and the
    /// copy follows the write. Any stale token fails the whole batch (a group then runs each
    /// operation alone).
    pub(crate) async fn complete_eager(
        &self,
        tx: &mut Tx,
        session: &SessionRow,
        completions: Vec<Completion>,
        claims: &[ClaimRequest],
        now: i64,
        cache: Option<&mut TaskCache>,
    ) -> Result<EagerBatch, Error> {
        let session_id = session.id.as_str();
        let roles: &[pb::Role] = claims.first().map_or(&[], |claim| claim.roles.as_slice());
        let wanted: usize = claims.iter().map(|claim| claim.max as usize).sum();
        let ids: Vec<String> = completions.iter().map(|c| c.task_id.clone()).collect();
        let Gathered {
            mut originals,
            dependents,
            ready,
            busy,
        } = match cache.as_deref() {
            Some(cache) => cache.gather(&ids, roles, wanted),
            None => read_batch(tx, session_id, &ids, roles, wanted).await?,
        };

        // The working set, each task once, with its stored form alongside.
        let mut before: Vec<Task> = Vec::new();
        let mut work: Vec<Task> = Vec::new();
        let mut transitions = Vec::new();
        for completion in completions {
            // Taken out, so a task completed twice in one batch is stale the second time.
            let Some(original) = originals.remove(&completion.task_id) else {
                if work.iter().any(|task| task.id == completion.task_id) {
                    return Err(Error::FailedPrecondition(format!(
                        "task {} is completed twice in one transaction",
                        completion.task_id
                    )));
                }
                return Err(Error::NotFound(format!(
                    "task {} not found in session {session_id}",
                    completion.task_id
                )));
            };
            if original.state != TaskState::Running || original.fencing_token != completion.token {
                return Err(stale(&original, completion.token));
            }
            write_back_convergence(tx, session_id, &completion.task_id, &completion.result).await?;
            before.push(original.clone());
            let mut task = original;
            task.result = Some(completion.result);
            transitions.push(task::transition(
                &mut task,
                TaskState::Completed,
                "completed",
                now,
            ));
            work.push(task);
        }
        let completed = work.len();
        for task in dependents.into_iter().chain(ready) {
            before.push(task.clone());
            work.push(task);
        }
        // The dependents' other dependencies (their states decide the settling).
        let mut others: Vec<String> = Vec::new();
        for dependent in &work[completed..] {
            for dep in &dependent.depends_on {
                if !work.iter().any(|known| &known.id == dep) && !others.contains(dep) {
                    others.push(dep.clone());
                }
            }
        }
        let mut loaded = match cache.as_deref() {
            Some(cache) => cache.get_all(&others),
            None => load_tasks_by_id(tx, session_id, &others, &lite_columns()).await?,
        };
        for id in &others {
            if let Some(task) = loaded.remove(id) {
                before.push(task.clone());
                work.push(task);
            }
        }
        transitions.extend(task::settle(
            &mut work,
            session.mode,
            session.on_failure,
            now,
        ));

        // The claims take the best ready tasks, those just readied included, in claim order.
        let mut candidates: Vec<usize> = (0..work.len())
            .filter(|&i| {
                work[i].state == TaskState::Ready
                    && (roles.is_empty() || roles.contains(&work[i].role))
            })
            .collect();
        candidates.sort_by_key(|&i| claim_order(&work[i]));
        let mut candidates = candidates.into_iter();
        let mut taken: Vec<(usize, usize)> = Vec::new();
        for (c, claim) in claims.iter().enumerate() {
            for i in candidates.by_ref().take(claim.max as usize) {
                transitions.push(lease(&mut work[i], claim));
                taken.push((c, i));
            }
        }
        let count = write_changes(tx, session_id, &before, &work, transitions, now).await?;
        if let Some(cache) = cache {
            // Written (an optimistic write commits on its own): the cache follows.
            for task in &work {
                cache.put(task.clone());
            }
        }
        let taken = taken
            .into_iter()
            .map(|(c, i)| (c, work[i].clone()))
            .collect();
        let claimed = self.hand_out(tx, session, claims.len(), taken).await?;
        // Only a completion can end the session; a task ready or running keeps it going.
        let open = completed == 0
            || busy
            || work
                .iter()
                .any(|task| matches!(task.state, TaskState::Ready | TaskState::Running));
        work.truncate(completed);
        Ok(EagerBatch {
            tasks: work,
            claimed,
            check_end: (!open).then_some(count),
        })
    }
}

/// A ready task's place in claim order: the order of the `tasks_claim` index (and of
/// [`read_batch`]'s ready tasks) within a session.
pub(crate) fn claim_order(task: &Task) -> (i32, std::cmp::Reverse<u64>, i64, i64) {
    (
        task.priority as i32,
        std::cmp::Reverse(task.path_ms),
        task.created_at,
        task.position,
    )
}

/// Ends the session or reports its stall, after `count` transitions that readied nothing.
/// While some task is ready or running the session can neither end nor stall, so only when
/// none is (rare) is the whole graph read to decide.
pub(crate) async fn check_end(
    tx: &mut Tx,
    session: &mut SessionRow,
    count: usize,
    now: i64,
) -> Result<(), Error> {
    if !any_task_in(tx, &session.id, &[TaskState::Ready, TaskState::Running]).await? {
        let tasks = load_tasks_lite(tx, &session.id).await?;
        finish(tx, session, &tasks, count, now).await?;
    }
    Ok(())
}

/// Applies the graph's consequences of a change (settle, session outcome), writes the changed
/// tasks and appends every transition as an event. Returns the number of task transitions.
async fn save(
    tx: &mut Tx,
    session: &mut SessionRow,
    before: &[Task],
    tasks: &mut [Task],
    mut transitions: Vec<pb::TaskTransition>,
    now: i64,
) -> Result<usize, Error> {
    if session.state == SessionState::Active {
        transitions.extend(task::settle(tasks, session.mode, session.on_failure, now));
    }
    let count = write_changes(tx, &session.id, before, tasks, transitions, now).await?;
    finish(tx, session, tasks, count, now).await?;
    Ok(count)
}

/// After the terminal failure of `task_id` (already in `tasks`, not yet saved): starts a fix
/// round when its spec asks for one (see [`rounds`]), inserting the two new tasks into the
/// database and into `before`/`tasks` (so [`save`] settles them with the rest), or logs that the
/// chain's rounds are used up. Returns the transitions to record.
async fn fix_round(
    tx: &mut Tx,
    before: &mut Vec<Task>,
    tasks: &mut Vec<Task>,
    task_id: &str,
    error: &pb::TaskError,
    partial: Option<&pb::TaskResult>,
    now: i64,
) -> Result<Vec<pb::TaskTransition>, Error> {
    let Some(index) = tasks.iter().position(|task| task.id == task_id) else {
        return Ok(Vec::new());
    };
    let session_id = tasks[index].session_id.clone();
    // The write path loads tasks without their spec; the loop configuration lives there.
    let stored = load_task(tx, &session_id, task_id).await?;
    let mut failed = tasks[index].clone();
    failed.spec = stored.spec;
    let decision = rounds::decide(
        &failed,
        error,
        partial,
        |id| tasks.iter().any(|task| task.id == id),
        now,
    );
    match decision {
        rounds::Decision::None => Ok(Vec::new()),
        rounds::Decision::Exhausted {
            kind,
            chain,
            max_rounds,
        } => {
            tracing::warn!(session_id = %session_id, task_id, chain = %chain, max_rounds, "fix rounds exhausted");
            let mut data = Map::new();
            data.insert(
                "kind".to_owned(),
                Value::String(kind.message_type().to_owned()),
            );
            data.insert("chain".to_owned(), Value::String(chain.clone()));
            data.insert("failed_task".to_owned(), Value::String(task_id.to_owned()));
            data.insert("max_rounds".to_owned(), Value::from(max_rounds));
            let message = NewMessage {
                from: "coordinator".to_owned(),
                to: "user".to_owned(),
                kind: "warning".to_owned(),
                summary: format!("{} rounds exhausted for {chain}", kind.name()),
                data: Some(data),
                idempotency_key: None,
            };
            insert_message(tx, &session_id, message, now).await?;
            Ok(Vec::new())
        }
        rounds::Decision::Round(round) => {
            let transitions = rounds::apply(tasks, index, &round);
            insert_task(tx, &round.fix).await?;
            insert_task(tx, &round.rerun).await?;
            let (kind, summary, data) = rounds::round_message(task_id, &round);
            tracing::info!(session_id = %session_id, task_id, fix = %round.fix.id, rerun = %round.rerun.id, round = round.round, "fix round added");
            let message = NewMessage {
                from: "coordinator".to_owned(),
                to: "executor".to_owned(),
                kind,
                summary,
                data: Some(data),
                idempotency_key: None,
            };
            insert_message(tx, &session_id, message, now).await?;
            let rows = [round.fix, round.rerun];
            for (offset, row) in rows.into_iter().enumerate() {
                before.insert(index + 1 + offset, row.clone());
                tasks.insert(index + 1 + offset, row);
            }
            Ok(transitions)
        }
    }
}

/// Whether completing with `result` writes convergence onto other tasks (see
/// [`write_back_convergence`]).
pub(crate) fn writes_convergence(result: &pb::TaskResult) -> bool {
    matches!(&result.detail, Some(pb::task_result::Detail::Validation(report)) if !report.upstream_convergence.is_empty())
}

/// Copies a validator task's per-task criterion results (`upstream_convergence` of its report)
/// onto the tasks they belong to, so each task's record carries its own `convergence`. Written
/// in the same transaction as the validator's result; a later validator overwrites it.
async fn write_back_convergence(
    tx: &mut Tx,
    session_id: &str,
    checked_by: &str,
    result: &pb::TaskResult,
) -> Result<(), Error> {
    let Some(pb::task_result::Detail::Validation(report)) = &result.detail else {
        return Ok(());
    };
    for entry in &report.upstream_convergence {
        tx.needs_lock("writing back convergence")?;
        let convergence = pb::TaskConvergence {
            verified: entry.convergence_verified.clone(),
            met: entry.convergence_met.clone(),
            checked_by: checked_by.to_owned(),
            commit: entry.commit.clone(),
        };
        let written =
            sqlx::query("UPDATE tasks SET convergence = $3 WHERE session_id = $1 AND id = $2")
                .bind(session_id)
                .bind(&entry.task_id)
                .bind(convergence.encode_to_vec())
                .execute(&mut **tx)
                .await?;
        if written.rows_affected() == 0 {
            tracing::warn!(session_id, checked_by, task_id = %entry.task_id, "convergence names an unknown task");
        }
    }
    Ok(())
}

/// After `count` transitions on the whole graph `tasks`: ends the session when every task is
/// terminal (updating `session` too: a group commit runs the next operation with it), and
/// reports a stall once, as it happens.
async fn finish(
    tx: &mut Tx,
    session: &mut SessionRow,
    tasks: &[Task],
    count: usize,
    now: i64,
) -> Result<(), Error> {
    let mut state = session.state;
    if session.state == SessionState::Active
        && let Some(outcome) = task::session_outcome(tasks)
    {
        let reason = if outcome == SessionState::Completed {
            "every task completed"
        } else {
            "every task is terminal and some did not complete"
        };
        set_session_state(tx, session, outcome, reason, now).await?;
        state = outcome;
    }
    // A change that leaves nothing able to move is reported once, as it happens (a paused
    // session is still on purpose; `check` says why its tasks wait).
    if count > 0
        && state != SessionState::Paused
        && let Some(stuck) = task::stall(tasks, state, now)
    {
        tracing::warn!(session_id = %session.id, stuck = stuck.len(), "session stalled");
        insert_message(tx, &session.id, stall_message(&stuck), now).await?;
    }
    Ok(())
}

/// Returns the bus message reporting a stall.
pub(crate) fn stall_message(stuck: &[task::Stuck]) -> NewMessage {
    let names: Vec<&str> = stuck.iter().map(|task| task.task_id.as_str()).collect();
    let tasks = stuck
        .iter()
        .map(|task| {
            let mut entry = Map::new();
            entry.insert("task_id".to_owned(), Value::String(task.task_id.clone()));
            entry.insert(
                "state".to_owned(),
                Value::String(task::state_name(task.state).to_owned()),
            );
            entry.insert("reason".to_owned(), Value::String(task.reason.clone()));
            Value::Object(entry)
        })
        .collect();
    let mut data = Map::new();
    data.insert("kind".to_owned(), Value::String("stall".to_owned()));
    data.insert("tasks".to_owned(), Value::Array(tasks));
    NewMessage {
        from: "coordinator".to_owned(),
        to: "user".to_owned(),
        kind: "warning".to_owned(),
        summary: format!(
            "[coordinator] stalled: nothing ready or running, stuck: {}",
            names.join(", ")
        ),
        data: Some(data),
        idempotency_key: None,
    }
}

/// Writes the tasks that changed and appends every transition as an event.
async fn write_changes(
    tx: &mut Tx,
    session_id: &str,
    before: &[Task],
    tasks: &[Task],
    transitions: Vec<pb::TaskTransition>,
    now: i64,
) -> Result<usize, Error> {
    let count = transitions.len();
    append_events(
        tx,
        session_id,
        now,
        transitions.into_iter().map(Kind::Task).collect(),
    )
    .await?;
    let changed: Vec<&Task> = before
        .iter()
        .zip(tasks.iter())
        .filter(|(old, new)| old != new)
        .map(|(_, new)| new)
        .collect();
    // With the session's events so far: one statement on PostgreSQL (see `write_events`).
    tx.write_with_events(session_id, &changed).await?;
    Ok(count)
}

fn find_task_mut<'a>(
    tasks: &'a mut [Task],
    task_id: &str,
    session_id: &str,
) -> Result<&'a mut Task, Error> {
    tasks
        .iter_mut()
        .find(|task| task.id == task_id)
        .ok_or_else(|| Error::NotFound(format!("task {task_id} not found in session {session_id}")))
}

//! The store: every SQL statement of the coordinator lives here, behind [`Store`].
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

use std::collections::{BTreeMap, HashMap};
use std::str::FromStr;
use std::time::Duration;

use prost::Message as _;
use serde_json::{Map, Value};
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{Any, AnyPool, ConnectOptions as _, Row, Transaction};
use troupe_plan::{Mode, OnFailure, Role};
use troupe_proto::v1::{self as pb, SessionState, TaskState, session_event::Kind};

use crate::Error;
use crate::convert::{json_to_struct, rfc3339, timestamp};
use crate::rounds;
use crate::task::{self, Task};

mod cache;
mod lifecycle;

pub(crate) use cache::{TaskCache, load_cache_in};

/// Schema migrations, applied in order and recorded in `schema_migrations`.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "init", include_str!("migrations/0001_init.sql")),
    (2, "workers", include_str!("migrations/0002_workers.sql")),
    (
        3,
        "superseded",
        include_str!("migrations/0003_superseded.sql"),
    ),
    (
        4,
        "claim order",
        include_str!("migrations/0004_claim_order.sql"),
    ),
    (
        5,
        "convergence",
        include_str!("migrations/0005_convergence.sql"),
    ),
    (6, "path ms", include_str!("migrations/0006_path_ms.sql")),
    (
        7,
        "repo urls",
        include_str!("migrations/0007_repo_urls.sql"),
    ),
    (
        8,
        "plan assets",
        include_str!("migrations/0008_plan_assets.sql"),
    ),
];

const TASK_COLUMNS: &str = "session_id, id, position, title, description, role, priority, repo, \
     wave, critical_path, path_ms, depends_on, files, spec, state, attempt, max_attempts, fencing_token, \
     worker_id, lease_ms, lease_expires_at, not_before, created_at, started_at, finished_at, \
     progress, result, last_error, superseded_by, convergence";

/// [`TASK_COLUMNS`] without `spec` (an empty object instead): for transactions that move the
/// graph without parsing every task's plan object; such rows are never written back whole
/// (the UPDATE leaves `spec` alone) nor sent to clients.
fn lite_columns() -> String {
    TASK_COLUMNS.replace(" spec,", " '{}' AS spec,")
}

const SESSION_COLUMNS: &str =
    "id, name, description, state, mode, on_failure, plan_dir, last_seq, created_at, updated_at";

/// A write transaction. Events appended in it are held back and written just before it
/// commits (or before the session's sequence is read or taken otherwise), so the operations
/// of a group commit share one sequence update and one insert per session.
pub(crate) struct Tx {
    inner: Conn,
    /// Per session, in order of first append: each event's time and kind.
    events: Vec<(String, Vec<(i64, Kind)>)>,
    /// Sessions whose row this transaction holds locked, with their `last_seq`: their events
    /// are numbered without reading the counter back (on PostgreSQL the counter update and the
    /// insert are then one statement).
    sequences: HashMap<String, u64>,
    dialect: Dialect,
    /// A write transaction (`begin`), not a snapshot (`begin_read`).
    writes: bool,
    /// Set once an optimistic [`Tx`] (see [`Store::optimistic`]) wrote: its one write
    /// committed on its own.
    pub(crate) wrote: bool,
}

/// What a [`Tx`] runs its statements on.
enum Conn {
    Tx(Transaction<'static, Any>),
    /// No transaction: each statement commits on its own (see [`Store::optimistic`]).
    Auto(sqlx::pool::PoolConnection<Any>),
}

impl std::ops::Deref for Tx {
    type Target = sqlx::AnyConnection;

    fn deref(&self) -> &Self::Target {
        match &self.inner {
            Conn::Tx(tx) => tx,
            Conn::Auto(conn) => conn,
        }
    }
}

impl std::ops::DerefMut for Tx {
    fn deref_mut(&mut self) -> &mut Self::Target {
        match &mut self.inner {
            Conn::Tx(tx) => tx,
            Conn::Auto(conn) => conn,
        }
    }
}

impl Tx {
    /// Writes the held-back events, then commits.
    pub(crate) async fn commit(mut self) -> Result<(), Error> {
        self.flush_events(None).await?;
        match self.inner {
            Conn::Tx(tx) => tx.commit().await?,
            // Everything it wrote went out in its one statement (see `write_events`).
            Conn::Auto(_) => {}
        }
        Ok(())
    }

    /// The session's `last_seq` as this transaction left it, when known (held or optimistic).
    pub(crate) fn last_seq(&self, session_id: &str) -> Option<u64> {
        self.sequences.get(session_id).copied()
    }

    /// What a failed write means: on SQLite, an optimistic write's transaction is rolled
    /// back (the call stopped at the failing statement), and a failed sequence check is
    /// [`Error::Contended`].
    async fn failed(&mut self, session_id: &str, from: u64, err: sqlx::Error) -> Error {
        if self.dialect != Dialect::Sqlite {
            return err.into();
        }
        if let Conn::Auto(conn) = &mut self.inner
            && let Err(rollback) = sqlx::query("ROLLBACK").execute(&mut **conn).await
        {
            // Also when the call failed before its `BEGIN`: nothing is open then.
            tracing::debug!(error = %rollback, "rollback after a failed optimistic write");
        }
        let check = matches!(&err, sqlx::Error::Database(db)
            if db.message().contains("NOT NULL") && db.message().contains("sessions.last_seq"));
        if check {
            moved(session_id, from)
        } else {
            err.into()
        }
    }

    /// Refuses a write that an optimistic [`Tx`] cannot make atomically with its one write:
    /// the caller runs the group under the lock instead.
    fn needs_lock(&self, what: &str) -> Result<(), Error> {
        match self.inner {
            Conn::Auto(_) => Err(Error::Contended(format!("{what} needs a transaction"))),
            Conn::Tx(_) => Ok(()),
        }
    }

    /// Writes `tasks` (changed tasks of `session_id`) with the session's held-back events: on
    /// PostgreSQL, with the session held, in one statement.
    async fn write_with_events(&mut self, session_id: &str, tasks: &[&Task]) -> Result<(), Error> {
        let events = match self.events.iter().position(|(id, _)| id == session_id) {
            Some(at) => self.events.remove(at).1,
            None => Vec::new(),
        };
        write_events(self, session_id, events, tasks).await
    }

    /// Rolls back, held-back events included.
    pub(crate) async fn rollback(self) -> Result<(), Error> {
        if let Conn::Tx(tx) = self.inner {
            tx.rollback().await?;
        }
        Ok(())
    }

    /// Writes the held-back events of `session_id` (of every session when `None`).
    async fn flush_events(&mut self, session_id: Option<&str>) -> Result<(), Error> {
        let pending = std::mem::take(&mut self.events);
        for (session, events) in pending {
            if session_id.is_none_or(|id| id == session) {
                write_events(self, &session, events, &[]).await?;
            } else {
                self.events.push((session, events));
            }
        }
        Ok(())
    }
}

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
struct Fixed {
    repos: Vec<pb::SessionRepo>,
    assets_digest: String,
}

/// A session with its repositories and tasks (topological order).
#[derive(Debug)]
pub(crate) struct SessionView {
    pub(crate) session: SessionRow,
    pub(crate) repos: Vec<pb::SessionRepo>,
    pub(crate) tasks: Vec<Task>,
}

/// A session with its repositories and task counts.
#[derive(Debug)]
pub(crate) struct SessionSummary {
    pub(crate) session: SessionRow,
    pub(crate) repos: Vec<pb::SessionRepo>,
    pub(crate) counts: pb::TaskCounts,
}

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

/// A message to append to a session's bus.
#[derive(Debug)]
pub(crate) struct NewMessage {
    pub(crate) from: String,
    pub(crate) to: String,
    pub(crate) kind: String,
    pub(crate) summary: String,
    pub(crate) data: Option<Map<String, Value>>,
    pub(crate) idempotency_key: Option<String>,
}

/// Filters of [`Store::list_messages`].
#[derive(Debug, Default)]
pub(crate) struct MessageFilter {
    pub(crate) from: Option<String>,
    pub(crate) to: Option<String>,
    pub(crate) kind: Option<String>,
    pub(crate) after_sequence: u64,
    pub(crate) last: u32,
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

fn stale(task: &Task, token: u64) -> Error {
    Error::FailedPrecondition(format!(
        "stale fencing token {token} for task {} (state {}, current token {})",
        task.id,
        task::state_name(task.state),
        task.fencing_token
    ))
}

/// JSON shape of a stored file change.
#[derive(serde::Serialize, serde::Deserialize)]
struct StoredFile {
    path: String,
    action: i32,
    change: String,
}

/// Returns a migration in a dialect: the files are written for SQLite with portable types; the
/// only PostgreSQL difference is the binary type (`BLOB` is `BYTEA`).
fn dialect_sql(sql: &str, dialect: Dialect) -> String {
    match dialect {
        Dialect::Sqlite => sql.to_owned(),
        Dialect::Postgres => sql.replace(" BLOB", " BYTEA"),
    }
}

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

/// How many of the newest completed tasks [`Store::learned_durations`] learns from.
const LEARNED_TASKS: u32 = 500;
/// How many completed tasks a role needs before its median counts.
const LEARNED_MIN: usize = 3;

/// Serialises concurrent migrations of coordinators starting together on one PostgreSQL.
const MIGRATION_LOCK: i64 = 0x7472_6f75_7065;

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

    /// A session's repositories and assets digest, from the cache once read (they never
    /// change).
    async fn fixed(&self, tx: &mut Tx, session_id: &str) -> Result<Fixed, Error> {
        if let Some(fixed) = self.cached_repos().get(session_id) {
            return Ok(fixed.clone());
        }
        let repos = load_repos(tx, session_id).await?;
        let assets_digest: String =
            sqlx::query_scalar("SELECT assets_digest FROM sessions WHERE id = $1")
                .bind(session_id)
                .fetch_one(&mut **tx)
                .await?;
        let fixed = Fixed {
            repos,
            assets_digest,
        };
        let mut cache = self.cached_repos();
        // Bounded: finished sessions' entries are dropped wholesale now and then.
        if cache.len() >= 4096 {
            cache.clear();
        }
        cache.insert(session_id.to_owned(), fixed.clone());
        Ok(fixed)
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

    fn cached_repos(&self) -> std::sync::MutexGuard<'_, HashMap<String, Fixed>> {
        // A poisoned cache holds nothing wrong: the data is immutable.
        self.repos
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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

    async fn migrate(&self) -> Result<(), Error> {
        let mut tx = self.begin().await?;
        if self.dialect == Dialect::Postgres {
            sqlx::query("SELECT pg_advisory_xact_lock($1)")
                .bind(MIGRATION_LOCK)
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version BIGINT PRIMARY KEY, name TEXT NOT NULL, applied_at BIGINT NOT NULL)",
        )
        .execute(&mut *tx)
        .await?;
        for (version, name, sql) in MIGRATIONS {
            let applied = sqlx::query("SELECT version FROM schema_migrations WHERE version = $1")
                .bind(version)
                .fetch_optional(&mut *tx)
                .await?;
            if applied.is_some() {
                continue;
            }
            let sql = dialect_sql(sql, self.dialect);
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "INSERT INTO schema_migrations (version, name, applied_at) VALUES ($1, $2, $3)",
            )
            .bind(version)
            .bind(*name)
            .bind(crate::convert::now_ms())
            .execute(&mut *tx)
            .await?;
            tracing::info!(version, name, "applied migration");
        }
        tx.commit().await?;
        Ok(())
    }

    pub(crate) async fn begin(&self) -> Result<Tx, Error> {
        let inner = match self.dialect {
            Dialect::Sqlite => self.writer.begin_with("BEGIN IMMEDIATE").await?,
            Dialect::Postgres => self.writer.begin().await?,
        };
        Ok(Tx {
            inner: Conn::Tx(inner),
            events: Vec::new(),
            sequences: HashMap::new(),
            dialect: self.dialect,
            writes: true,
            wrote: false,
        })
    }

    /// An optimistic write, without a lock: for a group of one session whose `last_seq` the
    /// caller knows (with what it read or holds in memory as of that sequence; see
    /// [`TaskCache`]). Reads see the latest commits; the one write (tasks, events and the
    /// sequence: see `write_events`; on PostgreSQL one statement, on SQLite one call that
    /// opens and commits its own transaction) applies only if the session's `last_seq` is
    /// still `last_seq`, and fails with [`Error::Contended`] otherwise. Every change to a
    /// session moves its sequence, so nothing can have changed what the group worked on.
    /// That saves the lock and the round trips of `BEGIN` and `COMMIT`. Anything that needs
    /// more than the one write fails with [`Error::Contended`] before writing, for the caller
    /// to run under the lock.
    pub(crate) async fn optimistic(&self, session_id: &str, last_seq: u64) -> Result<Tx, Error> {
        Ok(Tx {
            inner: Conn::Auto(self.writer.acquire().await?),
            events: Vec::new(),
            sequences: HashMap::from([(session_id.to_owned(), last_seq)]),
            dialect: self.dialect,
            writes: true,
            wrote: false,
        })
    }

    /// A read-only transaction on the reader pool: one consistent snapshot for several reads.
    async fn begin_read(&self) -> Result<Tx, Error> {
        Ok(Tx {
            inner: Conn::Tx(self.reader.begin().await?),
            events: Vec::new(),
            sequences: HashMap::new(),
            dialect: self.dialect,
            writes: false,
            wrote: false,
        })
    }

    // ----- sessions -------------------------------------------------------------------------

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

    /// Returns a session with its repos and tasks.
    pub(crate) async fn get_session(&self, session_id: &str) -> Result<SessionView, Error> {
        let mut tx = self.begin_read().await?;
        let session = load_session(&mut tx, session_id).await?;
        let repos = load_repos(&mut tx, session_id).await?;
        let tasks = load_tasks(&mut tx, session_id).await?;
        tx.commit().await?;
        Ok(SessionView {
            session,
            repos,
            tasks,
        })
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

    // ----- worker protocol ------------------------------------------------------------------

    /// The session holding the best ready task of `roles` (any role when empty) in claim
    /// order, read without locks: a claim is queued on that session's group (see
    /// [`crate::group_commit`]), which takes the session's best ready tasks under its lock.
    pub(crate) async fn pick_session(&self, roles: &[pb::Role]) -> Result<Option<String>, Error> {
        let role_filter = role_filter("t.role", roles, 1);
        // The order of the `tasks_claim` index, so the best candidate is its first entry. The
        // states are constants written into the statement, not parameters: PostgreSQL's
        // generic plans (see `open_postgres`) then still know how few rows they select.
        let sql = format!(
            "SELECT t.session_id FROM tasks t JOIN sessions s ON s.id = t.session_id \
             WHERE t.state = {} AND s.state = {}{role_filter} \
             ORDER BY t.priority, t.path_ms DESC, t.created_at, t.session_id, t.position LIMIT 1",
            TaskState::Ready as i32,
            SessionState::Active as i32
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for role in roles {
            query = query.bind(*role as i32);
        }
        let row = query.fetch_optional(&self.reader).await?;
        Ok(row.map(|row| row.try_get("session_id")).transpose()?)
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

    /// Returns the ready tasks of active sessions as (session id, task id, role).
    pub(crate) async fn ready_tasks(&self) -> Result<Vec<(String, String, pb::Role)>, Error> {
        let rows = sqlx::query(
            "SELECT t.session_id, t.id, t.role FROM tasks t JOIN sessions s ON s.id = t.session_id \
             WHERE t.state = $1 AND s.state = $2 ORDER BY t.session_id, t.position",
        )
        .bind(TaskState::Ready as i32)
        .bind(SessionState::Active as i32)
        .fetch_all(&self.reader)
        .await?;
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

    // ----- bus ------------------------------------------------------------------------------

    /// Appends a message (or returns the first one logged with the same idempotency key, and
    /// `false`).
    pub(crate) async fn log_message(
        &self,
        session_id: &str,
        message: NewMessage,
        now: i64,
    ) -> Result<(pb::Message, bool), Error> {
        let mut tx = self.begin().await?;
        lock_session(&mut tx, session_id, self.for_update()).await?;
        let before = load_session(&mut tx, session_id).await?.last_seq;
        let stored = insert_message(&mut tx, session_id, message, now).await?;
        tx.commit().await?;
        let created = stored.sequence > before;
        Ok((stored, created))
    }

    /// Lists messages matching `filter`, oldest first, with the cursor to continue from.
    pub(crate) async fn list_messages(
        &self,
        session_id: &str,
        filter: &MessageFilter,
    ) -> Result<(Vec<pb::Message>, u64), Error> {
        let mut tx = self.begin_read().await?;
        load_session(&mut tx, session_id).await?;
        let mut sql = String::from(
            "SELECT seq, msg_id, ts, sender, recipient, msg_type, summary, data FROM messages WHERE session_id = $1 AND seq > $2",
        );
        let mut binds: Vec<&str> = Vec::new();
        for (column, value) in [
            ("sender", &filter.from),
            ("recipient", &filter.to),
            ("msg_type", &filter.kind),
        ] {
            if let Some(value) = value {
                binds.push(value);
                sql.push_str(&format!(" AND {column} = ${}", binds.len() + 3));
            }
        }
        // Without a cursor, CCW's `list last=N`: the newest N. With one, page forward: the N
        // that follow it, so `next_sequence` never skips a message.
        let forward = filter.after_sequence > 0;
        sql.push_str(if forward {
            " ORDER BY seq ASC LIMIT $3"
        } else {
            " ORDER BY seq DESC LIMIT $3"
        });
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(session_id)
            .bind(to_i64(filter.after_sequence))
            .bind(i64::from(filter.last));
        for value in binds {
            query = query.bind(value);
        }
        let rows = query.fetch_all(&mut *tx).await?;
        tx.commit().await?;
        let mut messages = rows
            .iter()
            .map(message_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        if !forward {
            messages.reverse();
        }
        let next = messages
            .last()
            .map_or(filter.after_sequence, |message| message.sequence);
        Ok((messages, next))
    }

    /// Returns the role state of one role, or of all roles when `role` is empty.
    pub(crate) async fn get_state(
        &self,
        session_id: &str,
        role: &str,
    ) -> Result<BTreeMap<String, Map<String, Value>>, Error> {
        let mut tx = self.begin_read().await?;
        load_session(&mut tx, session_id).await?;
        let rows = if role.is_empty() {
            sqlx::query("SELECT role, state FROM role_state WHERE session_id = $1")
                .bind(session_id)
                .fetch_all(&mut *tx)
                .await?
        } else {
            sqlx::query("SELECT role, state FROM role_state WHERE session_id = $1 AND role = $2")
                .bind(session_id)
                .bind(role)
                .fetch_all(&mut *tx)
                .await?
        };
        tx.commit().await?;
        let mut out = BTreeMap::new();
        for row in rows {
            let role: String = row.try_get("role")?;
            let state: String = row.try_get("state")?;
            out.insert(role, parse_object(&state)?);
        }
        Ok(out)
    }

    /// Shallow-merges `data` into a role's state with `_updated_at`, and records the
    /// `state_update` message, atomically.
    pub(crate) async fn update_state(
        &self,
        session_id: &str,
        role: &str,
        data: Map<String, Value>,
        now: i64,
    ) -> Result<(Map<String, Value>, pb::Message), Error> {
        let mut tx = self.begin().await?;
        lock_session(&mut tx, session_id, self.for_update()).await?;
        let existing =
            sqlx::query("SELECT state FROM role_state WHERE session_id = $1 AND role = $2")
                .bind(session_id)
                .bind(role)
                .fetch_optional(&mut *tx)
                .await?;
        let mut state = match existing {
            Some(row) => parse_object(&row.try_get::<String, _>("state")?)?,
            None => Map::new(),
        };
        for (key, value) in &data {
            state.insert(key.clone(), value.clone());
        }
        state.insert("_updated_at".to_owned(), Value::String(rfc3339(now)));
        sqlx::query(
            "INSERT INTO role_state (session_id, role, state) VALUES ($1, $2, $3) \
             ON CONFLICT (session_id, role) DO UPDATE SET state = excluded.state",
        )
        .bind(session_id)
        .bind(role)
        .bind(Value::Object(state.clone()).to_string())
        .execute(&mut *tx)
        .await?;
        let message = insert_message(
            &mut tx,
            session_id,
            NewMessage {
                from: role.to_owned(),
                to: "coordinator".to_owned(),
                kind: "state_update".to_owned(),
                summary: format!("[{role}] state_update -> coordinator"),
                data: Some(data),
                idempotency_key: None,
            },
            now,
        )
        .await?;
        tx.commit().await?;
        Ok((state, message))
    }

    // ----- events ---------------------------------------------------------------------------

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

    /// What each role's tasks took lately: the median, in milliseconds, of the last attempt
    /// (the one that succeeded) of the newest [`LEARNED_TASKS`] completed tasks in the
    /// `sessions` newest sessions, for roles with at least [`LEARNED_MIN`] of them.
    /// It reads only those sessions' tasks (through the sessions' creation index and the
    /// tasks' primary key), however long the history.
    pub(crate) async fn learned_durations(
        &self,
        sessions: u32,
    ) -> Result<HashMap<Role, u64>, Error> {
        if sessions == 0 {
            return Ok(HashMap::new());
        }
        let mut conn = self.reader.acquire().await?;
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT role, finished_at - started_at AS took FROM tasks \
             WHERE session_id IN (SELECT id FROM sessions ORDER BY created_at DESC LIMIT {sessions}) \
             AND state = $1 AND started_at IS NOT NULL AND finished_at IS NOT NULL \
             ORDER BY finished_at DESC LIMIT {LEARNED_TASKS}"
        )))
        .bind(TaskState::Completed as i32)
        .fetch_all(&mut *conn)
        .await?;
        let mut took: HashMap<Role, Vec<u64>> = HashMap::new();
        for row in rows {
            let role = pb::Role::try_from(row.try_get::<i32, _>("role")?).map_err(corrupt)?;
            let Some(role) = Role::from_proto(role) else {
                continue;
            };
            let ms = u64::try_from(row.try_get::<i64, _>("took")?).unwrap_or(0);
            took.entry(role).or_default().push(ms);
        }
        Ok(took
            .into_iter()
            .filter(|(_, took)| took.len() >= LEARNED_MIN)
            .map(|(role, mut took)| {
                took.sort_unstable();
                // At least 1 ms, so chains of a role that takes no time still rank by length.
                (role, took[took.len() / 2].max(1))
            })
            .collect())
    }

    /// Returns up to `limit` events with a sequence greater than `after`, in order.
    pub(crate) async fn events_after(
        &self,
        session_id: &str,
        after: u64,
        limit: u32,
    ) -> Result<Vec<pb::SessionEvent>, Error> {
        let mut conn = self.reader.acquire().await?;
        let rows = sqlx::query(
            "SELECT payload FROM events WHERE session_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
        )
        .bind(session_id)
        .bind(to_i64(after))
        .bind(i64::from(limit))
        .fetch_all(&mut *conn)
        .await?;
        rows.iter()
            .map(|row| {
                let payload: Vec<u8> = row.try_get("payload")?;
                pb::SessionEvent::decode(payload.as_slice()).map_err(corrupt)
            })
            .collect()
    }
}

// ----- transaction helpers -------------------------------------------------------------------

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

/// What a batch works on: the tasks it completes, their pending dependents, the best ready
/// tasks for its claims, and whether another task is ready or running.
#[derive(Debug, Default)]
pub(crate) struct Gathered {
    pub(crate) originals: HashMap<String, Task>,
    /// In plan order.
    pub(crate) dependents: Vec<Task>,
    /// In claim order.
    pub(crate) ready: Vec<Task>,
    pub(crate) busy: bool,
}

/// Reads what a batch completing `ids` and claiming `wanted` tasks of `roles` works on, in
/// one statement (per 128 ids).
async fn read_batch(
    tx: &mut Tx,
    session_id: &str,
    ids: &[String],
    roles: &[pb::Role],
    wanted: usize,
) -> Result<Gathered, Error> {
    let mut originals: HashMap<String, Task> = HashMap::with_capacity(ids.len());
    let mut dependents: Vec<Task> = Vec::new();
    let mut ready: Vec<Task> = Vec::new();
    // Per chunk of ids (the first also reads the ready tasks; with no ids, only that): the
    // tasks, the pending tasks naming one of them among their dependencies (the LIKE is a
    // coarse filter on the JSON text; the parsed list decides), the best ready tasks.
    let mut chunks: Vec<&[String]> = ids.chunks(128).collect();
    if chunks.is_empty() {
        chunks.push(&[]);
    }
    let single = chunks.len() == 1;
    // Some task outside the batch is ready or running (known with one chunk of ids).
    let mut busy = false;
    for (n, chunk) in chunks.into_iter().enumerate() {
        let read_ready = n == 0 && wanted > 0;
        if chunk.is_empty() && !read_ready {
            continue;
        }
        let mut parts = Vec::new();
        let mut next = 2;
        let mut param = || {
            let name = format!("${next}");
            next += 1;
            name
        };
        // Padded (see `padded`): the last id repeats.
        let width = padded(chunk.len());
        let repeat = |i: usize| &chunk[i.min(chunk.len().saturating_sub(1))];
        if !chunk.is_empty() {
            let these: Vec<String> = (0..width).map(|_| param()).collect();
            let likes: Vec<String> = (0..width)
                .map(|_| format!("depends_on LIKE {}", param()))
                .collect();
            parts.push(format!(
                "SELECT {TASK_COLUMNS} FROM tasks WHERE session_id = $1 AND id IN ({})",
                these.join(", ")
            ));
            // States are constants in the statement (see `pick_session`).
            parts.push(format!(
                "SELECT {TASK_COLUMNS} FROM tasks WHERE session_id = $1 AND state = {} AND ({})",
                TaskState::Pending as i32,
                likes.join(" OR ")
            ));
            if single {
                // Whether any other task is ready or running: then the session goes on
                // whatever this batch does, and needs no end check.
                parts.push(format!(
                    "SELECT * FROM (SELECT {TASK_COLUMNS} FROM tasks WHERE session_id = $1 \
                     AND state IN ({}, {}) AND id NOT IN ({}) LIMIT 1) o",
                    TaskState::Ready as i32,
                    TaskState::Running as i32,
                    these.join(", ")
                ));
            }
        }
        if read_ready {
            let state = TaskState::Ready as i32;
            let limit = param();
            let first_role: usize = next;
            parts.push(format!(
                "SELECT * FROM (SELECT {TASK_COLUMNS} FROM tasks WHERE session_id = $1 AND state = {state}{} \
                 ORDER BY priority, path_ms DESC, created_at, position LIMIT {limit}) r",
                role_filter("role", roles, first_role)
            ));
        }
        let mut query =
            sqlx::query(sqlx::AssertSqlSafe(parts.join(" UNION ALL "))).bind(session_id);
        if !chunk.is_empty() {
            for i in 0..width {
                query = query.bind(repeat(i));
            }
            for i in 0..width {
                query = query.bind(format!("%{}%", Value::String(repeat(i).clone())));
            }
        }
        if read_ready {
            query = query.bind(i64::try_from(wanted).unwrap_or(i64::MAX));
            for role in roles {
                query = query.bind(*role as i32);
            }
        }
        for row in query.fetch_all(&mut **tx).await? {
            let task = task_from_row(&row)?;
            let completing = ids.contains(&task.id);
            busy |= !completing && matches!(task.state, TaskState::Ready | TaskState::Running);
            if completing {
                originals.insert(task.id.clone(), task);
            } else if task.state == TaskState::Ready {
                if !ready.iter().any(|known| known.id == task.id) {
                    ready.push(task);
                }
            } else if task.depends_on.iter().any(|dep| ids.contains(dep))
                && !dependents.iter().any(|known| known.id == task.id)
            {
                dependents.push(task);
            }
        }
    }
    dependents.sort_by_key(|task| task.position);
    Ok(Gathered {
        originals,
        dependents,
        ready,
        busy,
    })
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

/// Loads tasks of a session by id (those that exist), with `columns` (all, or without `spec`),
/// in one query per chunk under the bind limits.
async fn load_tasks_by_id(
    tx: &mut Tx,
    session_id: &str,
    ids: &[String],
    columns: &str,
) -> Result<HashMap<String, Task>, Error> {
    let mut out = HashMap::with_capacity(ids.len());
    for chunk in ids.chunks(256) {
        let width = padded(chunk.len());
        let placeholders: Vec<String> = (0..width).map(|i| format!("${}", i + 2)).collect();
        let mut query = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {columns} FROM tasks WHERE session_id = $1 AND id IN ({})",
            placeholders.join(", ")
        )))
        .bind(session_id);
        for i in 0..width {
            query = query.bind(&chunk[i.min(chunk.len() - 1)]);
        }
        for row in query.fetch_all(&mut **tx).await? {
            let task = task_from_row(&row)?;
            out.insert(task.id.clone(), task);
        }
    }
    Ok(out)
}

/// The length an `IN (...)` list of `n` items is padded to (repeating its last item): a power
/// of two, so a few prepared statements serve every length instead of one per length (each
/// new one costs a prepare, and they crowd the connection's statement cache).
fn padded(n: usize) -> usize {
    n.next_power_of_two()
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

/// The completed tasks upstream of each of `tasks` (transitively, in plan order). Reads the
/// session's graph skeleton (ids, dependencies, states), then only the rows handed out, so a
/// claim costs what it returns rather than the whole session's results.
async fn load_upstream(
    tx: &mut Tx,
    session_id: &str,
    tasks: &[Task],
) -> Result<HashMap<String, Vec<Task>>, Error> {
    let mut out = HashMap::new();
    if tasks.iter().all(|task| task.depends_on.is_empty()) {
        return Ok(out);
    }
    let rows = sqlx::query("SELECT id, depends_on, state FROM tasks WHERE session_id = $1")
        .bind(session_id)
        .fetch_all(&mut **tx)
        .await?;
    let mut graph: HashMap<String, (Vec<String>, bool)> = HashMap::with_capacity(rows.len());
    for row in &rows {
        let depends_on: String = row.try_get("depends_on")?;
        let depends_on: Vec<String> = serde_json::from_str(&depends_on).map_err(corrupt)?;
        let completed = row.try_get::<i32, _>("state")? == TaskState::Completed as i32;
        graph.insert(row.try_get("id")?, (depends_on, completed));
    }
    let mut wanted: Vec<String> = Vec::new();
    let mut per_task: Vec<(String, Vec<String>)> = Vec::new();
    for task in tasks {
        let mut seen: std::collections::HashSet<&str> = std::collections::HashSet::new();
        let mut stack: Vec<&str> = task.depends_on.iter().map(String::as_str).collect();
        while let Some(dep) = stack.pop() {
            if seen.insert(dep)
                && let Some((deps, _)) = graph.get(dep)
            {
                stack.extend(deps.iter().map(String::as_str));
            }
        }
        let completed: Vec<String> = seen
            .into_iter()
            .filter(|id| graph.get(*id).is_some_and(|(_, completed)| *completed))
            .map(str::to_owned)
            .collect();
        for id in &completed {
            if !wanted.contains(id) {
                wanted.push(id.clone());
            }
        }
        per_task.push((task.id.clone(), completed));
    }
    // Checkers read what their upstream tasks promised (criteria, verification) from the
    // upstream specs; other roles need only the results.
    let columns = if tasks.iter().any(|task| task.role == pb::Role::Validator) {
        TASK_COLUMNS.to_owned()
    } else {
        lite_columns()
    };
    let loaded = load_tasks_by_id(tx, session_id, &wanted, &columns).await?;
    for (task_id, ids) in per_task {
        let mut upstream: Vec<Task> = ids
            .iter()
            .filter_map(|id| loaded.get(id).cloned())
            .collect();
        upstream.sort_by_key(|task| task.position);
        out.insert(task_id, upstream);
    }
    Ok(out)
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

/// `AND <column> = $n` for one role (an equality keeps the claim index's order), `IN` for
/// several, nothing for any role; the roles bind from `$first` on.
fn role_filter(column: &str, roles: &[pb::Role], first: usize) -> String {
    match roles.len() {
        0 => String::new(),
        1 => format!(" AND {column} = ${first}"),
        n => {
            let placeholders: Vec<String> = (first..first + n).map(|i| format!("${i}")).collect();
            format!(" AND {column} IN ({})", placeholders.join(", "))
        }
    }
}

/// Whether any of a session's tasks is in one of `states` (an index probe, not a count).
async fn any_task_in(tx: &mut Tx, session_id: &str, states: &[TaskState]) -> Result<bool, Error> {
    // The states are written into the statement (see [`Store::pick_session`]).
    let states: Vec<String> = states
        .iter()
        .map(|state| (*state as i32).to_string())
        .collect();
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 AS found FROM tasks WHERE session_id = $1 AND state IN ({}) LIMIT 1",
        states.join(", ")
    )))
    .bind(session_id)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(row.is_some())
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

async fn set_session_state(
    tx: &mut Tx,
    session: &mut SessionRow,
    to: SessionState,
    reason: &str,
    now: i64,
) -> Result<(), Error> {
    let from = session.state;
    sqlx::query("UPDATE sessions SET state = $2, updated_at = $3 WHERE id = $1")
        .bind(&session.id)
        .bind(to as i32)
        .bind(now)
        .execute(&mut **tx)
        .await?;
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

/// Takes the session's next `count` sequence numbers and returns the first; the row lock makes
/// them gap-free and unique. Events held back in `tx` come first.
async fn next_seq(tx: &mut Tx, session_id: &str, now: i64, count: usize) -> Result<u64, Error> {
    tx.flush_events(Some(session_id)).await?;
    reserve_seq(tx, session_id, now, count).await
}

async fn reserve_seq(tx: &mut Tx, session_id: &str, now: i64, count: usize) -> Result<u64, Error> {
    let row = sqlx::query(
        "UPDATE sessions SET last_seq = last_seq + $3, updated_at = $2 WHERE id = $1 RETURNING last_seq",
    )
    .bind(session_id)
    .bind(now)
    .bind(i64::try_from(count).map_err(corrupt)?)
    .fetch_optional(&mut **tx)
    .await?
    .ok_or_else(|| Error::NotFound(format!("session {session_id} not found")))?;
    let last = u64::try_from(row.try_get::<i64, _>("last_seq")?).map_err(corrupt)?;
    if let Some(known) = tx.sequences.get_mut(session_id) {
        *known = last;
    }
    Ok(last + 1 - count as u64)
}

/// The stored form of one event.
fn event_payload(session_id: &str, sequence: u64, now: i64, kind: Kind) -> Vec<u8> {
    pb::SessionEvent {
        sequence,
        session_id: session_id.to_owned(),
        ts: Some(timestamp(now)),
        kind: Some(kind),
    }
    .encode_to_vec()
}

/// Appends events to a session's log: held back in `tx` until it commits (see [`Tx`]), so
/// they get their sequence numbers then, in the order appended.
async fn append_events(
    tx: &mut Tx,
    session_id: &str,
    now: i64,
    kinds: Vec<Kind>,
) -> Result<(), Error> {
    if kinds.is_empty() {
        return Ok(());
    }
    let events = kinds.into_iter().map(|kind| (now, kind));
    match tx.events.iter_mut().find(|(id, _)| id == session_id) {
        Some((_, pending)) => pending.extend(events),
        None => tx.events.push((session_id.to_owned(), events.collect())),
    }
    Ok(())
}

/// Writes events with consecutive sequence numbers: one sequence update and one insert
/// (per chunk) however many there are.
async fn write_events(
    tx: &mut Tx,
    session_id: &str,
    events: Vec<(i64, Kind)>,
    tasks: &[&Task],
) -> Result<(), Error> {
    let Some(last_ts) = events.iter().map(|(ts, _)| *ts).max() else {
        return update_tasks(tx, tasks).await;
    };
    if tx.wrote {
        tx.needs_lock("a second write")?;
    }
    let count = events.len();
    // Rows per INSERT, well below the databases' limits on bound parameters.
    const CHUNK: usize = 256;
    // With the session's row held (or an optimistic write's counter known), its counter is
    // known: number the events here and move the counter with the first insert, together
    // with the tasks' update, in one round trip (PostgreSQL: one statement with writing CTEs;
    // SQLite, which has none: several statements in one call). Else take the numbers from
    // the database first.
    let known = tx.sequences.get(session_id).copied();
    let together = known.is_some();
    if !together || count > CHUNK || tasks.len() > TASK_ROWS {
        tx.needs_lock("a write of more than one statement")?;
    }
    // The tasks that go out with the first insert; the others (all, unless together and
    // within one statement's rows) are updated first, on their own.
    let mut tasks = if together && tasks.len() <= TASK_ROWS {
        tasks
    } else {
        update_tasks(tx, tasks).await?;
        &[]
    };
    let first = match known {
        Some(last) => last + 1,
        None => reserve_seq(tx, session_id, last_ts, count).await?,
    };
    let last = first + count as u64 - 1;
    let mut events = events.into_iter().enumerate().peekable();
    let mut bump = together;
    while events.peek().is_some() {
        let chunk: Vec<(usize, (i64, Kind))> = events.by_ref().take(CHUNK).collect();
        let rows = chunk.len();
        // After `$1` (and `$2` to `$4` for the bump), three parameters per event, then the
        // tasks.
        let base = if bump { 5 } else { 2 };
        let values: Vec<String> = (0..rows)
            .map(|i| {
                let at = base + 3 * i;
                format!("($1, ${at}, ${}, ${})", at + 1, at + 2)
            })
            .collect();
        let values = values.join(", ");
        let v = || {
            format!(
                "v (session_id, id, {}) AS (VALUES {})",
                MUTABLE_COLUMNS.join(", "),
                task_values(base + 3 * rows, tasks.len())
            )
        };
        let sql = match tx.dialect {
            Dialect::Postgres if bump => {
                // The counter moves only from the value the events were numbered from, and
                // the tasks and events go in only if it moved: under the lock that always
                // holds; an optimistic write learns from the row count that someone else
                // wrote first.
                let mut ctes = vec![
                    "bump AS (UPDATE sessions SET last_seq = $2, updated_at = $3 \
                     WHERE id = $1 AND last_seq = $4 RETURNING id)"
                        .to_owned(),
                ];
                if !tasks.is_empty() {
                    ctes.push(v());
                    ctes.push(format!("upd AS ({})", *UPDATE_FROM_V_BUMP));
                }
                format!(
                    "WITH {} INSERT INTO events (session_id, seq, ts, payload) \
                     SELECT e.* FROM (VALUES {values}) e (session_id, seq, ts, payload), bump",
                    ctes.join(", ")
                )
            }
            Dialect::Sqlite if bump => {
                // An optimistic write (no transaction open) brings its own, so the call is
                // all or nothing. The counter moves only from the value the events were
                // numbered from: else its NOT NULL constraint fails the call (see
                // `Tx::failed`), before anything else is written.
                let auto = matches!(tx.inner, Conn::Auto(_));
                let mut sql = String::from(if auto { "BEGIN IMMEDIATE; " } else { "" });
                sql.push_str(
                    "UPDATE sessions SET last_seq = CASE last_seq WHEN $4 THEN $2 END, \
                     updated_at = $3 WHERE id = $1; ",
                );
                if !tasks.is_empty() {
                    sql.push_str(&format!("WITH {} {}; ", v(), *UPDATE_FROM_V));
                }
                sql.push_str(&format!(
                    "INSERT INTO events (session_id, seq, ts, payload) VALUES {values}"
                ));
                if auto {
                    sql.push_str("; COMMIT");
                }
                sql
            }
            _ => format!("INSERT INTO events (session_id, seq, ts, payload) VALUES {values}"),
        };
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(session_id);
        let bumped = bump;
        if bump {
            query = query
                .bind(to_i64(last))
                .bind(last_ts)
                .bind(to_i64(first - 1));
        }
        bump = false;
        for (i, (ts, kind)) in chunk {
            let sequence = first + i as u64;
            query = query
                .bind(to_i64(sequence))
                .bind(ts)
                .bind(event_payload(session_id, sequence, ts, kind));
        }
        for task in std::mem::take(&mut tasks) {
            query = bind_task(query, task)?;
        }
        let written = match query.execute(&mut **tx).await {
            Ok(done) => done.rows_affected(),
            Err(err) => return Err(tx.failed(session_id, first - 1, err).await),
        };
        if bumped && tx.dialect == Dialect::Postgres && written != rows as u64 {
            return Err(moved(session_id, first - 1));
        }
        tx.wrote = true;
    }
    if known.is_some() {
        tx.sequences.insert(session_id.to_owned(), last);
    }
    Ok(())
}

fn moved(session_id: &str, from: u64) -> Error {
    Error::Contended(format!("session {session_id} moved past sequence {from}"))
}

async fn append_event(tx: &mut Tx, session_id: &str, now: i64, kind: Kind) -> Result<(), Error> {
    append_events(tx, session_id, now, vec![kind]).await
}

/// Inserts one event under a sequence number taken with [`next_seq`].
async fn insert_event(
    tx: &mut Tx,
    session_id: &str,
    sequence: u64,
    now: i64,
    kind: Kind,
) -> Result<(), Error> {
    sqlx::query("INSERT INTO events (session_id, seq, ts, payload) VALUES ($1, $2, $3, $4)")
        .bind(session_id)
        .bind(to_i64(sequence))
        .bind(now)
        .bind(event_payload(session_id, sequence, now, kind))
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn insert_message(
    tx: &mut Tx,
    session_id: &str,
    message: NewMessage,
    now: i64,
) -> Result<pb::Message, Error> {
    if let Some(key) = &message.idempotency_key {
        let existing = sqlx::query(
            "SELECT seq, msg_id, ts, sender, recipient, msg_type, summary, data FROM messages WHERE session_id = $1 AND idempotency_key = $2",
        )
        .bind(session_id)
        .bind(key)
        .fetch_optional(&mut **tx)
        .await?;
        if let Some(row) = existing {
            return message_from_row(&row);
        }
    }
    let counter_row = sqlx::query(
        "UPDATE sessions SET msg_counter = msg_counter + 1 WHERE id = $1 RETURNING msg_counter",
    )
    .bind(session_id)
    .fetch_one(&mut **tx)
    .await?;
    let counter: i64 = counter_row.try_get("msg_counter")?;
    let id = format!("MSG-{counter:03}");
    let sequence = next_seq(tx, session_id, now, 1).await?;
    let stored = pb::Message {
        id: id.clone(),
        sequence,
        ts: Some(timestamp(now)),
        from: message.from,
        to: message.to,
        r#type: message.kind,
        summary: message.summary,
        data: message.data.as_ref().map(json_to_struct),
    };
    sqlx::query(
        "INSERT INTO messages (session_id, seq, msg_id, ts, sender, recipient, msg_type, summary, data, idempotency_key) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(session_id)
    .bind(to_i64(sequence))
    .bind(&id)
    .bind(now)
    .bind(&stored.from)
    .bind(&stored.to)
    .bind(&stored.r#type)
    .bind(&stored.summary)
    .bind(message.data.map(|data| Value::Object(data).to_string()))
    .bind(message.idempotency_key)
    .execute(&mut **tx)
    .await?;
    insert_event(tx, session_id, sequence, now, Kind::Message(stored.clone())).await?;
    Ok(stored)
}

fn message_from_row(row: &AnyRow) -> Result<pb::Message, Error> {
    let data: Option<String> = row.try_get("data")?;
    let data = data.map(|text| parse_object(&text)).transpose()?;
    Ok(pb::Message {
        id: row.try_get("msg_id")?,
        sequence: u64::try_from(row.try_get::<i64, _>("seq")?).map_err(corrupt)?,
        ts: Some(timestamp(row.try_get("ts")?)),
        from: row.try_get("sender")?,
        to: row.try_get("recipient")?,
        r#type: row.try_get("msg_type")?,
        summary: row.try_get("summary")?,
        data: data.as_ref().map(json_to_struct),
    })
}

fn parse_object(text: &str) -> Result<Map<String, Value>, Error> {
    match serde_json::from_str::<Value>(text).map_err(corrupt)? {
        Value::Object(object) => Ok(object),
        other => Err(corrupt(format!("expected a json object, got {other}"))),
    }
}

async fn load_session(tx: &mut Tx, session_id: &str) -> Result<SessionRow, Error> {
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
async fn load_summary(tx: &mut Tx, session_id: &str) -> Result<SessionSummary, Error> {
    Ok(SessionSummary {
        session: load_session(tx, session_id).await?,
        repos: load_repos(tx, session_id).await?,
        counts: load_counts(tx, session_id).await?,
    })
}

async fn load_repos(tx: &mut Tx, session_id: &str) -> Result<Vec<pb::SessionRepo>, Error> {
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

async fn load_counts(tx: &mut Tx, session_id: &str) -> Result<pb::TaskCounts, Error> {
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
        TaskState::Unspecified => return,
    };
    *slot += n;
}

/// Loads a session's tasks in topological order. Writers call [`lock_session`] first: the
/// session row lock serialises every writer of a session, so what they read stays current.
async fn load_tasks(tx: &mut Tx, session_id: &str) -> Result<Vec<Task>, Error> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {TASK_COLUMNS} FROM tasks WHERE session_id = $1 ORDER BY position"
    )))
    .bind(session_id)
    .fetch_all(&mut **tx)
    .await?;
    rows.iter().map(task_from_row).collect()
}

/// Loads a session's tasks without their `spec` (left empty): what write transactions need
/// to move the graph, without parsing every task's plan object. Never written back (the
/// UPDATE leaves `spec` alone) nor sent to clients.
async fn load_tasks_lite(tx: &mut Tx, session_id: &str) -> Result<Vec<Task>, Error> {
    let columns = lite_columns();
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {columns} FROM tasks WHERE session_id = $1 ORDER BY position"
    )))
    .bind(session_id)
    .fetch_all(&mut **tx)
    .await?;
    rows.iter().map(task_from_row).collect()
}

/// Loads up to `limit` ready tasks of `roles` (any when empty) of a session, best first (the
/// claim order).
async fn load_claimable(
    tx: &mut Tx,
    session_id: &str,
    roles: &[pb::Role],
    limit: usize,
) -> Result<Vec<Task>, Error> {
    let role_filter = role_filter("role", roles, 3);
    // The state is a constant in the statement (see `Store::pick_session`).
    let mut query = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {TASK_COLUMNS} FROM tasks WHERE session_id = $1 AND state = {}{role_filter} \
         ORDER BY priority, path_ms DESC, created_at, position LIMIT $2",
        TaskState::Ready as i32
    )))
    .bind(session_id)
    .bind(i64::try_from(limit).unwrap_or(i64::MAX));
    for role in roles {
        query = query.bind(*role as i32);
    }
    let rows = query.fetch_all(&mut **tx).await?;
    rows.iter().map(task_from_row).collect()
}

async fn load_task(tx: &mut Tx, session_id: &str, task_id: &str) -> Result<Task, Error> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {TASK_COLUMNS} FROM tasks WHERE session_id = $1 AND id = $2"
    )))
    .bind(session_id)
    .bind(task_id)
    .fetch_optional(&mut **tx)
    .await?
    .ok_or_else(|| Error::NotFound(format!("task {task_id} not found in session {session_id}")))?;
    task_from_row(&row)
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

fn task_from_row(row: &AnyRow) -> Result<Task, Error> {
    let depends_on: String = row.try_get("depends_on")?;
    let files: String = row.try_get("files")?;
    let spec: String = row.try_get("spec")?;
    let files: Vec<StoredFile> = serde_json::from_str(&files).map_err(corrupt)?;
    let result: Option<Vec<u8>> = row.try_get("result")?;
    let last_error: Option<Vec<u8>> = row.try_get("last_error")?;
    let convergence: Option<Vec<u8>> = row.try_get("convergence")?;
    Ok(Task {
        session_id: row.try_get("session_id")?,
        id: row.try_get("id")?,
        position: row.try_get("position")?,
        title: row.try_get("title")?,
        description: row.try_get("description")?,
        role: pb::Role::try_from(row.try_get::<i32, _>("role")?).map_err(corrupt)?,
        priority: pb::Priority::try_from(row.try_get::<i32, _>("priority")?).map_err(corrupt)?,
        repo: row.try_get("repo")?,
        wave: to_u32(row.try_get("wave")?),
        critical_path: to_u32(row.try_get("critical_path")?),
        path_ms: u64::try_from(row.try_get::<i64, _>("path_ms")?).map_err(corrupt)?,
        depends_on: serde_json::from_str(&depends_on).map_err(corrupt)?,
        files: files
            .into_iter()
            .map(|file| pb::FileChange {
                path: file.path,
                action: file.action,
                change: file.change,
            })
            .collect(),
        spec: parse_object(&spec)?,
        state: TaskState::try_from(row.try_get::<i32, _>("state")?).map_err(corrupt)?,
        attempt: to_u32(row.try_get("attempt")?),
        max_attempts: to_u32(row.try_get("max_attempts")?),
        fencing_token: u64::try_from(row.try_get::<i64, _>("fencing_token")?).map_err(corrupt)?,
        worker_id: row.try_get("worker_id")?,
        lease_ms: row.try_get("lease_ms")?,
        lease_expires_at: row.try_get("lease_expires_at")?,
        not_before: row.try_get("not_before")?,
        created_at: row.try_get("created_at")?,
        started_at: row.try_get("started_at")?,
        finished_at: row.try_get("finished_at")?,
        progress: row.try_get("progress")?,
        result: result
            .map(|bytes| pb::TaskResult::decode(bytes.as_slice()))
            .transpose()
            .map_err(corrupt)?,
        last_error: last_error
            .map(|bytes| pb::TaskError::decode(bytes.as_slice()))
            .transpose()
            .map_err(corrupt)?,
        superseded_by: row.try_get("superseded_by")?,
        convergence: convergence
            .map(|bytes| pb::TaskConvergence::decode(bytes.as_slice()))
            .transpose()
            .map_err(corrupt)?,
    })
}

async fn insert_task(tx: &mut Tx, task: &Task) -> Result<(), Error> {
    let files: Vec<StoredFile> = task
        .files
        .iter()
        .map(|file| StoredFile {
            path: file.path.clone(),
            action: file.action,
            change: file.change.clone(),
        })
        .collect();
    sqlx::query(
        "INSERT INTO tasks (session_id, id, position, title, description, role, priority, repo, wave, critical_path, \
         path_ms, depends_on, files, spec, state, attempt, max_attempts, fencing_token, worker_id, lease_ms, created_at, \
         progress, finished_at, result) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, 0, $16, 0, '', 0, $17, '', $18, $19)",
    )
    .bind(&task.session_id)
    .bind(&task.id)
    .bind(task.position)
    .bind(&task.title)
    .bind(&task.description)
    .bind(task.role as i32)
    .bind(task.priority as i32)
    .bind(&task.repo)
    .bind(i64::from(task.wave))
    .bind(i64::from(task.critical_path))
    .bind(i64::try_from(task.path_ms).unwrap_or(i64::MAX))
    .bind(serde_json::to_string(&task.depends_on).map_err(corrupt)?)
    .bind(serde_json::to_string(&files).map_err(corrupt)?)
    .bind(Value::Object(task.spec.clone()).to_string())
    .bind(task.state as i32)
    .bind(i64::from(task.max_attempts))
    .bind(task.created_at)
    .bind(task.finished_at)
    .bind(task.result.as_ref().map(prost::Message::encode_to_vec))
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Writes a task's mutable columns.
async fn update_task(tx: &mut Tx, task: &Task) -> Result<(), Error> {
    update_tasks(tx, &[task]).await
}

/// The columns [`update_tasks`] writes, after `session_id` and `id`.
const MUTABLE_COLUMNS: [&str; 16] = [
    "state",
    "attempt",
    "fencing_token",
    "worker_id",
    "lease_ms",
    "lease_expires_at",
    "not_before",
    "started_at",
    "finished_at",
    "progress",
    "result",
    "last_error",
    "max_attempts",
    "position",
    "depends_on",
    "superseded_by",
];

/// Writes the mutable columns of several tasks in one statement per chunk (an `UPDATE ...
/// FROM` a `VALUES` list, which both databases run): a group commit's transitions cost one
/// round trip, not one per task.
async fn update_tasks(tx: &mut Tx, tasks: &[&Task]) -> Result<(), Error> {
    for chunk in tasks.chunks(TASK_ROWS) {
        tx.needs_lock("a task update without events")?;
        let sql = format!(
            "WITH v (session_id, id, {}) AS (VALUES {}) {}",
            MUTABLE_COLUMNS.join(", "),
            task_values(1, chunk.len()),
            *UPDATE_FROM_V
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for task in chunk {
            query = bind_task(query, task)?;
        }
        query.execute(&mut **tx).await?;
    }
    Ok(())
}

/// Task rows per `UPDATE`: 18 parameters each, well below both databases' limits.
const TASK_ROWS: usize = 200;

type AnyQuery<'q> = sqlx::query::Query<'q, Any, sqlx::any::AnyArguments>;

/// `UPDATE tasks ... FROM v`, for a `v` of the session id, the id and [`MUTABLE_COLUMNS`].
static UPDATE_FROM_V: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| update_from_v(""));
/// [`UPDATE_FROM_V`] joined with an optimistic write's `bump`, which vetoes every row when the
/// session's sequence moved (see `write_events`).
static UPDATE_FROM_V_BUMP: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| update_from_v(", bump"));

/// `UPDATE tasks ... FROM v{also}` (`also`: more from-items), built once per form above.
fn update_from_v(also: &str) -> String {
    format!(
        "UPDATE tasks SET {} FROM v{also} WHERE tasks.session_id = v.session_id AND tasks.id = v.id",
        MUTABLE_COLUMNS
            .iter()
            .map(|column| format!("{column} = v.{column}"))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// The `VALUES` rows of `rows` tasks for [`bind_task`], numbering parameters from `$first`.
fn task_values(first: usize, rows: usize) -> String {
    const WIDTH: usize = MUTABLE_COLUMNS.len() + 2;
    (0..rows)
        .map(|row| {
            let params: Vec<String> = (0..WIDTH)
                .map(|i| format!("${}", first + row * WIDTH + i))
                .collect();
            format!("({})", params.join(", "))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Binds a task's id and [`MUTABLE_COLUMNS`], in that order.
fn bind_task<'q>(query: AnyQuery<'q>, task: &'q Task) -> Result<AnyQuery<'q>, Error> {
    Ok(query
        .bind(&task.session_id)
        .bind(&task.id)
        .bind(task.state as i32)
        .bind(i64::from(task.attempt))
        .bind(to_i64(task.fencing_token))
        .bind(&task.worker_id)
        .bind(task.lease_ms)
        .bind(task.lease_expires_at)
        .bind(task.not_before)
        .bind(task.started_at)
        .bind(task.finished_at)
        .bind(&task.progress)
        .bind(task.result.as_ref().map(prost::Message::encode_to_vec))
        .bind(task.last_error.as_ref().map(prost::Message::encode_to_vec))
        .bind(i64::from(task.max_attempts))
        .bind(task.position)
        .bind(serde_json::to_string(&task.depends_on).map_err(corrupt)?)
        .bind(&task.superseded_by))
}

/// Returns the lowercase name of a session state.
pub(crate) fn session_state_name(state: SessionState) -> &'static str {
    match state {
        SessionState::Unspecified => "unspecified",
        SessionState::Active => "active",
        SessionState::Completed => "completed",
        SessionState::Failed => "failed",
        SessionState::Cancelled => "cancelled",
        SessionState::Paused => "paused",
    }
}

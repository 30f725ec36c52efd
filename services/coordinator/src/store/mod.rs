//! The store: every SQL statement of the coordinator, behind [`Store`]. It reads and writes
//! rows; what a change means (which task runs next, when a session ends) is decided in
//! [`crate::lifecycle`].
//!
//! Layers, each using only the ones before it:
//! 1. [`transactions`]: the transaction every statement runs in ([`Tx`]), and the events it
//!    holds back until it commits.
//! 2. The tables, one module each: [`sessions`] (with their repositories and plan assets),
//!    [`tasks`], [`events`], [`messages`] (with role state) and [`workers`]; [`migrations`] is
//!    their schema.
//! 3. [`crate::lifecycle`]: the state changes, which open transactions and read and write
//!    through the tables, never with SQL of their own.
//!
//! One set of statements (sqlx `Any`, `$n` parameters, `ON CONFLICT`, `RETURNING`) and one set
//! of migrations serve SQLite and PostgreSQL. SQLite (the default) runs in WAL mode with one
//! writer connection (SQLite serialises writers anyway; `BEGIN IMMEDIATE` never waits on
//! ourselves), a small reader pool, and its WAL checkpointed in the background
//! ([`checkpoints`]). PostgreSQL has one shared pool, and several
//! coordinators may use the same database: every writer of a session first locks the session
//! row (`FOR UPDATE`; a claim first picks its session without locks, then locks it and
//! re-reads its ready tasks), and `pg_notify` wakes the other coordinators' long polls. Each
//! state change is one transaction that also appends its events with the session's gap-free
//! sequence (`sessions.last_seq`, moved under the row lock); events are held back in the
//! [`Tx`] and written once, just before the commit.

use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

use serde_json::{Map, Value};
use sqlx::any::AnyPoolOptions;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{AnyPool, ConnectOptions as _};

use crate::Error;
use crate::store::sessions::Fixed;

pub(crate) mod check;
mod checkpoints;
pub(crate) mod events;
pub(crate) mod gates;
pub(crate) mod intake;
pub(crate) mod messages;
mod migrations;
mod ready;
pub(crate) mod sessions;
mod statistics;
pub(crate) mod tasks;
mod transactions;
pub(crate) mod workers;

pub(crate) use events::HeldWrite;
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

/// Where a [`Store`] writes.
#[derive(Debug, Clone)]
enum Writer {
    /// SQLite's one writer connection.
    Sqlite(transactions::SqliteWriter),
    /// PostgreSQL's pool (the readers' too), and the group commit's own connection
    /// ([`Store::write_held`]).
    Pool { pool: AnyPool, held: AnyPool },
}

/// The store over SQLite or PostgreSQL (sqlx `Any`, so one set of statements serves both).
#[derive(Debug, Clone)]
pub(crate) struct Store {
    writer: Writer,
    reader: AnyPool,
    dialect: Dialect,
    /// The PostgreSQL URL, for the change listener.
    url: Option<String>,
    /// Each session's repositories and plan assets digest, which never change once stored:
    /// claims skip the queries.
    repos: std::sync::Arc<std::sync::Mutex<HashMap<String, Fixed>>>,
    /// What intakes added since the statistics were last refreshed (PostgreSQL).
    growth: std::sync::Arc<statistics::Growth>,
}

/// Channel of the PostgreSQL notifications that wake other coordinators' long polls.
const CHANGES_CHANNEL: &str = "troupe_changes";

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
        Self::open_sqlite_through(options, i64::MAX).await
    }

    /// [`Self::open_sqlite`] with the migrations up to version `last` only (tests open a
    /// store as an older coordinator left it).
    async fn open_sqlite_through(options: SqliteConnectOptions, last: i64) -> Result<Self, Error> {
        sqlx::any::install_default_drivers();
        // `Any` connects by URL; the SQLite URL keeps the file name percent-encoded.
        let url = options.create_if_missing(true).to_url_lossy().to_string();
        const PRAGMAS: &str = "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; \
                               PRAGMA busy_timeout = 10000; PRAGMA foreign_keys = ON;";
        let writer = transactions::SqliteWriter::connect(&url, PRAGMAS).await?;
        // No ping before each acquire (sqlx's default): it costs a round trip per read, and a
        // dead connection fails its statement just the same.
        let reader = AnyPoolOptions::new()
            .test_before_acquire(false)
            .after_connect(|conn, _meta| {
                Box::pin(async move {
                    sqlx::raw_sql(PRAGMAS).execute(&mut *conn).await?;
                    Ok(())
                })
            })
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(30))
            .connect_lazy(&url)?;
        let store = Self {
            writer: Writer::Sqlite(writer),
            reader,
            dialect: Dialect::Sqlite,
            url: None,
            repos: Default::default(),
            growth: Default::default(),
        };
        store.migrate_through(last).await?;
        Ok(store)
    }

    async fn open_postgres(url: &str) -> Result<Self, Error> {
        sqlx::any::install_default_drivers();
        // No ping before each acquire (see `open_sqlite`). Generic plans: every statement is
        // prepared once per connection and its shape fixes its index, so re-planning it for
        // each execution's values (PostgreSQL's first five, and whenever a custom plan looks
        // cheaper) only costs time; S1 measured 20 to 25% more throughput without it.
        let options = || {
            AnyPoolOptions::new()
                .test_before_acquire(false)
                .after_connect(|conn, _meta| {
                    Box::pin(async move {
                        sqlx::raw_sql("SET plan_cache_mode = force_generic_plan")
                            .execute(&mut *conn)
                            .await?;
                        Ok(())
                    })
                })
                .acquire_timeout(Duration::from_secs(30))
        };
        let pool = options().max_connections(16).connect(url).await?;
        // The group commit's writes, one after the other, on a connection of their own: each
        // shape of them (by sessions, tasks and events: 178 with 1,000 sessions) is prepared
        // once, not on each of the pool's connections in turn, and stays prepared (sqlx keeps
        // 100 a connection by default; a capacity in `url` is overridden here).
        let separator = if url.contains('?') { '&' } else { '?' };
        let held = options()
            .max_connections(1)
            .connect(&format!("{url}{separator}statement-cache-capacity=1024"))
            .await?;
        let mut store = Self {
            writer: Writer::Pool {
                pool: pool.clone(),
                held,
            },
            reader: pool,
            dialect: Dialect::Postgres,
            url: Some(url.to_owned()),
            repos: Default::default(),
            growth: Default::default(),
        };
        store.migrate().await?;
        let (tasks, sessions) = store.planner_rows().await?;
        store.growth = std::sync::Arc::new(statistics::Growth::holding(tasks, sessions));
        Ok(store)
    }

    /// Closes the database's connections (tests reopen a database an older coordinator left).
    #[cfg(test)]
    pub(crate) async fn close(self) {
        self.reader.close().await;
        match self.writer {
            Writer::Sqlite(writer) => writer.close().await,
            Writer::Pool { pool, held } => {
                held.close().await;
                pool.close().await;
            }
        }
    }

    pub(crate) fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// After an intake of `tasks` tasks on PostgreSQL, refreshes the planner's statistics in
    /// the background when the intakes since the last refresh doubled the tasks or the
    /// sessions (see [`statistics`]).
    pub(crate) fn refresh_statistics(&self, tasks: usize) {
        if self.dialect == Dialect::Postgres && self.growth.took_in(tasks) {
            self.refresh("an intake");
        }
    }

    /// After `tasks` tasks ended, on PostgreSQL, refreshes the planner's statistics in the
    /// background when as many ended since the last refresh as half the tasks taken in (see
    /// [`statistics`]).
    pub(crate) fn tasks_ended(&self, tasks: usize) {
        if tasks > 0 && self.dialect == Dialect::Postgres && self.growth.ended(tasks) {
            self.refresh("tasks ended");
        }
    }

    /// PostgreSQL's estimates of the rows in `tasks` and `sessions` (0 before the first
    /// `ANALYZE`): what this coordinator's refreshes count from (see [`statistics`]).
    async fn planner_rows(&self) -> Result<(usize, usize), Error> {
        let (tasks, sessions): (i64, i64) = sqlx::query_as(
            "SELECT \
             COALESCE((SELECT reltuples::BIGINT FROM pg_class WHERE oid = to_regclass('tasks')), 0), \
             COALESCE((SELECT reltuples::BIGINT FROM pg_class WHERE oid = to_regclass('sessions')), 0)",
        )
        .fetch_one(&self.reader)
        .await?;
        let rows = |n: i64| usize::try_from(n).unwrap_or_default();
        Ok((rows(tasks), rows(sessions)))
    }

    fn refresh(&self, after: &'static str) {
        let (pool, growth) = (self.reader.clone(), self.growth.clone());
        tokio::spawn(async move {
            if let Err(err) = sqlx::raw_sql("ANALYZE sessions, tasks, task_deps, events")
                .execute(&pool)
                .await
            {
                tracing::warn!(error = %err, after, "refreshing statistics");
            }
            growth.done();
        });
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
                .execute(&self.reader)
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

/// Connects a listener to the change notifications that the coordinators sharing the
/// PostgreSQL at `url` publish ([`Store::publish_change`]).
pub(crate) async fn listen_to_changes(
    url: &str,
) -> Result<sqlx::postgres::PgListener, sqlx::Error> {
    let mut listener = sqlx::postgres::PgListener::connect(url).await?;
    listener.listen(CHANGES_CHANNEL).await?;
    Ok(listener)
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

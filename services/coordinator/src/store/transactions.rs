//! The transaction every statement runs in: [`Tx`], opened by [`Store::begin`] (a write),
//! [`Store::optimistic`] (one conditional write without a lock) or [`Store::begin_read`] (a
//! snapshot). A write transaction holds back the events appended in it and writes them once,
//! just before it commits, numbered from the session's sequence (see [`super::events`]).

use std::collections::HashMap;

use sqlx::Any;
use troupe_proto::v1::SessionState;
use troupe_proto::v1::session_event::Kind;

use crate::Error;
use crate::task::Task;
use sqlx::Transaction;

use super::events::{moved, write_events};
use super::{Dialect, Store};

/// A write transaction. Events appended in it are held back and written just before it
/// commits (or before the session's sequence is read or taken otherwise), so the operations
/// of a group commit share one sequence update and one insert per session.
pub(crate) struct Tx {
    pub(super) inner: Conn,
    /// Per session, in order of first append: each event's time and kind.
    pub(super) events: Vec<(String, Vec<(i64, Kind)>)>,
    /// Sessions whose row this transaction holds locked, with their `last_seq`: their events
    /// are numbered without reading the counter back (on PostgreSQL the counter update and the
    /// insert are then one statement).
    pub(super) sequences: HashMap<String, u64>,
    /// Sessions whose new state goes out with the write that moves their sequence (see
    /// [`super::sessions::set_session_state`]).
    pub(super) states: HashMap<String, SessionState>,
    pub(super) dialect: Dialect,
    /// A write transaction (`begin`), not a snapshot (`begin_read`).
    pub(super) writes: bool,
    /// Set once an optimistic [`Tx`] (see [`Store::optimistic`]) wrote: its one write
    /// committed on its own.
    pub(crate) wrote: bool,
}

/// What a [`Tx`] runs its statements on.
pub(super) enum Conn {
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
    fn new(inner: Conn, dialect: Dialect, writes: bool) -> Self {
        Self {
            inner,
            events: Vec::new(),
            sequences: HashMap::new(),
            states: HashMap::new(),
            dialect,
            writes,
            wrote: false,
        }
    }

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
    pub(crate) async fn failed(&mut self, session_id: &str, from: u64, err: sqlx::Error) -> Error {
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
    pub(super) fn needs_lock(&self, what: &str) -> Result<(), Error> {
        match self.inner {
            Conn::Auto(_) => Err(Error::Contended(format!("{what} needs a transaction"))),
            Conn::Tx(_) => Ok(()),
        }
    }

    /// Writes `tasks` (changed tasks of `session_id`) with the session's held-back events: on
    /// PostgreSQL, with the session held, in one statement. `reshaped`: whether any of them
    /// changed its place in the graph or its retry budget (see `tasks::reshaped`).
    pub(crate) async fn write_with_events(
        &mut self,
        session_id: &str,
        tasks: &[&Task],
        reshaped: bool,
    ) -> Result<(), Error> {
        let events = match self.events.iter().position(|(id, _)| id == session_id) {
            Some(at) => self.events.remove(at).1,
            None => Vec::new(),
        };
        write_events(self, session_id, events, tasks, reshaped).await
    }

    /// Rolls back, held-back events included.
    pub(crate) async fn rollback(self) -> Result<(), Error> {
        if let Conn::Tx(tx) = self.inner {
            tx.rollback().await?;
        }
        Ok(())
    }

    /// Writes the held-back events of `session_id` (of every session when `None`).
    pub(super) async fn flush_events(&mut self, session_id: Option<&str>) -> Result<(), Error> {
        let pending = std::mem::take(&mut self.events);
        for (session, events) in pending {
            if session_id.is_none_or(|id| id == session) {
                write_events(self, &session, events, &[], false).await?;
            } else {
                self.events.push((session, events));
            }
        }
        Ok(())
    }
}

impl Store {
    pub(crate) async fn begin(&self) -> Result<Tx, Error> {
        let inner = match self.dialect {
            Dialect::Sqlite => self.writer.begin_with("BEGIN IMMEDIATE").await?,
            Dialect::Postgres => self.writer.begin().await?,
        };
        Ok(Tx::new(Conn::Tx(inner), self.dialect, true))
    }

    /// An optimistic write, without a lock: for a group of one session whose `last_seq` the
    /// caller knows (with what it read or holds in memory as of that sequence; see
    /// [`crate::lifecycle::task_cache::TaskCache`]). Reads see the latest commits; the one write (tasks, events and the
    /// sequence: see `write_events`; on PostgreSQL one statement, on SQLite one call that
    /// opens and commits its own transaction) applies only if the session's `last_seq` is
    /// still `last_seq`, and fails with [`Error::Contended`] otherwise. Every change to a
    /// session moves its sequence, so nothing can have changed what the group worked on.
    /// That saves the lock and the round trips of `BEGIN` and `COMMIT`. Anything that needs
    /// more than the one write fails with [`Error::Contended`] before writing, for the caller
    /// to run under the lock.
    pub(crate) async fn optimistic(&self, session_id: &str, last_seq: u64) -> Result<Tx, Error> {
        let mut tx = Tx::new(Conn::Auto(self.writer.acquire().await?), self.dialect, true);
        tx.sequences.insert(session_id.to_owned(), last_seq);
        Ok(tx)
    }

    /// Reads on the reader pool without a transaction: each statement sees the latest commits
    /// (no `BEGIN` and `ROLLBACK` round trips), for reads that check their own consistency.
    pub(crate) async fn read_latest(&self) -> Result<Tx, Error> {
        Ok(Tx::new(
            Conn::Auto(self.reader.acquire().await?),
            self.dialect,
            false,
        ))
    }

    /// A read-only transaction on the reader pool: one consistent snapshot for several reads.
    pub(crate) async fn begin_read(&self) -> Result<Tx, Error> {
        Ok(Tx::new(
            Conn::Tx(self.reader.begin().await?),
            self.dialect,
            false,
        ))
    }
}

//! The transaction every statement runs in: [`Tx`], opened by [`Store::begin`] (a write),
//! [`Store::optimistic`] (one conditional write without a lock) or [`Store::begin_read`] (a
//! snapshot). A write transaction holds back the events appended in it and writes them once,
//! just before it commits, numbered from the session's sequence (see [`super::events`]).

use std::collections::HashMap;
use std::sync::Arc;

use sqlx::{Any, AnyConnection, Connection as _};
use tokio::sync::{Mutex, OwnedMutexGuard};
use troupe_proto::v1::SessionState;
use troupe_proto::v1::session_event::Kind;

use crate::Error;
use crate::task::Task;
use sqlx::Transaction;

use super::checkpoints::{self, Checkpoints};
use super::events::{HeldWrite, held_writes, held_writes_postgres, moved, write_events};
use super::{Dialect, Store, Writer};

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
    /// committed on its own, or is held back (`held`).
    pub(crate) wrote: bool,
    /// An optimistic [`Tx`] that holds its one write back (see [`Tx::hold`]).
    hold: bool,
    held: Option<HeldWrite>,
}

/// What a [`Tx`] runs its statements on.
pub(super) enum Conn {
    Tx(Transaction<'static, Any>),
    /// No transaction: each statement commits on its own (see [`Store::optimistic`]).
    Auto(sqlx::pool::PoolConnection<Any>),
    /// SQLite's writer connection: inside `BEGIN IMMEDIATE` when `begun` ([`Store::begin`]),
    /// else each statement (or call) commits on its own, as [`Conn::Auto`].
    Writer {
        lease: WriterLease,
        begun: bool,
    },
}

/// The database's one writer connection on SQLite, passed from writer to writer in the order
/// they asked (a fair lock). Not a pool of one: sqlx pings a pooled connection's worker thread
/// each time it goes back to the pool, a round trip that the next writer waits for (on the
/// group commit's lane, a fifth of its time). It checkpoints only when the background
/// checkpoint asks (see [`super::checkpoints`]).
#[derive(Debug, Clone)]
pub(super) struct SqliteWriter {
    conn: Arc<Mutex<WriterConn>>,
    checkpoints: Arc<Checkpoints>,
}

#[derive(Debug)]
struct WriterConn {
    conn: AnyConnection,
    /// A writer went away inside a transaction (an error, or a caller that gave up): it is
    /// rolled back before the next writer's first statement.
    open: bool,
}

/// The writer connection, held by one writer.
pub(super) struct WriterLease {
    guard: OwnedMutexGuard<WriterConn>,
    /// Inside a transaction this writer opened (`BEGIN` sent, no `COMMIT` or `ROLLBACK` yet).
    open: bool,
}

impl Drop for WriterLease {
    fn drop(&mut self) {
        if self.open {
            self.guard.open = true;
        }
    }
}

impl SqliteWriter {
    /// Connects to the SQLite database at `url`, runs `setup` on the connection and starts
    /// the background checkpoint.
    pub(super) async fn connect(url: &str, setup: &str) -> Result<Self, Error> {
        let mut conn = AnyConnection::connect(url).await?;
        let setup = format!("{setup} PRAGMA wal_autocheckpoint = 0;");
        sqlx::raw_sql(sqlx::AssertSqlSafe(setup.clone()))
            .execute(&mut conn)
            .await?;
        let conn = Arc::new(Mutex::new(WriterConn { conn, open: false }));
        let checkpoints = Arc::new(Checkpoints::default());
        checkpoints::start(url, &setup, Arc::downgrade(&conn), Arc::clone(&checkpoints)).await?;
        Ok(Self { conn, checkpoints })
    }

    /// Waits for the connection; rolls back what a writer before left open, and finishes a
    /// checkpoint when one is due.
    async fn lease(&self) -> WriterLease {
        let mut guard = Arc::clone(&self.conn).lock_owned().await;
        if guard.open {
            // Fails when the call never got to its `BEGIN`: nothing is open then either.
            if let Err(err) = sqlx::query("ROLLBACK").execute(&mut guard.conn).await {
                tracing::debug!(error = %err, "rollback of what a writer left open");
            }
            guard.open = false;
        }
        if self.checkpoints.leased()
            && let Err(err) = checkpoints::checkpoint(&mut guard.conn).await
        {
            tracing::warn!(error = %err, "checkpoint failed");
        }
        WriterLease { guard, open: false }
    }

    /// Closes the connection once every writer let go of it.
    #[cfg(test)]
    pub(super) async fn close(self) {
        if let Ok(writer) = Arc::try_unwrap(self.conn) {
            let _ = writer.into_inner().conn.close().await;
        }
    }
}

impl WriterLease {
    /// Runs `BEGIN …` (`opens`), `COMMIT` or `ROLLBACK`.
    async fn run(&mut self, statement: &'static str, opens: bool) -> Result<(), Error> {
        // Marked before it runs: a call cut short may still have opened the transaction.
        self.open = true;
        let done = sqlx::query(statement).execute(&mut self.guard.conn).await;
        // After a `ROLLBACK`, failed or not, nothing is open.
        if done.is_ok() || statement == "ROLLBACK" {
            self.open = opens;
        }
        done?;
        Ok(())
    }
}

impl std::ops::Deref for Tx {
    type Target = sqlx::AnyConnection;

    fn deref(&self) -> &Self::Target {
        match &self.inner {
            Conn::Tx(tx) => tx,
            Conn::Auto(conn) => conn,
            Conn::Writer { lease, .. } => &lease.guard.conn,
        }
    }
}

impl std::ops::DerefMut for Tx {
    fn deref_mut(&mut self) -> &mut Self::Target {
        match &mut self.inner {
            Conn::Tx(tx) => tx,
            Conn::Auto(conn) => conn,
            Conn::Writer { lease, .. } => &mut lease.guard.conn,
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
            hold: false,
            held: None,
        }
    }

    /// Holds this optimistic [`Tx`]'s one write back instead of sending it, for
    /// [`Store::write_held`] to send with other sessions' in one call ([`Tx::take_held`]).
    /// Only optimistic writes are held; any other [`Tx`] is left as it is.
    pub(crate) fn hold(&mut self) {
        self.hold = self.autocommits();
    }

    /// Whether this [`Tx`] holds its write back (see [`Tx::hold`]).
    pub(super) fn holds(&self) -> bool {
        self.hold
    }

    /// Keeps the write that [`Tx::hold`] holds back.
    pub(super) fn keep_held(&mut self, write: HeldWrite) {
        self.held = Some(write);
        self.wrote = true;
    }

    /// The write held back, if it came to one.
    pub(crate) fn take_held(&mut self) -> Option<HeldWrite> {
        self.held.take()
    }

    /// Writes the held-back events, then commits.
    pub(crate) async fn commit(mut self) -> Result<(), Error> {
        self.flush_events(None).await?;
        match self.inner {
            Conn::Tx(tx) => tx.commit().await?,
            Conn::Writer {
                mut lease,
                begun: true,
            } => lease.run("COMMIT", false).await?,
            // Everything it wrote went out in its one statement (see `write_events`).
            Conn::Auto(_) | Conn::Writer { .. } => {}
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
        if self.autocommits()
            && let Err(rollback) = self.roll_back_call().await
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
        if self.autocommits() {
            return Err(Error::Contended(format!("{what} needs a transaction")));
        }
        Ok(())
    }

    /// No transaction open: each statement (or call) commits on its own.
    pub(super) fn autocommits(&self) -> bool {
        matches!(
            self.inner,
            Conn::Auto(_) | Conn::Writer { begun: false, .. }
        )
    }

    /// Before a call that opens and commits its own transaction (see `write_events`): on
    /// SQLite's writer, a call cut short leaves it to the next writer to roll back.
    pub(super) fn call_opens(&mut self, opens: bool) {
        if let Conn::Writer { lease, .. } = &mut self.inner {
            lease.open = opens;
        }
    }

    /// Rolls back what a failed call that opened its own transaction left open.
    async fn roll_back_call(&mut self) -> Result<(), Error> {
        match &mut self.inner {
            Conn::Writer { lease, .. } => lease.run("ROLLBACK", false).await,
            Conn::Auto(conn) => {
                sqlx::query("ROLLBACK").execute(&mut **conn).await?;
                Ok(())
            }
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
        match self.inner {
            Conn::Tx(tx) => tx.rollback().await?,
            Conn::Writer {
                mut lease,
                begun: true,
            } => lease.run("ROLLBACK", false).await?,
            Conn::Auto(_) | Conn::Writer { .. } => {}
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
        let inner = match &self.writer {
            Writer::Sqlite(writer) => {
                let mut lease = writer.lease().await;
                lease.run("BEGIN IMMEDIATE", true).await?;
                Conn::Writer { lease, begun: true }
            }
            Writer::Pool { pool, .. } => Conn::Tx(pool.begin().await?),
        };
        Ok(Tx::new(inner, self.dialect, true))
    }

    /// Writes without a transaction: each statement commits on its own.
    pub(crate) async fn autocommit(&self) -> Result<Tx, Error> {
        let inner = match &self.writer {
            Writer::Sqlite(writer) => Conn::Writer {
                lease: writer.lease().await,
                begun: false,
            },
            Writer::Pool { pool, .. } => Conn::Auto(pool.acquire().await?),
        };
        Ok(Tx::new(inner, self.dialect, true))
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
        let mut tx = self.autocommit().await?;
        tx.sequences.insert(session_id.to_owned(), last_seq);
        Ok(tx)
    }

    /// Sends writes that optimistic [`Tx`]s held back (see [`Tx::hold`]), of several sessions, at
    /// once, in order of session id (so two coordinators' writes lock the rows they share in the
    /// same order as far as PostgreSQL's plan follows it; a deadlock it breaks fails the call like
    /// a lost write). Each write still checks its own session's sequence, so one that lost fails
    /// them all and nothing is written. The group commit holds its sessions' writes back this way:
    /// one call however many sessions a group holds. On SQLite, one call on the one writer
    /// connection (`BEGIN IMMEDIATE`, each write, `COMMIT`); on PostgreSQL, one statement (a
    /// transaction of one a batch when they exceed one statement's rows) on the group commit's own
    /// connection.
    pub(crate) async fn write_held(&self, mut writes: Vec<HeldWrite>) -> Result<(), Error> {
        if writes.is_empty() {
            return Ok(());
        }
        writes.sort_by(|a, b| a.session_id.cmp(&b.session_id));
        let writer = match &self.writer {
            Writer::Sqlite(writer) => writer,
            Writer::Pool { held: pool, .. } => {
                let mut queries = held_writes_postgres(&writes)?;
                if queries.len() == 1
                    && let Some((query, rows)) = queries.pop()
                {
                    if query.execute(pool).await?.rows_affected() != rows {
                        return Err(moved(&writes[0].session_id, writes[0].from));
                    }
                    return Ok(());
                }
                let mut tx = pool.begin().await?;
                for (query, rows) in queries {
                    if query.execute(&mut *tx).await?.rows_affected() != rows {
                        return Err(Error::Contended("a session moved".to_owned()));
                    }
                }
                tx.commit().await?;
                return Ok(());
            }
        };
        let query = held_writes(&writes)?;
        let mut lease = writer.lease().await;
        // Marked before it runs: a call cut short may have opened the transaction.
        lease.open = true;
        let done = query.execute(&mut lease.guard.conn).await;
        match done {
            Ok(_) => {
                lease.open = false;
                Ok(())
            }
            Err(err) => {
                // Also when the call failed before its `BEGIN`: nothing is open then.
                if let Err(rollback) = lease.run("ROLLBACK", false).await {
                    tracing::debug!(error = %rollback, "rollback after a failed held write");
                }
                Err(err.into())
            }
        }
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

#[cfg(test)]
mod tests {
    use super::Store;
    use crate::store::events::HeldWrite;

    async fn workers(store: &Store) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM workers")
            .fetch_one(&store.reader)
            .await
            .unwrap()
    }

    /// SQLite's writer connection outlives its writers: one that goes away inside its
    /// transaction, or in the middle of a call that opens its own, leaves nothing behind, and
    /// the next writer starts afresh.
    #[tokio::test]
    async fn a_writer_that_goes_away_leaves_the_connection_clean() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_file(&dir.path().join("troupe.db"))
            .await
            .unwrap();
        let insert = |id: &'static str| {
            sqlx::query(
                "INSERT INTO workers (worker_id, roles, last_seen, backends) \
                 VALUES ($1, '[]', 1, '||')",
            )
            .bind(id)
        };

        let mut tx = store.begin().await.unwrap();
        insert("dropped").execute(&mut *tx).await.unwrap();
        drop(tx);
        assert_eq!(workers(&store).await, 0, "dropped inside its transaction");

        // A call that opens its own transaction and stops after its `BEGIN`.
        let mut tx = store.autocommit().await.unwrap();
        tx.call_opens(true);
        sqlx::raw_sql("BEGIN IMMEDIATE")
            .execute(&mut *tx)
            .await
            .unwrap();
        insert("cut short").execute(&mut *tx).await.unwrap();
        drop(tx);
        assert_eq!(workers(&store).await, 0, "cut short inside its call");

        // Marked open though nothing was: the next writer's rollback finds nothing to undo.
        let mut tx = store.autocommit().await.unwrap();
        tx.call_opens(true);
        drop(tx);

        let mut tx = store.begin().await.unwrap();
        insert("kept").execute(&mut *tx).await.unwrap();
        tx.commit().await.unwrap();
        let mut tx = store.autocommit().await.unwrap();
        insert("alone").execute(&mut *tx).await.unwrap();
        drop(tx);
        assert_eq!(workers(&store).await, 2);
    }

    /// On PostgreSQL, a held write of several sessions locks their rows before it inserts
    /// their events, as every other writer of a session does. A message holding a session's
    /// row (its sequence number taken, its event not yet in) makes the write wait; the
    /// message's event then goes in at once and, once it commits, the write finds the session
    /// moved and fails whole. Inserting the events first, the write would wait for the row
    /// while the message waited for the write's event key: a deadlock, which PostgreSQL breaks
    /// by failing the write a second later.
    #[tokio::test]
    async fn a_held_write_waits_for_a_message_that_holds_a_session() {
        use sqlx::Row as _;
        let Some(url) = troupe_testkit::postgres_url() else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let (store, coordinator) =
            crate::service::Coordinator::for_tests_on_postgres(&url, dir.path()).await;
        for name in ["a", "b"] {
            let plan = serde_json::json!({
                "name": name,
                "repos": {"app": {"path": "repo"}},
                "tasks": [{"id": "IMPL-1", "title": "one"}],
            });
            coordinator
                .create_for_tests(&plan, &dir.path().join(name))
                .await;
        }
        let sequences = || async {
            let rows = sqlx::query("SELECT id, last_seq FROM sessions ORDER BY id")
                .fetch_all(&store.reader)
                .await
                .unwrap();
            rows.iter()
                .map(|row| (row.get::<String, _>("id"), row.get::<i64, _>("last_seq")))
                .collect::<Vec<_>>()
        };
        let before = sequences().await;
        let now = crate::convert::now_ms();
        let writes: Vec<HeldWrite> = before
            .iter()
            .map(|(id, last)| HeldWrite::one_event(id, *last as u64, now))
            .collect();
        // The message: the first session's row and its next sequence number.
        let (first, last) = before[0].clone();
        let mut message = store.reader.begin().await.unwrap();
        sqlx::query("UPDATE sessions SET last_seq = last_seq + 1 WHERE id = $1")
            .bind(&first)
            .execute(&mut *message)
            .await
            .unwrap();
        let held = tokio::spawn({
            let store = store.clone();
            async move { store.write_held(writes).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert!(!held.is_finished(), "the write waits for the message's row");
        sqlx::query("INSERT INTO events (session_id, seq, ts, payload) VALUES ($1, $2, $3, $4)")
            .bind(&first)
            .bind(last + 1)
            .bind(now)
            .bind(vec![0_u8])
            .execute(&mut *message)
            .await
            .expect("the message's event goes in while the write waits");
        message.commit().await.unwrap();
        let err = held.await.unwrap().expect_err("the session moved");
        assert!(
            !err.to_string().contains("deadlock"),
            "failed as moved, not by a deadlock: {err}"
        );
        let after = sequences().await;
        assert_eq!(after[0], (first, last + 1), "the message's number only");
        assert_eq!(after[1], before[1], "nothing of the write landed");
    }
}

//! The `events` table: each session's log of transitions and messages under its gap-free
//! sequence (`sessions.last_seq`), which `WatchSession` streams.

use prost::Message as _;
use sqlx::Row;
use troupe_proto::v1::{self as pb, session_event::Kind};

use super::intake::numbered;
use super::intake::values;
use super::tasks::AnyQuery;
use super::tasks::{
    MUTABLE_COLUMNS, TASK_ROWS, UPDATE_FROM_V, UPDATE_FROM_V_BUMP, UPDATE_OR_FAIL_FROM_V,
    UPDATE_OR_FAIL_FROM_V_LEAN, bind_task, task_values, update_tasks,
};
use super::{Dialect, Store, Tx, corrupt, to_i64};
use crate::Error;
use crate::convert::timestamp;
use crate::task::Task;

impl Store {
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

/// Rows per INSERT, well below the databases' limits on bound parameters.
const CHUNK: usize = 256;

/// Appends events to a session's log: held back in `tx` until it commits (see [`Tx`]), so
/// they get their sequence numbers then, in the order appended.
pub(crate) async fn append_events(
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

pub(crate) async fn append_event(
    tx: &mut Tx,
    session_id: &str,
    now: i64,
    kind: Kind,
) -> Result<(), Error> {
    append_events(tx, session_id, now, vec![kind]).await
}

/// Writes events with consecutive sequence numbers: one sequence update and one insert
/// (per chunk) however many there are.
pub(super) async fn write_events(
    tx: &mut Tx,
    session_id: &str,
    events: Vec<(i64, Kind)>,
    tasks: &[&Task],
    reshaped: bool,
) -> Result<(), Error> {
    let Some(last_ts) = events.iter().map(|(ts, _)| *ts).max() else {
        return update_tasks(tx, tasks).await;
    };
    if tx.wrote {
        tx.needs_lock("a second write")?;
    }
    let count = events.len();
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
    if tx.holds() {
        // Optimistic, so within one statement's rows (see above): held back whole.
        let events = events
            .into_iter()
            .enumerate()
            .map(|(i, (ts, kind))| {
                let sequence = first + i as u64;
                (sequence, ts, event_payload(session_id, sequence, ts, kind))
            })
            .collect();
        let write = HeldWrite {
            session_id: session_id.to_owned(),
            from: first - 1,
            to: last,
            ts: last_ts,
            state: tx.states.remove(session_id).map(|state| state as i32),
            tasks: tasks.iter().map(|&task| task.clone()).collect(),
            events,
            reshaped,
        };
        tx.keep_held(write);
        tx.sequences.insert(session_id.to_owned(), last);
        return Ok(());
    }
    let mut events = events.into_iter().enumerate().peekable();
    let mut bump = together;
    while events.peek().is_some() {
        let chunk: Vec<(usize, (i64, Kind))> = events.by_ref().take(CHUNK).collect();
        let rows = chunk.len();
        let bumped = bump;
        bump = false;
        // A state `set_session_state` left to this write (see `Tx::states`).
        let state = if bumped {
            tx.states.remove(session_id).map(|state| state as i32)
        } else {
            None
        };
        let query = match tx.dialect {
            // Anonymous parameters, bound in the order they appear: SQLite looks a named one
            // up by a linear scan, which grew with the rows of a write.
            Dialect::Sqlite => {
                let auto = tx.autocommits();
                let sql = sqlite_write(auto, bumped, rows, tasks.len(), reshaped);
                let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
                if bumped {
                    query = query
                        .bind(to_i64(first - 1))
                        .bind(to_i64(last))
                        .bind(last_ts)
                        .bind(state)
                        .bind(session_id);
                }
                for task in std::mem::take(&mut tasks) {
                    query = bind_task(query, task)?;
                }
                for (i, (ts, kind)) in chunk {
                    let sequence = first + i as u64;
                    query = query
                        .bind(session_id)
                        .bind(to_i64(sequence))
                        .bind(ts)
                        .bind(event_payload(session_id, sequence, ts, kind));
                }
                query
            }
            Dialect::Postgres => {
                let sql = postgres_write(bumped, rows, tasks.len());
                let mut query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(session_id);
                if bumped {
                    query = bind_bump(query, first - 1, last, last_ts, state);
                }
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
                query
            }
        };
        let opens = bumped && tx.autocommits() && tx.dialect == Dialect::Sqlite;
        tx.call_opens(opens);
        let written = match query.execute(&mut **tx).await {
            Ok(done) => {
                tx.call_opens(false);
                done.rows_affected()
            }
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

/// An optimistic write held back (see [`Tx::hold`]): the session's sequence moves
/// from `from` to `to`, its tasks and events go in; see [`held_writes`].
pub(crate) struct HeldWrite {
    pub(super) session_id: String,
    pub(super) from: u64,
    to: u64,
    /// The session's `updated_at`.
    ts: i64,
    /// The session's new state, when it changes.
    state: Option<i32>,
    tasks: Vec<Task>,
    /// Sequence, time and payload of each.
    events: Vec<(u64, i64, Vec<u8>)>,
    reshaped: bool,
}

#[cfg(test)]
impl HeldWrite {
    /// A write that moves `session_id`'s sequence from `from` by one event (a note) at `now`.
    pub(crate) fn one_event(session_id: &str, from: u64, now: i64) -> Self {
        let kind = Kind::Message(pb::Message {
            summary: "held back".to_owned(),
            ..Default::default()
        });
        Self {
            session_id: session_id.to_owned(),
            from,
            to: from + 1,
            ts: now,
            state: None,
            tasks: Vec::new(),
            events: vec![(
                from + 1,
                now,
                event_payload(session_id, from + 1, now, kind),
            )],
            reshaped: false,
        }
    }
}

/// Held writes in batches within one statement's rows, in order.
fn batches(writes: &[HeldWrite]) -> Vec<&[HeldWrite]> {
    let mut batches: Vec<&[HeldWrite]> = Vec::new();
    let (mut start, mut tasks, mut events) = (0, 0, 0);
    for (i, write) in writes.iter().enumerate() {
        if i > start
            && (tasks + write.tasks.len() > TASK_ROWS || events + write.events.len() > CHUNK)
        {
            batches.push(&writes[start..i]);
            (start, tasks, events) = (i, 0, 0);
        }
        tasks += write.tasks.len();
        events += write.events.len();
    }
    batches.push(&writes[start..]);
    batches
}

/// The call that sends held writes of several sessions on SQLite (see [`Store::write_held`]):
/// one transaction, `BEGIN IMMEDIATE` to `COMMIT`. A statement a table, whatever the sessions:
/// each session's sequence moves from its own value or the call fails (the NOT NULL
/// constraint, as in [`sqlite_write`]); the writes go in batches within one statement's rows.
pub(super) fn held_writes(writes: &[HeldWrite]) -> Result<AnyQuery<'_>, Error> {
    let batches = batches(writes);
    // As in an optimistic write's call (`sqlite_write` with `auto`), which one write alone
    // is, statement for statement.
    let mut sql = String::from("BEGIN IMMEDIATE; ");
    for batch in &batches {
        let tasks: usize = batch.iter().map(|write| write.tasks.len()).sum();
        let events: usize = batch.iter().map(|write| write.events.len()).sum();
        let reshaped = batch.iter().any(|write| write.reshaped);
        if let [_] = batch {
            sql.push_str(&sqlite_write(false, true, events, tasks, reshaped));
        } else {
            sql.push_str(&sqlite_write_many(batch.len(), events, tasks, reshaped));
        }
        sql.push_str("; ");
    }
    sql.push_str("COMMIT");
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
    for batch in batches {
        query = bind_held(query, batch)?;
    }
    Ok(query)
}

/// The statements that send held writes of several sessions on PostgreSQL (see
/// [`Store::write_held`]), one a batch within one statement's rows, each with the rows it
/// inserts when it applies. A batch of several sessions moves every session's sequence from
/// its own value, or fails whole (the NOT NULL constraint on `sessions.last_seq`, as on
/// SQLite); a batch of one is the session's optimistic write ([`postgres_write`]), which
/// inserts nothing when the sequence moved.
pub(super) fn held_writes_postgres(
    writes: &[HeldWrite],
) -> Result<Vec<(AnyQuery<'_>, u64)>, Error> {
    batches(writes)
        .into_iter()
        .map(|batch| {
            let tasks: usize = batch.iter().map(|write| write.tasks.len()).sum();
            let events: usize = batch.iter().map(|write| write.events.len()).sum();
            let query = match batch {
                [write] => {
                    let sql = postgres_write(true, events, tasks);
                    let query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(&write.session_id);
                    let mut query = bind_bump(query, write.from, write.to, write.ts, write.state);
                    for (sequence, ts, payload) in &write.events {
                        query = query
                            .bind(to_i64(*sequence))
                            .bind(*ts)
                            .bind(payload.as_slice());
                    }
                    for task in &write.tasks {
                        query = bind_task(query, task)?;
                    }
                    query
                }
                _ => {
                    let sql = postgres_write_many(batch.len(), events, tasks);
                    bind_held(sqlx::query(sqlx::AssertSqlSafe(sql)), batch)?
                }
            };
            Ok((query, events as u64))
        })
        .collect()
}

/// Binds a batch of held writes: each session's sequence move (`from`, `to`, `updated_at`,
/// state, id), then the tasks (see [`bind_task`]), then four per event.
fn bind_held<'q>(mut query: AnyQuery<'q>, batch: &'q [HeldWrite]) -> Result<AnyQuery<'q>, Error> {
    for write in batch {
        query = query
            .bind(to_i64(write.from))
            .bind(to_i64(write.to))
            .bind(write.ts)
            .bind(write.state)
            .bind(&write.session_id);
    }
    for task in batch.iter().flat_map(|write| &write.tasks) {
        query = bind_task(query, task)?;
    }
    for write in batch {
        for (sequence, ts, payload) in &write.events {
            query = query
                .bind(&write.session_id)
                .bind(to_i64(*sequence))
                .bind(*ts)
                .bind(payload.as_slice());
        }
    }
    Ok(query)
}

/// [`postgres_write`] for `sessions` sessions at once (see [`held_writes_postgres`]), its
/// parameters bound as [`bind_held`] binds them.
fn postgres_write_many(sessions: usize, rows: usize, tasks: usize) -> String {
    let mut ctes = vec![
        format!(
            "s (from_seq, to_seq, ts, state, id) AS (VALUES {})",
            numbered(1, sessions, 5)
        ),
        "bump AS (UPDATE sessions SET last_seq = CASE sessions.last_seq WHEN s.from_seq \
         THEN s.to_seq END, updated_at = s.ts, state = COALESCE(s.state, sessions.state) \
         FROM s WHERE sessions.id = s.id RETURNING 1)"
            .to_owned(),
    ];
    let tasks_from = 1 + 5 * sessions;
    if tasks > 0 {
        ctes.push(format!(
            "v (session_id, id, {}) AS (VALUES {})",
            MUTABLE_COLUMNS.join(", "),
            task_values(tasks_from, tasks)
        ));
        ctes.push(format!("upd AS ({})", *UPDATE_FROM_V));
    }
    let events_from = tasks_from + (MUTABLE_COLUMNS.len() + 2) * tasks;
    // The events' insert waits for `bump` (its one-time filter, always true, counts the
    // sessions moved), so the sessions' rows are locked first, as every other writer of a
    // session locks them. Unreferenced, `bump` ran after the insert: a message that took a
    // session's next sequence number meanwhile then waited for these events' keys while this
    // statement waited for the message's row lock.
    format!(
        "WITH {} INSERT INTO events (session_id, seq, ts, payload) \
         SELECT * FROM (VALUES {}) e WHERE (SELECT count(*) FROM bump) >= 0",
        ctes.join(", "),
        numbered(events_from, rows, 4)
    )
}

/// [`sqlite_write`] for `sessions` sessions at once, inside a transaction: their sequences'
/// moves as rows (`from`, `to`, `updated_at`, state, id: bound as in [`sqlite_write`]).
fn sqlite_write_many(sessions: usize, rows: usize, tasks: usize, reshaped: bool) -> String {
    let mut sql = format!(
        "WITH s (from_seq, to_seq, ts, state, id) AS (VALUES {}) UPDATE sessions SET \
         last_seq = CASE sessions.last_seq WHEN s.from_seq THEN s.to_seq END, updated_at = s.ts, \
         state = COALESCE(s.state, sessions.state) FROM s WHERE sessions.id = s.id; ",
        values(Dialect::Sqlite, sessions, 5)
    );
    if tasks > 0 {
        sql.push_str(&task_update(tasks, reshaped));
    }
    sql.push_str(&format!(
        "INSERT OR FAIL INTO events (session_id, seq, ts, payload) VALUES {}",
        values(Dialect::Sqlite, rows, 4)
    ));
    sql
}

/// The tasks' update of a write on SQLite, `tasks` rows (see [`bind_task`]).
fn task_update(tasks: usize, reshaped: bool) -> String {
    let update = if reshaped {
        &*UPDATE_OR_FAIL_FROM_V
    } else {
        &*UPDATE_OR_FAIL_FROM_V_LEAN
    };
    format!(
        "WITH v (session_id, id, {}) AS (VALUES {}) {update}; ",
        MUTABLE_COLUMNS.join(", "),
        values(Dialect::Sqlite, tasks, MUTABLE_COLUMNS.len() + 2),
    )
}

/// One chunk of a write on SQLite (see `write_events`), its parameters anonymous, in the order
/// bound: with `bump`, the session's sequence moves from `?` to `?` (else its NOT NULL
/// constraint fails the call, see `Tx::failed`) with `updated_at = ?`, its state to `?` (kept
/// when null) and the session id, then the `tasks` rows' parameters (see [`bind_task`]), then
/// four per event. An optimistic write (`auto`: no transaction open) brings its own, so the
/// call is all or nothing.
fn sqlite_write(auto: bool, bump: bool, rows: usize, tasks: usize, reshaped: bool) -> String {
    let events = values(Dialect::Sqlite, rows, 4);
    if !bump {
        return format!("INSERT INTO events (session_id, seq, ts, payload) VALUES {events}");
    }
    let mut sql = String::from(if auto { "BEGIN IMMEDIATE; " } else { "" });
    sql.push_str(
        "UPDATE sessions SET last_seq = CASE last_seq WHEN ? THEN ? END, updated_at = ?, \
         state = COALESCE(?, state) WHERE id = ?; ",
    );
    if tasks > 0 {
        sql.push_str(&task_update(tasks, reshaped));
    }
    sql.push_str(&format!(
        "INSERT OR FAIL INTO events (session_id, seq, ts, payload) VALUES {events}"
    ));
    if auto {
        sql.push_str("; COMMIT");
    }
    sql
}

/// One chunk of a write on PostgreSQL (see `write_events`): `$1` the session id; with `bump`,
/// `$2` to `$4` the sequence's new value, `updated_at` and the sequence's old value, `$5` the
/// session's new state (kept when null); three parameters per event, then the `tasks` rows'.
fn postgres_write(bump: bool, rows: usize, tasks: usize) -> String {
    let base = if bump { 6 } else { 2 };
    let values: Vec<String> = (0..rows)
        .map(|i| {
            let at = base + 3 * i;
            format!("($1, ${at}, ${}, ${})", at + 1, at + 2)
        })
        .collect();
    let values = values.join(", ");
    if !bump {
        return format!("INSERT INTO events (session_id, seq, ts, payload) VALUES {values}");
    }
    // The counter moves only from the value the events were numbered from, and the tasks and
    // events go in only if it moved: under the lock that always holds; an optimistic write
    // learns from the row count that someone else wrote first.
    let mut ctes = vec![
        "bump AS (UPDATE sessions SET last_seq = $2, updated_at = $3, \
         state = COALESCE($5, state) WHERE id = $1 AND last_seq = $4 RETURNING id)"
            .to_owned(),
    ];
    if tasks > 0 {
        ctes.push(format!(
            "v (session_id, id, {}) AS (VALUES {})",
            MUTABLE_COLUMNS.join(", "),
            task_values(base + 3 * rows, tasks)
        ));
        ctes.push(format!("upd AS ({})", *UPDATE_FROM_V_BUMP));
    }
    format!(
        "WITH {} INSERT INTO events (session_id, seq, ts, payload) \
         SELECT e.* FROM (VALUES {values}) e (session_id, seq, ts, payload), bump",
        ctes.join(", ")
    )
}

/// Binds `$2` to `$5` of [`postgres_write`] with `bump`: the sequence moving from `from` to
/// `to`, `updated_at` and the session's new state.
fn bind_bump(query: AnyQuery<'_>, from: u64, to: u64, ts: i64, state: Option<i32>) -> AnyQuery<'_> {
    query
        .bind(to_i64(to))
        .bind(ts)
        .bind(to_i64(from))
        .bind(state)
}

pub(super) fn moved(session_id: &str, from: u64) -> Error {
    Error::Contended(format!("session {session_id} moved past sequence {from}"))
}

/// Takes the session's next `count` sequence numbers and returns the first; the row lock makes
/// them gap-free and unique. Events held back in `tx` come first.
pub(super) async fn next_seq(
    tx: &mut Tx,
    session_id: &str,
    now: i64,
    count: usize,
) -> Result<u64, Error> {
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

/// Inserts one event under a sequence number taken with [`next_seq`].
pub(super) async fn insert_event(
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

/// The stored form of one event.
pub(super) fn event_payload(session_id: &str, sequence: u64, now: i64, kind: Kind) -> Vec<u8> {
    pb::SessionEvent {
        sequence,
        session_id: session_id.to_owned(),
        ts: Some(timestamp(now)),
        kind: Some(kind),
    }
    .encode_to_vec()
}

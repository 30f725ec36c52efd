//! Group commit for the worker protocol's writes (claim, heartbeat, complete).
//!
//! Writes of one session are serialised anyway (its row lock on PostgreSQL, the one writer
//! connection on SQLite), so writes that arrive while a transaction runs would only wait.
//! Instead they queue, and the next transaction runs all of them: N operations cost one
//! `BEGIN`/`COMMIT` (one durable commit on PostgreSQL, one writer hand-over on SQLite) and
//! fewer scheduler wake-ups. Each caller still gets its answer only once its change is
//! committed, and every operation runs exactly the code it runs alone (fencing checks,
//! settling, event sequence), one after the other in arrival order.
//!
//! Lanes: SQLite has one writer, so everything shares one lane. PostgreSQL has a lane per
//! session, so a group transaction locks one session row only and two coordinators' groups
//! can never wait on each other crosswise; claims there pick their sessions themselves
//! (`SKIP LOCKED`) and run alone, as before.
//!
//! A caller that finds its lane idle runs its operation at once, alone (no added latency
//! when there is no contention); what queued meanwhile is then run by a spawned task.
//! When an operation of a group fails (a stale fencing token, say), the whole group is
//! rolled back and each operation is run again alone, so only that caller sees the error
//! (cheaper than a `SAVEPOINT` per operation in the common case, where nothing fails).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;
use troupe_proto::v1 as pb;

use crate::Error;
use crate::sched::TaskRow;
use crate::store::{self, Claimed, Dialect, SessionRow, Store};

/// One queued write and where its answer goes.
#[derive(Debug)]
enum Op {
    Claim {
        worker_id: String,
        roles: Vec<pb::Role>,
        max: u32,
        lease_ms: i64,
        now: i64,
        reply: oneshot::Sender<Result<Vec<Claimed>, Error>>,
    },
    Heartbeat {
        session_id: String,
        task_id: String,
        token: u64,
        progress: String,
        lease_ms: Option<i64>,
        now: i64,
        reply: oneshot::Sender<Result<(i64, bool), Error>>,
    },
    Complete {
        session_id: String,
        task_id: String,
        token: u64,
        // Boxed: the largest variant by far.
        result: Box<pb::TaskResult>,
        now: i64,
        reply: oneshot::Sender<Result<TaskRow, Error>>,
    },
}

/// What an operation returned inside a group, before the group committed.
enum Outcome {
    Claim(Vec<Claimed>),
    Heartbeat((i64, bool)),
    Complete(Box<TaskRow>),
}

/// Why a group did not commit.
enum GroupError {
    /// An operation (or the transaction before the commit) failed: nothing was committed,
    /// run each operation alone.
    Op,
    /// The commit itself failed: its outcome is unknown, so every caller gets the error.
    Commit(Error),
}

/// The group-commit front of the store's worker-protocol writes.
#[derive(Debug, Clone)]
pub(crate) struct GroupCommit {
    store: Store,
    /// Lanes with a transaction running (present), with the operations waiting for the next.
    lanes: Arc<Mutex<HashMap<String, Vec<Op>>>>,
}

/// Marks a lane busy while its leader runs; on drop (also when the leader's caller goes away
/// mid-transaction) hands what queued to a task, so a lane is never left busy.
struct Leader<'a> {
    group: &'a GroupCommit,
    lane: String,
}

impl Drop for Leader<'_> {
    fn drop(&mut self) {
        self.group.hand_off(std::mem::take(&mut self.lane));
    }
}

fn gone() -> Error {
    // The task running the group ended without answering (the runtime shut down).
    Error::Database(sqlx::Error::WorkerCrashed)
}

impl GroupCommit {
    pub(crate) fn new(store: Store) -> Self {
        Self {
            store,
            lanes: Arc::default(),
        }
    }

    fn lanes(&self) -> MutexGuard<'_, HashMap<String, Vec<Op>>> {
        // The map holds no invariant a panic could break halfway.
        self.lanes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// SQLite: one lane (one writer); PostgreSQL: the session's.
    fn lane(&self, session_id: &str) -> String {
        match self.store.dialect() {
            Dialect::Sqlite => String::new(),
            Dialect::Postgres => session_id.to_owned(),
        }
    }

    pub(crate) async fn claim(
        &self,
        worker_id: &str,
        roles: &[pb::Role],
        max: u32,
        lease_ms: i64,
        now: i64,
    ) -> Result<Vec<Claimed>, Error> {
        if self.store.dialect() == Dialect::Postgres {
            return self.store.claim(worker_id, roles, max, lease_ms, now).await;
        }
        let (reply, answer) = oneshot::channel();
        let op = Op::Claim {
            worker_id: worker_id.to_owned(),
            roles: roles.to_vec(),
            max,
            lease_ms,
            now,
            reply,
        };
        self.submit(String::new(), op).await;
        answer.await.unwrap_or_else(|_| Err(gone()))
    }

    pub(crate) async fn heartbeat(
        &self,
        session_id: &str,
        task_id: &str,
        token: u64,
        progress: &str,
        lease_ms: Option<i64>,
        now: i64,
    ) -> Result<(i64, bool), Error> {
        let (reply, answer) = oneshot::channel();
        let op = Op::Heartbeat {
            session_id: session_id.to_owned(),
            task_id: task_id.to_owned(),
            token,
            progress: progress.to_owned(),
            lease_ms,
            now,
            reply,
        };
        self.submit(self.lane(session_id), op).await;
        answer.await.unwrap_or_else(|_| Err(gone()))
    }

    pub(crate) async fn complete(
        &self,
        session_id: &str,
        task_id: &str,
        token: u64,
        result: pb::TaskResult,
        now: i64,
    ) -> Result<TaskRow, Error> {
        let (reply, answer) = oneshot::channel();
        let op = Op::Complete {
            session_id: session_id.to_owned(),
            task_id: task_id.to_owned(),
            token,
            result: Box::new(result),
            now,
            reply,
        };
        self.submit(self.lane(session_id), op).await;
        answer.await.unwrap_or_else(|_| Err(gone()))
    }

    /// Queues `op` behind the running transaction of its lane, or runs it at once when the
    /// lane is idle. Returns once `op` is queued or answered.
    async fn submit(&self, lane: String, op: Op) {
        let lead = {
            let mut lanes = self.lanes();
            match lanes.get_mut(&lane) {
                Some(queue) => {
                    queue.push(op);
                    None
                }
                None => {
                    lanes.insert(lane.clone(), Vec::new());
                    Some(op)
                }
            }
        };
        if let Some(op) = lead {
            let _leader = Leader { group: self, lane };
            self.run(vec![op]).await;
        }
    }

    /// Gives what queued on `lane` to a task that runs it group by group until the lane is
    /// empty, or marks the lane idle.
    fn hand_off(&self, lane: String) {
        {
            let mut lanes = self.lanes();
            if lanes.get(&lane).is_none_or(Vec::is_empty) {
                lanes.remove(&lane);
                return;
            }
        }
        let group = self.clone();
        tokio::spawn(async move {
            loop {
                let ops = {
                    let mut lanes = group.lanes();
                    match lanes.get_mut(&lane) {
                        Some(queue) if !queue.is_empty() => std::mem::take(queue),
                        _ => {
                            lanes.remove(&lane);
                            return;
                        }
                    }
                };
                group.run(ops).await;
            }
        });
    }

    /// Runs `ops` in one transaction and answers each; see the module comment for failures.
    async fn run(&self, ops: Vec<Op>) {
        if ops.len() > 1 {
            match self.run_together(&ops).await {
                Ok(outcomes) => {
                    for (op, outcome) in ops.into_iter().zip(outcomes) {
                        answer(op, Ok(outcome));
                    }
                    return;
                }
                Err(GroupError::Commit(err)) => {
                    tracing::warn!(ops = ops.len(), error = %err, "group commit failed");
                    let message = err.to_string();
                    for op in ops {
                        answer(
                            op,
                            Err(Error::Database(sqlx::Error::Protocol(message.clone()))),
                        );
                    }
                    return;
                }
                Err(GroupError::Op) => {}
            }
        }
        for op in ops {
            let outcome = self.run_alone(&op).await;
            answer(op, outcome);
        }
    }

    async fn run_together(&self, ops: &[Op]) -> Result<Vec<Outcome>, GroupError> {
        let mut tx = self.store.begin().await.map_err(|_| GroupError::Op)?;
        let mut sessions = HashMap::new();
        let mut outcomes = Vec::with_capacity(ops.len());
        for op in ops {
            // Dropping `tx` on an error rolls the whole group back.
            let outcome = self
                .run_in(&mut tx, &mut sessions, op)
                .await
                .map_err(|_| GroupError::Op)?;
            outcomes.push(outcome);
        }
        tx.commit()
            .await
            .map_err(|err| GroupError::Commit(err.into()))?;
        Ok(outcomes)
    }

    async fn run_alone(&self, op: &Op) -> Result<Outcome, Error> {
        let mut tx = self.store.begin().await?;
        let outcome = self.run_in(&mut tx, &mut HashMap::new(), op).await?;
        tx.commit().await?;
        Ok(outcome)
    }

    /// One operation inside a transaction, exactly as it runs alone. `sessions` holds the
    /// sessions this transaction already locked and loaded (kept current by the operations:
    /// only a completion can change a session row, through `finish`).
    async fn run_in(
        &self,
        tx: &mut store::Tx,
        sessions: &mut HashMap<String, SessionRow>,
        op: &Op,
    ) -> Result<Outcome, Error> {
        let lock = self.store.for_update();
        Ok(match op {
            Op::Claim {
                worker_id,
                roles,
                max,
                lease_ms,
                now,
                ..
            } => Outcome::Claim(
                self.store
                    .claim_in(tx, worker_id, roles, *max, *lease_ms, *now)
                    .await?,
            ),
            Op::Heartbeat {
                session_id,
                task_id,
                token,
                progress,
                lease_ms,
                now,
                ..
            } => {
                if !sessions.contains_key(session_id) {
                    store::lock_session(tx, session_id, lock).await?;
                }
                Outcome::Heartbeat(
                    store::heartbeat_in(tx, session_id, task_id, *token, progress, *lease_ms, *now)
                        .await?,
                )
            }
            Op::Complete {
                session_id,
                task_id,
                token,
                result,
                now,
                ..
            } => {
                let session = match sessions.entry(session_id.clone()) {
                    Entry::Occupied(entry) => entry.into_mut(),
                    Entry::Vacant(entry) => {
                        entry.insert(store::lock_and_load_session(tx, session_id, lock).await?)
                    }
                };
                let result = pb::TaskResult::clone(result);
                Outcome::Complete(Box::new(
                    store::complete_in(tx, session, task_id, *token, result, *now).await?,
                ))
            }
        })
    }
}

/// Sends an operation its answer (a caller that went away is not waiting for it).
fn answer(op: Op, outcome: Result<Outcome, Error>) {
    match op {
        Op::Claim { reply, .. } => {
            let _ = reply.send(outcome.and_then(|outcome| match outcome {
                Outcome::Claim(claimed) => Ok(claimed),
                _ => Err(mismatch()),
            }));
        }
        Op::Heartbeat { reply, .. } => {
            let _ = reply.send(outcome.and_then(|outcome| match outcome {
                Outcome::Heartbeat(beat) => Ok(beat),
                _ => Err(mismatch()),
            }));
        }
        Op::Complete { reply, .. } => {
            let _ = reply.send(outcome.and_then(|outcome| match outcome {
                Outcome::Complete(task) => Ok(*task),
                _ => Err(mismatch()),
            }));
        }
    }
}

fn mismatch() -> Error {
    Error::Corrupt("group commit answered an operation with another's outcome".to_owned())
}

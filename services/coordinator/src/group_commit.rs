//! Group commit for the worker protocol's writes (claim, heartbeat, complete).
//!
//! Writes of one session are serialised anyway (its row lock on PostgreSQL, the one writer
//! connection on SQLite), so writes that arrive while a transaction runs would only wait.
//! Instead they queue, and the next transaction runs all of them: N operations cost one
//! `BEGIN`/`COMMIT` (one durable commit on PostgreSQL, one writer hand-over on SQLite) and
//! fewer scheduler wake-ups. Each caller still gets its answer only once its change is
//! committed. Inside the transaction each session's operations run together: its row is
//! locked and loaded once, heartbeats run one by one, then its completions and claims (and
//! completions' `claim_next`) as one batch ([`complete::complete_eager`]): one read, settling
//! and claiming in memory, one write. So a group costs about five round trips to the
//! database however many operations it holds. The claims see what the completions readied.
//!
//! One lane carries every session's operations, on both databases: SQLite has one writer anyway,
//! and on PostgreSQL it lets many small sessions share a commit as the operations of one large
//! session do. On PostgreSQL a session too large for a copy has a lane of its own (see
//! `GroupCommit::lane`). A group that locks several sessions locks them in order of id, so two
//! coordinators' groups never wait on each other crosswise. A claim does not name a session: it
//! first reads, without locks, which session with a ready task for its roles was served least
//! recently (sessions take turns), and queues there; when others emptied that session first it
//! picks again. A completion's `claim_next` stays in its session for a turn (see [`crate::turns`]),
//! and goes on to another session when its own has nothing ready for it once the claims already
//! queued there took theirs (as far as the session's copy tells: see [`crate::demand`]); that claim
//! is made in the completion's group, its write sent with the completion's (see `run_parts`), in
//! that session's part when the group has one. Which session: see [`crate::picks`].
//!
//! A group of completions and claims of one active eager session first runs optimistically
//! (see `run_optimistic`): no lock, its tasks from the in-memory copy of the session
//! ([`TaskCache`]) that the session's previous group left, and one write that applies only if
//! the session's sequence is still where the copy left it: on PostgreSQL one statement
//! without a transaction, on SQLite one call that opens and commits its own. So such a group
//! costs one round trip. A group of several sessions works out each session's part this
//! way, its write held back, and the parts' writes go out in one call (see `run_parts`): on
//! PostgreSQL one statement, on SQLite one call on the writer; when that call loses, each part
//! runs again on its own, on its copy as it was. When the write loses
//! (another coordinator, or a write outside the group commit such as a message or a failure,
//! moved the sequence), nothing was written. If only messages came in between (they change no
//! task), the group writes again on the same copy as of the new sequence; otherwise the copy
//! is dropped and the group runs under the lock as above. A message logged while the copy
//! sits between groups moves the copy along. Under the lock a group also works on the copy
//! when the copy is as of the locked sequence (see `run_in`). A new session's first copy is
//! the one its intake left ([`GroupCommit::seed`]).
//!
//! A long-polling claim that found nothing parks here ([`GroupCommit::park`]); the next group
//! that completes tasks takes it as one of its claims, so a task a completion readies is
//! claimed for a waiting worker in that completion's transaction.
//!
//! A caller that finds the lane idle has its operation run at once, alone (no added latency
//! when there is no contention), on a task of its own; what queued meanwhile runs next.
//! When an operation of a group fails (a stale fencing token, say), the whole group is
//! rolled back and each operation is run again alone, so only that caller sees the error
//! (cheaper than a `SAVEPOINT` per operation in the common case, where nothing fails).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;
use troupe_proto::v1 as pb;

use crate::Error;
use crate::demand::{Demand, Out, Queued};
use crate::lifecycle::check_end;
use crate::lifecycle::claim::{self, ClaimRequest, Claimed};
use crate::lifecycle::complete::{self, Completion};
use crate::lifecycle::heartbeat::heartbeat_in;
use crate::lifecycle::routing::Filter;
use crate::lifecycle::task_cache::{self, Budget, TaskCache};
use crate::picks::{self, Picks};
use crate::store::sessions::{self, SessionRow};
use crate::store::{Dialect, HeldWrite, Store, Tx};
use crate::task::Task;
use crate::turns::Turns;

/// One queued write and where its answer goes.
#[derive(Debug)]
enum Op {
    Claim {
        /// The session [`Store::pick_sessions`] chose.
        session_id: String,
        request: ClaimRequest,
        reply: oneshot::Sender<Result<Vec<Claimed>, Error>>,
    },
    Heartbeat {
        session_id: String,
        task_id: String,
        token: u64,
        progress: String,
        /// The typed figures the heartbeat carried (`HeartbeatRequest.work_progress`).
        figures: Option<pb::WorkProgress>,
        lease_ms: Option<i64>,
        now: i64,
        reply: oneshot::Sender<Result<(i64, bool), Error>>,
    },
    Complete {
        session_id: String,
        // Boxed: the largest variant by far.
        completion: Box<Completion>,
        /// `claim_next`: claim from the same session, with this group's claims.
        claim_next: Option<ClaimRequest>,
        /// `claim_next` sent on to another session, claimed with the completion's write when
        /// the group can (see `run_parts`).
        elsewhere: Option<Elsewhere>,
        /// `claim_next` counted in [`Demand`] until answered.
        _queued: Option<Queued>,
        now: i64,
        reply: oneshot::Sender<Result<(Task, Vec<Claimed>), Error>>,
    },
}

/// A completion's `claim_next` in another session (the worker's turn ended, or its session
/// has nothing ready): claimed in the completion's group and written with it (see
/// `run_parts`). A group that does not take it drops `reply`, and the claim is made once the
/// completion is committed, as a claim of its own.
#[derive(Debug)]
struct Elsewhere {
    session_id: String,
    request: ClaimRequest,
    reply: oneshot::Sender<Result<Vec<Claimed>, Error>>,
}

impl Elsewhere {
    /// The claim, as of now, for a group to make in its session's part.
    fn into_claim(self) -> Op {
        Op::Claim {
            request: ClaimRequest {
                now: crate::convert::now_ms(),
                ..self.request
            },
            reply: self.reply,
            session_id: self.session_id,
        }
    }
}

impl Op {
    /// A claim's request, or a completion's `claim_next`.
    fn claim_request(&self) -> Option<&ClaimRequest> {
        match self {
            Op::Claim { request, .. }
            | Op::Complete {
                claim_next: Some(request),
                ..
            } => Some(request),
            _ => None,
        }
    }

    fn session_id(&self) -> &str {
        match self {
            Op::Claim { session_id, .. }
            | Op::Heartbeat { session_id, .. }
            | Op::Complete { session_id, .. } => session_id,
        }
    }
}

/// What an operation returned inside a group, before the group committed.
enum Outcome {
    Claim(Vec<Claimed>),
    Heartbeat((i64, bool)),
    Complete(Box<Task>, Vec<Claimed>),
}

/// A session's part of a group worked out on its copy, its write sent or held back (see
/// `GroupCommit::prepare`).
struct Prepared {
    session: SessionRow,
    tasks: Option<TaskCache>,
    outcomes: Vec<Option<Outcome>>,
    /// What `run_session` returned: whether the session may have ended.
    end: Option<(usize, i64)>,
    wrote: bool,
    /// The session's sequence after the write.
    last: Option<u64>,
    /// The write held back, until it is taken out to be sent.
    held: Option<HeldWrite>,
    /// When the write was held back: the session's row as it was before, to put back.
    before: Option<SessionRow>,
    /// The copy out with this part, in [`Demand`].
    _out: Option<Out>,
}

/// How [`GroupCommit::prepare`] sends a part's write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// Sent at once.
    No,
    /// Held back when the session has a copy, else sent at once.
    WithCopy,
    /// Held back, else the part does not run: a claim that must not commit before the
    /// completion it belongs to.
    Only,
}

/// Why a group did not commit.
enum GroupError {
    /// An operation (or the transaction before the commit) failed: nothing was committed,
    /// run each operation alone.
    Op,
    /// The commit itself failed: its outcome is unknown, so every caller gets the error.
    Commit(Error),
    /// The optimistic path does not apply or lost a race: nothing was written, run the group
    /// under the lock.
    Contended,
}

/// The group commit of the worker protocol's writes (claim, heartbeat, complete).
#[derive(Debug, Clone)]
pub(crate) struct GroupCommit {
    store: Store,
    /// Lanes with a group running (present), with the operations waiting for the next (see
    /// [`GroupCommit::lane`]).
    lanes: Arc<Mutex<HashMap<String, Vec<Op>>>>,
    /// Sessions whose last group found no copy, each in a lane of its own on PostgreSQL (see
    /// [`GroupCommit::lane`]).
    apart: Arc<Mutex<HashSet<String>>>,
    /// Sessions as their last group left them (see `run_optimistic` and `run_in`).
    /// Only the lane's running group uses an entry.
    sessions: Arc<Mutex<HashMap<String, Cached>>>,
    /// Long-polling claims that found nothing, in arrival order, for the next group that
    /// completes tasks to claim for (see [`GroupCommit::park`]).
    parked: Arc<Mutex<Vec<Parked>>>,
    next_parked: Arc<std::sync::atomic::AtomicU64>,
    /// How long each worker's `claim_next` has stayed in one session (see [`crate::turns`]).
    turns: Arc<Turns>,
    /// What claims queued on each session will take (see [`crate::demand`]).
    demand: Arc<Demand>,
    /// The bound on the tasks of all copies, [`CACHED_TASKS`].
    budget: Budget,
    /// Sessions a read named for the next picks (see [`crate::picks`]).
    picks: Arc<Picks>,
    /// Whether workers that pick together go to one session, with visits (see
    /// [`crate::turns`]) and completions' claims joining their session's part of a group:
    /// SQLite only. On PostgreSQL, 1,000 sessions burned at half the rate in one run of two
    /// that way, for a reason not yet found (docs/performance.md, "nineteenth run"); there
    /// every pick reads.
    clusters: bool,
}

/// A parked claim: its request and where its answer goes once a group took it.
#[derive(Debug)]
struct Parked {
    id: u64,
    request: ClaimRequest,
    reply: oneshot::Sender<Result<Vec<Claimed>, Error>>,
}

/// A claim waiting in [`GroupCommit::park`]; dropping it withdraws it.
#[derive(Debug)]
pub(crate) struct ParkedClaim {
    group: GroupCommit,
    id: u64,
    answer: oneshot::Receiver<Result<Vec<Claimed>, Error>>,
}

impl ParkedClaim {
    /// What a group that took the claim claimed for it (possibly nothing). Pending while the
    /// claim is parked.
    pub(crate) async fn answered(&mut self) -> Result<Vec<Claimed>, Error> {
        (&mut self.answer).await.unwrap_or_else(|_| Err(gone()))
    }

    /// Withdraws the claim: nothing when it was still parked; else a group took it, and this
    /// is its answer (tasks leased to the caller, which must not be dropped).
    pub(crate) async fn withdraw(mut self) -> Result<Vec<Claimed>, Error> {
        if self.group.unpark(self.id) {
            return Ok(Vec::new());
        }
        self.answered().await
    }
}

impl Drop for ParkedClaim {
    fn drop(&mut self) {
        self.group.unpark(self.id);
    }
}

/// A session (and its tasks, when small enough) as its last group left them.
#[derive(Debug)]
struct Cached {
    session: SessionRow,
    tasks: Option<TaskCache>,
}

impl Cached {
    /// `session` and `tasks` as a group that moved the session's sequence to `last` (when
    /// the transaction knows it) left them.
    fn after(mut session: SessionRow, tasks: Option<TaskCache>, last: Option<u64>) -> Self {
        if let Some(last) = last {
            session.last_seq = last;
        }
        Self { session, tasks }
    }
}

/// How often an optimistic group writes before it runs under the lock, when only messages
/// beat it (see `run_optimistic`).
const OPTIMISTIC_TRIES: u32 = 3;

/// Sessions kept in [`GroupCommit::sessions`]; beyond that it starts over (a stale or missing
/// entry costs one read).
const CACHED_SESSIONS: usize = 1024;

/// Tasks in all copies together, kept in [`GroupCommit::sessions`] or held by running groups
/// ([`Budget`]): a session whose copy would not fit reads its batches instead, so the copies'
/// memory has a bound however many sessions are active (each session's copy has one too, see
/// [`task_cache`]).
const CACHED_TASKS: usize = 50_000;

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
        let clusters = store.dialect() == Dialect::Sqlite;
        Self {
            store,
            lanes: Arc::default(),
            apart: Arc::default(),
            sessions: Arc::default(),
            parked: Arc::default(),
            next_parked: Arc::default(),
            turns: Arc::new(Turns::new(clusters)),
            demand: Arc::default(),
            budget: Budget::new(CACHED_TASKS),
            picks: Arc::default(),
            clusters,
        }
    }

    fn parked(&self) -> MutexGuard<'_, Vec<Parked>> {
        // A list of waiters: a panic cannot leave it half-changed.
        self.parked.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Parks a long-polling claim that found nothing. The next group that completes tasks
    /// takes it, when it asks for the same roles as that group's claims, and claims for it in
    /// the same transaction: the task a completion readies reaches a waiting worker with that
    /// one commit, instead of a wake-up, a pick and a second commit.
    pub(crate) fn park(&self, request: ClaimRequest) -> ParkedClaim {
        let id = self
            .next_parked
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (reply, answer) = oneshot::channel();
        self.parked().push(Parked { id, request, reply });
        ParkedClaim {
            group: self.clone(),
            id,
            answer,
        }
    }

    /// Removes a parked claim; false when a group took it first.
    fn unpark(&self, id: u64) -> bool {
        let mut parked = self.parked();
        match parked.iter().position(|claim| claim.id == id) {
            Some(at) => {
                parked.remove(at);
                true
            }
            None => false,
        }
    }

    /// Adds to a group that completes tasks the parked claims that can share its batch: those
    /// asking for the roles of its claims (or of the first parked claim, when it has none), on
    /// the session of its first completion.
    fn take_parked(&self, ops: &mut Vec<Op>) {
        let Some(session_id) = ops.iter().find_map(|op| match op {
            Op::Complete { session_id, .. } => Some(session_id.clone()),
            _ => None,
        }) else {
            return;
        };
        let mut parked = self.parked();
        if parked.is_empty() {
            return;
        }
        let first = ops
            .iter()
            .filter(|op| op.session_id() == session_id)
            .find_map(Op::claim_request)
            .unwrap_or(&parked[0].request)
            .clone();
        let now = crate::convert::now_ms();
        let (taken, left): (Vec<Parked>, Vec<Parked>) = std::mem::take(&mut *parked)
            .into_iter()
            .partition(|claim| claim.request.filter() == first.filter());
        *parked = left;
        drop(parked);
        ops.extend(taken.into_iter().map(|claim| Op::Claim {
            session_id: session_id.clone(),
            request: ClaimRequest {
                now,
                ..claim.request
            },
            reply: claim.reply,
        }));
    }

    fn lanes(&self) -> MutexGuard<'_, HashMap<String, Vec<Op>>> {
        // The map holds no invariant a panic could break halfway.
        self.lanes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lane of `session_id`'s operations: the one lane, shared by every session whose
    /// copy this coordinator keeps or may keep, so their writes share a commit (see the module
    /// comment). On PostgreSQL a session known to have no copy (it does not fit the copies'
    /// budget: see [`Budget`]) has a lane of its own: its groups read their batches from the
    /// database, which would hold up every other session's, and a commit of its own costs it
    /// little next to those reads. SQLite has one writer: everything shares one lane there.
    /// A session goes apart once a group finds it without a copy, and back once one finds it
    /// with one.
    fn lane(&self, session_id: &str) -> String {
        if self.apart().contains(session_id) {
            session_id.to_owned()
        } else {
            String::new()
        }
    }

    fn apart(&self) -> MutexGuard<'_, HashSet<String>> {
        self.apart.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Notes whether a group found `session_id` with a copy (`copied`), for [`Self::lane`].
    fn found(&self, session_id: &str, copied: bool) {
        if self.store.dialect() != Dialect::Postgres {
            return;
        }
        let mut apart = self.apart();
        if copied {
            apart.remove(session_id);
        } else if !apart.contains(session_id) {
            if apart.len() >= CACHED_SESSIONS {
                apart.clear();
            }
            apart.insert(session_id.to_owned());
        }
    }

    fn sessions(&self) -> MutexGuard<'_, HashMap<String, Cached>> {
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps the copy of a session this coordinator just took in (`session` and its `tasks` as
    /// its intake committed them), so its first group reads nothing: on the one lane, that read
    /// (all of a session's tasks) would hold up every session's workers.
    pub(crate) fn seed(&self, session: SessionRow, tasks: Vec<Task>) {
        if session.state != pb::SessionState::Active {
            return;
        }
        let Some(tasks) = task_cache::stored(&session.id, tasks, &self.budget) else {
            return;
        };
        let mut sessions = self.sessions();
        if sessions.len() < CACHED_SESSIONS {
            sessions.entry(session.id.clone()).or_insert(Cached {
                session,
                tasks: Some(tasks),
            });
        }
    }

    /// The copy kept of `session_id`: its row and its tasks in order of position.
    #[cfg(test)]
    pub(crate) fn copy_of(&self, session_id: &str) -> Option<(SessionRow, Vec<Task>)> {
        let sessions = self.sessions();
        let copy = sessions.get(session_id)?;
        let tasks = copy.tasks.as_ref()?.tasks();
        Some((copy.session.clone(), tasks))
    }

    /// A message (one event, no task changed) moved `session_id`'s sequence to `sequence`:
    /// the session's copy, when it is as of the sequence just before, is as good as of
    /// `sequence`, so the next batch still runs on it instead of losing its sequence check
    /// and reading the session again. A copy a running group holds is not in the map: that
    /// group loses its check, as it would anyway.
    pub(crate) fn message_logged(&self, session_id: &str, sequence: u64) {
        if let Some(copy) = self.sessions().get_mut(session_id)
            && copy.session.last_seq + 1 == sequence
        {
            copy.session.last_seq = sequence;
        }
    }

    /// Claims up to `request.max` ready tasks of its roles from the session served least
    /// recently that has one (see [`Store::pick_sessions`]).
    pub(crate) async fn claim(&self, request: &ClaimRequest) -> Result<Vec<Claimed>, Error> {
        self.claim_from(request, None).await
    }

    /// [`Self::claim`], trying `picked` (a session just picked) first.
    async fn claim_from(
        &self,
        request: &ClaimRequest,
        mut picked: Option<String>,
    ) -> Result<Vec<Claimed>, Error> {
        // Each round either claims or finds that others took the picked session's ready tasks
        // first (someone made progress), so this ends once nothing is ready.
        loop {
            let session_id = match picked.take() {
                Some(session_id) => session_id,
                None => match self.pick(request, None).await? {
                    Some(session_id) => session_id,
                    None => break,
                },
            };
            let (reply, answer) = oneshot::channel();
            let _queued = self.sent(&session_id, request);
            let op = Op::Claim {
                session_id: session_id.clone(),
                request: request.clone(),
                reply,
            };
            self.submit(self.lane(&session_id), op);
            let claimed = answer.await.unwrap_or_else(|_| Err(gone()))?;
            if !claimed.is_empty() {
                return Ok(claimed);
            }
            self.picks.emptied(&session_id);
            // A provider quota may be what holds the ready tasks back: asking again changes
            // nothing (the long poll waits for a change, or the quota's next rebuild).
            if request.quotas.engaged() {
                break;
            }
        }
        Ok(Vec::new())
    }

    pub(crate) async fn heartbeat(
        &self,
        session_id: &str,
        task_id: &str,
        token: u64,
        (progress, figures): (&str, Option<pb::WorkProgress>),
        lease_ms: Option<i64>,
        now: i64,
    ) -> Result<(i64, bool), Error> {
        let (reply, answer) = oneshot::channel();
        let op = Op::Heartbeat {
            session_id: session_id.to_owned(),
            task_id: task_id.to_owned(),
            token,
            progress: progress.to_owned(),
            figures,
            lease_ms,
            now,
            reply,
        };
        self.submit(self.lane(session_id), op);
        answer.await.unwrap_or_else(|_| Err(gone()))
    }

    pub(crate) async fn complete(
        &self,
        session_id: &str,
        task_id: &str,
        token: u64,
        result: pb::TaskResult,
        claim_next: Option<ClaimRequest>,
        now: i64,
    ) -> Result<(Task, Vec<Claimed>), Error> {
        // At the end of the worker's turn in this session (see `crate::turns`), or when the
        // session has nothing left for the claim, the worker's next claim goes to the session
        // served least recently when that is another: with the completion's write when the
        // group can, else after the commit.
        let mut claim_next = claim_next;
        // What the group may take (`ask`), and what to claim with after the commit if not.
        let (mut ask, mut elsewhere) = (None, None);
        if let Some(request) = &claim_next
            && (self.turns.over(&request.worker_id, session_id)
                || self.runs_dry(session_id, Some(task_id)))
            && let Ok(Some(picked)) = self.pick(request, Some(session_id)).await
            && picked != session_id
            && let Some(request) = claim_next.take()
        {
            let (reply, answer) = oneshot::channel();
            ask = Some(Elsewhere {
                session_id: picked.clone(),
                request: request.clone(),
                reply,
            });
            let queued = self.sent(&picked, &request);
            elsewhere = Some((answer, request, picked, queued));
        }
        let queued = claim_next
            .as_ref()
            .map(|request| self.demand.queue(session_id, request.max as usize));
        let (reply, answer) = oneshot::channel();
        let op = Op::Complete {
            session_id: session_id.to_owned(),
            completion: Box::new(Completion {
                task_id: task_id.to_owned(),
                token,
                result,
            }),
            claim_next,
            elsewhere: ask,
            _queued: queued,
            now,
            reply,
        };
        self.submit(self.lane(session_id), op);
        let (task, mut next) = answer.await.unwrap_or_else(|_| Err(gone()))?;
        if let Some((answer, request, picked, _queued)) = elsewhere {
            next = match answer.await {
                Ok(claimed) => claimed,
                // Not taken by the group: claimed now, after the completion's commit.
                Err(_) => {
                    let request = ClaimRequest {
                        now: crate::convert::now_ms(),
                        ..request
                    };
                    // The session picked above first: picking again would cost a read for
                    // the same answer, unless someone emptied it meanwhile (then it picks
                    // again).
                    self.claim_from(&request, Some(picked)).await
                }
            }
            // The completion is committed: a claim that fails leaves the worker without a
            // next task (it claims again), not with a completion it would think refused.
            .unwrap_or_else(|err| {
                tracing::warn!(error = %err, "claim in another session failed");
                Vec::new()
            });
        }
        Ok((task, next))
    }

    /// The session `request` goes to: the active one with a ready task for it served least
    /// recently, as the last read for its filter tells while that is fresh (see
    /// [`crate::picks`]), else as a new read tells. `leaving`: the session whose turn the
    /// worker ends, which a read already made does not send it back to.
    async fn pick(
        &self,
        request: &ClaimRequest,
        leaving: Option<&str>,
    ) -> Result<Option<String>, Error> {
        let (filter, worker) = (request.filter(), request.worker_id.as_str());
        if !self.clusters {
            let sessions = self.store.pick_sessions(filter, 1).await?;
            return Ok(sessions.into_iter().next());
        }
        // Passed over: sessions with nothing ready, and those whose visit is over.
        let passed =
            |session_id: &str| self.runs_dry(session_id, None) || self.turns.visited(session_id);
        if let Some(session_id) = self.picks.next(filter, worker, leaving, passed) {
            return Ok(Some(session_id));
        }
        let at = std::time::Instant::now();
        let sessions = self.store.pick_sessions(filter, picks::PER_READ).await?;
        self.picks.keep(filter, at, worker, &sessions);
        if let Some(session_id) = sessions.first() {
            self.turns.visit_begins(session_id);
        }
        Ok(sessions.into_iter().next())
    }

    /// Counts a claim a pick sent to `session_id` in [`Demand`] until the returned guard drops
    /// (when it is answered), so that picks meanwhile pass the session over when the claims
    /// already sent there will take what it has ready; with `clusters` only.
    fn sent(&self, session_id: &str, request: &ClaimRequest) -> Option<Queued> {
        self.clusters
            .then(|| self.demand.queue(session_id, request.max as usize))
    }

    /// Whether `session_id` has nothing ready for another claim once the claims queued there
    /// took theirs (and, with `completing`, that task's completion readies nothing), as far as
    /// its copy tells (or, while a group has the copy out, what it left in [`Demand`]; false
    /// without either): the claim would come back empty.
    fn runs_dry(&self, session_id: &str, completing: Option<&str>) -> bool {
        let (queued, ready_out) = self.demand.of(session_id);
        match self
            .sessions()
            .get(session_id)
            .and_then(|copy| copy.tasks.as_ref())
        {
            Some(tasks) => tasks.runs_dry(completing, queued),
            None => ready_out.is_some_and(|ready| ready <= queued),
        }
    }

    /// Queues `op` behind the running transaction of its lane, or runs it at once when the
    /// lane is idle. Its answer comes on its reply channel.
    fn submit(&self, lane: String, op: Op) {
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
            // On a task of its own: a caller that goes away (a client's cancelled call) must
            // not cut a group short, which on SQLite could leave an optimistic write's
            // transaction open on the one writer connection.
            let group = self.clone();
            tokio::spawn(async move {
                let _leader = Leader {
                    group: &group,
                    lane,
                };
                group.run(vec![op]).await;
            });
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
    async fn run(&self, mut ops: Vec<Op>) {
        self.take_parked(&mut ops);
        let ops = self.run_parts(ops).await;
        if ops.is_empty() {
            return;
        }
        // What `run_parts` left has tried its optimistic write, or cannot: together under the
        // lock, or (one operation) alone in `settle`.
        let result = if ops.len() > 1 {
            self.run_together(&ops).await
        } else {
            Err(GroupError::Contended)
        };
        self.settle(ops, result).await;
    }

    /// The lane carries several sessions' operations in a group. Each session's part that can is
    /// worked out optimistically on its copy with its write held back (see [`Tx::hold`]), and the
    /// writes of all of them go out in one call, which every group waits for
    /// ([`Store::write_held`]: one statement on PostgreSQL, one call on SQLite's writer): one
    /// commit a group, as with one session, instead of one a session. Each write still checks its
    /// session's sequence; when the call fails, nothing was written, the parts' copies are put back
    /// as they were, and each part runs optimistically on its own. Returns what is left to run
    /// together: the parts with heartbeats and those that lost their optimistic write.
    async fn run_parts(&self, ops: Vec<Op>) -> Vec<Op> {
        let mut parts: Vec<Vec<Op>> = Vec::new();
        // Completions' claims in other sessions, with the part of each completion.
        let mut asks: Vec<(usize, Elsewhere)> = Vec::new();
        for mut op in ops {
            let ask = match &mut op {
                Op::Complete { elsewhere, .. } => elsewhere.take(),
                _ => None,
            };
            let at = match parts
                .iter()
                .position(|part| part[0].session_id() == op.session_id())
            {
                Some(at) => {
                    parts[at].push(op);
                    at
                }
                None => {
                    parts.push(vec![op]);
                    parts.len() - 1
                }
            };
            asks.extend(ask.map(|ask| (at, ask)));
        }
        let parts = if self.clusters {
            claimed_last(parts, &mut asks)
        } else {
            parts
        };
        let mut sessions: Vec<String> = parts
            .iter()
            .map(|part| part[0].session_id().to_owned())
            .collect();
        let mut rest = Vec::new();
        // Each part worked out, with how many claims of completions it took in (at its end).
        let mut worked = Vec::with_capacity(parts.len());
        let mut ready = vec![false; parts.len()];
        // Whether the part's write is held back.
        let mut held = vec![false; parts.len()];
        // Only on the shared lane, for sessions of that lane: a session's own lane (see
        // `lane`) must not take the copies the shared lane's groups work on.
        let shared = self.lane(&sessions[0]).is_empty();
        for (at, mut part) in parts.into_iter().enumerate() {
            let (mut taken, hold) = if shared && self.clusters {
                take_asks(&mut asks, &mut part, at, &ready, &held)
            } else {
                (0, Hold::WithCopy)
            };
            // A part with heartbeats is declined at once, its copy untouched.
            let mut result = self.prepare(&part, hold).await;
            if taken > 0 && matches!(result, Err(GroupError::Contended)) {
                // It could not hold its write back: the claims it took in are made once their
                // completions are committed, and the part runs as it would have.
                part.truncate(part.len() - taken);
                taken = 0;
                result = self.prepare(&part, Hold::WithCopy).await;
            }
            match result {
                Ok(prepared) => {
                    ready[at] = true;
                    held[at] = prepared.held.is_some();
                    worked.push((part, prepared, taken));
                }
                Err(GroupError::Contended) => rest.extend(part),
                Err(err) => {
                    // The claims it took in are made once their completions are committed.
                    part.truncate(part.len() - taken);
                    self.settle(part, Err(err)).await;
                }
            }
        }
        // The claims of completions worked out, in sessions of their own: a part each, whose
        // write goes out with the completions'. One that is not taken here (its completion
        // failed, or its session is already in the group) is made after the commit.
        let asked = worked.len();
        let mut claims: Vec<Vec<Op>> = Vec::new();
        for (at, ask) in asks {
            if !ready[at] || !shared || !self.lane(&ask.session_id).is_empty() {
                continue;
            }
            let op = ask.into_claim();
            match claims
                .iter_mut()
                .find(|part| part[0].session_id() == op.session_id())
            {
                Some(part) => part.push(op),
                None if !sessions.iter().any(|id| id == op.session_id()) => {
                    sessions.push(op.session_id().to_owned());
                    claims.push(vec![op]);
                }
                None => {}
            }
        }
        for part in claims {
            if let Ok(prepared) = self.prepare(&part, Hold::Only).await {
                worked.push((part, prepared, 0));
            }
        }
        let writes: Vec<HeldWrite> = worked
            .iter_mut()
            .filter_map(|(_, prepared, _)| prepared.held.take())
            .collect();
        // None held back (every part wrote at once, or none worked out) costs no call.
        let written = match self.store.write_held(writes).await {
            Ok(()) => true,
            Err(err) => {
                tracing::debug!(error = %err, "held writes lost; the sessions write on their own");
                false
            }
        };
        for (i, (mut part, prepared, taken)) in worked.into_iter().enumerate() {
            let session_id = part[0].session_id();
            if written || prepared.before.is_none() {
                let result = self.finish(session_id, prepared).await;
                self.settle(part, result).await;
                continue;
            }
            self.put_back(session_id, prepared);
            // A claim for a completion is made once the completion is committed.
            if i >= asked {
                continue;
            }
            part.truncate(part.len() - taken);
            match self.run_optimistic(&part).await {
                Err(GroupError::Contended) => rest.extend(part),
                result => self.settle(part, result).await,
            }
        }
        rest
    }

    /// Answers `ops` with what their group returned; see the module comment for failures.
    async fn settle(&self, ops: Vec<Op>, result: Result<Vec<Outcome>, GroupError>) {
        match result {
            Ok(outcomes) => {
                let ended = outcomes
                    .iter()
                    .filter(|outcome| matches!(outcome, Outcome::Complete(..)))
                    .count();
                self.store.tasks_ended(ended);
                for (op, outcome) in ops.into_iter().zip(outcomes) {
                    answer(op, Ok(outcome));
                }
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
            }
            Err(GroupError::Op | GroupError::Contended) => {
                for op in ops {
                    let outcome = self.run_alone(&op).await;
                    if matches!(outcome, Ok(Outcome::Complete(..))) {
                        self.store.tasks_ended(1);
                    }
                    answer(op, outcome);
                }
            }
        }
    }

    /// The fast path for a group of completions and claims of one active eager session (the
    /// lane splits its groups by session first, see `run_parts`): no transaction and no lock;
    /// the session's row and tasks as the previous group left them (read once when there is no
    /// copy; a session too large to copy reads its batch instead), and one conditional write
    /// (see [`Store::optimistic`]). When the session turns out to have moved on (another
    /// coordinator, or a write outside the group commit), nothing is written and the group
    /// runs under the lock. A group with heartbeats, or of several sessions, runs under the
    /// lock at once.
    async fn run_optimistic(&self, ops: &[Op]) -> Result<Vec<Outcome>, GroupError> {
        let prepared = self.prepare(ops, Hold::No).await?;
        self.finish(ops[0].session_id(), prepared).await
    }

    /// [`Self::run_optimistic`] up to its write, which it sends or holds back (see [`Hold`]),
    /// for the caller to send and then [`Self::finish`] or [`Self::put_back`].
    async fn prepare(&self, ops: &[Op], hold: Hold) -> Result<Prepared, GroupError> {
        let session_id = ops[0].session_id();
        // Heartbeats run under the lock, on the copy (see `run_in`).
        if ops
            .iter()
            .any(|op| matches!(op, Op::Heartbeat { .. }) || op.session_id() != session_id)
        {
            return Err(GroupError::Contended);
        }
        // Taken out for the group: a group that fails, or runs under the lock after losing,
        // leaves none behind.
        let cached = self.sessions().remove(session_id);
        let Cached {
            mut session,
            mut tasks,
        } = match cached {
            Some(cached) if self.serves(&cached) => cached,
            _ => {
                let (session, tasks) =
                    task_cache::load_cached(&self.store, session_id, &self.budget)
                        .await
                        .map_err(|_| GroupError::Contended)?;
                Cached { session, tasks }
            }
        };
        self.found(session_id, tasks.is_some());
        let out = self
            .demand
            .take_out(session_id, tasks.as_ref().and_then(TaskCache::ready_alone));
        // Only `complete_eager` writes once (see `run_session`).
        let filters = ops
            .iter()
            .filter_map(Op::claim_request)
            .map(ClaimRequest::filter);
        if !one_batch(&session, filters) {
            return Err(GroupError::Contended);
        }
        // Held back only on a copy: a batch that reads the session would not see its own
        // write (a claimed task's upstream results, say) until it went out.
        let before = match &mut tasks {
            Some(tasks) if hold != Hold::No => {
                tasks.journal();
                Some(session.clone())
            }
            _ if hold == Hold::Only => return Err(GroupError::Contended),
            _ => None,
        };
        let mut outcomes: Vec<Option<Outcome>> = ops.iter().map(|_| None).collect();
        let mut tries = 0;
        // A batch that ends the session changes its state in memory before writing.
        let state = session.state;
        let (end, mut tx) = loop {
            let mut tx = self
                .store
                .optimistic(session_id, session.last_seq)
                .await
                .map_err(|_| GroupError::Contended)?;
            if before.is_some() {
                tx.hold();
            }
            match self
                .run_session(&mut tx, &mut session, tasks.as_mut(), ops, &mut outcomes)
                .await
            {
                Ok(end) => break (end, tx),
                // Held back, nothing went out; the copy, which the batch may have changed,
                // is dropped with it.
                Err(Error::Contended(_)) if before.is_some() => {
                    return Err(GroupError::Contended);
                }
                Err(_) if before.is_some() => return Err(GroupError::Op),
                Err(err) if tx.wrote => return Err(GroupError::Commit(err)),
                Err(Error::Contended(_)) => {
                    drop(tx);
                    tries += 1;
                    // Lost to messages only (a busy message bus): nothing it worked on
                    // changed, and a failed write leaves the copy as it was, so it tries
                    // again as of the new sequence instead of reading the session afresh.
                    match self.only_messages_since(session_id, session.last_seq).await {
                        Some(last) if tries < OPTIMISTIC_TRIES => {
                            session.last_seq = last;
                            session.state = state;
                            outcomes.fill_with(|| None);
                        }
                        _ => return Err(GroupError::Contended),
                    }
                }
                Err(_) => return Err(GroupError::Op),
            }
        };
        let held = tx.take_held();
        Ok(Prepared {
            wrote: tx.wrote,
            last: tx.last_seq(session_id),
            before: before.filter(|_| held.is_some()),
            held,
            session,
            tasks,
            outcomes,
            end,
            _out: out,
        })
    }

    /// The rest of [`Self::run_optimistic`] once a part's write went out: keeps its copy (or
    /// decides whether its session ended) and returns its outcomes.
    async fn finish(
        &self,
        session_id: &str,
        prepared: Prepared,
    ) -> Result<Vec<Outcome>, GroupError> {
        let Prepared {
            session,
            mut tasks,
            outcomes,
            end,
            wrote,
            last,
            ..
        } = prepared;
        if let Some(tasks) = &mut tasks {
            tasks.forget();
        }
        match end {
            // Nothing checked the copy against the session's sequence: it may be stale (a
            // fruitless claim, say, of a task readied elsewhere), so it is kept only when the
            // sequence still says it is current. Else the next group reads afresh, which for
            // a large session costs far more than this one read.
            _ if !wrote => {
                if tasks.is_some()
                    && let Ok((_, last)) = self.store.session_head(session_id).await
                    && last == session.last_seq
                {
                    self.keep(vec![(session_id.to_owned(), Cached { session, tasks })]);
                }
            }
            None => self.keep(vec![(
                session_id.to_owned(),
                Cached::after(session, tasks, last),
            )]),
            // Rare (the session may have ended or stalled): decided under the lock, after the
            // group's own write committed, which leaves the copy behind.
            Some((count, now)) => self
                .check_end(session_id, count, now)
                .await
                .map_err(GroupError::Commit)?,
        }
        outcomes
            .into_iter()
            .map(|outcome| outcome.ok_or_else(mismatch))
            .collect::<Result<_, _>>()
            .map_err(GroupError::Commit)
    }

    /// Whether a kept entry serves as it is: it has its tasks, or its session still cannot
    /// have a copy (too large, or refused for want of room that there still is not: see
    /// [`Budget::has_room_for`]).
    fn serves(&self, copy: &Cached) -> bool {
        copy.tasks.is_some() || !self.budget.has_room_for(&copy.session.id)
    }

    /// A part whose held-back write did not go out: its copy as it was before the part, for
    /// the part to run again.
    fn put_back(&self, session_id: &str, prepared: Prepared) {
        let (Some(session), Some(mut tasks)) = (prepared.before, prepared.tasks) else {
            return;
        };
        tasks.undo();
        self.keep(vec![(
            session_id.to_owned(),
            Cached {
                session,
                tasks: Some(tasks),
            },
        )]);
    }

    /// When every event recorded after `after` is a message (which changes no task), the
    /// sequence of the last: a copy as of `after` is as good as of it. `None` when anything
    /// else was recorded, or nothing (the write lost for another reason).
    async fn only_messages_since(&self, session_id: &str, after: u64) -> Option<u64> {
        const MOST: u32 = 64;
        let events = self
            .store
            .events_after(session_id, after, MOST + 1)
            .await
            .ok()?;
        if events.is_empty() || events.len() > MOST as usize {
            return None;
        }
        let mut last = after;
        for event in events {
            let message = matches!(event.kind, Some(pb::session_event::Kind::Message(_)));
            if !message || event.sequence != last + 1 {
                return None;
            }
            last = event.sequence;
        }
        Some(last)
    }

    async fn check_end(&self, session_id: &str, count: usize, now: i64) -> Result<(), Error> {
        let mut tx = self.store.begin().await?;
        let mut session =
            sessions::lock_and_load_session(&mut tx, session_id, self.store.for_update()).await?;
        check_end(&mut tx, &mut session, count, now).await?;
        tx.commit().await
    }

    async fn run_together(&self, ops: &[Op]) -> Result<Vec<Outcome>, GroupError> {
        let mut tx = self.store.begin().await.map_err(|_| GroupError::Op)?;
        // Dropping `tx` on an error rolls the whole group back.
        let (outcomes, copies) = self
            .run_in(&mut tx, ops)
            .await
            .map_err(|_| GroupError::Op)?;
        tx.commit().await.map_err(GroupError::Commit)?;
        self.keep(copies);
        Ok(outcomes)
    }

    async fn run_alone(&self, op: &Op) -> Result<Outcome, Error> {
        let mut tx = self.store.begin().await?;
        let (mut outcomes, copies) = self.run_in(&mut tx, std::slice::from_ref(op)).await?;
        let outcome = outcomes.pop().ok_or_else(mismatch)?;
        tx.commit().await?;
        self.keep(copies);
        Ok(outcome)
    }

    /// Keeps sessions' copies as a committed group left them, but those of sessions that
    /// ended (no group works on them again).
    fn keep(&self, mut copies: Vec<(String, Cached)>) {
        copies.retain(|(_, copy)| copy.session.state == pb::SessionState::Active);
        if copies.is_empty() {
            return;
        }
        let mut sessions = self.sessions();
        if sessions.len() + copies.len() > CACHED_SESSIONS {
            sessions.clear();
        }
        // Every copy took its share of `budget` when it was loaded: the copies kept stay, and
        // a session that did not fit reads its batches (through indexes) until others leave
        // room (`Budget::has_room_for`), instead of sessions taking turns reloading theirs.
        sessions.extend(copies);
    }

    /// Runs `ops` inside a transaction, session by session (in order of first appearance):
    /// lock and load the session, then [`Self::run_session`]. Returns the outcomes in the
    /// order of `ops`, and the sessions' copies to keep once the transaction commits.
    ///
    /// A session whose operations are one batch of completions and claims works on its copy
    /// ([`TaskCache`]) instead of reading, when the copy is as of the sequence just locked
    /// (every change to a session moves it); SQLite loads one when it has none (PostgreSQL
    /// loads its copies outside the lock, in `run_optimistic`). Groups with heartbeats keep
    /// their sessions' copies this way.
    async fn run_in(
        &self,
        tx: &mut Tx,
        ops: &[Op],
    ) -> Result<(Vec<Outcome>, Vec<(String, Cached)>), Error> {
        let mut sessions: Vec<&str> = ops.iter().map(Op::session_id).collect();
        // Locked in order of id: two coordinators' groups never wait on each other crosswise.
        sessions.sort_unstable();
        sessions.dedup();
        let mut outcomes: Vec<Option<Outcome>> = ops.iter().map(|_| None).collect();
        let mut copies = Vec::new();
        for session_id in sessions {
            let copy = self.sessions().remove(session_id);
            let mut session =
                sessions::lock_and_load_session(tx, session_id, self.store.for_update()).await?;
            let mut tasks = match copy {
                _ if !copyable(&session, ops) => None,
                Some(copy) if copy.session.last_seq == session.last_seq && self.serves(&copy) => {
                    Some(copy.tasks)
                }
                // PostgreSQL loads its copies outside the lock (see `run_optimistic`).
                _ if self.store.dialect() == Dialect::Postgres => None,
                _ => Some(task_cache::load_cache_in(tx, session_id, &self.budget).await?),
            };
            match self
                .run_session(
                    tx,
                    &mut session,
                    tasks.as_mut().and_then(Option::as_mut),
                    ops,
                    &mut outcomes,
                )
                .await?
            {
                Some((count, now)) => check_end(tx, &mut session, count, now).await?,
                None => {
                    if let Some(tasks) = tasks {
                        let copy = Cached::after(session, tasks, tx.last_seq(session_id));
                        copies.push((session_id.to_owned(), copy));
                    }
                }
            }
        }
        let outcomes = outcomes
            .into_iter()
            .map(|outcome| outcome.ok_or_else(mismatch))
            .collect::<Result<_, _>>()?;
        Ok((outcomes, copies))
    }

    /// Runs the operations of `ops` on `session` (loaded; locked unless `tx` is optimistic):
    /// its heartbeats one by one, then its completions and claims as one batch (see the
    /// module comment), filling in their `outcomes`. Returns `Some((transitions, now))` when
    /// the session may have ended or stalled, for [`check_end`].
    async fn run_session(
        &self,
        tx: &mut Tx,
        session: &mut SessionRow,
        mut tasks: Option<&mut TaskCache>,
        ops: &[Op],
        outcomes: &mut [Option<Outcome>],
    ) -> Result<Option<(usize, i64)>, Error> {
        let session_id = session.id.clone();
        let session_id = session_id.as_str();
        let mine = || {
            ops.iter()
                .enumerate()
                .filter(move |(_, op)| op.session_id() == session_id)
        };
        for (i, op) in mine() {
            if let Op::Heartbeat {
                task_id,
                token,
                progress,
                figures,
                lease_ms,
                now,
                ..
            } = op
            {
                let beat = heartbeat_in(
                    tx,
                    session_id,
                    task_id,
                    *token,
                    (progress, figures.as_ref()),
                    *lease_ms,
                    *now,
                    tasks.as_deref_mut(),
                )
                .await?;
                outcomes[i] = Some(Outcome::Heartbeat(beat));
            }
        }
        let completions: Vec<(usize, &Completion, i64)> = mine()
            .filter_map(|(i, op)| match op {
                Op::Complete {
                    completion, now, ..
                } => Some((i, &**completion, *now)),
                _ => None,
            })
            .collect();
        // Claims, and completions' `claim_next`, in arrival order.
        let claims: Vec<(usize, &ClaimRequest)> = mine()
            .filter_map(|(i, op)| op.claim_request().map(|request| (i, request)))
            .collect();
        let requests: Vec<ClaimRequest> = claims
            .iter()
            .map(|(_, request)| ClaimRequest::clone(request))
            .collect();
        let now = completions
            .iter()
            .map(|(_, _, now)| *now)
            .chain(requests.iter().map(|request| request.now))
            .max()
            .unwrap_or_default();
        let (done, claimed, check_end) =
            if one_batch(session, requests.iter().map(ClaimRequest::filter)) {
                // The common case: one batch reads, settles, claims and writes.
                let batch = completions
                    .iter()
                    .map(|(_, completion, _)| Completion::clone(completion))
                    .collect();
                let batch = complete::complete_eager(
                    &self.store,
                    tx,
                    session,
                    batch,
                    &requests,
                    now,
                    tasks,
                )
                .await?;
                (batch.tasks, batch.claimed, batch.check_end)
            } else {
                // Waves, a session no longer active, or claims asking for different roles:
                // completions one by one over the whole graph, then the claims.
                let mut done = Vec::with_capacity(completions.len());
                for (_, completion, now) in &completions {
                    done.push(
                        complete::complete_in(tx, session, Completion::clone(completion), *now)
                            .await?,
                    );
                }
                let claimed = if requests.is_empty() {
                    Vec::new()
                } else {
                    claim::claim_in(&self.store, tx, session, &requests).await?
                };
                (done, claimed, None)
            };
        for ((i, _, _), task) in completions.iter().zip(done) {
            outcomes[*i] = Some(Outcome::Complete(Box::new(task), Vec::new()));
        }
        for ((i, _), tasks) in claims.iter().zip(claimed) {
            match &mut outcomes[*i] {
                Some(Outcome::Complete(_, next)) => *next = tasks,
                slot => *slot = Some(Outcome::Claim(tasks)),
            }
        }
        Ok(check_end.map(|count| (count, now)))
    }
}

/// Whether `session`'s operations in `ops` may work on, and keep, its in-memory copy: one
/// batch of completions and claims, and heartbeats (which keep the copy's leases current). A
/// validator's convergence write-back would change tasks behind the copy's back.
fn copyable(session: &SessionRow, ops: &[Op]) -> bool {
    let mine = || ops.iter().filter(|op| op.session_id() == session.id);
    mine().all(|op| match op {
        Op::Claim { .. } | Op::Heartbeat { .. } => true,
        Op::Complete { completion, .. } => !complete::writes_convergence(&completion.result),
    }) && one_batch(
        session,
        mine()
            .filter_map(Op::claim_request)
            .map(ClaimRequest::filter),
    )
}

/// Whether a session's completions and claims (asking for `filters`) run as one batch
/// ([`complete::complete_eager`]): in an active eager session, with every claim asking for the
/// same roles and offering the same backends.
fn one_batch<'a>(session: &SessionRow, mut filters: impl Iterator<Item = Filter<'a>>) -> bool {
    let first = filters.next();
    session.mode == troupe_plan::Mode::Eager
        && session.state == pb::SessionState::Active
        && filters.all(|these| Some(these) == first)
}

/// `parts` with those whose session a completion of another part claims in (see
/// [`Elsewhere`]) after the others, so that such a claim joins its session's part (see
/// [`take_asks`]); `asks` follow their parts.
fn claimed_last(parts: Vec<Vec<Op>>, asks: &mut [(usize, Elsewhere)]) -> Vec<Vec<Op>> {
    let claimed: Vec<bool> = parts
        .iter()
        .enumerate()
        .map(|(at, part)| {
            asks.iter()
                .any(|(from, ask)| *from != at && ask.session_id == part[0].session_id())
        })
        .collect();
    if !claimed.contains(&true) {
        return parts;
    }
    let mut order: Vec<usize> = (0..parts.len()).collect();
    order.sort_by_key(|&at| claimed[at]);
    let mut place = vec![0; parts.len()];
    for (new, &old) in order.iter().enumerate() {
        place[old] = new;
    }
    for (from, _) in asks.iter_mut() {
        *from = place[*from];
    }
    let mut parts: Vec<Option<Vec<Op>>> = parts.into_iter().map(Some).collect();
    order
        .into_iter()
        .filter_map(|at| parts[at].take())
        .collect()
}

/// Takes out of `asks` the claims of completions (see [`Elsewhere`]) for the session of `part`,
/// the `at`-th part of a group, whose completions are in parts already worked out (`ready`), and
/// appends them to `part`: such a claim is then written with its session's part, in the
/// same call as its completion when that is held back (`held`), else after it. The claims
/// of other filters than `part`'s own are left (a part claims for one filter). Returns how
/// many it took, and how `part` must write: held back when one of their completions is.
fn take_asks(
    asks: &mut Vec<(usize, Elsewhere)>,
    part: &mut Vec<Op>,
    at: usize,
    ready: &[bool],
    held: &[bool],
) -> (usize, Hold) {
    let session_id = part[0].session_id().to_owned();
    let mut filter = part.iter().find_map(Op::claim_request).cloned();
    let (mut taken, mut hold) = (0, Hold::WithCopy);
    let mut left = Vec::with_capacity(asks.len());
    for (from, ask) in std::mem::take(asks) {
        let fits = from < at
            && ready[from]
            && ask.session_id == session_id
            && filter
                .as_ref()
                .is_none_or(|first| first.filter() == ask.request.filter());
        if !fits {
            left.push((from, ask));
            continue;
        }
        if held[from] {
            hold = Hold::Only;
        }
        filter.get_or_insert_with(|| ask.request.clone());
        part.push(ask.into_claim());
        taken += 1;
    }
    *asks = left;
    (taken, hold)
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
                Outcome::Complete(task, next) => Ok((*task, next)),
                _ => Err(mismatch()),
            }));
        }
    }
}

fn mismatch() -> Error {
    Error::Corrupt("group commit answered an operation with another's outcome".to_owned())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use serde_json::json;
    use tokio::sync::oneshot;
    use troupe_proto::v1 as pb;

    use super::{Completion, Op, Task, TaskCache};
    use crate::lifecycle::claim::ClaimRequest;
    use crate::lifecycle::task_cache;
    use crate::service::Coordinator;
    use crate::store::messages::NewMessage;

    /// A claim of one executor task.
    fn claim_one() -> ClaimRequest {
        ClaimRequest {
            worker_id: "w".to_owned(),
            roles: vec![pb::Role::Executor],
            backends: None,
            max: 1,
            lease_ms: 60_000,
            now: crate::convert::now_ms(),
            quotas: Arc::new(crate::quota::Quotas::new(
                Default::default(),
                Duration::from_secs(1),
            )),
        }
    }

    /// A session refused a copy only because the others' left no room (as when its first
    /// claim comes while its intake still builds the copy it will give up) is not left
    /// without one for good: once there is room, its next group copies it.
    #[tokio::test]
    async fn a_session_refused_a_copy_for_want_of_room_copies_once_there_is_room() {
        let dir = tempfile::tempdir().unwrap();
        let (store, coordinator) = Coordinator::for_tests(dir.path()).await;
        refused_a_copy_then_room(store, coordinator, dir.path()).await;
    }

    /// [`a_session_refused_a_copy_for_want_of_room_copies_once_there_is_room`] on PostgreSQL,
    /// where the session has a lane of its own while it has no copy, and shares the one lane
    /// again once it has one.
    #[tokio::test]
    async fn a_session_without_a_copy_has_a_lane_of_its_own_on_postgres() {
        let Some(url) = troupe_testkit::postgres_url() else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let (store, coordinator) = Coordinator::for_tests_on_postgres(&url, dir.path()).await;
        refused_a_copy_then_room(store, coordinator, dir.path()).await;
    }

    async fn refused_a_copy_then_room(
        store: crate::store::Store,
        coordinator: Coordinator,
        dir: &std::path::Path,
    ) {
        let postgres = store.dialect() == crate::store::Dialect::Postgres;
        let plan = json!({"name": "s", "repos": {"app": {"path": "repo"}}, "tasks": [
            {"id": "IMPL-1", "title": "one"}, {"id": "IMPL-2", "title": "two"}]});
        let session = coordinator.create_for_tests(&plan, &dir.join("s")).await;
        let group = super::GroupCommit::new(store.clone());
        // Another copy takes all the room.
        let (_, read) = task_cache::read_back(&store, &session).await;
        let filler = vec![read[0].clone(); super::CACHED_TASKS];
        let other = task_cache::stored("other", filler, &group.budget).expect("it fits alone");

        assert_eq!(
            group.lane(&session),
            "",
            "not known to be without a copy yet"
        );
        let first = group.claim(&claim_one()).await.unwrap();
        assert_eq!(first.len(), 1, "claimed without a copy");
        assert!(group.copy_of(&session).is_none(), "no room for a copy");
        let apart = if postgres { session.as_str() } else { "" };
        assert_eq!(group.lane(&session), apart);

        drop(other);
        let second = group.claim(&claim_one()).await.unwrap();
        assert_eq!(second.len(), 1);
        assert_eq!(
            group.lane(&session),
            "",
            "back on the one lane with its copy"
        );
        assert_ne!(first[0].task.id, second[0].task.id);
        let (_, tasks) = group.copy_of(&session).expect("copied once there was room");
        let (_, read) = task_cache::read_back(&store, &session).await;
        assert_eq!(tasks, read, "the copy is the session as stored");
        assert!(
            tasks
                .iter()
                .all(|task| task.state == pb::TaskState::Running),
            "both tasks claimed: {tasks:?}"
        );
    }

    /// A completion's `claim_next` stays in its session only while the claims queued there
    /// leave a ready task for it: with one ready task left and another claim queued for it,
    /// it goes to the other session instead of coming back empty; with none queued, it stays.
    /// While a group has a flat session's copy out, what the copy told is what decides.
    #[tokio::test]
    async fn claim_next_leaves_a_session_whose_ready_tasks_queued_claims_will_take() {
        let dir = tempfile::tempdir().unwrap();
        let (store, coordinator) = Coordinator::for_tests(dir.path()).await;
        for name in ["a", "b"] {
            let plan = json!({"name": name, "repos": {"app": {"path": "repo"}}, "tasks": [
                {"id": "IMPL-1", "title": "one"}, {"id": "IMPL-2", "title": "two"},
                {"id": "IMPL-3", "title": "three"}]});
            coordinator
                .create_for_tests(&plan, &dir.path().join(name))
                .await;
        }
        let group = super::GroupCommit::new(store.clone());
        let two = ClaimRequest {
            max: 2,
            ..claim_one()
        };
        let leased = group.claim(&two).await.unwrap();
        assert_eq!(leased.len(), 2);
        let here = leased[0].task.session_id.clone();
        let complete = async |task: &Task| {
            group
                .complete(
                    &here,
                    &task.id,
                    task.fencing_token,
                    pb::TaskResult::default(),
                    Some(claim_one()),
                    crate::convert::now_ms(),
                )
                .await
        };

        // One ready task left here, and a claim queued for it.
        let queued = group.demand.queue(&here, 1);
        let (_, next) = complete(&leased[0].task).await.unwrap();
        assert_eq!(next.len(), 1, "not empty-handed");
        let there = next[0].task.session_id.clone();
        assert_ne!(there, here, "sent to the other session");
        drop(queued);
        let (_, next) = complete(&leased[1].task).await.unwrap();
        assert_eq!(next.len(), 1);
        assert_eq!(
            next[0].task.session_id, here,
            "its last ready task, nothing queued"
        );

        // The other session's copy out with a group: two ready tasks, no dependencies.
        let copy = group.sessions().remove(&there).expect("a copy");
        let ready = copy.tasks.as_ref().and_then(TaskCache::ready_alone);
        assert_eq!(ready, Some(2));
        let out = group.demand.take_out(&there, ready);
        assert!(!group.runs_dry(&there, Some("IMPL-1")));
        let queued = group.demand.queue(&there, 2);
        assert!(
            group.runs_dry(&there, Some("IMPL-1")),
            "both ready tasks spoken for"
        );
        drop(out);
        assert!(
            !group.runs_dry(&there, Some("IMPL-1")),
            "unknown once the group is over"
        );
        drop(queued);
        group.keep(vec![(there, copy)]);
    }

    /// A group of two sessions' completions holds both writes back and sends them in one call
    /// (on SQLite one call on the writer, on PostgreSQL one statement). A message logged
    /// behind the group commit's back moved one session's sequence, so that call fails whole:
    /// nothing of either session lands, both copies are put back as they were, and each
    /// session writes again on its own (the moved one as of the message). Each task completes
    /// once, no completion is refused, and each copy is what reading the session back gives.
    /// Also when the writes take more rows than one statement (150 dependents a session).
    #[tokio::test]
    async fn a_group_of_two_sessions_writes_both_or_neither() {
        for dependents in [0, 150] {
            let dir = tempfile::tempdir().unwrap();
            let (store, coordinator) = Coordinator::for_tests(dir.path()).await;
            two_sessions_in_one_group(store, coordinator, dir.path(), true, dependents).await;
        }
    }

    /// [`a_group_of_two_sessions_writes_both_or_neither`] on PostgreSQL
    /// (`TROUPE_TEST_DATABASE_URL`, a schema each), where the two writes are one statement, or
    /// one transaction of a statement a batch: with neither session moved (both land), and
    /// with one moved.
    #[tokio::test]
    async fn a_group_of_two_sessions_writes_both_or_neither_on_postgres() {
        let Some(url) = troupe_testkit::postgres_url() else {
            return;
        };
        for (moved, dependents) in [(false, 0), (true, 0), (false, 150), (true, 150)] {
            let dir = tempfile::tempdir().unwrap();
            let (store, coordinator) = Coordinator::for_tests_on_postgres(&url, dir.path()).await;
            two_sessions_in_one_group(store, coordinator, dir.path(), moved, dependents).await;
        }
    }

    /// Completes a task of each of two sessions in one group, after a message moved the second
    /// session's sequence behind the group commit's back when `moved`; checks what landed.
    /// With `dependents`, each session's first task has that many dependents, which its
    /// completion readies: more rows than one statement takes, so the writes go in batches.
    async fn two_sessions_in_one_group(
        store: crate::store::Store,
        coordinator: Coordinator,
        dir: &std::path::Path,
        moved: bool,
        dependents: usize,
    ) {
        let mut tasks = vec![json!({"id": "IMPL-1", "title": "one"})];
        if dependents == 0 {
            tasks.push(json!({"id": "IMPL-2", "title": "two"}));
        }
        tasks.extend((1..=dependents).map(
            |i| json!({"id": format!("IMPL-D{i}"), "title": "after one", "depends_on": ["IMPL-1"]}),
        ));
        let mut sessions = Vec::new();
        for name in ["a", "b"] {
            let plan = json!({"name": name, "repos": {"app": {"path": "repo"}}, "tasks": tasks});
            sessions.push(coordinator.create_for_tests(&plan, &dir.join(name)).await);
        }
        // A group commit of its own, which reads its copies from the store.
        let group = super::GroupCommit::new(store.clone());
        let request = claim_one();
        // Sessions take turns: one task of each.
        let mut leased = Vec::new();
        for _ in 0..2 {
            let claimed = group.claim(&request).await.unwrap();
            let task = claimed.into_iter().next().expect("a task").task;
            leased.push(task);
        }
        leased.sort_by(|a, b| a.session_id.cmp(&b.session_id));
        let mut ids: Vec<&str> = leased.iter().map(|task| task.session_id.as_str()).collect();
        ids.dedup();
        assert_eq!(ids.len(), 2, "one task of each session");
        if moved {
            let message = NewMessage {
                from: "someone".to_owned(),
                to: "all".to_owned(),
                kind: "note".to_owned(),
                summary: "behind the group's back".to_owned(),
                data: None,
                idempotency_key: None,
            };
            store
                .log_message(&leased[1].session_id, message, crate::convert::now_ms())
                .await
                .unwrap();
        }

        let mut answers = Vec::new();
        let ops = leased
            .iter()
            .map(|task| {
                let (reply, answer) = oneshot::channel();
                answers.push(answer);
                Op::Complete {
                    session_id: task.session_id.clone(),
                    completion: Box::new(Completion {
                        task_id: task.id.clone(),
                        token: task.fencing_token,
                        result: pb::TaskResult {
                            summary: "done".to_owned(),
                            ..Default::default()
                        },
                    }),
                    claim_next: None,
                    elsewhere: None,
                    _queued: None,
                    now: crate::convert::now_ms(),
                    reply,
                }
            })
            .collect();
        group.run(ops).await;
        for answer in answers {
            let (task, _) = answer.await.unwrap().expect("completed");
            assert_eq!(task.state, pb::TaskState::Completed);
        }
        for session_id in &sessions {
            let (mut row, tasks) = group.copy_of(session_id).expect("a copy");
            let (read, cache) = task_cache::read_back(&store, session_id).await;
            // A copy's `updated_at` is not kept (what a group decides never reads it).
            row.updated_at = read.updated_at;
            assert_eq!(row, read, "{session_id}");
            assert_eq!(tasks, cache, "{session_id}");
            let completed = tasks
                .iter()
                .filter(|task| task.state == pb::TaskState::Completed)
                .count();
            assert_eq!(completed, 1, "{session_id}");
            let ready = tasks
                .iter()
                .filter(|task| task.state == pb::TaskState::Ready)
                .count();
            assert_eq!(ready, dependents.max(1), "{session_id}");
            // Intake, a claim, a completion (and the message): each recorded once.
            let events = store.events_after(session_id, 0, 1_000).await.unwrap();
            let sequences: Vec<u64> = events.iter().map(|event| event.sequence).collect();
            let expected: Vec<u64> = (1..=row.last_seq).collect();
            assert_eq!(sequences, expected, "gap-free in {session_id}");
        }
    }
}

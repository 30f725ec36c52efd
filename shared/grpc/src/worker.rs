//! The worker side of the coordinator's lease protocol, shared by every worker service.
//!
//! [`run_worker`] long-polls `ClaimTasks`, runs each claimed task with a [`TaskHandler`] while
//! heartbeating at a third of the lease, and reports the outcome with `CompleteTask` or
//! `FailTask` under the lease's fencing token. A `CompleteTask` also claims the slot's next
//! task (`claim_next`), so a busy worker goes from task to task in one call each.
//!
//! Every call to the coordinator has a deadline ([`WorkerConfig::rpc_timeout`], and for the
//! long-poll its wait plus that margin), enforced on this side too, so a stopped or cut-off
//! coordinator costs a bounded wait. Each attempt keeps a local lease clock: the instant
//! until which its lease is surely valid, the instant the claim or the last confirmed
//! heartbeat was *sent* plus the lease length ([`TaskContext::lease_deadline`]). When
//! that instant passes without a confirmation, or a heartbeat is refused for good (a stale
//! token, an unknown task: anything [`crate::is_transient`] does not call transient), the
//! attempt is over: its [`TaskContext`] is cancelled (the agent stopped), the handler awaited,
//! its result dropped, and nothing reported, because the coordinator may already have handed
//! the task to another attempt. A heartbeat that says "cancelled" cancels the context too,
//! and the handler's failure is reported. Reports retry transient errors until the local
//! deadline, then give the attempt up the same way. A claim answered after a third of its
//! lease or more (a long-poll that waited; a stopped coordinator that answered once it ran
//! again) is confirmed with a heartbeat before its handler starts, since its local clock,
//! counted from the send, has little or nothing left.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use troupe_proto::v1::{
    ClaimTasksRequest, ClaimedTask, CompleteTaskRequest, ErrorKind, FailTaskRequest, Lease, Role,
    Task, TaskError, TaskResult, TestIterationProgress, Usage, WorkProgress,
};

use crate::{Connector, CoordinatorClient, Error, ServiceHealth, is_transient, timed, within};

mod lease;
mod metrics;
pub mod prices;
mod trace;

pub use lease::LeaseLost;
use lease::{Beat, LeaseSpec, LeaseState};

/// A failed attempt: the classified error plus whatever partial result exists.
#[derive(Clone, Debug)]
pub struct TaskFailure {
    /// Why the attempt failed.
    pub error: TaskError,
    /// Reports or logs produced before the failure.
    pub partial: Option<TaskResult>,
}

impl TaskFailure {
    /// A failure of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>, retryable: bool) -> Self {
        Self {
            error: TaskError {
                kind: kind as i32,
                message: message.into(),
                retryable,
                details: Vec::new(),
                ..TaskError::default()
            },
            partial: None,
        }
    }

    /// Adds evidence lines.
    pub fn with_details(mut self, details: impl IntoIterator<Item = String>) -> Self {
        self.error.details.extend(details);
        self
    }

    /// Attaches a partial result.
    pub fn with_partial(mut self, partial: TaskResult) -> Self {
        self.partial = Some(partial);
        self
    }

    /// Names the backend whose provider refused the attempt with a rate limit, and how long it
    /// asked to wait: the coordinator then pauses that backend's claims and puts the task
    /// back without counting the attempt.
    pub fn with_rate_limit(
        mut self,
        backend: impl Into<String>,
        retry_after: Option<Duration>,
    ) -> Self {
        self.error.rate_limited_backend = backend.into();
        self.error.retry_after_ms = retry_after.map_or(0, |after| {
            u64::try_from(after.as_millis()).unwrap_or(u64::MAX)
        });
        self
    }
}

/// What a worker does with one claimed task.
pub trait TaskHandler: Send + Sync + 'static {
    /// Runs the task. Return promptly once `ctx.cancelled()` fires.
    fn handle(
        &self,
        task: ClaimedTask,
        ctx: TaskContext,
    ) -> impl Future<Output = Result<TaskResult, TaskFailure>> + Send;
}

/// A running task's link to the worker loop.
#[derive(Clone, Debug)]
pub struct TaskContext {
    cancel: CancellationToken,
    progress: Arc<Mutex<Option<String>>>,
    figures: Arc<Mutex<Figures>>,
    worker_id: Arc<str>,
    lease: Option<Arc<LeaseState>>,
    /// The deadline a context outside any lease reports: far enough to never matter.
    unleased_until: Instant,
}

impl TaskContext {
    /// A context outside any lease, for direct RPC runs and tests of handlers: cancelled only
    /// through `cancel`; [`TaskContext::confirm_lease`] always succeeds, with a far-future
    /// deadline, and the fencing token and attempt are 0.
    pub fn unleased(worker_id: impl Into<Arc<str>>, cancel: CancellationToken) -> Self {
        Self {
            cancel,
            progress: Arc::new(Mutex::new(None)),
            figures: Arc::new(Mutex::new(Figures::default())),
            worker_id: worker_id.into(),
            lease: None,
            // About thirty years, as tokio's own "far future".
            unleased_until: Instant::now() + Duration::from_secs(86_400 * 365 * 30),
        }
    }

    fn leased(worker_id: Arc<str>, cancel: CancellationToken, lease: Arc<LeaseState>) -> Self {
        Self {
            lease: Some(lease),
            ..Self::unleased(worker_id, cancel)
        }
    }

    /// Cancelled when the coordinator cancels the task, the lease is lost, or the worker stops.
    pub fn cancelled(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Records a short progress note, sent with the next heartbeat.
    pub fn progress(&self, note: impl Into<String>) {
        if let Ok(mut slot) = self.progress.lock() {
            *slot = Some(note.into());
        }
    }

    /// Records the attempt's token usage so far (the total, not an increment), sent with the
    /// next heartbeat.
    pub fn report_tokens(&self, tokens: Usage) {
        self.update_figures(|figures| figures.tokens = Some(tokens));
    }

    /// Records the backend the attempt's agent runs on now, sent with the next heartbeat.
    pub fn report_backend(&self, backend: &str) {
        self.update_figures(|figures| backend.clone_into(&mut figures.backend));
    }

    /// Records the latest test run of a test-runner's fix loop, sent with the next heartbeat.
    pub fn report_test(&self, test: TestIterationProgress) {
        self.update_figures(|figures| figures.test = Some(test));
    }

    /// The figures recorded so far (what the next heartbeat sends, or the last one sent).
    pub fn figures(&self) -> WorkProgress {
        self.figures
            .lock()
            .map(|slot| slot.latest.clone())
            .unwrap_or_default()
    }

    fn update_figures(&self, change: impl FnOnce(&mut WorkProgress)) {
        if let Ok(mut slot) = self.figures.lock() {
            let before = slot.latest.clone();
            change(&mut slot.latest);
            slot.unsent |= slot.latest != before;
        }
    }

    /// The figures, when they changed since the last heartbeat that carried them.
    fn take_figures(&self) -> Option<WorkProgress> {
        let mut slot = self.figures.lock().ok()?;
        std::mem::take(&mut slot.unsent).then(|| slot.latest.clone())
    }

    /// Marks the figures unsent again after a heartbeat that did not deliver them.
    fn restore_figures(&self, sent: Option<WorkProgress>) {
        if sent.is_some()
            && let Ok(mut slot) = self.figures.lock()
        {
            slot.unsent = true;
        }
    }

    /// The worker's id.
    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    /// Confirms with the coordinator, now, that this attempt still holds its lease (a
    /// heartbeat), and returns the local instant until which it surely holds it.
    ///
    /// Call it right before an effect that must happen under the lease (publishing a commit),
    /// and finish the effect before the instant returned. Transient errors (the coordinator
    /// restarting, a call timing out) are retried with backoff while the lease lasts, so this
    /// can take until the current [`TaskContext::lease_deadline`]; it then fails with
    /// [`LeaseLost::Unreachable`]. A refusal fails at once ([`LeaseLost::StaleToken`],
    /// [`LeaseLost::Refused`]) and ends the attempt, as does a lapsed lease
    /// ([`LeaseLost::Expired`]); a cancelled task fails with [`LeaseLost::Cancelled`] and
    /// cancels this context. A confirmation also counts as the attempt's heartbeat.
    pub async fn confirm_lease(&self) -> Result<Instant, LeaseLost> {
        match &self.lease {
            Some(lease) => lease.confirm(&self.cancel).await,
            None => Ok(self.unleased_until),
        }
    }

    /// The local instant until which the lease is surely valid (last confirmation + lease
    /// length); far in the future outside a lease.
    pub fn lease_deadline(&self) -> Instant {
        self.lease
            .as_ref()
            .map_or(self.unleased_until, |lease| lease.deadline())
    }

    /// The attempt's fencing token (0 outside a lease).
    pub fn fencing_token(&self) -> u64 {
        self.lease.as_ref().map_or(0, |lease| lease.fencing_token())
    }

    /// The attempt number (1-based; 0 outside a lease).
    pub fn attempt(&self) -> u32 {
        self.lease.as_ref().map_or(0, |lease| lease.attempt())
    }

    fn take_progress(&self) -> String {
        self.progress
            .lock()
            .ok()
            .and_then(|mut slot| slot.take())
            .unwrap_or_default()
    }

    /// Puts back a note a failed heartbeat did not deliver, unless a newer one came meanwhile.
    fn restore_progress(&self, note: String) {
        if note.is_empty() {
            return;
        }
        if let Ok(mut slot) = self.progress.lock() {
            slot.get_or_insert(note);
        }
    }
}

/// The typed figures of a running attempt, and whether the coordinator has the latest.
#[derive(Debug, Default)]
struct Figures {
    latest: WorkProgress,
    unsent: bool,
}

/// How a worker loop runs.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// Coordinator to claim from, such as `http://127.0.0.1:7070`.
    pub coordinator_url: String,
    /// Stable id of this worker.
    pub worker_id: String,
    /// Roles this worker handles.
    pub roles: Vec<Role>,
    /// Tasks run at once.
    pub concurrency: usize,
    /// Lease length requested per claim; heartbeats come every third of it.
    pub lease: Duration,
    /// Longest long-poll per claim.
    pub poll_wait: Duration,
    /// How long running tasks get to stop and report after shutdown begins.
    pub drain_timeout: Duration,
    /// Deadline of each call to the coordinator; a long-poll gets its wait plus this, and a
    /// call under a lease (heartbeat, report) never waits past the lease's local deadline.
    pub rpc_timeout: Duration,
    /// Credentials and TLS of the calls to the coordinator.
    pub connector: Connector,
    /// Where the files plans bring along are kept (`<dir>/<digest>/`); a claimed task's
    /// `plan_dir` becomes its bundle's directory there. `None` leaves `plan_dir` as the claim
    /// gives it (the submitting machine's directory).
    pub assets_dir: Option<std::path::PathBuf>,
    /// The service's health entry: NOT_SERVING after [`UNREACHABLE_AFTER`] claims in a row
    /// fail, SERVING again at the next that succeeds, so a probe sees a worker that cannot
    /// reach its coordinator.
    pub health: Option<ServiceHealth>,
    /// What this worker offers, sent with every claim (`ClaimTasksRequest.capabilities`):
    /// `backend:<name>` for each agent backend it can run here; the coordinator routes tasks
    /// by them. Empty: the worker declares none and may be given any task of its roles.
    pub capabilities: Vec<String>,
    /// The backend this worker runs tasks that leave the choice to it (auto) on, sent with
    /// each claim: the provider quota such tasks count against ('' for none).
    pub auto_backend: String,
}

/// Failed claims in a row after which a worker reports its service NOT_SERVING: one failure
/// may be a blip; three in a row, backing off between them, are an outage. Only claims count:
/// a worker whose slots are all busy makes none until a task ends.
pub const UNREACHABLE_AFTER: u32 = 3;

impl WorkerConfig {
    /// Defaults for `roles` against `coordinator_url`: one task at a time, 30 s leases, 10 s
    /// polls, 10 s call deadlines.
    pub fn new(
        coordinator_url: impl Into<String>,
        worker_id: impl Into<String>,
        roles: Vec<Role>,
    ) -> Self {
        let tuning = WorkerTuning::default();
        Self {
            coordinator_url: coordinator_url.into(),
            worker_id: worker_id.into(),
            roles,
            concurrency: 1,
            lease: Duration::from_secs_f64(tuning.lease_seconds),
            poll_wait: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(10),
            rpc_timeout: Duration::from_secs_f64(tuning.rpc_timeout_seconds),
            connector: Connector::default(),
            assets_dir: None,
            health: None,
            capabilities: Vec::new(),
            auto_backend: String::new(),
        }
    }

    /// Applies `tuning` (lease and call deadline), refusing values that are not positive.
    pub fn tuned(mut self, tuning: &WorkerTuning) -> Result<Self, Error> {
        self.lease = tuning.lease()?;
        self.rpc_timeout = tuning.rpc_timeout()?;
        Ok(self)
    }
}

fn positive_seconds(flag: &str, seconds: f64) -> Result<Duration, Error> {
    Duration::try_from_secs_f64(seconds)
        .ok()
        .filter(|duration| !duration.is_zero())
        .ok_or_else(|| Error::Config(format!("{flag} must be a positive number, not {seconds}")))
}

/// The worker settings every worker service takes as flags (or `TROUPE_WORKER_*` variables).
#[derive(Clone, Debug, clap::Args)]
pub struct WorkerTuning {
    /// Lease length asked for each claimed task (the coordinator grants 1 to 600 s);
    /// heartbeats go every third of it. An attempt that cannot confirm its lease for this
    /// long stops its task and abandons it.
    #[arg(long, env = "TROUPE_WORKER_LEASE_SECONDS", default_value_t = 30.0)]
    pub lease_seconds: f64,
    /// Deadline of each call to the coordinator (heartbeats and reports never wait past the
    /// lease; a claim's long-poll gets its wait plus this).
    #[arg(
        long,
        env = "TROUPE_WORKER_RPC_TIMEOUT_SECONDS",
        default_value_t = 10.0
    )]
    pub rpc_timeout_seconds: f64,
    /// Credentials for private repositories, by URL prefix: a TOML file of `[[remote]]` rules
    /// (`prefix` plus `token_file`, `token_env` or `ssh_key_file`; see docs/distributed.md). Never
    /// taken from a plan.
    #[arg(long, env = "TROUPE_GIT_CREDENTIALS")]
    pub git_credentials: Option<std::path::PathBuf>,
    /// Price table the cost metrics count by: a TOML file of USD per million tokens per model
    /// (`[models."<name>"]` with `input`, `output`, optional `cached_input`; see
    /// docs/operating.md). Without it no cost is counted.
    #[arg(long, env = "TROUPE_MODEL_PRICES")]
    pub model_prices: Option<std::path::PathBuf>,
}

impl WorkerTuning {
    /// The lease length; an error unless positive.
    pub fn lease(&self) -> Result<Duration, Error> {
        positive_seconds("--lease-seconds", self.lease_seconds)
    }

    /// The call deadline; an error unless positive.
    pub fn rpc_timeout(&self) -> Result<Duration, Error> {
        positive_seconds("--rpc-timeout-seconds", self.rpc_timeout_seconds)
    }
}

impl Default for WorkerTuning {
    fn default() -> Self {
        Self {
            lease_seconds: 30.0,
            rpc_timeout_seconds: 10.0,
            git_credentials: None,
            // `troupe up` builds its workers' tuning by default: the table still comes from
            // the environment there.
            model_prices: std::env::var_os("TROUPE_MODEL_PRICES")
                .filter(|path| !path.is_empty())
                .map(std::path::PathBuf::from),
        }
    }
}

/// What a worker loop did, returned when it stops.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Tasks leased by `ClaimTasks` long-polls.
    pub claimed: u64,
    /// Tasks leased by a `CompleteTask`'s `claim_next`.
    pub claimed_next: u64,
    /// Tasks whose `CompleteTask` the coordinator took.
    pub completed: u64,
    /// Tasks whose `FailTask` the coordinator took.
    pub failed: u64,
    /// Attempts given up because their lease was lost (a refused heartbeat or report, or no
    /// confirmation until the local deadline), their result dropped. A report retried after
    /// a lost answer is refused as stale and counts here although its first try landed.
    pub abandoned: u64,
}

/// [`WorkerStats`] as the loop and its tasks count them.
#[derive(Debug, Default)]
struct Counters {
    claimed: AtomicU64,
    claimed_next: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    abandoned: AtomicU64,
}

impl Counters {
    fn add(counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }

    fn stats(&self) -> WorkerStats {
        WorkerStats {
            claimed: self.claimed.load(Ordering::Relaxed),
            claimed_next: self.claimed_next.load(Ordering::Relaxed),
            completed: self.completed.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            abandoned: self.abandoned.load(Ordering::Relaxed),
        }
    }
}

/// A worker service's loop as its flags describe it.
#[derive(Clone, Debug)]
pub struct WorkerSettings<'a> {
    /// The coordinator to claim from; `None` runs no loop.
    pub coordinator_url: Option<String>,
    /// The worker id (default `<role>-<hostname>-<pid>`).
    pub worker_id: Option<String>,
    /// The role claimed.
    pub role: Role,
    /// Tasks run at once (at least 1).
    pub concurrency: usize,
    /// Lease and call deadlines.
    pub tuning: &'a WorkerTuning,
    /// Credentials of the calls to the coordinator.
    pub connector: &'a Connector,
    /// The service's data directory: the files plans bring along go to `<dir>/assets`.
    pub data_dir: &'a std::path::Path,
    /// The service's health entry, flipped while the coordinator cannot be reached.
    pub health: Option<ServiceHealth>,
    /// What the worker offers (see [`WorkerConfig::capabilities`]).
    pub capabilities: Vec<String>,
    /// The backend auto tasks run on here ('' for none), see [`WorkerConfig::auto_backend`].
    pub auto_backend: String,
}

/// Runs the worker loop when a coordinator URL is configured; otherwise the service only
/// answers its own RPCs, and this waits for `shutdown`.
pub async fn run_worker_if_configured<H: TaskHandler>(
    settings: WorkerSettings<'_>,
    handler: Arc<H>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let Some(url) = settings.coordinator_url else {
        shutdown.cancelled().await;
        return Ok(());
    };
    if let Some(path) = &settings.tuning.model_prices {
        prices::set(prices::Prices::load(path)?);
    }
    let role_name = metrics::role_name(settings.role);
    let worker_id = settings
        .worker_id
        .unwrap_or_else(|| default_worker_id(role_name));
    let mut config =
        WorkerConfig::new(url, worker_id, vec![settings.role]).tuned(settings.tuning)?;
    config.concurrency = settings.concurrency.max(1);
    config.connector = settings.connector.clone();
    config.assets_dir = Some(settings.data_dir.join("assets"));
    config.health = settings.health;
    config.capabilities = settings.capabilities;
    config.auto_backend = settings.auto_backend;
    run_worker(config, handler, shutdown).await.map(drop)
}

/// Points the claim's `plan_dir` at the files its plan brought, fetched into this worker's
/// assets directory on first use.
async fn with_assets(
    config: &WorkerConfig,
    client: &CoordinatorClient,
    claimed: &mut ClaimedTask,
) -> Result<(), TaskFailure> {
    let (Some(dir), false) = (&config.assets_dir, claimed.assets_digest.is_empty()) else {
        return Ok(());
    };
    let outcome = crate::assets::materialize(client, dir, &claimed.assets_digest).await;
    match outcome {
        Ok(local) => {
            claimed.plan_dir = local.display().to_string();
            Ok(())
        }
        Err(err) => Err(TaskFailure::new(ErrorKind::Internal, err.to_string(), true)),
    }
}

/// Returns `<role>-<hostname>-<pid>`, the default worker id.
pub fn default_worker_id(role: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_owned())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".to_owned());
    format!("{role}-{host}-{}", std::process::id())
}

/// Registers the worker loop's metric families, so a scrape shows them before the loop
/// starts (a worker may first spend seconds probing its backends).
pub fn register_metrics() {
    metrics::register();
}

/// Claims and runs tasks with `handler` until `shutdown` is cancelled, then cancels running
/// tasks and waits up to `drain_timeout` for them to report. Returns what it did.
pub async fn run_worker<H: TaskHandler>(
    config: WorkerConfig,
    handler: Arc<H>,
    shutdown: CancellationToken,
) -> Result<WorkerStats, Error> {
    if config.rpc_timeout.is_zero() || config.lease.is_zero() {
        return Err(Error::Config(
            "the worker's lease and call deadline must be positive".to_owned(),
        ));
    }
    metrics::register();
    let slot = Arc::new(Slot {
        client: config
            .connector
            .coordinator_client(&config.coordinator_url)?,
        config: Arc::new(config),
        handler,
        shutdown: shutdown.clone(),
        counters: Counters::default(),
    });
    let config = &slot.config;
    let mut running: JoinSet<()> = JoinSet::new();
    let mut backoff = RECONNECT.retries();
    let mut failed_claims = 0u32;
    tracing::info!(worker_id = %config.worker_id, roles = ?config.roles, coordinator = %config.coordinator_url, lease = ?config.lease, rpc_timeout = ?config.rpc_timeout, "worker started");

    while !shutdown.is_cancelled() {
        // Finished tasks still count in the set until joined; reap them so slots are freed.
        while running.try_join_next().is_some() {}
        let free = config.concurrency.saturating_sub(running.len());
        if free == 0 {
            tokio::select! {
                _ = running.join_next() => {}
                () = shutdown.cancelled() => break,
            }
            continue;
        }
        let request = claim_request(config, free, Some(config.poll_wait));
        // The long-poll may legitimately take its whole wait; the margin is for the answer.
        let timeout = config.poll_wait + config.rpc_timeout;
        let sent = Instant::now();
        let claim = {
            let mut client = slot.client.clone();
            async move { within(timeout, client.claim_tasks(timed(request, timeout))).await }
        };
        // Abandon a claim in flight only at its deadline or on shutdown: the coordinator may
        // already have leased tasks to it, and a dropped answer leaves them under a lease
        // nobody holds until it expires.
        let response = tokio::select! {
            response = claim => response,
            () = shutdown.cancelled() => break,
        };
        match response {
            Ok(response) => {
                backoff.reset();
                if failed_claims >= UNREACHABLE_AFTER {
                    tracing::info!(
                        after = failed_claims,
                        "coordinator reachable again, reporting SERVING"
                    );
                    set_health(config, true, &shutdown).await;
                }
                failed_claims = 0;
                let tasks = response.tasks;
                Counters::add(&slot.counters.claimed, tasks.len());
                for task in tasks {
                    running.spawn(run_slot(Arc::clone(&slot), task, sent));
                }
            }
            Err(status) => {
                let delay = backoff.next_delay();
                tracing::warn!(code = ?status.code(), error = %status.message(), retry_in = ?delay, "claim failed");
                failed_claims = failed_claims.saturating_add(1);
                if failed_claims == UNREACHABLE_AFTER {
                    tracing::warn!(
                        failed_claims,
                        "coordinator unreachable, reporting NOT_SERVING until a claim succeeds"
                    );
                    set_health(config, false, &shutdown).await;
                }
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = shutdown.cancelled() => break,
                }
            }
        }
    }

    // Running tasks saw the same shutdown token; give them a bounded time to report.
    let drained = tokio::time::timeout(config.drain_timeout, async {
        while running.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(worker_id = %config.worker_id, left = running.len(), "tasks did not stop in time, abandoning their leases");
        running.abort_all();
    }
    let stats = slot.counters.stats();
    tracing::info!(worker_id = %config.worker_id, claimed = stats.claimed, claimed_next = stats.claimed_next, completed = stats.completed, failed = stats.failed, abandoned = stats.abandoned, "worker stopped");
    Ok(stats)
}

/// Reports the worker's service SERVING or not, unless shutdown has begun: the server says
/// NOT_SERVING then, and a claim answered late must not undo it.
async fn set_health(config: &WorkerConfig, serving: bool, shutdown: &CancellationToken) {
    if let (Some(health), false) = (&config.health, shutdown.is_cancelled()) {
        health.set(serving).await;
    }
}

/// What a worker loop's slots share.
struct Slot<H> {
    client: CoordinatorClient,
    config: Arc<WorkerConfig>,
    handler: Arc<H>,
    shutdown: CancellationToken,
    counters: Counters,
}

/// A `ClaimTasks` request of this worker for up to `max` tasks.
fn claim_request(config: &WorkerConfig, max: usize, wait: Option<Duration>) -> ClaimTasksRequest {
    ClaimTasksRequest {
        worker_id: config.worker_id.clone(),
        roles: config.roles.iter().map(|role| *role as i32).collect(),
        capabilities: config.capabilities.clone(),
        max_tasks: u32::try_from(max).unwrap_or(u32::MAX),
        wait: wait.map(duration_proto),
        lease_duration: Some(duration_proto(config.lease)),
        auto_backend: config.auto_backend.clone(),
    }
}

/// One slot of the worker: runs `claimed` (leased by a call sent at `sent`), then each task
/// its completion claimed next, until a completion brings none.
async fn run_slot<H: TaskHandler>(slot: Arc<Slot<H>>, claimed: ClaimedTask, sent: Instant) {
    let mut queue = std::collections::VecDeque::from([(claimed, sent)]);
    while let Some((claimed, sent)) = queue.pop_front() {
        let next = run_one(&slot, claimed, sent).await;
        if let Some((next, sent)) = next {
            Counters::add(&slot.counters.claimed_next, next.len());
            queue.extend(next.into_iter().map(|task| (task, sent)));
        }
    }
}

/// The tasks a completion claimed next, with the instant the completion was sent.
type Next = Option<(Vec<ClaimedTask>, Instant)>;

/// Runs one claimed task; returns the tasks its completion claimed next.
async fn run_one<H: TaskHandler>(slot: &Slot<H>, claimed: ClaimedTask, sent: Instant) -> Next {
    let Some(task) = claimed.task.clone() else {
        tracing::warn!("claimed task without a task body, ignoring");
        return None;
    };
    let Some(lease) = claimed.lease else {
        tracing::warn!(task_id = %task.id, "claimed task without a lease, ignoring");
        return None;
    };
    let span = troupe_telemetry::spans::attempt_span(
        troupe_telemetry::spans::AttemptIds {
            session_id: &task.session_id,
            task_id: &task.id,
            attempt: lease.attempt,
            role: metrics::role_name(task.role()),
        },
        &claimed.traceparent,
    );
    run_leased(slot, claimed, task, lease, sent)
        .instrument(span)
        .await
}

async fn run_leased<H: TaskHandler>(
    slot: &Slot<H>,
    claimed: ClaimedTask,
    task: Task,
    lease: Lease,
    sent: Instant,
) -> Next {
    let Slot {
        client,
        config,
        handler,
        shutdown,
        counters,
    } = slot;
    let cancel = shutdown.child_token();
    let held = Arc::new(LeaseState::new(LeaseSpec {
        client: client.clone(),
        session_id: task.session_id.clone(),
        task_id: task.id.clone(),
        fencing_token: lease.fencing_token,
        attempt: lease.attempt,
        requested: config.lease,
        rpc_timeout: config.rpc_timeout,
        sent,
    }));
    if held.clock().next_beat() <= Instant::now() {
        // The claim answered late: its local lease is short or gone; confirm it first.
        if let Err(lost) = held.revalidate().await {
            tracing::warn!(reason = %lost, "attempt abandoned before it started: its late claim could not be confirmed");
            Counters::add(&counters.abandoned, 1);
            return None;
        }
        tracing::info!(claim_sent_ago = ?sent.elapsed(), "late claim confirmed before starting");
    }
    let ctx = TaskContext::leased(
        Arc::from(config.worker_id.as_str()),
        cancel.clone(),
        Arc::clone(&held),
    );
    let mut claimed = claimed;
    let began = Instant::now();
    let assets = with_assets(config, client, &mut claimed).await;
    let outcome = {
        let handle = async {
            match assets {
                Ok(()) => handler.handle(claimed, ctx.clone()).await,
                Err(failure) => Err(failure),
            }
        };
        let keeper = keep_lease(&held, &ctx);
        tokio::pin!(handle);
        tokio::pin!(keeper);
        tokio::select! {
            outcome = &mut handle => Some(outcome),
            lost = &mut keeper => {
                // The lease is gone: stop the work, and still wait for the handler so no
                // child outlives the attempt.
                tracing::warn!(reason = %lost, "lease lost, stopping the task");
                cancel.cancel();
                let _ = handle.await;
                None
            }
        }
    };
    // The handler may also have returned after the deadline, or after a refusal it saw.
    let lost = held.check();
    let (Some(outcome), None) = (outcome, &lost) else {
        let reason = lost.unwrap_or(LeaseLost::Expired);
        tracing::warn!(reason = %reason, "attempt abandoned: its lease is lost, the result is dropped");
        Counters::add(&counters.abandoned, 1);
        metrics::attempt(&task, began.elapsed(), &metrics::Outcome::Abandoned);
        trace::attempt(&metrics::Outcome::Abandoned, &reason.to_string());
        return None;
    };

    match outcome {
        Ok(result) => {
            let result = without_secrets(result);
            metrics::attempt(
                &task,
                began.elapsed(),
                &metrics::Outcome::Completed(&result),
            );
            trace::attempt(&metrics::Outcome::Completed(&result), "");
            // The slot's next task comes with the completion, unless the worker is stopping.
            let claim_next = (!shutdown.is_cancelled()).then(|| claim_request(config, 1, None));
            let mut request = CompleteTaskRequest {
                session_id: task.session_id.clone(),
                task_id: task.id.clone(),
                fencing_token: lease.fencing_token,
                result: Some(result),
                claim_next,
            };
            let answer = report("CompleteTask", &held, counters, |timeout| {
                let mut client = client.clone();
                let sent = request.clone();
                // A retry claims nothing: if the first call committed after all (its answer
                // lost), the retry is refused as stale, and what the first call claimed waits
                // out its lease, as with a lost `ClaimTasks` answer.
                request.claim_next = None;
                async move { client.complete_task(timed(sent, timeout)).await }
            })
            .await;
            let (answer, sent) = answer?;
            Counters::add(&counters.completed, 1);
            tracing::info!("task completed");
            Some((answer.next, sent))
        }
        Err(mut failure) => {
            failure.error = without_secrets(failure.error);
            failure.partial = failure.partial.map(without_secrets);
            if shutdown.is_cancelled() {
                // Stopped by our own shutdown, not by the task: let another worker retry it.
                failure.error.retryable = true;
            }
            tracing::warn!(kind = ?failure.error.kind(), error = %failure.error.message, "task failed");
            let outcome = metrics::Outcome::Failed(failure.error.kind(), failure.partial.as_ref());
            metrics::attempt(&task, began.elapsed(), &outcome);
            trace::attempt(&outcome, &failure.error.message);
            let request = FailTaskRequest {
                session_id: task.session_id.clone(),
                task_id: task.id.clone(),
                fencing_token: lease.fencing_token,
                error: Some(failure.error),
                partial_result: failure.partial,
            };
            let answer = report("FailTask", &held, counters, |timeout| {
                let mut client = client.clone();
                let request = request.clone();
                async move { client.fail_task(timed(request, timeout)).await }
            })
            .await;
            if answer.is_some() {
                Counters::add(&counters.failed, 1);
            }
            None
        }
    }
}

/// Sends a report under `lease`, retrying transient failures with backoff until the lease's
/// local deadline; `call` gets the deadline of each try. A refused report (stale token) is
/// logged and dropped; one still unanswered at the deadline abandons the attempt. Returns the
/// answer and the instant its call was sent.
async fn report<F, Fut, T>(
    rpc: &'static str,
    lease: &LeaseState,
    counters: &Counters,
    mut call: F,
) -> Option<(T, Instant)>
where
    F: FnMut(Duration) -> Fut,
    Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let mut backoff = RECONNECT.retries();
    loop {
        let sent = Instant::now();
        let Some(left) = lease.clock().remaining(sent) else {
            tracing::error!(
                rpc,
                "the lease expired before the report landed: attempt abandoned, the task will be retried"
            );
            lease.mark_lost(LeaseLost::Expired);
            Counters::add(&counters.abandoned, 1);
            return None;
        };
        let timeout = lease.rpc_timeout().min(left);
        match within(timeout, call(timeout)).await {
            Ok(answer) => return Some((answer, sent)),
            Err(status) if is_transient(&status) => {
                let delay = backoff
                    .next_delay()
                    .min(lease.clock().remaining(Instant::now()).unwrap_or_default());
                tracing::warn!(rpc, code = ?status.code(), error = %status.message(), retry_in = ?delay, "report failed, retrying while the lease lasts");
                tokio::time::sleep(delay).await;
            }
            Err(status) => {
                tracing::warn!(rpc, code = ?status.code(), error = %status.message(), "report refused, attempt abandoned");
                lease.mark_lost(LeaseLost::from_refusal(&status));
                Counters::add(&counters.abandoned, 1);
                return None;
            }
        }
    }
}

/// Keeps the lease: heartbeats every third of it (counted from the last confirmation), and
/// retries transient failures with backoff. Returns only once the lease is lost: a refusal,
/// the local deadline passing without a confirmation, or a loss [`TaskContext::confirm_lease`]
/// saw; the caller drops it when the task finishes first.
async fn keep_lease(lease: &LeaseState, ctx: &TaskContext) -> LeaseLost {
    let mut backoff = RECONNECT.retries();
    let mut next = lease.clock().next_beat();
    loop {
        tokio::select! {
            () = tokio::time::sleep_until(next.min(lease.deadline())) => {}
            lost = lease.lost() => return lost,
        }
        if let Some(lost) = lease.check() {
            return lost;
        }
        if Instant::now() < next {
            // Woken at a deadline that `confirm_lease` has moved since: not time yet.
            continue;
        }
        let progress = ctx.take_progress();
        let figures = ctx.take_figures();
        match lease.heartbeat(progress.clone(), figures.clone()).await {
            Beat::Answered { cancel: false } => {
                backoff.reset();
                next = lease.clock().next_beat();
            }
            Beat::Answered { cancel: true } => {
                // The coordinator does not extend a cancelled task's lease; the handler
                // should stop and report well before it lapses.
                backoff.reset();
                next = Instant::now() + lease.clock().beat();
                if !ctx.cancel.is_cancelled() {
                    tracing::info!("coordinator cancelled the task");
                    ctx.cancel.cancel();
                }
            }
            Beat::Transient(status) => {
                ctx.restore_progress(progress);
                ctx.restore_figures(figures);
                let delay = backoff.next_delay();
                tracing::warn!(code = ?status.code(), error = %status.message(), retry_in = ?delay, "heartbeat failed; the lease holds until its deadline");
                next = Instant::now() + delay;
            }
            Beat::Lost(lost) => return lost,
        }
    }
}

fn duration_proto(duration: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(duration.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(duration.subsec_nanos()).unwrap_or(0),
    }
}

/// How a worker waits between failed calls to the coordinator.
pub(crate) const RECONNECT: crate::Backoff =
    crate::Backoff::new(Duration::from_millis(200), Duration::from_secs(5));

/// `message` with every known secret masked (same length, so the encoding stays valid): an
/// agent that printed its API key does not put it in the store, a summary or an export.
fn without_secrets<M: prost::Message + Default>(message: M) -> M {
    let mut bytes = message.encode_to_vec();
    if !troupe_telemetry::redact_bytes(&mut bytes) {
        return message;
    }
    M::decode(bytes.as_slice()).unwrap_or(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_context_outside_any_lease_always_confirms() {
        let cancel = CancellationToken::new();
        let ctx = TaskContext::unleased("direct", cancel.clone());
        let far = Instant::now() + Duration::from_secs(86_400 * 365);
        assert_eq!(ctx.confirm_lease().await, Ok(ctx.lease_deadline()));
        assert!(ctx.lease_deadline() > far);
        assert_eq!((ctx.fencing_token(), ctx.attempt()), (0, 0));
        assert_eq!(ctx.worker_id(), "direct");
        cancel.cancel();
        assert!(ctx.cancelled().is_cancelled());
    }

    #[test]
    fn tuning_refuses_what_is_not_a_positive_duration() {
        let config = WorkerConfig::new("http://127.0.0.1:1", "w", vec![Role::Executor]);
        let tuned = config
            .clone()
            .tuned(&WorkerTuning {
                lease_seconds: 3.0,
                rpc_timeout_seconds: 0.5,
                ..WorkerTuning::default()
            })
            .expect("valid");
        assert_eq!(
            (tuned.lease, tuned.rpc_timeout),
            (Duration::from_secs(3), Duration::from_millis(500))
        );
        for (lease, rpc) in [(0.0, 1.0), (30.0, -1.0), (f64::NAN, 1.0)] {
            let err = config
                .clone()
                .tuned(&WorkerTuning {
                    lease_seconds: lease,
                    rpc_timeout_seconds: rpc,
                    ..WorkerTuning::default()
                })
                .expect_err("refused");
            assert!(
                err.to_string().contains("must be a positive number"),
                "{err}"
            );
        }
    }

    #[test]
    fn default_worker_id_names_role_and_pid() {
        let id = default_worker_id("executor");
        assert!(id.starts_with("executor-"));
        assert!(id.ends_with(&std::process::id().to_string()));
    }
}

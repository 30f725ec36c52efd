//! The worker side of the coordinator's lease protocol, shared by every worker service.
//!
//! [`run_worker`] long-polls `ClaimTasks`, runs each claimed task with a [`TaskHandler`] while
//! heartbeating at a third of the lease, and reports the outcome with `CompleteTask` or
//! `FailTask` under the lease's fencing token. A `CompleteTask` also claims the slot's next
//! task (`claim_next`), so a busy worker goes from task to task in one call each. A heartbeat
//! that says "cancelled" or a lost lease cancels the task's [`TaskContext`]; a lost lease also
//! drops the result, because the coordinator has already handed the task to someone else.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use troupe_proto::v1::{
    ClaimTasksRequest, ClaimedTask, CompleteTaskRequest, ErrorKind, FailTaskRequest,
    HeartbeatRequest, Lease, Role, Task, TaskError, TaskResult,
};

use crate::{CoordinatorClient, Error, coordinator_client, is_transient};

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
    worker_id: Arc<str>,
}

impl TaskContext {
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

    /// The worker's id.
    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    fn take_progress(&self) -> String {
        self.progress
            .lock()
            .ok()
            .and_then(|mut slot| slot.take())
            .unwrap_or_default()
    }
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
}

impl WorkerConfig {
    /// Defaults for `roles` against `coordinator_url`: one task at a time, 30 s leases, 10 s polls.
    pub fn new(
        coordinator_url: impl Into<String>,
        worker_id: impl Into<String>,
        roles: Vec<Role>,
    ) -> Self {
        Self {
            coordinator_url: coordinator_url.into(),
            worker_id: worker_id.into(),
            roles,
            concurrency: 1,
            lease: Duration::from_secs(30),
            poll_wait: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(10),
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
}

/// [`WorkerStats`] as the loop and its tasks count them.
#[derive(Debug, Default)]
struct Counters {
    claimed: AtomicU64,
    claimed_next: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
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
        }
    }
}

/// Runs the worker loop when a coordinator URL is configured; otherwise the service only
/// answers its own RPCs, and this waits for `shutdown`.
pub async fn run_worker_if_configured<H: TaskHandler>(
    coordinator_url: Option<String>,
    worker_id: Option<String>,
    role: Role,
    concurrency: usize,
    handler: Arc<H>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let Some(url) = coordinator_url else {
        shutdown.cancelled().await;
        return Ok(());
    };
    let role_name = match role {
        Role::Executor => "executor",
        Role::Validator => "validator",
        Role::TestRunner => "test-runner",
        Role::Unspecified => "worker",
    };
    let worker_id = worker_id.unwrap_or_else(|| default_worker_id(role_name));
    let mut config = WorkerConfig::new(url, worker_id, vec![role]);
    config.concurrency = concurrency.max(1);
    run_worker(config, handler, shutdown).await.map(drop)
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

/// Claims and runs tasks with `handler` until `shutdown` is cancelled, then cancels running
/// tasks and waits up to `drain_timeout` for them to report. Returns what it did.
pub async fn run_worker<H: TaskHandler>(
    config: WorkerConfig,
    handler: Arc<H>,
    shutdown: CancellationToken,
) -> Result<WorkerStats, Error> {
    let slot = Arc::new(Slot {
        client: coordinator_client(&config.coordinator_url)?,
        config: Arc::new(config),
        handler,
        shutdown: shutdown.clone(),
        counters: Counters::default(),
    });
    let config = &slot.config;
    let mut running: JoinSet<()> = JoinSet::new();
    let mut backoff = Backoff::new();
    tracing::info!(worker_id = %config.worker_id, roles = ?config.roles, coordinator = %config.coordinator_url, "worker started");

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
        let claim = {
            let mut client = slot.client.clone();
            async move { client.claim_tasks(request).await }
        };
        // Never abandon a claim in flight: the coordinator may already have leased tasks to
        // it, and a dropped response leaves them running under a lease nobody holds until it
        // expires. The long-poll is bounded by `poll_wait`; shutdown is the only exception.
        let response = tokio::select! {
            response = claim => response,
            () = shutdown.cancelled() => break,
        };
        match response {
            Ok(response) => {
                backoff.reset();
                let tasks = response.into_inner().tasks;
                Counters::add(&slot.counters.claimed, tasks.len());
                for task in tasks {
                    running.spawn(run_slot(Arc::clone(&slot), task));
                }
            }
            Err(status) => {
                let delay = backoff.next();
                tracing::warn!(code = ?status.code(), error = %status.message(), retry_in = ?delay, "claim failed");
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
    tracing::info!(worker_id = %config.worker_id, claimed = stats.claimed, claimed_next = stats.claimed_next, completed = stats.completed, failed = stats.failed, "worker stopped");
    Ok(stats)
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
        capabilities: Vec::new(),
        max_tasks: u32::try_from(max).unwrap_or(u32::MAX),
        wait: wait.map(duration_proto),
        lease_duration: Some(duration_proto(config.lease)),
    }
}

/// One slot of the worker: runs `claimed`, then each task its completion claimed next, until
/// a completion brings none.
async fn run_slot<H: TaskHandler>(slot: Arc<Slot<H>>, claimed: ClaimedTask) {
    let mut queue = std::collections::VecDeque::from([claimed]);
    while let Some(claimed) = queue.pop_front() {
        let next = run_one(&slot, claimed).await;
        Counters::add(&slot.counters.claimed_next, next.len());
        queue.extend(next);
    }
}

/// Runs one claimed task; returns the tasks its completion claimed next.
async fn run_one<H: TaskHandler>(slot: &Slot<H>, claimed: ClaimedTask) -> Vec<ClaimedTask> {
    let Some(task) = claimed.task.clone() else {
        tracing::warn!("claimed task without a task body, ignoring");
        return Vec::new();
    };
    let Some(lease) = claimed.lease else {
        tracing::warn!(task_id = %task.id, "claimed task without a lease, ignoring");
        return Vec::new();
    };
    let span = tracing::info_span!("task", session_id = %task.session_id, task_id = %task.id, attempt = lease.attempt);
    run_leased(slot, claimed, task, lease)
        .instrument(span)
        .await
}

async fn run_leased<H: TaskHandler>(
    slot: &Slot<H>,
    claimed: ClaimedTask,
    task: Task,
    lease: Lease,
) -> Vec<ClaimedTask> {
    let Slot {
        client,
        config,
        handler,
        shutdown,
        counters,
    } = slot;
    let cancel = shutdown.child_token();
    let ctx = TaskContext {
        cancel: cancel.clone(),
        progress: Arc::new(Mutex::new(None)),
        worker_id: Arc::from(config.worker_id.as_str()),
    };
    let lease_lost = CancellationToken::new();
    let heartbeat = heartbeat_loop(
        client.clone(),
        Arc::clone(config),
        task.session_id.clone(),
        task.id.clone(),
        lease.fencing_token,
        ctx.clone(),
        lease_lost.clone(),
    );
    let outcome = {
        let handle = handler.handle(claimed, ctx.clone());
        tokio::pin!(handle);
        tokio::pin!(heartbeat);
        tokio::select! {
            outcome = &mut handle => outcome,
            () = &mut heartbeat => {
                // The heartbeat loop ends only when the lease is lost: stop the work, and
                // still wait for the handler so no child outlives the attempt.
                cancel.cancel();
                handle.await
            }
        }
    };
    if lease_lost.is_cancelled() {
        tracing::warn!("lease lost, dropping the result");
        return Vec::new();
    }

    match outcome {
        Ok(result) => {
            // The slot's next task comes with the completion, unless the worker is stopping.
            let claim_next = (!shutdown.is_cancelled()).then(|| claim_request(config, 1, None));
            let mut request = CompleteTaskRequest {
                session_id: task.session_id.clone(),
                task_id: task.id.clone(),
                fencing_token: lease.fencing_token,
                result: Some(result),
                claim_next,
            };
            let response = report("CompleteTask", || {
                let mut client = client.clone();
                let sent = request.clone();
                // A retry claims nothing: if the first call committed after all (its answer
                // lost), the retry is refused as stale, and what the first call claimed waits
                // out its lease, as with a lost `ClaimTasks` answer.
                request.claim_next = None;
                async move { client.complete_task(sent).await }
            })
            .await;
            let Some(response) = response else {
                return Vec::new();
            };
            Counters::add(&counters.completed, 1);
            tracing::info!("task completed");
            return response.into_inner().next;
        }
        Err(mut failure) => {
            if shutdown.is_cancelled() {
                // Stopped by our own shutdown, not by the task: let another worker retry it.
                failure.error.retryable = true;
            }
            tracing::warn!(kind = ?failure.error.kind(), error = %failure.error.message, "task failed");
            let request = FailTaskRequest {
                session_id: task.session_id.clone(),
                task_id: task.id.clone(),
                fencing_token: lease.fencing_token,
                error: Some(failure.error),
                partial_result: failure.partial,
            };
            if report("FailTask", || {
                let mut client = client.clone();
                let request = request.clone();
                async move { client.fail_task(request).await }
            })
            .await
            .is_some()
            {
                Counters::add(&counters.failed, 1);
            }
        }
    }
    Vec::new()
}

/// Sends a report, retrying transient failures a few times; a refused report (stale token)
/// is logged once and dropped. Returns the answer, if one came.
async fn report<F, Fut, T>(rpc: &'static str, mut call: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, tonic::Status>>,
{
    let mut backoff = Backoff::new();
    for _ in 0..6 {
        match call().await {
            Ok(answer) => return Some(answer),
            Err(status) if is_transient(&status) => {
                let delay = backoff.next();
                tracing::warn!(rpc, code = ?status.code(), retry_in = ?delay, "report failed, retrying");
                tokio::time::sleep(delay).await;
            }
            Err(status) => {
                tracing::warn!(rpc, code = ?status.code(), error = %status.message(), "report refused");
                return None;
            }
        }
    }
    tracing::error!(
        rpc,
        "report failed repeatedly, the lease will expire and the task be retried"
    );
    None
}

/// Heartbeats until the lease is lost (then returns); runs forever otherwise, so the caller
/// drops it when the task finishes.
async fn heartbeat_loop(
    client: CoordinatorClient,
    config: Arc<WorkerConfig>,
    session_id: String,
    task_id: String,
    fencing_token: u64,
    ctx: TaskContext,
    lease_lost: CancellationToken,
) {
    let interval = (config.lease / 3).max(Duration::from_millis(100));
    loop {
        tokio::time::sleep(interval).await;
        let request = HeartbeatRequest {
            session_id: session_id.clone(),
            task_id: task_id.clone(),
            fencing_token,
            progress: ctx.take_progress(),
            lease_duration: Some(duration_proto(config.lease)),
        };
        let mut client = client.clone();
        match client.heartbeat(request).await {
            Ok(response) => {
                if response.into_inner().cancel_requested && !ctx.cancel.is_cancelled() {
                    tracing::info!(%task_id, "coordinator cancelled the task");
                    ctx.cancel.cancel();
                }
            }
            Err(status) if status.code() == tonic::Code::FailedPrecondition => {
                tracing::warn!(%task_id, error = %status.message(), "lease lost");
                lease_lost.cancel();
                return;
            }
            Err(status) => {
                // Transient: the lease is still ours until it expires; try again next beat.
                tracing::warn!(%task_id, code = ?status.code(), "heartbeat failed");
            }
        }
    }
}

fn duration_proto(duration: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(duration.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(duration.subsec_nanos()).unwrap_or(0),
    }
}

/// Capped exponential backoff with jitter, for reconnecting to the coordinator.
#[derive(Debug)]
struct Backoff {
    next: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(200);
    const MAX: Duration = Duration::from_secs(5);

    fn new() -> Self {
        Self { next: Self::FIRST }
    }

    fn reset(&mut self) {
        self.next = Self::FIRST;
    }

    fn next(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        let jitter = rand::random_range(0.8..1.2);
        base.mul_f64(jitter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_its_cap_and_resets() {
        let mut backoff = Backoff::new();
        let first = backoff.next();
        assert!(first >= Duration::from_millis(160) && first <= Duration::from_millis(240));
        for _ in 0..10 {
            backoff.next();
        }
        assert!(backoff.next() <= Backoff::MAX.mul_f64(1.2));
        backoff.reset();
        assert!(backoff.next() <= Duration::from_millis(240));
    }

    #[test]
    fn default_worker_id_names_role_and_pid() {
        let id = default_worker_id("executor");
        assert!(id.starts_with("executor-"));
        assert!(id.ends_with(&std::process::id().to_string()));
    }
}

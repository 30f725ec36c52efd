//! The coordinator's domain operations: validation, repository resolution, the long-polling
//! claim, the event stream. Storage is [`Store`]; the wire adapter is `grpc.rs`.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::Stream;
use rand::Rng;
use tokio::sync::{Notify, mpsc, watch};
use tokio_util::sync::CancellationToken;
use troupe_plan::Plan;
use troupe_proto::v1::{self as pb, SessionState, TaskState};

use crate::Error;
use crate::check;
use crate::convert::{json_to_struct, now_ms, opt_timestamp, struct_to_json, timestamp};
use crate::group_commit::GroupCommit;
use crate::lifecycle::{self, claim::ClaimRequest, claim::Claimed};
use crate::store::messages::{MessageFilter, NewMessage};
use crate::store::sessions::{NewSession, SessionRow, SessionView, add_count};
use crate::store::{CHANGES_CHANNEL, Dialect, Store};
use crate::task::{self, Task};

const DEFAULT_LEASE: Duration = Duration::from_secs(30);
const MIN_LEASE: Duration = Duration::from_secs(1);
const MAX_LEASE: Duration = Duration::from_secs(600);
const MAX_WAIT: Duration = Duration::from_secs(60);
const MAX_CLAIM: u32 = 64;
const MAX_PROGRESS_CHARS: usize = 200;
const EVENT_PAGE: u32 = 256;

/// The coordinator's state, shared by the gRPC adapter and the background reaper.
#[derive(Debug)]
pub(crate) struct Coordinator {
    store: Store,
    /// The worker protocol's writes (claim, heartbeat, complete), group-committed.
    group: GroupCommit,
    data_dir: PathBuf,
    /// How intake reads private remotes (`git ls-remote`).
    credentials: Arc<troupe_workspace::Credentials>,
    /// Bumped after every committed change; claim long-polls and watchers wait on it. A watch
    /// channel (not `Notify`) so that a change between "look" and "wait" is never missed.
    changes: watch::Sender<u64>,
    /// Bumped after changes that may make a task claimable (not after claims or heartbeats):
    /// what parked claims wait on, so they do not all retry on every change.
    claimable: watch::Sender<u64>,
    /// Cancelled at shutdown so open `WatchSession` streams end.
    stop: CancellationToken,
    /// Ready tasks of a role no worker claimed for this long are a capability gap.
    capability_gap: Duration,
    /// How many of the newest sessions a new session's tasks without estimates learn their
    /// roles' durations from (0: they weigh what the plan says alone).
    learn_from_sessions: u32,
    /// When this coordinator started (unix ms): the floor of "unserved since".
    started_at: i64,
    /// When each worker was last recorded in the store, to write that at most every few seconds.
    workers_seen: Mutex<HashMap<String, i64>>,
    /// Random id of this coordinator, the payload of its change notifications.
    origin: String,
    /// PostgreSQL: a change to announce to the other coordinators. One stored permit, so a
    /// burst of changes costs one `pg_notify` (plus one for changes made during it and the
    /// [`PUBLISH_SPACING`] after it).
    publish: Notify,
}

/// How often a worker's "last seen" is written at most (less when the gap threshold is short).
const WORKER_TOUCH_MS: i64 = 2_000;
/// PostgreSQL: the least time between two change notifications of a coordinator. A NOTIFY
/// per group commit cost about a tenth of S1's rate; this bounds them to 200 a second, for at
/// most this much more latency on another coordinator's long polls and watches.
const PUBLISH_SPACING: Duration = Duration::from_millis(5);
/// How many reaper ticks between capability-gap scans.
const GAP_SCAN_TICKS: u32 = 4;

/// Moves a change generation on, waking everything that waits on it.
fn advance(generation: &watch::Sender<u64>) {
    generation.send_modify(|value| *value = value.wrapping_add(1));
}

/// Returns a `Duration` field, or `default` when absent; refuses negative values.
fn duration(
    value: Option<prost_types::Duration>,
    field: &str,
    default: Duration,
) -> Result<Duration, Error> {
    match value {
        None => Ok(default),
        Some(value) => Duration::try_from(value).map_err(|_| {
            Error::InvalidArgument(format!("{field} must be a non-negative duration"))
        }),
    }
}

fn lease(value: Option<prost_types::Duration>, default: Duration) -> Result<Duration, Error> {
    let lease = duration(value, "lease_duration", default)?;
    if lease.is_zero() {
        return Ok(default);
    }
    Ok(lease.clamp(MIN_LEASE, MAX_LEASE))
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

fn require(value: &str, field: &str) -> Result<(), Error> {
    if value.is_empty() {
        return Err(Error::InvalidArgument(format!("{field} is required")));
    }
    Ok(())
}

/// The wire form of claimed tasks, each logged as claimed.
fn claimed_protos(claimed: Vec<Claimed>) -> Vec<pb::ClaimedTask> {
    claimed
        .into_iter()
        .map(|claimed| {
            tracing::info!(session_id = %claimed.task.session_id, task_id = %claimed.task.id, attempt = claimed.task.attempt, "task claimed");
            pb::ClaimedTask {
                lease: Some(pb::Lease {
                    fencing_token: claimed.task.fencing_token,
                    expires_at: opt_timestamp(claimed.task.lease_expires_at),
                    attempt: claimed.task.attempt,
                }),
                task: Some(task_proto(&claimed.task)),
                repo: claimed.repo,
                repos: claimed.repos,
                assets_digest: claimed.assets_digest,
                upstream: claimed
                    .upstream
                    .iter()
                    .map(|dep| pb::UpstreamResult {
                        repo: dep.repo.clone(),
                        spec: (!dep.spec.is_empty()).then(|| json_to_struct(&dep.spec)),
                        task_id: dep.id.clone(),
                        role: dep.role as i32,
                        files: dep.files.clone(),
                        result: dep.result.clone(),
                    })
                    .collect(),
                plan_dir: claimed.plan_dir,
            }
        })
        .collect()
}

/// Returns the wire form of a stored task.
pub(crate) fn task_proto(row: &Task) -> pb::Task {
    pb::Task {
        session_id: row.session_id.clone(),
        id: row.id.clone(),
        title: row.title.clone(),
        description: row.description.clone(),
        role: row.role as i32,
        state: row.state as i32,
        priority: row.priority as i32,
        depends_on: row.depends_on.clone(),
        repo: row.repo.clone(),
        attempt: row.attempt,
        max_attempts: row.max_attempts,
        wave: row.wave,
        spec: Some(json_to_struct(&row.spec)),
        files: row.files.clone(),
        result: row.result.clone(),
        last_error: row.last_error.clone(),
        worker_id: row.worker_id.clone(),
        created_at: Some(timestamp(row.created_at)),
        started_at: opt_timestamp(row.started_at),
        finished_at: opt_timestamp(row.finished_at),
        progress: row.progress.clone(),
        superseded_by: row.superseded_by.clone(),
        convergence: row.convergence.clone(),
    }
}

fn session_proto(
    session: &SessionRow,
    repos: Vec<pb::SessionRepo>,
    counts: pb::TaskCounts,
) -> pb::Session {
    pb::Session {
        id: session.id.clone(),
        name: session.name.clone(),
        description: session.description.clone(),
        state: session.state as i32,
        repos,
        counts: Some(counts),
        created_at: Some(timestamp(session.created_at)),
        updated_at: Some(timestamp(session.updated_at)),
        last_sequence: session.last_seq,
        mode: session.mode.as_str().to_owned(),
        on_failure: session.on_failure.as_str().to_owned(),
    }
}

fn counts_of(tasks: &[Task]) -> pb::TaskCounts {
    let mut counts = pb::TaskCounts::default();
    for task in tasks {
        add_count(&mut counts, task.state, 1);
    }
    counts
}

fn view_proto(view: SessionView) -> (pb::Session, Vec<pb::Task>) {
    let counts = counts_of(&view.tasks);
    let mut repos = view.repos;
    for repo in &mut repos {
        let tasks: Vec<&Task> = view.tasks.iter().filter(|t| t.repo == repo.name).collect();
        let mut counts = pb::TaskCounts::default();
        for task in &tasks {
            add_count(&mut counts, task.state, 1);
        }
        repo.counts = Some(counts);
        // The deepest landing is the branch's head: every landing deepens the branch.
        repo.head = tasks
            .iter()
            .filter_map(|t| t.result.as_ref())
            .filter(|r| r.branch_depth > 0)
            .max_by_key(|r| r.branch_depth)
            .map(|r| r.commit.clone())
            .unwrap_or_default();
    }
    let session = session_proto(&view.session, repos, counts);
    (session, view.tasks.iter().map(task_proto).collect())
}

impl Coordinator {
    pub(crate) fn new(
        store: Store,
        data_dir: PathBuf,
        credentials: Arc<troupe_workspace::Credentials>,
        capability_gap: Duration,
        learn_from_sessions: u32,
    ) -> Self {
        let (changes, _) = watch::channel(0);
        let (claimable, _) = watch::channel(0);
        Self {
            group: GroupCommit::new(store.clone()),
            store,
            data_dir,
            credentials,
            changes,
            claimable,
            stop: CancellationToken::new(),
            capability_gap,
            learn_from_sessions,
            started_at: now_ms(),
            workers_seen: Mutex::new(HashMap::new()),
            origin: uuid::Uuid::new_v4().simple().to_string(),
            publish: Notify::new(),
        }
    }

    fn touch_interval_ms(&self) -> i64 {
        WORKER_TOUCH_MS.min(millis(self.capability_gap) / 4)
    }

    /// Records the worker and its roles in the store (at most every few seconds per worker).
    async fn touch_worker(&self, worker_id: &str, roles: &[pb::Role]) {
        let now = now_ms();
        let due = {
            let mut seen = self
                .workers_seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match seen.get(worker_id) {
                Some(at) if now - at < self.touch_interval_ms() => false,
                _ => {
                    seen.insert(worker_id.to_owned(), now);
                    true
                }
            }
        };
        if due && let Err(err) = self.store.touch_worker(worker_id, roles, now).await {
            tracing::warn!(worker_id, error = %err, "could not record worker");
        }
    }

    /// Announces a committed change that may have made tasks claimable.
    fn notify(&self) {
        advance(&self.claimable);
        self.notify_watchers();
    }

    /// Announces a committed change that cannot make a task claimable (a claim, a heartbeat):
    /// it wakes watchers, not parked claims.
    fn notify_watchers(&self) {
        self.bump();
        // Other coordinators on the same PostgreSQL learn of it through LISTEN/NOTIFY.
        if self.store.dialect() == Dialect::Postgres {
            self.publish.notify_one();
        }
    }

    /// On PostgreSQL, announces this coordinator's changes to the others, coalescing bursts;
    /// returns at once on SQLite.
    pub(crate) async fn run_change_publisher(&self, shutdown: CancellationToken) {
        if self.store.dialect() != Dialect::Postgres {
            return;
        }
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = self.publish.notified() => {
                    if let Err(err) = self.store.publish_change(&self.origin).await {
                        tracing::warn!(error = %err, "could not publish a change");
                    }
                    // Changes made meanwhile leave one permit: they share the next NOTIFY.
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(PUBLISH_SPACING) => {}
                    }
                }
            }
        }
    }

    fn bump(&self) {
        advance(&self.changes);
    }

    /// Wakes everything: a change made by another coordinator, of a kind not known here.
    fn bump_all(&self) {
        advance(&self.claimable);
        self.bump();
    }

    /// On PostgreSQL, wakes this coordinator's long polls and watchers when another
    /// coordinator changes something; returns at once on SQLite.
    pub(crate) async fn run_change_listener(&self, shutdown: CancellationToken) {
        let Some(url) = self.store.postgres_url() else {
            return;
        };
        let mut listener = loop {
            let attempt = async {
                let mut listener = sqlx::postgres::PgListener::connect(url).await?;
                listener.listen(CHANGES_CHANNEL).await?;
                Ok::<_, sqlx::Error>(listener)
            };
            tokio::select! {
                () = shutdown.cancelled() => return,
                result = attempt => match result {
                    Ok(listener) => break listener,
                    Err(err) => {
                        tracing::warn!(error = %err, "change listener could not connect");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        };
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                received = listener.recv() => match received {
                    // Our own changes already woke our waiters.
                    Ok(notification) if notification.payload() == self.origin => {}
                    Ok(_) => self.bump_all(),
                    Err(err) => {
                        // recv reconnects on the next call; wake everyone in case we missed one.
                        tracing::warn!(error = %err, "change listener lost its connection");
                        self.bump_all();
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }
    }

    /// Ends open event streams (shutdown).
    pub(crate) fn stop(&self) {
        self.stop.cancel();
    }

    // ----- sessions -------------------------------------------------------------------------

    #[tracing::instrument(skip_all, fields(dry_run = request.dry_run))]
    pub(crate) async fn create_session(
        &self,
        mut request: pb::CreateSessionRequest,
    ) -> Result<pb::CreateSessionResponse, Error> {
        let mut plan = Plan::from_json(&request.plan_json)?;
        let loop_problems: Vec<String> = plan
            .tasks
            .iter()
            .flat_map(|task| {
                lifecycle::fix_round::config_problems(&task.id, task.role.to_proto(), &task.spec)
            })
            .collect();
        if !loop_problems.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "invalid plan:\n{}",
                loop_problems.join("\n")
            )));
        }
        // The files the plan brings: checked here, stored with the session.
        let assets = match request.assets.len() {
            0 => None,
            _ => Some(
                troupe_grpc::assets::bundle(std::mem::take(&mut request.assets))
                    .map_err(|why| Error::InvalidArgument(format!("invalid plan:\n{why}")))?,
            ),
        };
        // Tasks without an estimate rank by what their role took lately (see the README's
        // plan format), so a chain of quick checks does not go before slower work.
        plan.weigh_by_role(
            &self
                .store
                .learned_durations(self.learn_from_sessions)
                .await?,
        );
        // The submitting machine's plan directory: relative repositories resolve against it
        // when this machine can see it; across machines, repositories are URLs.
        let base_dir = match request.base_dir.as_str() {
            "" => None,
            dir => Some(
                tokio::fs::canonicalize(dir)
                    .await
                    .unwrap_or_else(|_| PathBuf::from(dir)),
            ),
        };
        let repos = crate::repos::Intake {
            base_dir: base_dir.as_deref(),
            overrides: &request.repo_paths,
            dry_run: request.dry_run,
            data_dir: &self.data_dir,
            credentials: &self.credentials,
        }
        .resolve(&plan)
        .await?;
        let now = now_ms();
        let plan_dir = base_dir
            .as_ref()
            .map(|dir| dir.display().to_string())
            .unwrap_or_default();

        if request.dry_run {
            let session_repos = repos.iter().map(|repo| repo.to_proto("")).collect();
            let session = SessionRow {
                id: String::new(),
                name: plan.name.clone(),
                description: plan.description.clone(),
                state: SessionState::Active,
                mode: plan.mode,
                on_failure: plan.on_failure,
                plan_dir,
                last_seq: 0,
                created_at: now,
                updated_at: now,
            };
            let mut tasks = task_rows(&plan, "", now);
            task::settle(&mut tasks, plan.mode, plan.on_failure, now);
            let (session, tasks) = view_proto(SessionView {
                session,
                repos: session_repos,
                tasks,
            });
            return Ok(pb::CreateSessionResponse {
                session: Some(session),
                tasks,
            });
        }

        let session_id = format!(
            "{}-{}-{:06x}",
            plan.name,
            chrono::Utc::now().format("%Y%m%d"),
            rand::rng().random_range(0..0x100_0000u32)
        );
        let branch = format!("troupe/{session_id}");
        let created = crate::repos::create_local_branches(&repos, &branch).await?;
        let session_repos = repos.iter().map(|repo| repo.to_proto(&branch)).collect();
        let new = NewSession {
            session: SessionRow {
                id: session_id.clone(),
                name: plan.name.clone(),
                description: plan.description.clone(),
                state: SessionState::Active,
                mode: plan.mode,
                on_failure: plan.on_failure,
                plan_dir,
                last_seq: 0,
                created_at: now,
                updated_at: now,
            },
            plan_json: request.plan_json,
            repos: session_repos,
            assets,
            tasks: task_rows(&plan, &session_id, now),
        };
        if let Err(err) = lifecycle::create::create_session(&self.store, new, now).await {
            crate::repos::delete_branches(&created, &branch).await;
            return Err(err);
        }
        self.notify();
        tracing::info!(session_id = %session_id, tasks = plan.tasks.len(), "session created");
        let (session, tasks) = view_proto(self.store.get_session(&session_id).await?);
        Ok(pb::CreateSessionResponse {
            session: Some(session),
            tasks,
        })
    }

    pub(crate) async fn get_plan_assets(
        &self,
        digest: &str,
    ) -> Result<pb::GetPlanAssetsResponse, Error> {
        require(digest, "digest")?;
        let bundle = self
            .store
            .plan_assets(digest)
            .await?
            .ok_or_else(|| Error::NotFound(format!("no plan assets with digest {digest}")))?;
        prost::Message::decode(bundle.as_slice())
            .map_err(|err| Error::Corrupt(format!("plan assets {digest}: {err}")))
    }

    pub(crate) async fn get_session(
        &self,
        session_id: &str,
    ) -> Result<pb::GetSessionResponse, Error> {
        require(session_id, "session_id")?;
        let (session, tasks) = view_proto(self.store.get_session(session_id).await?);
        Ok(pb::GetSessionResponse {
            session: Some(session),
            tasks,
        })
    }

    pub(crate) async fn list_sessions(
        &self,
        request: pb::ListSessionsRequest,
    ) -> Result<pb::ListSessionsResponse, Error> {
        let state = match request.state() {
            SessionState::Unspecified => None,
            state => Some(state),
        };
        let limit = match request.limit {
            0 => 50,
            limit => limit.min(500),
        };
        let sessions = self
            .store
            .list_sessions(state, limit)
            .await?
            .into_iter()
            .map(|summary| session_proto(&summary.session, summary.repos, summary.counts))
            .collect();
        Ok(pb::ListSessionsResponse { sessions })
    }

    #[tracing::instrument(skip_all, fields(session_id = %request.session_id))]
    pub(crate) async fn cancel_session(
        &self,
        request: pb::CancelSessionRequest,
    ) -> Result<pb::CancelSessionResponse, Error> {
        require(&request.session_id, "session_id")?;
        let summary = lifecycle::cancel::cancel_session(
            &self.store,
            &request.session_id,
            &request.reason,
            now_ms(),
        )
        .await?;
        self.notify();
        Ok(pb::CancelSessionResponse {
            session: Some(session_proto(
                &summary.session,
                summary.repos,
                summary.counts,
            )),
        })
    }

    // ----- worker protocol ------------------------------------------------------------------

    #[tracing::instrument(skip_all, fields(worker_id = %request.worker_id))]
    pub(crate) async fn claim_tasks(
        &self,
        request: pb::ClaimTasksRequest,
    ) -> Result<pb::ClaimTasksResponse, Error> {
        let claim = self.claim_request(&request).await?;
        let wait = duration(request.wait, "wait", Duration::ZERO)?.min(MAX_WAIT);
        let deadline = tokio::time::Instant::now() + wait;
        let mut changes = self.claimable.subscribe();
        let claimed = loop {
            changes.borrow_and_update();
            let claimed = self
                .group
                .claim(&ClaimRequest {
                    now: now_ms(),
                    ..claim.clone()
                })
                .await?;
            if !claimed.is_empty() || tokio::time::Instant::now() >= deadline {
                break claimed;
            }
            // Parked, a group that completes tasks may claim for it (see `GroupCommit::park`);
            // else a change wakes it to look again. Once a group took it, its answer counts
            // whatever woke it: what it claimed is leased to this caller.
            let mut parked = self.group.park(claim.clone());
            let (claimed, look_again) = tokio::select! {
                answer = parked.answered() => (answer?, true),
                changed = changes.changed() => (parked.withdraw().await?, changed.is_ok()),
                () = tokio::time::sleep_until(deadline) => (parked.withdraw().await?, false),
                () = self.stop.cancelled() => (parked.withdraw().await?, false),
            };
            if !claimed.is_empty() || !look_again {
                break claimed;
            }
        };
        if !claimed.is_empty() {
            self.notify_watchers();
        }
        Ok(pb::ClaimTasksResponse {
            tasks: claimed_protos(claimed),
        })
    }

    pub(crate) async fn heartbeat(
        &self,
        request: pb::HeartbeatRequest,
    ) -> Result<pb::HeartbeatResponse, Error> {
        require(&request.session_id, "session_id")?;
        require(&request.task_id, "task_id")?;
        let lease_ms = match request.lease_duration {
            None => None,
            Some(value) => Some(millis(lease(Some(value), DEFAULT_LEASE)?)),
        };
        let progress: String = request.progress.chars().take(MAX_PROGRESS_CHARS).collect();
        let (expires_at, cancel_requested) = self
            .group
            .heartbeat(
                &request.session_id,
                &request.task_id,
                request.fencing_token,
                &progress,
                lease_ms,
                now_ms(),
            )
            .await?;
        if !progress.is_empty() {
            self.notify_watchers();
        }
        Ok(pb::HeartbeatResponse {
            expires_at: Some(timestamp(expires_at)),
            cancel_requested,
        })
    }

    #[tracing::instrument(skip_all, fields(session_id = %request.session_id, task_id = %request.task_id))]
    pub(crate) async fn complete_task(
        &self,
        request: pb::CompleteTaskRequest,
    ) -> Result<pb::CompleteTaskResponse, Error> {
        require(&request.session_id, "session_id")?;
        require(&request.task_id, "task_id")?;
        let claim_next = match &request.claim_next {
            Some(claim) => Some(self.claim_request(claim).await?),
            None => None,
        };
        let result = request.result.unwrap_or_default();
        let (task, next) = self
            .group
            .complete(
                &request.session_id,
                &request.task_id,
                request.fencing_token,
                result,
                claim_next,
                now_ms(),
            )
            .await?;
        self.notify();
        tracing::info!(attempt = task.attempt, "task completed");
        Ok(pb::CompleteTaskResponse {
            task: Some(task_proto(&task)),
            next: claimed_protos(next),
        })
    }

    /// Checks a claim's request and records its worker as seen.
    async fn claim_request(&self, request: &pb::ClaimTasksRequest) -> Result<ClaimRequest, Error> {
        require(&request.worker_id, "worker_id")?;
        let roles: Vec<pb::Role> = request
            .roles()
            .filter(|role| *role != pb::Role::Unspecified)
            .collect();
        let max = match request.max_tasks {
            0 => 1,
            max => max.min(MAX_CLAIM),
        };
        let lease_ms = millis(lease(request.lease_duration, DEFAULT_LEASE)?);
        self.touch_worker(&request.worker_id, &roles).await;
        Ok(ClaimRequest {
            worker_id: request.worker_id.clone(),
            roles,
            max,
            lease_ms,
            now: now_ms(),
        })
    }

    #[tracing::instrument(skip_all, fields(session_id = %request.session_id, task_id = %request.task_id))]
    pub(crate) async fn fail_task(
        &self,
        request: pb::FailTaskRequest,
    ) -> Result<pb::FailTaskResponse, Error> {
        require(&request.session_id, "session_id")?;
        require(&request.task_id, "task_id")?;
        let error = request.error.unwrap_or_else(|| pb::TaskError {
            kind: pb::ErrorKind::Unspecified as i32,
            message: "worker reported a failure without an error".to_owned(),
            retryable: false,
            details: Vec::new(),
        });
        // The attempt number is only known inside the transaction, so pass the policy in.
        let backoff_for = |attempt: u32| task::backoff(attempt, &mut rand::rng());
        let (task, retry_at) = lifecycle::fail::fail(
            &self.store,
            &request.session_id,
            &request.task_id,
            request.fencing_token,
            error,
            request.partial_result,
            backoff_for,
            now_ms(),
        )
        .await?;
        self.notify();
        let state = task.state;
        tracing::info!(
            attempt = task.attempt,
            state = task::state_name(state),
            "task attempt failed"
        );
        Ok(pb::FailTaskResponse {
            task: Some(task_proto(&task)),
            retry_at: opt_timestamp(retry_at),
        })
    }

    /// Returns expired leases and releases due retries until `shutdown`.
    pub(crate) async fn run_reaper(&self, interval: Duration, shutdown: CancellationToken) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut ticks: u32 = 0;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
            }
            match lifecycle::reap::reap(&self.store, now_ms()).await {
                Ok(0) => {}
                Ok(_) => self.notify(),
                Err(err) => tracing::warn!(error = %err, "reaper pass failed"),
            }
            ticks = ticks.wrapping_add(1);
            if ticks.is_multiple_of(GAP_SCAN_TICKS) {
                match self.report_capability_gaps(now_ms()).await {
                    Ok(0) => {}
                    Ok(_) => self.notify(),
                    Err(err) => tracing::warn!(error = %err, "capability gap scan failed"),
                }
            }
        }
    }

    /// Ready tasks grouped by session, and when each role was last served.
    async fn gaps_by_session(
        &self,
        now: i64,
    ) -> Result<BTreeMap<String, Vec<pb::CapabilityGap>>, Error> {
        let ready = self.store.ready_tasks().await?;
        let mut out = BTreeMap::new();
        if ready.is_empty() {
            return Ok(out);
        }
        let seen = self.store.role_last_seen(0).await?;
        let mut by_session: BTreeMap<String, Vec<(String, pb::Role)>> = BTreeMap::new();
        for (session_id, task_id, role) in ready {
            by_session
                .entry(session_id)
                .or_default()
                .push((task_id, role));
        }
        for (session_id, ready) in by_session {
            let gaps =
                check::capability_gaps(&ready, &seen, self.started_at, now, self.capability_gap);
            if !gaps.is_empty() {
                out.insert(session_id, gaps);
            }
        }
        Ok(out)
    }

    /// Logs a `capability_gap` message per session and unserved role, once per gap (the
    /// idempotency key names the role and when it was last served, so coordinators sharing a
    /// database report it once too). Returns how many were new.
    async fn report_capability_gaps(&self, now: i64) -> Result<usize, Error> {
        let mut logged = 0;
        for (session_id, gaps) in self.gaps_by_session(now).await? {
            for gap in gaps {
                let unserved_ms = gap.unserved_for.map_or(0, |d| d.seconds * 1000);
                let since = (now - unserved_ms) / 10_000;
                let role = check::role_name(gap.role());
                let mut data = serde_json::Map::new();
                data.insert("role".into(), role.into());
                data.insert("task_ids".into(), gap.task_ids.clone().into());
                data.insert(
                    "covered_by".into(),
                    match gap.covered_by() {
                        pb::Role::Unspecified => serde_json::Value::Null,
                        other => check::role_name(other).into(),
                    },
                );
                let message = NewMessage {
                    from: "coordinator".to_owned(),
                    to: "user".to_owned(),
                    kind: "capability_gap".to_owned(),
                    summary: format!("[coordinator] capability_gap: {}", gap.message),
                    data: Some(data),
                    idempotency_key: Some(format!("capability_gap:{role}:{since}")),
                };
                let (_, created) = self.log(&session_id, message, now).await?;
                if created {
                    tracing::warn!(session_id = %session_id, role, "capability gap");
                    logged += 1;
                }
            }
        }
        Ok(logged)
    }

    // ----- session commands -----------------------------------------------------------------

    /// CCW `check`: the session's status, read-only.
    pub(crate) async fn check_session(
        &self,
        session_id: &str,
    ) -> Result<pb::CheckSessionResponse, Error> {
        require(session_id, "session_id")?;
        let now = now_ms();
        let view = self.store.get_session(session_id).await?;
        let recent = |kind: &str, last: u32| MessageFilter {
            kind: Some(kind.to_owned()),
            last,
            ..MessageFilter::default()
        };
        let (blockers, _) = self
            .store
            .list_messages(session_id, &recent("blocker", 10))
            .await?;
        let (progress, _) = self
            .store
            .list_messages(session_id, &recent("progress", 50))
            .await?;
        let gaps = if view.session.state == SessionState::Active {
            self.gaps_by_session(now)
                .await?
                .remove(session_id)
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        let counts = counts_of(&view.tasks);
        let session = session_proto(&view.session, view.repos.clone(), counts);
        Ok(check::status(
            session,
            &view.tasks,
            blockers,
            &progress,
            gaps,
            now,
        ))
    }

    /// CCW `resume`: reconcile, advance, then report the status.
    #[tracing::instrument(skip_all, fields(session_id = %session_id))]
    pub(crate) async fn resume_session(
        &self,
        session_id: &str,
    ) -> Result<pb::ResumeSessionResponse, Error> {
        require(session_id, "session_id")?;
        let reconciled = lifecycle::resume::resume(&self.store, session_id, now_ms()).await?;
        self.notify();
        tracing::info!(reconciled = reconciled.len(), "session resumed");
        Ok(pb::ResumeSessionResponse {
            reconciled,
            status: Some(self.check_session(session_id).await?),
        })
    }

    /// Pauses a session: no new claims until resumed; running tasks finish and are recorded.
    #[tracing::instrument(skip_all, fields(session_id = %request.session_id))]
    pub(crate) async fn pause_session(
        &self,
        request: pb::PauseSessionRequest,
    ) -> Result<pb::PauseSessionResponse, Error> {
        require(&request.session_id, "session_id")?;
        let paused = lifecycle::pause::pause_session(
            &self.store,
            &request.session_id,
            &request.reason,
            now_ms(),
        )
        .await?;
        if paused.changed {
            self.notify();
            tracing::info!(running = paused.running.len(), "session paused");
        }
        let summary = paused.summary;
        Ok(pb::PauseSessionResponse {
            session: Some(session_proto(
                &summary.session,
                summary.repos,
                summary.counts,
            )),
            running_task_ids: paused.running,
        })
    }

    // ----- bus ------------------------------------------------------------------------------

    pub(crate) async fn log_message(
        &self,
        request: pb::LogMessageRequest,
    ) -> Result<pb::LogMessageResponse, Error> {
        require(&request.session_id, "session_id")?;
        require(&request.from, "from")?;
        let to = if request.to.is_empty() {
            "coordinator".to_owned()
        } else {
            request.to
        };
        let kind = if request.r#type.is_empty() {
            "message".to_owned()
        } else {
            request.r#type
        };
        let summary = if request.summary.is_empty() {
            format!("[{}] {kind} -> {to}", request.from)
        } else {
            request.summary
        };
        let message = NewMessage {
            from: request.from,
            to,
            kind,
            summary,
            data: request.data.as_ref().map(struct_to_json),
            idempotency_key: Some(request.idempotency_key).filter(|key| !key.is_empty()),
        };
        let (message, _) = self.log(&request.session_id, message, now_ms()).await?;
        self.notify();
        Ok(pb::LogMessageResponse {
            message: Some(message),
        })
    }

    /// Logs a message (or finds the one with its idempotency key, and `false`), and moves the
    /// group commit's copy of the session along with a new one (see
    /// [`GroupCommit::message_logged`]).
    async fn log(
        &self,
        session_id: &str,
        message: NewMessage,
        now: i64,
    ) -> Result<(pb::Message, bool), Error> {
        let (message, created) = self.store.log_message(session_id, message, now).await?;
        if created {
            self.group.message_logged(session_id, message.sequence);
        }
        Ok((message, created))
    }

    pub(crate) async fn list_messages(
        &self,
        request: pb::ListMessagesRequest,
    ) -> Result<pb::ListMessagesResponse, Error> {
        require(&request.session_id, "session_id")?;
        let non_empty = |text: String| Some(text).filter(|text| !text.is_empty());
        let filter = MessageFilter {
            from: non_empty(request.from),
            to: non_empty(request.to),
            kind: non_empty(request.r#type),
            after_sequence: request.after_sequence,
            last: match request.last {
                0 => 20,
                last => last.min(1000),
            },
        };
        let (messages, next_sequence) = self
            .store
            .list_messages(&request.session_id, &filter)
            .await?;
        Ok(pb::ListMessagesResponse {
            messages,
            next_sequence,
        })
    }

    pub(crate) async fn get_state(
        &self,
        request: pb::GetStateRequest,
    ) -> Result<pb::GetStateResponse, Error> {
        require(&request.session_id, "session_id")?;
        let states: BTreeMap<_, _> = self
            .store
            .get_state(&request.session_id, &request.role)
            .await?;
        Ok(pb::GetStateResponse {
            role_state: states
                .into_iter()
                .map(|(role, state)| (role, json_to_struct(&state)))
                .collect(),
        })
    }

    pub(crate) async fn update_state(
        &self,
        request: pb::UpdateStateRequest,
    ) -> Result<pb::UpdateStateResponse, Error> {
        require(&request.session_id, "session_id")?;
        require(&request.role, "role")?;
        let data = request
            .data
            .as_ref()
            .map(struct_to_json)
            .unwrap_or_default();
        let (state, message) = self
            .store
            .update_state(&request.session_id, &request.role, data, now_ms())
            .await?;
        // Role state is not part of the copy either.
        self.group
            .message_logged(&request.session_id, message.sequence);
        self.notify();
        Ok(pb::UpdateStateResponse {
            state: Some(json_to_struct(&state)),
            message: Some(message),
        })
    }

    // ----- events ---------------------------------------------------------------------------

    /// Streams a session's events after `after_sequence`: first the stored ones, then live
    /// ones as they commit; ends once the session is terminal and everything was sent, unless
    /// `follow`.
    pub(crate) async fn watch_session(
        self: &Arc<Self>,
        request: pb::WatchSessionRequest,
    ) -> Result<impl Stream<Item = Result<pb::SessionEvent, Error>> + Send + 'static, Error> {
        require(&request.session_id, "session_id")?;
        // Fail the call itself (NOT_FOUND) rather than the stream when the session is unknown.
        self.store.session_head(&request.session_id).await?;
        let (sender, receiver) = mpsc::channel(64);
        let this = Arc::clone(self);
        tokio::spawn(async move {
            if let Err(err) = this.pump_events(&request, &sender).await {
                tracing::warn!(session_id = %request.session_id, error = %err, "event stream failed");
                let _ = sender.send(Err(err)).await;
            }
        });
        Ok(tokio_stream::wrappers::ReceiverStream::new(receiver))
    }

    async fn pump_events(
        &self,
        request: &pb::WatchSessionRequest,
        sender: &mpsc::Sender<Result<pb::SessionEvent, Error>>,
    ) -> Result<(), Error> {
        let session_id = &request.session_id;
        let mut cursor = request.after_sequence;
        let mut changes = self.changes.subscribe();
        loop {
            // Mark the generation seen before reading, so a commit after the read wakes us.
            changes.borrow_and_update();
            let (state, last_sequence) = self.store.session_head(session_id).await?;
            let events = self
                .store
                .events_after(session_id, cursor, EVENT_PAGE)
                .await?;
            let full_page = events.len() == EVENT_PAGE as usize;
            for event in events {
                cursor = event.sequence;
                if sender.send(Ok(event)).await.is_err() {
                    return Ok(());
                }
            }
            if full_page {
                continue;
            }
            if !request.follow && task::is_session_terminal(state) && cursor >= last_sequence {
                return Ok(());
            }
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return Ok(()) },
                () = sender.closed() => return Ok(()),
                () = self.stop.cancelled() => return Ok(()),
            }
        }
    }
}

/// Returns a CCW runtime `status: "completed"` task's result: an imported session resumes
/// where it was. `None` for every other status (those tasks start pending).
fn imported_result(spec: &serde_json::Map<String, serde_json::Value>) -> Option<pb::TaskResult> {
    use serde_json::Value;
    if spec.get("status").and_then(Value::as_str) != Some("completed") {
        return None;
    }
    let strings = |value: Option<&Value>| -> Vec<String> {
        value
            .and_then(Value::as_array)
            .map(|items| {
                items
                    .iter()
                    .filter_map(|item| item.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut result = pb::TaskResult {
        summary: "imported as completed".to_owned(),
        ..Default::default()
    };
    match spec.get("result") {
        Some(Value::String(text)) => result.summary.clone_from(text),
        Some(Value::Object(object)) => {
            result.summary = match object.get("summary") {
                Some(Value::String(text)) => text.clone(),
                _ => Value::Object(object.clone()).to_string(),
            };
            if let Some(commit) = object.get("commit").and_then(Value::as_str) {
                commit.clone_into(&mut result.commit);
            }
            result.files_modified = strings(object.get("files_modified"));
            result.warnings = strings(object.get("warnings"));
        }
        Some(Value::Null) | None => {}
        Some(other) => result.summary = other.to_string(),
    }
    Some(result)
}

/// Builds the stored rows of a plan's tasks (topological order): pending, or completed when
/// the plan says so (CCW runtime `status`).
fn task_rows(plan: &Plan, session_id: &str, now: i64) -> Vec<Task> {
    plan.tasks
        .iter()
        .enumerate()
        .map(|(position, task)| (position, task, imported_result(&task.spec)))
        .map(|(position, task, imported)| Task {
            session_id: session_id.to_owned(),
            id: task.id.clone(),
            position: i64::try_from(position).unwrap_or(i64::MAX),
            title: task.title.clone(),
            description: task.description.clone(),
            role: task.role.to_proto(),
            priority: task.priority.to_proto(),
            repo: task.repo.clone(),
            wave: task.wave,
            critical_path: task.critical_path,
            path_ms: task.path_ms,
            depends_on: task.depends_on.clone(),
            files: task
                .files
                .iter()
                .map(troupe_plan::FileSpec::to_proto)
                .collect(),
            spec: task.spec.clone(),
            state: if imported.is_some() {
                TaskState::Completed
            } else {
                TaskState::Pending
            },
            attempt: 0,
            max_attempts: task.max_attempts,
            fencing_token: 0,
            worker_id: String::new(),
            lease_ms: 0,
            lease_expires_at: None,
            not_before: None,
            created_at: now,
            started_at: None,
            finished_at: imported.is_some().then_some(now),
            progress: String::new(),
            result: imported,
            last_error: None,
            superseded_by: String::new(),
            convergence: None,
        })
        .collect()
}

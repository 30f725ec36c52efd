//! The coordinator's domain operations, behind the gRPC adapter (`crate::grpc`, which owns the
//! wire forms of what these return): [`sessions`] (intake, reads, CCW's session commands),
//! [`workers`] (the worker protocol, long-polling claims, the reaper) and [`bus`] (messages,
//! role state, the event stream). State changes are [`crate::lifecycle`]'s; the worker
//! protocol's writes go through [`GroupCommit`].

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use troupe_proto::v1 as pb;

use crate::Error;
use crate::convert::now_ms;
use crate::group_commit::GroupCommit;
use crate::store::{self, Dialect, Store};
use crate::task::Task;

mod bus;
mod sessions;
mod workers;

pub(crate) use sessions::{Created, SessionCheck, page_token};

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
    /// The latest figures each running attempt's heartbeats carried, by (session, task), with
    /// the attempt's fencing token; memory only (the progress events keep them too).
    work_progress: Mutex<HashMap<(String, String), (u64, pb::WorkProgress)>>,
    /// Random id of this coordinator, the payload of its change notifications.
    origin: String,
    /// Provider quotas, enforced at claim time (see [`crate::quota`]).
    quotas: Arc<crate::quota::Quotas>,
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

/// How many reaper ticks between rebuilds of the quota counts (see [`crate::quota`]).
const QUOTA_TICKS: u32 = 2;

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

impl Coordinator {
    /// The store, for reads outside the RPCs (the metrics).
    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    pub(crate) fn new(
        store: Store,
        data_dir: PathBuf,
        credentials: Arc<troupe_workspace::Credentials>,
        capability_gap: Duration,
        learn_from_sessions: u32,
        quotas: Arc<crate::quota::Quotas>,
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
            work_progress: Mutex::new(HashMap::new()),
            origin: uuid::Uuid::new_v4().simple().to_string(),
            publish: Notify::new(),
            quotas,
        }
    }

    fn touch_interval_ms(&self) -> i64 {
        WORKER_TOUCH_MS.min(millis(self.capability_gap) / 4)
    }

    /// Records the worker, its roles and the backends it offers in the store (at most every
    /// few seconds per worker).
    async fn touch_worker(&self, worker_id: &str, roles: &[pb::Role], backends: Option<&[String]>) {
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
        if due
            && let Err(err) = self
                .store
                .touch_worker(worker_id, roles, backends, now)
                .await
        {
            tracing::warn!(worker_id, error = %err, "could not record worker");
        }
    }

    /// Announces a committed change that may have made tasks claimable.
    fn notify(&self) {
        advance(&self.claimable);
        self.notify_watchers();
    }

    /// Keeps the figures a heartbeat of the attempt holding `token` carried.
    fn keep_work_progress(
        &self,
        (session_id, task_id): (&str, &str),
        token: u64,
        figures: pb::WorkProgress,
    ) {
        if let Ok(mut kept) = self.work_progress.lock() {
            kept.insert(
                (session_id.to_owned(), task_id.to_owned()),
                (token, figures),
            );
        }
    }

    /// The figures of each task's running attempt, as its latest heartbeat carried them; `None`
    /// for a task not running, or whose attempt sent none. Figures of attempts that are over
    /// are dropped on the way.
    pub(crate) fn work_progress_of(&self, tasks: &[Task]) -> Vec<Option<pb::WorkProgress>> {
        let Ok(mut kept) = self.work_progress.lock() else {
            return vec![None; tasks.len()];
        };
        tasks
            .iter()
            .map(|task| {
                let key = (task.session_id.clone(), task.id.clone());
                let (token, figures) = kept.get(&key)?;
                if task.state == pb::TaskState::Running && *token == task.fencing_token {
                    return Some(figures.clone());
                }
                kept.remove(&key);
                None
            })
            .collect()
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
            let attempt = store::listen_to_changes(url);
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
}

//! The coordinator's metric families (see `docs/operating.md`, "Metrics").
//!
//! Tasks by state and the ready depth per role are read from the store when scraped
//! ([`refresh`]), so they are right after a restart and with several coordinators on one
//! database; the counters and histograms count what this process did.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use troupe_proto::v1::{self as pb, TaskState};
use troupe_telemetry::metrics::{
    self, Counter, Family, Gauge, HistogramFamily, Labels, Refresh, labels,
};

use crate::check::role_name;
use crate::lifecycle::claim::Claimed;
use crate::store::Store;
use crate::task::{Task, Upstream};

/// Every role a task can have.
const ROLES: [pb::Role; 3] = [
    pb::Role::Executor,
    pb::Role::Validator,
    pb::Role::TestRunner,
];

pub(crate) struct Metrics {
    tasks: Family<Labels, Gauge>,
    ready: Family<Labels, Gauge>,
    claim: HistogramFamily,
    pickup: HistogramFamily,
    lease_expiries: Family<Labels, Counter>,
    retries: Family<Labels, Counter>,
    quota_waiting: Family<Labels, Gauge>,
    quota_in_flight: Family<Labels, Gauge>,
    quota_pauses: Family<Labels, Counter>,
}

/// The coordinator's families, registered on first use.
pub(crate) fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(|| Metrics {
        tasks: metrics::gauge(
            "troupe_tasks",
            "Tasks in the store by role and state, every session's.",
        ),
        ready: metrics::gauge(
            "troupe_tasks_ready",
            "Ready tasks of active sessions by role: the queue a worker of that role would claim from.",
        ),
        claim: metrics::seconds_histogram(
            "troupe_claim_duration",
            "Time to answer ClaimTasks, long-poll wait included, by outcome (claimed or empty).",
            metrics::latency_buckets,
        ),
        pickup: metrics::seconds_histogram(
            "troupe_task_pickup",
            "Time from a task becoming ready to a worker claiming it, by role.",
            metrics::duration_buckets,
        ),
        lease_expiries: metrics::counter(
            "troupe_lease_expiries",
            "Leases that expired (the worker stopped heartbeating), by role.",
        ),
        retries: metrics::counter(
            "troupe_task_retries",
            "Failed attempts scheduled for a retry, by role and error kind.",
        ),
        quota_waiting: metrics::gauge(
            "troupe_quota_waiting_tasks",
            "Ready tasks held back by their backend's provider quota (in flight, rate or pause), by backend.",
        ),
        quota_in_flight: metrics::gauge(
            "troupe_quota_in_flight",
            "Tasks running against a backend with a quota or pause, by backend.",
        ),
        quota_pauses: metrics::counter(
            "troupe_quota_pauses",
            "Pauses of a backend's claims after a worker reported a 429, by backend.",
        ),
    })
}

/// A metric label for an error kind: `timeout`, `rate_limited`, ...
pub(crate) fn kind_label(kind: pb::ErrorKind) -> String {
    troupe_proto::names::name(kind).to_owned()
}

fn state_label(state: TaskState) -> String {
    troupe_proto::names::name(state).to_owned()
}

/// Reads the tasks by state and the ready depth from `store` into their gauges.
pub(crate) fn refresh(store: Store) -> Refresh {
    Arc::new(move || {
        let store = store.clone();
        Box::pin(async move {
            let counts = store
                .task_counts()
                .await
                .map_err(|err| format!("reading task counts: {err}"))?;
            let metrics = metrics();
            for role in ROLES {
                let mut ready = 0;
                for state in crate::task::STATES {
                    let (mut all, mut active_ready) = (0, 0);
                    for (r, s, active, n) in &counts {
                        if *r == role && *s == state {
                            all += n;
                            if *active && state == TaskState::Ready {
                                active_ready += n;
                            }
                        }
                    }
                    ready += active_ready;
                    metrics
                        .tasks
                        .get_or_create(&labels([
                            ("role", role_name(role)),
                            ("state", &state_label(state)),
                        ]))
                        .set(i64::try_from(all).unwrap_or(i64::MAX));
                }
                metrics
                    .ready
                    .get_or_create(&labels([("role", role_name(role))]))
                    .set(i64::try_from(ready).unwrap_or(i64::MAX));
            }
            Ok(())
        })
    })
}

/// Records one answered claim: how long it took, and for each task how long it waited ready.
pub(crate) fn claimed(took: Option<Duration>, claimed: &[Claimed]) {
    let metrics = metrics();
    if let Some(took) = took {
        let outcome = if claimed.is_empty() {
            "empty"
        } else {
            "claimed"
        };
        metrics
            .claim
            .get_or_create(&labels([("outcome", outcome)]))
            .observe(took.as_secs_f64());
    }
    for claim in claimed {
        if let Some(waited) = ready_for(&claim.task, &claim.upstream) {
            metrics
                .pickup
                .get_or_create(&labels([("role", role_name(claim.task.role))]))
                .observe(waited.as_secs_f64());
        }
    }
}

/// How long `task` (just claimed) was ready: since its creation or its last dependency's
/// finish on a first attempt, since its retry time after a failure. `None` when unknown (an
/// attempt after an expired lease: when it became ready again is not stored).
fn ready_for(task: &Task, upstream: &[Upstream]) -> Option<Duration> {
    let claimed_at = task.started_at?;
    let ready_at = if task.attempt == 1 {
        upstream
            .iter()
            .filter_map(|dep| dep.finished_at)
            .fold(task.created_at, i64::max)
    } else {
        task.not_before?
    };
    let waited = u64::try_from(claimed_at.saturating_sub(ready_at)).unwrap_or(0);
    Some(Duration::from_millis(waited))
}

/// Counts expired leases of `role`.
pub(crate) fn lease_expired(role: pb::Role) {
    metrics()
        .lease_expiries
        .get_or_create(&labels([("role", role_name(role))]))
        .inc();
}

/// Counts a failed attempt of `role` that will be retried.
pub(crate) fn retried(role: pb::Role, kind: pb::ErrorKind) {
    metrics()
        .retries
        .get_or_create(&labels([
            ("role", role_name(role)),
            ("kind", &kind_label(kind)),
        ]))
        .inc();
}

/// Sets a backend's quota gauges: tasks in flight and ready tasks waiting.
pub(crate) fn quota_standing(backend: &str, in_flight: u32, waiting: usize) {
    let metrics = metrics();
    let label = labels([("backend", backend)]);
    metrics
        .quota_in_flight
        .get_or_create(&label)
        .set(i64::from(in_flight));
    metrics
        .quota_waiting
        .get_or_create(&label)
        .set(i64::try_from(waiting).unwrap_or(i64::MAX));
}

/// Counts a pause of `backend`'s claims.
pub(crate) fn quota_paused(backend: &str) {
    metrics()
        .quota_pauses
        .get_or_create(&labels([("backend", backend)]))
        .inc();
}

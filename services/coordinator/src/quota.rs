//! Provider quotas across the cluster (see `docs/quotas.md`): per backend, the most tasks in
//! flight at once and the most started per minute, enforced when a task is claimed, whichever
//! worker claims it; and pauses, when a worker reports that the provider answered 429.
//!
//! The counts live in memory and are rebuilt from the store (every running task, its
//! backend) at boot and then every half second (two reaper ticks): so they are right after a restart,
//! and a lease that expired or a task that failed or was cancelled stops counting by the next
//! pass at the latest (completions and failures release at once). A claim that counted a task
//! and then did not commit (a lost optimistic write) holds its place until that pass too.
//! With several coordinators on one PostgreSQL each enforces the limits on its own claims.
//!
//! Which backend a task uses is [`backend_of`], the one place that decides it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use troupe_proto::v1 as pb;

use crate::Error;
use crate::convert::timestamp;
use crate::task::Task;

/// A claim counted but not yet seen running in the store is kept this long by a rebuild: its
/// transaction may still be committing.
const CLAIM_GRACE_MS: i64 = 5_000;

/// The window of the per-minute rate.
const MINUTE_MS: i64 = 60_000;

/// One backend's limits; `None` is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Limit {
    pub(crate) in_flight: Option<u32>,
    pub(crate) per_minute: Option<u32>,
}

/// Parses `--quota` values: `claude=in_flight:3,per_minute:30` (either part may be left out).
pub(crate) fn parse_limits(specs: &[String]) -> Result<BTreeMap<String, Limit>, Error> {
    let mut limits = BTreeMap::new();
    for spec in specs
        .iter()
        .map(|spec| spec.trim())
        .filter(|s| !s.is_empty())
    {
        let bad = |why: &str| {
            Error::InvalidArgument(format!(
                "quota `{spec}`: {why} (expected `<backend>=in_flight:N,per_minute:N`)"
            ))
        };
        let (backend, parts) = spec.split_once('=').ok_or_else(|| bad("no `=`"))?;
        let backend = backend.trim().to_ascii_lowercase();
        if backend.is_empty() {
            return Err(bad("no backend named"));
        }
        let mut limit = Limit::default();
        for part in parts.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part
                .split_once(':')
                .or_else(|| part.split_once('='))
                .ok_or_else(|| bad(&format!("`{part}` has no value")))?;
            let value: u32 = value
                .trim()
                .parse()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| bad(&format!("`{part}` is not a positive whole number")))?;
            match key.trim() {
                "in_flight" => limit.in_flight = Some(value),
                "per_minute" => limit.per_minute = Some(value),
                other => return Err(bad(&format!("unknown limit `{other}`"))),
            }
        }
        if limit == Limit::default() {
            return Err(bad("no limit given"));
        }
        if limits.insert(backend.clone(), limit).is_some() {
            return Err(bad(&format!("`{backend}` is given twice")));
        }
    }
    Ok(limits)
}

/// The backend a task runs on: the one it named, as decided at intake by the executor's own
/// resolution (`troupe_plan::backend::choose`, stored as the first of [`Task::backends`]),
/// else the backend of the worker that claims it (`auto`: empty when the worker names none).
/// Tasks of other roles than the executor's use no provider here (`None`).
pub(crate) fn backend_of(task: &Task, auto: &str) -> Option<String> {
    if task.role != pb::Role::Executor {
        return None;
    }
    match task.backends.first() {
        Some(named) => Some(named.clone()),
        None => (!auto.is_empty()).then(|| auto.to_ascii_lowercase()),
    }
}

/// The provider a failure report names as rate limited, with the wait it asked for: a
/// RATE_LIMITED or QUOTA error that carries `rate_limited_backend`.
pub(crate) fn reported(error: &pb::TaskError) -> Option<(String, Option<Duration>)> {
    let kind = error.kind();
    let limited = matches!(kind, pb::ErrorKind::RateLimited | pb::ErrorKind::Quota);
    let backend = error.rate_limited_backend.trim().to_ascii_lowercase();
    if !limited || backend.is_empty() {
        return None;
    }
    let wait = (error.retry_after_ms > 0).then(|| Duration::from_millis(error.retry_after_ms));
    Some((backend, wait))
}

/// A task counted against its backend.
#[derive(Debug, Clone)]
struct Held {
    backend: String,
    token: u64,
    /// When it was counted (unix ms).
    since: i64,
}

/// A pause of a backend's claims.
#[derive(Debug, Clone)]
struct Paused {
    until: i64,
    /// Why: the worker and what the provider said.
    reason: String,
}

#[derive(Debug, Default)]
struct State {
    /// `(session, task)` → the backend it runs on.
    held: HashMap<(String, String), Held>,
    /// `(session, task)` → the fencing token released: a rebuild that read the task running
    /// before its release committed does not count it again.
    released: HashMap<(String, String), (u64, i64)>,
    /// Start times (unix ms) in the last minute, per backend.
    starts: HashMap<String, VecDeque<i64>>,
    paused: HashMap<String, Paused>,
    /// Worker id → the backend it runs auto tasks on.
    auto: HashMap<String, String>,
    /// Ready tasks whose backend held them back at the last rebuild: backend → session →
    /// task ids.
    waiting: BTreeMap<String, BTreeMap<String, Vec<String>>>,
}

/// The quotas and their counts; one per coordinator.
#[derive(Debug, Default)]
pub(crate) struct Quotas {
    limits: BTreeMap<String, Limit>,
    /// How long a 429 that names no reset time pauses its backend.
    default_pause: Duration,
    /// Set once there is anything to enforce (a limit, or a pause ever): until then a claim
    /// takes no lock.
    engaged: AtomicBool,
    state: Mutex<State>,
}

/// What a backend's quota looks like now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Standing {
    pub(crate) in_flight: u32,
    pub(crate) limit: Limit,
    pub(crate) started_last_minute: u32,
    pub(crate) paused_until: Option<i64>,
    pub(crate) pause_reason: String,
}

impl Standing {
    /// Whether a claim of this backend must wait now.
    fn blocks(&self, now: i64) -> bool {
        self.paused_until.is_some_and(|until| until > now)
            || self
                .limit
                .in_flight
                .is_some_and(|max| self.in_flight >= max)
            || self
                .limit
                .per_minute
                .is_some_and(|max| self.started_last_minute >= max)
    }

    /// One line for people: `claude: 3/3 in flight, paused until ...`.
    fn summary(&self, backend: &str, now: i64) -> String {
        let mut parts = vec![match self.limit.in_flight {
            Some(max) => format!("{}/{max} in flight", self.in_flight),
            None => format!("{} in flight", self.in_flight),
        }];
        if let Some(max) = self.limit.per_minute {
            parts.push(format!(
                "{}/{max} started this minute",
                self.started_last_minute
            ));
        }
        if let Some(until) = self.paused_until.filter(|until| *until > now) {
            parts.push(format!(
                "paused for {:.1}s more ({})",
                (until - now) as f64 / 1000.0,
                self.pause_reason
            ));
        }
        format!("{backend}: {}", parts.join(", "))
    }
}

impl Quotas {
    pub(crate) fn new(limits: BTreeMap<String, Limit>, default_pause: Duration) -> Self {
        Self {
            engaged: AtomicBool::new(!limits.is_empty()),
            limits,
            default_pause,
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Counts only: a panic halfway leaves nothing a rebuild does not repair.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether anything is enforced (a limit configured, or a pause reported since start).
    pub(crate) fn engaged(&self) -> bool {
        self.engaged.load(Ordering::Relaxed)
    }

    /// Remembers the backend `worker_id` runs auto tasks on (from its claims).
    pub(crate) fn note_worker(&self, worker_id: &str, auto: &str) {
        if auto.is_empty() {
            return;
        }
        let mut state = self.state();
        if state.auto.get(worker_id).map(String::as_str) != Some(auto) {
            state.auto.insert(worker_id.to_owned(), auto.to_owned());
        }
    }

    fn standing(&self, state: &State, backend: &str, now: i64) -> Standing {
        let in_flight = state
            .held
            .values()
            .filter(|held| held.backend == backend)
            .count();
        let started = state.starts.get(backend).map_or(0, |starts| {
            starts.iter().filter(|at| **at > now - MINUTE_MS).count()
        });
        let paused = state.paused.get(backend).filter(|p| p.until > now);
        Standing {
            in_flight: u32::try_from(in_flight).unwrap_or(u32::MAX),
            limit: self.limits.get(backend).copied().unwrap_or_default(),
            started_last_minute: u32::try_from(started).unwrap_or(u32::MAX),
            paused_until: paused.map(|p| p.until),
            pause_reason: paused.map(|p| p.reason.clone()).unwrap_or_default(),
        }
    }

    /// Whether `worker_id` may take `task` now; if so the task is counted against its
    /// backend (in flight, and a start this minute). The claim paths call this for each task
    /// they would hand out, in claim order, and skip a task it refuses.
    pub(crate) fn admit(&self, task: &Task, worker_id: &str, now: i64) -> bool {
        if !self.engaged() {
            return true;
        }
        let mut state = self.state();
        let auto = state.auto.get(worker_id).cloned().unwrap_or_default();
        let Some(backend) = backend_of(task, &auto) else {
            return true;
        };
        let key = (task.session_id.clone(), task.id.clone());
        // A batch run again after a lost write claims the same task for the same lease
        // again: counted once. An entry of an earlier lease is stale (its release is late).
        if state
            .held
            .get(&key)
            .is_some_and(|held| held.token > task.fencing_token)
        {
            return true;
        }
        if self.standing(&state, &backend, now).blocks(now) {
            return false;
        }
        let starts = state.starts.entry(backend.clone()).or_default();
        while starts.front().is_some_and(|at| *at <= now - MINUTE_MS) {
            starts.pop_front();
        }
        starts.push_back(now);
        state.held.insert(
            key,
            Held {
                backend,
                // The lease about to be written takes the next token.
                token: task.fencing_token + 1,
                since: now,
            },
        );
        true
    }

    /// Stops counting `task`'s attempt under `token` (completed, failed, put back).
    pub(crate) fn release(&self, session_id: &str, task_id: &str, token: u64, now: i64) {
        if !self.engaged() {
            return;
        }
        let mut state = self.state();
        let key = (session_id.to_owned(), task_id.to_owned());
        if state.held.get(&key).is_some_and(|held| held.token <= token) {
            state.held.remove(&key);
        }
        state.released.insert(key, (token, now));
    }

    /// Pauses claims of `backend` for `retry_after` (the default pause when `None`), as a
    /// worker reported. A later pause that ends sooner does not shorten it. Returns the end.
    pub(crate) fn pause(
        &self,
        backend: &str,
        retry_after: Option<Duration>,
        reason: String,
        now: i64,
    ) -> i64 {
        self.engaged.store(true, Ordering::Relaxed);
        let wait = retry_after.unwrap_or(self.default_pause);
        let until = now.saturating_add(i64::try_from(wait.as_millis()).unwrap_or(i64::MAX));
        let mut state = self.state();
        let paused = state.paused.entry(backend.to_owned()).or_insert(Paused {
            until,
            reason: reason.clone(),
        });
        if until >= paused.until {
            *paused = Paused { until, reason };
        }
        crate::metrics::quota_paused(backend);
        paused.until
    }

    /// Rebuilds the counts from the store's live tasks (ready and running, with their
    /// fencing tokens) read at `read_at`; records which ready tasks wait and refreshes the
    /// gauges. Returns whether some ready task waits on a quota that may open with time (a
    /// pause ending, the minute moving on), so the caller wakes parked claims.
    pub(crate) fn rebuild(&self, live: &[Task], read_at: i64) -> bool {
        let mut state = self.state();
        let now = read_at;
        let mut held: HashMap<(String, String), Held> = HashMap::new();
        for task in live.iter().filter(|t| t.state == pb::TaskState::Running) {
            let key = (task.session_id.clone(), task.id.clone());
            let released = state
                .released
                .get(&key)
                .is_some_and(|(token, _)| *token >= task.fencing_token);
            if released {
                continue;
            }
            let auto = state.auto.get(&task.worker_id).cloned().unwrap_or_default();
            if let Some(backend) = backend_of(task, &auto) {
                let since = task.started_at.unwrap_or(now);
                held.insert(
                    key,
                    Held {
                        backend,
                        token: task.fencing_token,
                        since,
                    },
                );
            }
        }
        // Counted by a claim whose write may not be visible yet.
        for (key, entry) in &state.held {
            if entry.since > now - CLAIM_GRACE_MS && !held.contains_key(key) {
                held.insert(key.clone(), entry.clone());
            }
        }
        state.held = held;
        state
            .released
            .retain(|_, (_, at)| *at > now - CLAIM_GRACE_MS);
        state.paused.retain(|_, paused| paused.until > now);
        for starts in state.starts.values_mut() {
            while starts.front().is_some_and(|at| *at <= now - MINUTE_MS) {
                starts.pop_front();
            }
        }
        let mut waiting: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
        let mut standings: HashMap<String, Standing> = HashMap::new();
        for task in live.iter().filter(|t| t.state == pb::TaskState::Ready) {
            // A ready task of an auto backend waits on no particular worker's quota.
            let Some(backend) = backend_of(task, "") else {
                continue;
            };
            let standing = standings
                .entry(backend.clone())
                .or_insert_with(|| self.standing(&state, &backend, now));
            if standing.blocks(now) {
                waiting
                    .entry(backend)
                    .or_default()
                    .entry(task.session_id.clone())
                    .or_default()
                    .push(task.id.clone());
            }
        }
        let mut backends: Vec<String> = self.limits.keys().cloned().collect();
        backends.extend(state.paused.keys().cloned());
        backends.extend(state.waiting.keys().cloned());
        backends.extend(waiting.keys().cloned());
        backends.sort();
        backends.dedup();
        for backend in &backends {
            let count: usize = waiting
                .get(backend)
                .map_or(0, |sessions| sessions.values().map(Vec::len).sum());
            let standing = self.standing(&state, backend, now);
            crate::metrics::quota_standing(backend, standing.in_flight, count);
        }
        let any_waiting = !waiting.is_empty();
        state.waiting = waiting;
        any_waiting
    }

    /// The quotas `session_id`'s ready tasks wait on, as of the last rebuild, with the counts
    /// as they are now.
    pub(crate) fn waits(&self, session_id: &str, now: i64) -> Vec<pb::QuotaWait> {
        if !self.engaged() {
            return Vec::new();
        }
        let state = self.state();
        let mut out = Vec::new();
        for (backend, sessions) in &state.waiting {
            let Some(task_ids) = sessions.get(session_id) else {
                continue;
            };
            let standing = self.standing(&state, backend, now);
            out.push(pb::QuotaWait {
                backend: backend.clone(),
                in_flight: standing.in_flight,
                in_flight_limit: standing.limit.in_flight.unwrap_or(0),
                started_last_minute: standing.started_last_minute,
                per_minute_limit: standing.limit.per_minute.unwrap_or(0),
                paused_until: standing.paused_until.map(timestamp),
                task_ids: task_ids
                    .iter()
                    .take(crate::check::MAX_LISTED)
                    .cloned()
                    .collect(),
                task_count: u32::try_from(task_ids.len()).unwrap_or(u32::MAX),
                message: format!(
                    "{} ready task(s) wait on the {backend} quota: {}",
                    task_ids.len(),
                    standing.summary(backend, now)
                ),
            });
        }
        out
    }

    /// One line on `backend`'s standing now, for the messages a wait gets.
    pub(crate) fn summary(&self, backend: &str, now: i64) -> String {
        let state = self.state();
        self.standing(&state, backend, now).summary(backend, now)
    }

    /// Sessions with tasks waiting, per backend, as of the last rebuild.
    pub(crate) fn waiting(&self) -> Vec<(String, String, usize)> {
        let state = self.state();
        state
            .waiting
            .iter()
            .flat_map(|(backend, sessions)| {
                sessions
                    .iter()
                    .map(move |(session, ids)| (backend.clone(), session.clone(), ids.len()))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn task(id: &str, spec: serde_json::Value) -> Task {
        Task {
            session_id: "s".to_owned(),
            id: id.to_owned(),
            role: pb::Role::Executor,
            // What intake stores for a task naming `agent.backend`.
            backends: spec["agent"]["backend"]
                .as_str()
                .map(|name| vec![name.to_ascii_lowercase()])
                .unwrap_or_default(),
            spec: spec.as_object().cloned().unwrap_or_default().into(),
            state: pb::TaskState::Ready,
            ..Task::default()
        }
    }

    #[test]
    fn limits_parse_and_bad_ones_are_refused_with_the_reason() {
        let limits = parse_limits(&["claude=in_flight:3,per_minute:30".to_owned()]).unwrap();
        assert_eq!(
            limits["claude"],
            Limit {
                in_flight: Some(3),
                per_minute: Some(30)
            }
        );
        for bad in ["claude", "claude=", "claude=in_flight:0", "x=speed:3"] {
            let err = parse_limits(&[bad.to_owned()]).unwrap_err().to_string();
            assert!(err.contains("quota"), "{bad}: {err}");
        }
        let twice = parse_limits(&["a=in_flight:1".to_owned(), "a=in_flight:2".to_owned()]);
        assert!(twice.unwrap_err().to_string().contains("twice"));
    }

    #[test]
    fn the_backend_comes_from_the_task_else_the_workers_auto() {
        let mut named = task("a", json!({}));
        named.backends = vec!["claude".to_owned(), "codex".to_owned()];
        assert_eq!(backend_of(&named, "qwen").as_deref(), Some("claude"));
        let auto = task("e", json!({}));
        assert_eq!(backend_of(&auto, "Qwen").as_deref(), Some("qwen"));
        assert_eq!(backend_of(&auto, ""), None);
        let mut validator = named.clone();
        validator.role = pb::Role::Validator;
        assert_eq!(backend_of(&validator, "qwen"), None);
    }

    #[test]
    fn in_flight_and_rate_limits_hold_and_release() {
        let limits = parse_limits(&["agent=in_flight:2,per_minute:3".to_owned()]).unwrap();
        let quotas = Quotas::new(limits, Duration::from_secs(30));
        let tasks: Vec<Task> = (0..5)
            .map(|i| task(&format!("T{i}"), json!({"agent": {"backend": "agent"}})))
            .collect();
        assert!(quotas.admit(&tasks[0], "w", 0));
        assert!(quotas.admit(&tasks[1], "w", 0));
        assert!(!quotas.admit(&tasks[2], "w", 0), "in flight at its limit");
        // Claimed again in a batch run twice: still one.
        assert!(quotas.admit(&tasks[1], "w", 0));
        quotas.release("s", "T0", 1, 10);
        assert!(quotas.admit(&tasks[2], "w", 10));
        quotas.release("s", "T1", 1, 20);
        assert!(
            !quotas.admit(&tasks[3], "w", 20),
            "three started this minute"
        );
        assert!(
            quotas.admit(&tasks[3], "w", MINUTE_MS + 1),
            "the minute moved on"
        );
    }

    #[test]
    fn a_pause_holds_every_claim_of_its_backend_until_it_ends() {
        let quotas = Quotas::new(BTreeMap::new(), Duration::from_secs(30));
        let claude = task("a", json!({"agent": {"backend": "claude"}}));
        let codex = task("b", json!({"agent": {"backend": "codex"}}));
        assert!(!quotas.engaged());
        let until = quotas.pause("claude", Some(Duration::from_secs(2)), "429".into(), 1_000);
        assert_eq!(until, 3_000);
        assert!(!quotas.admit(&claude, "w", 2_999));
        assert!(quotas.admit(&codex, "w", 2_999));
        assert!(quotas.admit(&claude, "w", 3_000));
        // A task put back after its 429 is not let through by its old attempt's count.
        let mut again = claude.clone();
        again.fencing_token = 1;
        quotas.pause("claude", Some(Duration::from_secs(2)), "429".into(), 3_000);
        assert!(!quotas.admit(&again, "w", 3_001));
        // No reset time named: the default pause.
        assert_eq!(quotas.pause("codex", None, "429".into(), 0), 30_000);
    }

    #[test]
    fn a_rebuild_counts_running_tasks_and_keeps_fresh_claims() {
        let limits = parse_limits(&["agent=in_flight:2".to_owned()]).unwrap();
        let quotas = Quotas::new(limits, Duration::from_secs(30));
        let mut running = task("R", json!({"agent": {"backend": "agent"}}));
        running.state = pb::TaskState::Running;
        running.fencing_token = 1;
        let ready = task("Q", json!({"agent": {"backend": "agent"}}));
        let fresh = task("F", json!({"agent": {"backend": "agent"}}));
        // A restart: nothing in memory, one task running in the store.
        assert!(!quotas.rebuild(&[running.clone(), ready.clone()], 100_000));
        assert!(quotas.admit(&fresh, "w", 100_001));
        // The fresh claim is not in the store yet: kept, and the ready one now waits.
        assert!(quotas.rebuild(&[running.clone(), ready.clone()], 100_002));
        assert_eq!(quotas.waits("s", 100_002)[0].task_ids, ["Q"]);
        // The running task completed (released); a rebuild that still read it running
        // does not count it again.
        quotas.release("s", "R", 1, 100_003);
        assert!(!quotas.rebuild(&[running, ready], 100_004));
    }
}

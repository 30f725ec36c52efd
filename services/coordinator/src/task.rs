//! The task ([`Task`]) and its state machine, free of I/O: the tasks a transaction loaded go
//! in, the transitions to record come out. [`crate::lifecycle`] calls these inside its transactions.

use std::collections::HashMap;
use std::time::Duration;

use rand::Rng;
use troupe_plan::{Mode, OnFailure};
use troupe_proto::v1::{self as pb, SessionState, TaskState};

/// Longest retry delay.
const BACKOFF_CAP: Duration = Duration::from_secs(60);

/// A task of a session: what the plan says it is, where it stands (state, attempt, lease) and
/// what it produced. One row of the `tasks` table.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Task {
    pub(crate) session_id: String,
    pub(crate) id: String,
    /// Index in the plan's topological order.
    pub(crate) position: i64,
    pub(crate) title: String,
    pub(crate) description: String,
    pub(crate) role: pb::Role,
    pub(crate) priority: pb::Priority,
    pub(crate) repo: String,
    pub(crate) wave: u32,
    pub(crate) critical_path: u32,
    /// Estimated milliseconds of the longest chain from this task to a sink (the plan's
    /// `path_ms`): the claim order's rank after priority.
    pub(crate) path_ms: u64,
    pub(crate) depends_on: Vec<String>,
    pub(crate) files: Vec<pb::FileChange>,
    /// The task's object from the plan. Shared: tasks are copied on every batch (the
    /// session's in-memory copy, the batch's before and after), the spec never changes.
    pub(crate) spec: std::sync::Arc<serde_json::Map<String, serde_json::Value>>,
    pub(crate) state: TaskState,
    pub(crate) attempt: u32,
    pub(crate) max_attempts: u32,
    pub(crate) fencing_token: u64,
    pub(crate) worker_id: String,
    pub(crate) lease_ms: i64,
    pub(crate) lease_expires_at: Option<i64>,
    pub(crate) not_before: Option<i64>,
    pub(crate) created_at: i64,
    pub(crate) started_at: Option<i64>,
    pub(crate) finished_at: Option<i64>,
    pub(crate) progress: String,
    /// Boxed: a result is most of a task's size inline (about 1 KB of its 1.6), and tasks are
    /// moved and copied on every batch; most tasks of a session have none yet.
    pub(crate) result: Option<Box<pb::TaskResult>>,
    pub(crate) last_error: Option<pb::TaskError>,
    /// The re-run that replaced this failed task in a fix round (empty when none): the task
    /// stays failed but no longer holds the session back.
    pub(crate) superseded_by: String,
    /// The task's own criteria as last checked by a validator task downstream of it.
    pub(crate) convergence: Option<pb::TaskConvergence>,
    /// The backends a worker must offer (one of) to take it, primary first; empty: any
    /// worker (see [`crate::lifecycle::routing`]). Decided at intake.
    pub(crate) backends: Vec<String>,
}

/// Every state a task can be in.
pub(crate) const STATES: [TaskState; 10] = [
    TaskState::Pending,
    TaskState::Ready,
    TaskState::Running,
    TaskState::Completed,
    TaskState::Failed,
    TaskState::Skipped,
    TaskState::Cancelled,
    TaskState::TimedOut,
    TaskState::Blocked,
    TaskState::WaitingApproval,
];

/// Whether a dependency in `state` settles its pending dependents as skipped or blocked (see
/// [`settle_beside`]): it ended without completing.
pub(crate) fn fails_dependents(state: TaskState) -> bool {
    is_terminal(state) && state != TaskState::Completed
}

/// Returns true for states a task never leaves on its own.
pub(crate) fn is_terminal(state: TaskState) -> bool {
    matches!(
        state,
        TaskState::Completed
            | TaskState::Failed
            | TaskState::Skipped
            | TaskState::Cancelled
            | TaskState::TimedOut
            | TaskState::Blocked
    )
}

/// Returns true for session states that end scheduling.
pub(crate) fn is_session_terminal(state: SessionState) -> bool {
    matches!(
        state,
        SessionState::Completed | SessionState::Failed | SessionState::Cancelled
    )
}

/// Records a state change on `task` and returns its event payload.
pub(crate) fn transition(
    task: &mut Task,
    to: TaskState,
    reason: impl Into<String>,
    now_ms: i64,
) -> pb::TaskTransition {
    let from = task.state;
    task.state = to;
    if is_terminal(to) {
        task.finished_at = Some(now_ms);
        task.lease_expires_at = None;
    }
    if to != TaskState::Running {
        task.lease_expires_at = None;
    }
    pb::TaskTransition {
        task_id: task.id.clone(),
        from: from as i32,
        to: to as i32,
        attempt: task.attempt,
        worker_id: task.worker_id.clone(),
        reason: reason.into(),
    }
}

/// Moves tasks the dependency graph decides: pending tasks downstream of a terminal failure
/// become skipped or blocked (transitively), and pending tasks whose dependencies completed
/// (and, in `waves` mode, whose earlier waves are all terminal) become ready once their retry
/// backoff has passed. `tasks` must be in topological order.
pub(crate) fn settle(
    tasks: &mut [Task],
    mode: Mode,
    on_failure: OnFailure,
    now_ms: i64,
) -> Vec<pb::TaskTransition> {
    settle_beside(tasks, |_| None, mode, on_failure, now_ms)
}

/// [`settle`] of some of a session's tasks, whose dependencies outside `tasks` have the states
/// `beside` tells (which it does not change; `None`: no such task). In `waves` mode `tasks`
/// must be the whole graph: the barrier looks at every task.
pub(crate) fn settle_beside(
    tasks: &mut [Task],
    beside: impl Fn(&str) -> Option<TaskState>,
    mode: Mode,
    on_failure: OnFailure,
    now_ms: i64,
) -> Vec<pb::TaskTransition> {
    let mut transitions = Vec::new();
    let index: HashMap<String, usize> = tasks
        .iter()
        .enumerate()
        .map(|(position, task)| (task.id.clone(), position))
        .collect();
    let state_of = |tasks: &[Task], dep: &str| {
        index
            .get(dep)
            .map(|&at| tasks[at].state)
            .or_else(|| beside(dep))
    };

    // Topological order makes one pass enough for transitive propagation.
    for position in 0..tasks.len() {
        if tasks[position].state != TaskState::Pending {
            continue;
        }
        let failed_dep = tasks[position].depends_on.iter().find_map(|dep| {
            let state = state_of(tasks, dep)?;
            fails_dependents(state).then(|| (dep.clone(), state))
        });
        if let Some((dep, dep_state)) = failed_dep {
            let to = match on_failure {
                OnFailure::Skip => TaskState::Skipped,
                OnFailure::Block => TaskState::Blocked,
            };
            let reason = format!("dependency {dep} is {}", state_name(dep_state));
            transitions.push(transition(&mut tasks[position], to, reason, now_ms));
        }
    }

    let min_open_wave = tasks
        .iter()
        .filter(|task| !is_terminal(task.state))
        .map(|task| task.wave)
        .min()
        .unwrap_or(u32::MAX);
    for position in 0..tasks.len() {
        let task = &tasks[position];
        if task.state != TaskState::Pending {
            continue;
        }
        let deps_done = task
            .depends_on
            .iter()
            .all(|dep| state_of(tasks, dep) == Some(TaskState::Completed));
        let due = task.not_before.is_none_or(|at| at <= now_ms);
        let barrier_open = mode == Mode::Eager || task.wave <= min_open_wave;
        if deps_done && due && barrier_open {
            let reason = if task.attempt == 0 {
                "dependencies completed"
            } else {
                "retry backoff elapsed"
            };
            let task = &mut tasks[position];
            task.not_before = None;
            transitions.push(transition(task, TaskState::Ready, reason, now_ms));
        }
    }
    transitions
}

/// Returns the state a session reaches when every task is terminal, else `None`.
pub(crate) fn session_outcome(tasks: &[Task]) -> Option<SessionState> {
    if !tasks.iter().all(|task| is_terminal(task.state)) {
        return None;
    }
    if tasks.iter().all(|task| {
        task.state == TaskState::Completed
            || (task.state == TaskState::Failed && !task.superseded_by.is_empty())
    }) {
        Some(SessionState::Completed)
    } else {
        Some(SessionState::Failed)
    }
}

/// How long a failed task waits before its next attempt: 1 s · 2^(attempt-1), capped at 60 s,
/// with jitter so retries do not march in step.
const RETRY: troupe_grpc::Backoff = troupe_grpc::Backoff::new(Duration::from_secs(1), BACKOFF_CAP);

/// Returns the delay before retry number `attempt` (the attempt that just failed, 1-based).
pub(crate) fn backoff(attempt: u32, rng: &mut impl Rng) -> Duration {
    RETRY.delay_with(attempt.saturating_sub(1), rng)
}

/// A task that cannot make progress, and why.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Stuck {
    pub(crate) task_id: String,
    pub(crate) state: TaskState,
    pub(crate) reason: String,
}

/// Detects a stall: nothing ready, nothing running (nor waiting out a retry backoff), and
/// work left (pending or blocked tasks). Returns the stuck tasks with their reasons, or `None`.
pub(crate) fn stall(tasks: &[Task], session: SessionState, now_ms: i64) -> Option<Vec<Stuck>> {
    if matches!(session, SessionState::Completed | SessionState::Cancelled) {
        return None;
    }
    // A task at its approval gate waits on a person, not on the graph: not a stall.
    let moving = tasks.iter().any(|task| {
        matches!(
            task.state,
            TaskState::Ready | TaskState::Running | TaskState::WaitingApproval
        ) || (task.state == TaskState::Pending && task.not_before.is_some_and(|at| at > now_ms))
    });
    if moving {
        return None;
    }
    let states: HashMap<&str, TaskState> = tasks
        .iter()
        .map(|task| (task.id.as_str(), task.state))
        .collect();
    let stuck: Vec<Stuck> = tasks
        .iter()
        .filter(|task| matches!(task.state, TaskState::Pending | TaskState::Blocked))
        .map(|task| stuck(task, |dep| states.get(dep).copied(), session))
        .collect();
    (!stuck.is_empty()).then_some(stuck)
}

/// A pending or blocked task of a stalled session and why it cannot start: `state_of` gives
/// the state of a dependency (`None`: no such task).
pub(crate) fn stuck(
    task: &Task,
    state_of: impl Fn(&str) -> Option<TaskState>,
    session: SessionState,
) -> Stuck {
    let waits: Vec<String> = task
        .depends_on
        .iter()
        .filter_map(|dep| match state_of(dep) {
            None => Some(format!("depends on unknown task {dep}")),
            Some(TaskState::Completed) => None,
            Some(state) => Some(format!("waits on {dep} ({})", state_name(state))),
        })
        .collect();
    let reason = if !waits.is_empty() {
        waits.join(", ")
    } else if session == SessionState::Paused {
        "the session is paused".to_owned()
    } else {
        format!(
            "dependencies completed but the task is {} (resume the session)",
            state_name(task.state)
        )
    };
    Stuck {
        task_id: task.id.clone(),
        state: task.state,
        reason,
    }
}

/// Returns the lowercase name of a task state, for reasons and messages.
pub(crate) fn state_name(state: TaskState) -> &'static str {
    troupe_proto::names::task_state(state)
}

/// Returns the lowercase name of a session state.
pub(crate) fn session_state_name(state: SessionState) -> &'static str {
    troupe_proto::names::session_state(state)
}

/// What a claim carries of a completed task upstream of the claimed one: its result and what
/// a worker needs beside it. Only these fields: a claim is built on the group commit's lane,
/// so copying the whole task for each claim of each of its dependents would cost it there.
#[derive(Debug)]
pub(crate) struct Upstream {
    pub(crate) id: String,
    pub(crate) role: pb::Role,
    pub(crate) repo: String,
    pub(crate) position: i64,
    pub(crate) finished_at: Option<i64>,
    pub(crate) files: Vec<pb::FileChange>,
    pub(crate) spec: std::sync::Arc<serde_json::Map<String, serde_json::Value>>,
    pub(crate) result: Option<Box<pb::TaskResult>>,
}

impl From<&Task> for Upstream {
    fn from(task: &Task) -> Self {
        Self {
            id: task.id.clone(),
            role: task.role,
            repo: task.repo.clone(),
            position: task.position,
            finished_at: task.finished_at,
            files: task.files.clone(),
            spec: std::sync::Arc::clone(&task.spec),
            result: task.result.clone(),
        }
    }
}

/// A ready task's place in claim order: the order of the `tasks_session_ready` index (and of
/// [`crate::store::tasks::read_batch`]'s ready tasks) within a session.
pub(crate) fn claim_order(task: &Task) -> (i32, std::cmp::Reverse<u64>, i64, i64) {
    (
        task.priority as i32,
        std::cmp::Reverse(task.path_ms),
        task.created_at,
        task.position,
    )
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    fn row(id: &str, deps: &[&str], wave: u32, position: i64) -> Task {
        Task {
            session_id: "s".into(),
            id: id.into(),
            position,
            title: id.into(),
            description: String::new(),
            role: pb::Role::Executor,
            priority: pb::Priority::P1,
            repo: "app".into(),
            wave,
            critical_path: 1,
            path_ms: 60_000,
            depends_on: deps.iter().map(|d| (*d).to_owned()).collect(),
            files: Vec::new(),
            spec: std::sync::Arc::default(),
            state: TaskState::Pending,
            attempt: 0,
            max_attempts: 2,
            fencing_token: 0,
            worker_id: String::new(),
            lease_ms: 0,
            lease_expires_at: None,
            not_before: None,
            created_at: 0,
            started_at: None,
            finished_at: None,
            progress: String::new(),
            result: None,
            last_error: None,
            superseded_by: String::new(),
            convergence: None,
            backends: Vec::new(),
        }
    }

    fn states(tasks: &[Task]) -> Vec<TaskState> {
        tasks.iter().map(|task| task.state).collect()
    }

    #[test]
    fn eager_releases_tasks_whose_own_deps_completed() {
        // A -> B ; C (wave 1) ; D depends on C.
        let mut tasks = vec![
            row("A", &[], 1, 0),
            row("C", &[], 1, 1),
            row("B", &["A"], 2, 2),
            row("D", &["C"], 2, 3),
        ];
        settle(&mut tasks, Mode::Eager, OnFailure::Skip, 0);
        assert_eq!(
            states(&tasks),
            vec![
                TaskState::Ready,
                TaskState::Ready,
                TaskState::Pending,
                TaskState::Pending
            ]
        );
        tasks[1].state = TaskState::Completed;
        let transitions = settle(&mut tasks, Mode::Eager, OnFailure::Skip, 0);
        assert_eq!(transitions.len(), 1);
        assert_eq!(tasks[3].state, TaskState::Ready);
        assert_eq!(tasks[2].state, TaskState::Pending);
    }

    #[test]
    fn a_part_of_the_graph_settles_against_the_states_beside_it() {
        // B waits for A and X, D for X alone, E for Y; X and Y are not among the tasks.
        let mut tasks = vec![
            row("A", &[], 1, 0),
            row("B", &["A", "X"], 2, 1),
            row("D", &["X"], 2, 2),
            row("E", &["Y"], 2, 3),
        ];
        tasks[0].state = TaskState::Completed;
        let running = |id: &str| ["X", "Y"].contains(&id).then_some(TaskState::Running);
        settle_beside(&mut tasks, running, Mode::Eager, OnFailure::Skip, 0);
        assert_eq!(&states(&tasks)[1..], [TaskState::Pending; 3]);
        let beside = HashMap::from([
            ("X".to_owned(), TaskState::Completed),
            ("Y".to_owned(), TaskState::Failed),
        ]);
        let beside = |id: &str| beside.get(id).copied();
        let transitions = settle_beside(&mut tasks, beside, Mode::Eager, OnFailure::Skip, 0);
        assert_eq!(
            &states(&tasks)[1..],
            [TaskState::Ready, TaskState::Ready, TaskState::Skipped]
        );
        assert_eq!(transitions.len(), 3);
        // A dependency neither among the tasks nor beside them is not done.
        let mut alone = vec![row("F", &["Z"], 2, 0)];
        settle_beside(&mut alone, beside, Mode::Eager, OnFailure::Skip, 0);
        assert_eq!(alone[0].state, TaskState::Pending);
    }

    #[test]
    fn waves_wait_for_the_whole_earlier_wave() {
        let mut tasks = vec![
            row("A", &[], 1, 0),
            row("C", &[], 1, 1),
            row("B", &["A"], 2, 2),
            row("D", &["C"], 2, 3),
        ];
        tasks[0].state = TaskState::Ready;
        tasks[1].state = TaskState::Completed;
        settle(&mut tasks, Mode::Waves, OnFailure::Skip, 0);
        assert_eq!(
            tasks[3].state,
            TaskState::Pending,
            "A of wave 1 is still open"
        );
        tasks[0].state = TaskState::Completed;
        settle(&mut tasks, Mode::Waves, OnFailure::Skip, 0);
        assert_eq!(tasks[2].state, TaskState::Ready);
        assert_eq!(tasks[3].state, TaskState::Ready);
    }

    #[test]
    fn failure_skips_or_blocks_downstream_transitively() {
        for (policy, expected) in [
            (OnFailure::Skip, TaskState::Skipped),
            (OnFailure::Block, TaskState::Blocked),
        ] {
            let mut tasks = vec![
                row("A", &[], 1, 0),
                row("B", &["A"], 2, 1),
                row("C", &["B"], 3, 2),
                row("X", &[], 1, 3),
            ];
            tasks[0].state = TaskState::Failed;
            tasks[3].state = TaskState::Completed;
            let transitions = settle(&mut tasks, Mode::Eager, policy, 5);
            assert_eq!(transitions.len(), 2);
            assert_eq!(tasks[1].state, expected);
            assert_eq!(tasks[2].state, expected);
            assert_eq!(tasks[2].finished_at, Some(5));
            assert!(
                transitions[1].reason.contains('B'),
                "{}",
                transitions[1].reason
            );
            assert_eq!(session_outcome(&tasks), Some(SessionState::Failed));
        }
    }

    #[test]
    fn backoff_respects_not_before() {
        let mut tasks = vec![row("A", &[], 1, 0)];
        tasks[0].not_before = Some(100);
        tasks[0].attempt = 1;
        settle(&mut tasks, Mode::Eager, OnFailure::Skip, 99);
        assert_eq!(tasks[0].state, TaskState::Pending);
        settle(&mut tasks, Mode::Eager, OnFailure::Skip, 100);
        assert_eq!(tasks[0].state, TaskState::Ready);
        assert_eq!(tasks[0].not_before, None);
    }

    #[test]
    fn stall_names_stuck_tasks_and_why() {
        let mut tasks = vec![
            row("A", &[], 1, 0),
            row("B", &["A"], 2, 1),
            row("C", &["B", "X"], 3, 2),
        ];
        tasks[0].state = TaskState::Failed;
        tasks[1].state = TaskState::Blocked;
        let stuck = stall(&tasks, SessionState::Failed, 0).expect("stalled");
        let reasons: Vec<(&str, &str)> = stuck
            .iter()
            .map(|s| (s.task_id.as_str(), s.reason.as_str()))
            .collect();
        assert_eq!(
            reasons,
            vec![
                ("B", "waits on A (failed)"),
                ("C", "waits on B (blocked), depends on unknown task X")
            ]
        );
        tasks[2].state = TaskState::Ready;
        assert_eq!(stall(&tasks, SessionState::Active, 0), None, "C can run");
        tasks[2].state = TaskState::Pending;
        tasks[2].not_before = Some(10);
        assert_eq!(
            stall(&tasks, SessionState::Active, 5),
            None,
            "backoff pending"
        );
        assert_eq!(stall(&tasks, SessionState::Completed, 50), None);
    }

    #[test]
    fn outcome_needs_every_task_terminal() {
        let mut tasks = vec![row("A", &[], 1, 0), row("B", &[], 1, 1)];
        tasks[0].state = TaskState::Completed;
        assert_eq!(session_outcome(&tasks), None);
        tasks[1].state = TaskState::Completed;
        assert_eq!(session_outcome(&tasks), Some(SessionState::Completed));
        tasks[1].state = TaskState::Failed;
        assert_eq!(session_outcome(&tasks), Some(SessionState::Failed));
        tasks[1].superseded_by = "B-R1".into();
        assert_eq!(
            session_outcome(&tasks),
            Some(SessionState::Completed),
            "a superseded failure does not hold the session back"
        );
    }

    #[test]
    fn backoff_grows_with_jitter_and_cap() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..100 {
            let first = backoff(1, &mut rng);
            assert!(
                first >= Duration::from_millis(800) && first <= Duration::from_millis(1200),
                "{first:?}"
            );
            let third = backoff(3, &mut rng);
            assert!(
                third >= Duration::from_millis(3200) && third <= Duration::from_millis(4800),
                "{third:?}"
            );
            assert!(backoff(30, &mut rng) <= BACKOFF_CAP);
        }
    }
}

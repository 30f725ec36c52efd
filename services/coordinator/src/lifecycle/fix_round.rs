//! Fix rounds: CCW's generator-critic loop (1.C.12, `test.gc` on test-runner tasks) and gap
//! closure (1.D.6, `gap_closure` on validator tasks). When such a check fails terminally
//! ([`super::fail`]) with a report that says what is wrong, [`fix_round`] adds, in the failure's
//! transaction, an executor task `FIX-<orig>-R<n>` that is told what failed and a re-run
//! `<orig>-R<n>` of the check after it, supersedes the failed task and points its dependents at
//! the re-run, so downstream waits instead of being skipped. Rounds are counted per chain (the
//! original task id). What a failure starts ([`decide`]) and how the graph changes ([`apply`])
//! are free of I/O.

use serde_json::{Map, Value, json};
use troupe_proto::v1::{self as pb, TaskState};

use crate::Error;
use crate::store::Tx;
use crate::store::messages::{NewMessage, insert_message};
use crate::store::tasks::{insert_task, load_task};
use crate::task::Task;

/// After the terminal failure of `task_id` (already in `tasks`, not yet saved): starts a fix
/// round when its spec asks for one (see [`decide`]), inserting the two new tasks into the
/// database and into `before`/`tasks` (so `save` settles them with the rest), or logs that the
/// chain's rounds are used up. Returns the transitions to record.
pub(crate) async fn fix_round(
    tx: &mut Tx,
    before: &mut Vec<Task>,
    tasks: &mut Vec<Task>,
    task_id: &str,
    error: &pb::TaskError,
    partial: Option<&pb::TaskResult>,
    now: i64,
) -> Result<Vec<pb::TaskTransition>, Error> {
    let Some(index) = tasks.iter().position(|task| task.id == task_id) else {
        return Ok(Vec::new());
    };
    let session_id = tasks[index].session_id.clone();
    // The write path loads tasks without their spec; the loop configuration lives there.
    let stored = load_task(tx, &session_id, task_id).await?;
    let mut failed = tasks[index].clone();
    failed.spec = stored.spec;
    let decision = decide(
        &failed,
        error,
        partial,
        |id| tasks.iter().any(|task| task.id == id),
        now,
    );
    match decision {
        Decision::None => Ok(Vec::new()),
        Decision::Exhausted {
            kind,
            chain,
            max_rounds,
        } => {
            tracing::warn!(session_id = %session_id, task_id, chain = %chain, max_rounds, "fix rounds exhausted");
            let mut data = Map::new();
            data.insert(
                "kind".to_owned(),
                Value::String(kind.message_type().to_owned()),
            );
            data.insert("chain".to_owned(), Value::String(chain.clone()));
            data.insert("failed_task".to_owned(), Value::String(task_id.to_owned()));
            data.insert("max_rounds".to_owned(), Value::from(max_rounds));
            let message = NewMessage {
                from: "coordinator".to_owned(),
                to: "user".to_owned(),
                kind: "warning".to_owned(),
                summary: format!("{} rounds exhausted for {chain}", kind.name()),
                data: Some(data),
                idempotency_key: None,
            };
            insert_message(tx, &session_id, message, now).await?;
            Ok(Vec::new())
        }
        Decision::Round(round) => {
            let transitions = apply(tasks, index, &round);
            insert_task(tx, &round.fix).await?;
            insert_task(tx, &round.rerun).await?;
            let (kind, summary, data) = round_message(task_id, &round);
            tracing::info!(session_id = %session_id, task_id, fix = %round.fix.id, rerun = %round.rerun.id, round = round.round, "fix round added");
            let message = NewMessage {
                from: "coordinator".to_owned(),
                to: "executor".to_owned(),
                kind,
                summary,
                data: Some(data),
                idempotency_key: None,
            };
            insert_message(tx, &session_id, message, now).await?;
            let rows = [round.fix, round.rerun];
            for (offset, row) in rows.into_iter().enumerate() {
                before.insert(index + 1 + offset, row.clone());
                tasks.insert(index + 1 + offset, row);
            }
            Ok(transitions)
        }
    }
}

/// Rounds a loop may add when its configuration does not say.
const DEFAULT_MAX_ROUNDS: u32 = 3;

/// Which loop a failure belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LoopKind {
    /// A test run below target (`test.gc`).
    GeneratorCritic,
    /// A goal-backward verification with gaps (`gap_closure`).
    GapClosure,
}

impl LoopKind {
    /// The CCW message type logged when a round starts.
    fn message_type(self) -> &'static str {
        match self {
            Self::GeneratorCritic => "gc_loop_trigger",
            Self::GapClosure => "gap_closure",
        }
    }

    /// The loop's name in reasons and summaries.
    fn name(self) -> &'static str {
        match self {
            Self::GeneratorCritic => "generator-critic",
            Self::GapClosure => "gap closure",
        }
    }
}

/// What the coordinator does about a terminal failure.
#[derive(Debug, Clone, PartialEq)]
enum Decision {
    /// Not a loop failure: the failure cascades as usual.
    None,
    /// Add a round.
    Round(Box<Round>),
    /// The chain used every round: the failure cascades, with a warning.
    Exhausted {
        kind: LoopKind,
        chain: String,
        max_rounds: u32,
    },
}

/// One round to add.
#[derive(Debug, Clone, PartialEq)]
struct Round {
    pub(crate) kind: LoopKind,
    /// The original task id.
    pub(crate) chain: String,
    /// 1-based round number.
    pub(crate) round: u32,
    pub(crate) max_rounds: u32,
    /// `FIX-<chain>-R<n>`, an executor task without dependencies.
    pub(crate) fix: Task,
    /// `<chain>-R<n>`, the check again, after the fix.
    pub(crate) rerun: Task,
    /// What failed, one line per item, for the message.
    pub(crate) findings: Vec<String>,
}

/// Decides what a terminal failure of `failed` (loaded with its spec) starts. `taken` says
/// whether a task id is already used in the session.
fn decide(
    failed: &Task,
    error: &pb::TaskError,
    partial: Option<&pb::TaskResult>,
    taken: impl Fn(&str) -> bool,
    now_ms: i64,
) -> Decision {
    if error.kind() != pb::ErrorKind::CheckFailed || failed.state != TaskState::Failed {
        return Decision::None;
    }
    let detail = partial.and_then(|result| result.detail.as_ref());
    let (kind, config, findings) = match (failed.role, detail) {
        (pb::Role::TestRunner, Some(pb::task_result::Detail::TestRun(report))) => {
            let config = failed
                .spec
                .get("test")
                .and_then(Value::as_object)
                .and_then(|test| test.get("gc"))
                .and_then(Value::as_object);
            (LoopKind::GeneratorCritic, config, test_findings(report))
        }
        (pb::Role::Validator, Some(pb::task_result::Detail::Validation(report))) => {
            let gaps = report
                .verification
                .as_ref()
                .map(|verification| verification.gaps.as_slice())
                .unwrap_or_default();
            if gaps.is_empty() {
                return Decision::None;
            }
            let config = failed.spec.get("gap_closure").and_then(Value::as_object);
            (LoopKind::GapClosure, config, gap_findings(gaps))
        }
        _ => return Decision::None,
    };
    let Some(config) = config else {
        return Decision::None;
    };
    let Some(agent) = config.get("agent").and_then(Value::as_object) else {
        return Decision::None;
    };
    let max_rounds = config
        .get("max_rounds")
        .and_then(Value::as_u64)
        .map_or(DEFAULT_MAX_ROUNDS, |n| u32::try_from(n).unwrap_or(u32::MAX));
    let used = failed
        .spec
        .get("gc_round")
        .and_then(Value::as_u64)
        .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX));
    let chain = failed
        .spec
        .get("gc_origin")
        .and_then(Value::as_str)
        .map_or_else(|| failed.id.clone(), str::to_owned);
    let round = used.saturating_add(1);
    let fix_id = format!("FIX-{chain}-R{round}");
    let rerun_id = format!("{chain}-R{round}");
    if round > max_rounds || taken(&fix_id) || taken(&rerun_id) {
        return Decision::Exhausted {
            kind,
            chain,
            max_rounds,
        };
    }

    let mut description = match kind {
        LoopKind::GeneratorCritic => format!(
            "The test run {} failed. Fix the code (or the tests, where they are wrong) so that every test passes and coverage meets its target.\n",
            failed.id
        ),
        LoopKind::GapClosure => format!(
            "The goal-backward verification {} found gaps. Close each gap below.\n",
            failed.id
        ),
    };
    for finding in &findings {
        description.push_str("- ");
        description.push_str(finding);
        description.push('\n');
    }
    let title = match kind {
        LoopKind::GeneratorCritic => format!("Fix the failing tests of {chain} (round {round})"),
        LoopKind::GapClosure => format!("Close the verification gaps of {chain} (round {round})"),
    };
    let mut fix_spec = Map::new();
    fix_spec.insert("id".to_owned(), json!(fix_id));
    fix_spec.insert("title".to_owned(), json!(title));
    fix_spec.insert("description".to_owned(), json!(description));
    fix_spec.insert("role".to_owned(), json!("executor"));
    fix_spec.insert("agent".to_owned(), Value::Object(agent.clone()));
    fix_spec.insert("depends_on".to_owned(), json!([]));
    fix_spec.insert("allow_empty".to_owned(), json!(false));
    for key in ["focus_paths", "files"] {
        if let Some(value) = config.get(key) {
            fix_spec.insert(key.to_owned(), value.clone());
        }
    }
    fix_spec.insert("gc_origin".to_owned(), json!(chain));
    fix_spec.insert("gc_round".to_owned(), json!(round));

    let mut rerun_spec = (*failed.spec).clone();
    rerun_spec.insert("id".to_owned(), json!(rerun_id));
    rerun_spec.insert("depends_on".to_owned(), json!([fix_id]));
    rerun_spec.insert("gc_origin".to_owned(), json!(chain));
    rerun_spec.insert("gc_round".to_owned(), json!(round));

    // The fix task runs the backend its own spec names (the loop's agent), not the failed
    // task's: routed by that.
    let fix_backends =
        troupe_plan::TaskSpec::from_object(&fix_spec, Some(troupe_plan::Role::Executor))
            .map(|spec| troupe_plan::backend::routes(&spec))
            .unwrap_or_default();
    let fix = Task {
        id: fix_id.clone(),
        backends: fix_backends,
        position: failed.position + 1,
        title,
        description,
        role: pb::Role::Executor,
        depends_on: Vec::new(),
        files: Vec::new(),
        spec: fix_spec.into(),
        ..fresh(failed, now_ms)
    };
    let rerun = Task {
        id: rerun_id,
        position: failed.position + 2,
        depends_on: vec![fix_id],
        spec: rerun_spec.into(),
        ..fresh(failed, now_ms)
    };
    Decision::Round(Box::new(Round {
        kind,
        chain,
        round,
        max_rounds,
        fix,
        rerun,
        findings,
    }))
}

/// A pending copy of `failed` with nothing of its runs.
fn fresh(failed: &Task, now_ms: i64) -> Task {
    Task {
        state: TaskState::Pending,
        attempt: 0,
        fencing_token: 0,
        worker_id: String::new(),
        lease_ms: 0,
        lease_expires_at: None,
        not_before: None,
        created_at: now_ms,
        started_at: None,
        finished_at: None,
        progress: String::new(),
        result: None,
        last_error: None,
        superseded_by: String::new(),
        convergence: None,
        ..failed.clone()
    }
}

/// One line per failing test (name, file:line, message), then coverage against the target.
fn test_findings(report: &pb::TestRunReport) -> Vec<String> {
    let mut findings: Vec<String> = report
        .failures
        .iter()
        .map(|failure| {
            let location = if failure.line > 0 {
                format!("{}:{}", failure.file, failure.line)
            } else {
                failure.file.clone()
            };
            let message = failure.message.lines().next().unwrap_or_default();
            format!("{} ({location}): {message}", failure.name)
        })
        .collect();
    if let Some(totals) = &report.totals {
        findings.push(format!(
            "tests: {} passed, {} failed, {} errors of {}",
            totals.passed, totals.failed, totals.errors, totals.total
        ));
    }
    // A run that crashed or could not load its tests names no failing test: the runner's
    // stderr is what the fixer needs.
    if report.failures.is_empty() {
        let outcome = troupe_proto::names::name(report.outcome());
        findings.push(format!("outcome: {outcome}"));
        let tail: Vec<&str> = report.stderr_tail.lines().rev().take(15).collect();
        if !tail.is_empty() {
            let lines: Vec<&str> = tail.into_iter().rev().collect();
            findings.push(format!("runner stderr (tail):\n  {}", lines.join("\n  ")));
        }
    }
    let overall = report
        .coverage
        .as_ref()
        .and_then(|coverage| coverage.overall);
    if report.coverage_target > 0.0 {
        let measured = overall.map_or_else(|| "not measured".to_owned(), |v| format!("{v:.1}%"));
        findings.push(format!(
            "coverage {measured} vs target {:.1}%",
            report.coverage_target
        ));
    }
    findings
}

/// One line per gap: task, type, item, expected, actual.
fn gap_findings(gaps: &[pb::VerificationGap]) -> Vec<String> {
    gaps.iter()
        .map(|gap| {
            format!(
                "{} {} `{}`: expected {}, actual {}",
                gap.task,
                troupe_proto::names::name(gap.r#type()),
                gap.item,
                gap.expected,
                gap.actual
            )
        })
        .collect()
}

/// Applies `round` to `tasks` (topological order, `failed_index` the failed task): marks the
/// failed task superseded, points its dependents at the re-run and makes room for the two new
/// rows right after it (positions shift by two). Returns the transitions to record; the caller
/// inserts `round.fix` and `round.rerun` at `failed_index + 1` and `+ 2`.
fn apply(tasks: &mut [Task], failed_index: usize, round: &Round) -> Vec<pb::TaskTransition> {
    let failed_id = tasks[failed_index].id.clone();
    let failed_position = tasks[failed_index].position;
    let reason = |what: &str| {
        format!(
            "{} round {}: {what}",
            round.kind.name().replace(' ', "-"),
            round.round
        )
    };
    tasks[failed_index].superseded_by = round.rerun.id.clone();
    let failed = &tasks[failed_index];
    let mut transitions = vec![pb::TaskTransition {
        task_id: failed_id.clone(),
        from: TaskState::Failed as i32,
        to: TaskState::Failed as i32,
        attempt: failed.attempt,
        worker_id: failed.worker_id.clone(),
        reason: reason(&format!("superseded by {}", round.rerun.id)),
    }];
    for task in tasks.iter_mut() {
        if task.position > failed_position {
            task.position += 2;
        }
        for dep in &mut task.depends_on {
            if *dep == failed_id {
                dep.clone_from(&round.rerun.id);
            }
        }
    }
    for (task, what) in [
        (&round.fix, format!("fix {} for {}", failed_id, round.chain)),
        (
            &round.rerun,
            format!("re-run {failed_id} after {}", round.fix.id),
        ),
    ] {
        transitions.push(pb::TaskTransition {
            task_id: task.id.clone(),
            from: TaskState::Unspecified as i32,
            to: TaskState::Pending as i32,
            attempt: 0,
            worker_id: String::new(),
            reason: reason(&what),
        });
    }
    transitions
}

/// The bus message announcing a round.
fn round_message(failed_id: &str, round: &Round) -> (String, String, Map<String, Value>) {
    let summary = format!(
        "[coordinator] {} round {}/{} for {}: {} then {} ({} finding(s))",
        round.kind.name(),
        round.round,
        round.max_rounds,
        round.chain,
        round.fix.id,
        round.rerun.id,
        round.findings.len()
    );
    let mut data = Map::new();
    data.insert("chain".to_owned(), json!(round.chain));
    data.insert("failed_task".to_owned(), json!(failed_id));
    data.insert("round".to_owned(), json!(round.round));
    data.insert("max_rounds".to_owned(), json!(round.max_rounds));
    data.insert("fix_task".to_owned(), json!(round.fix.id));
    data.insert("rerun_task".to_owned(), json!(round.rerun.id));
    data.insert("findings".to_owned(), json!(round.findings));
    (round.kind.message_type().to_owned(), summary, data)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, role: pb::Role, spec: Value, position: i64) -> Task {
        Task {
            session_id: "s".into(),
            id: id.into(),
            position,
            title: id.into(),
            description: String::new(),
            role,
            priority: pb::Priority::P1,
            repo: "app".into(),
            wave: 1,
            critical_path: 1,
            path_ms: 60_000,
            depends_on: Vec::new(),
            files: Vec::new(),
            spec: spec.as_object().cloned().unwrap_or_default().into(),
            state: TaskState::Failed,
            attempt: 1,
            max_attempts: 1,
            fencing_token: 1,
            worker_id: "w".into(),
            lease_ms: 0,
            lease_expires_at: None,
            not_before: None,
            created_at: 0,
            started_at: None,
            finished_at: Some(1),
            progress: String::new(),
            result: None,
            last_error: None,
            superseded_by: String::new(),
            convergence: None,
            backends: Vec::new(),
        }
    }

    fn check_failed() -> pb::TaskError {
        pb::TaskError {
            kind: pb::ErrorKind::CheckFailed as i32,
            message: "tests failed".into(),
            retryable: false,
            details: Vec::new(),
            ..Default::default()
        }
    }

    fn test_report() -> pb::TaskResult {
        pb::TaskResult {
            detail: Some(pb::task_result::Detail::TestRun(pb::TestRunReport {
                failures: vec![pb::TestFailure {
                    name: "tests/test_a.py::test_add".into(),
                    file: "tests/test_a.py".into(),
                    line: 7,
                    message: "assert 3 == 4\nmore".into(),
                    ..Default::default()
                }],
                coverage_target: 80.0,
                coverage: Some(pb::Coverage {
                    overall: Some(42.0),
                    ..Default::default()
                }),
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    #[test]
    fn test_failure_starts_a_round_with_the_failures() {
        let spec = json!({"id": "TESTRUN-1", "test": {"framework": "pytest", "gc": {"agent": {"backend": "command", "command": ["fix"]}, "focus_paths": ["src"]}}});
        let failed = row("TESTRUN-1", pb::Role::TestRunner, spec, 3);
        let Decision::Round(round) =
            decide(&failed, &check_failed(), Some(&test_report()), |_| false, 9)
        else {
            panic!("expected a round");
        };
        assert_eq!(round.fix.id, "FIX-TESTRUN-1-R1");
        assert_eq!(round.rerun.id, "TESTRUN-1-R1");
        assert_eq!(round.rerun.depends_on, vec!["FIX-TESTRUN-1-R1".to_owned()]);
        assert_eq!(round.fix.role, pb::Role::Executor);
        assert_eq!(
            round.fix.title,
            "Fix the failing tests of TESTRUN-1 (round 1)"
        );
        assert!(
            round
                .fix
                .description
                .contains("tests/test_a.py::test_add (tests/test_a.py:7): assert 3 == 4"),
            "{}",
            round.fix.description
        );
        assert!(
            round
                .fix
                .description
                .contains("coverage 42.0% vs target 80.0%")
        );
        assert_eq!(round.fix.spec["focus_paths"], json!(["src"]));
        assert_eq!(round.fix.spec["allow_empty"], json!(false));
        assert_eq!(round.rerun.spec["gc_round"], json!(1));
        assert_eq!(round.rerun.spec["test"]["framework"], json!("pytest"));
        assert_eq!(round.rerun.state, TaskState::Pending);
        assert_eq!(round.rerun.attempt, 0);
    }

    #[test]
    fn a_crashed_run_hands_over_the_runner_stderr() {
        let spec = json!({"test": {"gc": {"agent": {"backend": "command"}}}});
        let failed = row("TESTRUN-1", pb::Role::TestRunner, spec, 0);
        let crashed = pb::TaskResult {
            detail: Some(pb::task_result::Detail::TestRun(pb::TestRunReport {
                outcome: pb::TestOutcome::CollectionError as i32,
                stderr_tail: "Traceback\nImportError: no module named calc".into(),
                ..Default::default()
            })),
            ..Default::default()
        };
        let Decision::Round(round) = decide(&failed, &check_failed(), Some(&crashed), |_| false, 0)
        else {
            panic!("expected a round");
        };
        assert!(
            round.fix.description.contains("outcome: collection_error"),
            "{}",
            round.fix.description
        );
        assert!(
            round
                .fix
                .description
                .contains("ImportError: no module named calc")
        );
    }

    #[test]
    fn rounds_count_per_chain_and_run_out() {
        let spec = json!({"test": {"gc": {"agent": {"backend": "command"}, "max_rounds": 2}}, "gc_round": 1, "gc_origin": "TESTRUN-1"});
        let failed = row("TESTRUN-1-R1", pb::Role::TestRunner, spec, 0);
        let Decision::Round(round) =
            decide(&failed, &check_failed(), Some(&test_report()), |_| false, 0)
        else {
            panic!("expected round 2");
        };
        assert_eq!(round.rerun.id, "TESTRUN-1-R2");
        let exhausted = decide(
            &round.rerun_failed(),
            &check_failed(),
            Some(&test_report()),
            |_| false,
            0,
        );
        assert_eq!(
            exhausted,
            Decision::Exhausted {
                kind: LoopKind::GeneratorCritic,
                chain: "TESTRUN-1".into(),
                max_rounds: 2
            }
        );
    }

    impl Round {
        fn rerun_failed(&self) -> Task {
            Task {
                state: TaskState::Failed,
                ..self.rerun.clone()
            }
        }
    }

    #[test]
    fn no_config_retryable_or_other_kinds_start_nothing() {
        let plain = row("TESTRUN-1", pb::Role::TestRunner, json!({"test": {}}), 0);
        assert_eq!(
            decide(&plain, &check_failed(), Some(&test_report()), |_| false, 0),
            Decision::None
        );
        let spec = json!({"test": {"gc": {"agent": {"backend": "command"}}}});
        let configured = row("TESTRUN-1", pb::Role::TestRunner, spec, 0);
        let mut crashed = check_failed();
        crashed.kind = pb::ErrorKind::Crash as i32;
        assert_eq!(
            decide(&configured, &crashed, Some(&test_report()), |_| false, 0),
            Decision::None
        );
        assert_eq!(
            decide(&configured, &check_failed(), None, |_| false, 0),
            Decision::None
        );
    }

    #[test]
    fn gaps_start_a_gap_closure_round_and_apply_rewires() {
        let spec = json!({"gap_closure": {"agent": {"backend": "command"}}});
        let mut tasks = vec![
            row("IMPL-1", pb::Role::Executor, json!({}), 0),
            row("VERIFY-1", pb::Role::Validator, spec, 1),
            row("DOC-1", pb::Role::Executor, json!({}), 2),
        ];
        tasks[2].depends_on = vec!["VERIFY-1".into(), "IMPL-1".into()];
        tasks[2].state = TaskState::Pending;
        let report = pb::TaskResult {
            detail: Some(pb::task_result::Detail::Validation(pb::ValidationReport {
                verification: Some(pb::GoalVerification {
                    status: pb::VerificationStatus::GapsFound as i32,
                    gaps: vec![pb::VerificationGap {
                        task: "IMPL-1".into(),
                        r#type: pb::GapType::File as i32,
                        item: "src/a.py".into(),
                        expected: "exists".into(),
                        actual: "missing".into(),
                        ..pb::VerificationGap::default()
                    }],
                    ..Default::default()
                }),
                ..Default::default()
            })),
            ..Default::default()
        };
        let Decision::Round(round) =
            decide(&tasks[1], &check_failed(), Some(&report), |_| false, 0)
        else {
            panic!("expected a round");
        };
        assert_eq!(round.kind, LoopKind::GapClosure);
        assert!(
            round
                .fix
                .description
                .contains("IMPL-1 file `src/a.py`: expected exists, actual missing")
        );
        let transitions = apply(&mut tasks, 1, &round);
        assert_eq!(transitions.len(), 3);
        assert!(
            transitions[0]
                .reason
                .starts_with("gap-closure round 1: superseded by VERIFY-1-R1")
        );
        assert_eq!(tasks[1].superseded_by, "VERIFY-1-R1");
        assert_eq!(
            tasks[2].depends_on,
            vec!["VERIFY-1-R1".to_owned(), "IMPL-1".to_owned()]
        );
        assert_eq!(tasks[2].position, 4);
        assert_eq!((round.fix.position, round.rerun.position), (2, 3));
    }
}

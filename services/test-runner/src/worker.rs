//! TESTRUN-* tasks from the coordinator.
//!
//! The task's `test` object (`framework`, `coverage_target`, `install` (default true),
//! `coverage_source`, `timeout_seconds`, `test_timeout_seconds` (0 = none), `setup`, `env`,
//! `workdir`, `python`, `fix`) configures one run at the session branch head. The task
//! completes when the outcome is PASSED, or when its fix loop ended meeting CCW's criterion
//! (pass rate ≥ 0.95 and coverage ≥ target); any other outcome fails it with CHECK_FAILED, not
//! retryable, with the report as the partial result and a crash's reason in the message.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use troupe_grpc::CoordinatorClient;
use troupe_grpc::worker::{TaskContext, TaskFailure, TaskHandler};
use troupe_plan::spec as plan;
use troupe_proto::v1::{
    ClaimedTask, ErrorKind, FixScope, LogMessageRequest, TaskResult, TestFramework, TestOutcome,
    TestRunReport, UpdateStateRequest, task_result,
};
use troupe_workspace::{Attempt, Claim, ConfirmWith, Oid, Publication, Remote};

use crate::runner::{DEFAULT_TEST_TIMEOUT_SECONDS, DEFAULT_TIMEOUT, RunSpec, Runner};
use crate::{Error, FixSpec};

/// Runs TESTRUN-* tasks with a shared [`Runner`].
#[derive(Debug, Clone)]
pub struct TestRunHandler {
    runner: Arc<Runner>,
    /// The coordinator's bus, and the deadline of each call to it.
    coordinator: Option<(CoordinatorClient, Duration)>,
}

impl TestRunHandler {
    /// A handler running tasks with `runner`.
    pub fn new(runner: Arc<Runner>) -> Self {
        Self {
            runner,
            coordinator: None,
        }
    }

    /// Also sends the CCW `state_update` and `tests_passed` / `tests_failed` message for each
    /// finished run to the coordinator through `client`, each call bounded by `rpc_timeout`.
    pub fn with_coordinator(mut self, client: CoordinatorClient, rpc_timeout: Duration) -> Self {
        self.coordinator = Some((client, rpc_timeout));
        self
    }

    /// Records the run on the coordinator's bus: the role state (CCW 1.C.11) and a message.
    /// Best effort: the task's result already carries the report.
    async fn notify(&self, session: &str, task_id: &str, layer: &str, report: &TestRunReport) {
        let Some((client, timeout)) = &self.coordinator else {
            return;
        };
        let (mut client, timeout) = (client.clone(), *timeout);
        let passed = report.outcome() == TestOutcome::Passed;
        let coverage = report.coverage.as_ref().and_then(|c| c.overall);
        let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let t = report.totals.unwrap_or_default();
        let result = serde_json::json!({
            "task_id": task_id, "layer": layer, "framework": troupe_proto::names::name(report.framework()),
            "outcome": troupe_proto::names::name(report.outcome()), "pass_rate": report.pass_rate,
            "coverage": coverage, "coverage_target": report.coverage_target,
            "total": t.total, "passed": t.passed, "failed": t.failed, "skipped": t.skipped,
            "iterations": report.fix_loop.as_ref().map_or(1, |f| f.iterations.len() + 1),
            "flaky_tests": report.fix_loop.as_ref().map(|f| f.flaky_tests.clone()).unwrap_or_default(),
            "commit": report.commit, "timestamp": now,
        });
        let history: Vec<Value> = report
            .fix_loop
            .as_ref()
            .map_or_else(
                || vec![coverage.unwrap_or(0.0)],
                |f| f.coverage_history.clone(),
            )
            .into_iter()
            .map(|c| {
                serde_json::json!({"layer": layer, "coverage": c, "target": report.coverage_target,
                                         "pass_rate": report.pass_rate, "timestamp": now})
            })
            .collect();
        let state = serde_json::json!({
            "execution_results": [result.clone()],
            "defect_patterns": report.defect_patterns,
            "effective_test_patterns": report.effective_patterns,
            "coverage_history": history,
        });
        let update = UpdateStateRequest {
            session_id: session.to_owned(),
            role: "test-runner".to_owned(),
            data: Some(troupe_proto::json::to_struct(&state)),
        };
        if let Err(err) = troupe_grpc::within(
            timeout,
            client.update_state(troupe_grpc::timed(update, timeout)),
        )
        .await
        {
            tracing::warn!(task_id, error = %err, "state_update failed");
        }
        let kind = if passed {
            "tests_passed"
        } else {
            "tests_failed"
        };
        let message = LogMessageRequest {
            session_id: session.to_owned(),
            from: "test-runner".to_owned(),
            to: "coordinator".to_owned(),
            r#type: kind.to_owned(),
            summary: format!("[test-runner] {task_id}: {}", summarize(report)),
            data: Some(troupe_proto::json::to_struct(&result)),
            ..LogMessageRequest::default()
        };
        if let Err(err) = troupe_grpc::within(
            timeout,
            client.log_message(troupe_grpc::timed(message, timeout)),
        )
        .await
        {
            tracing::warn!(task_id, error = %err, "tests message failed");
        }
    }

    async fn run(&self, task: ClaimedTask, ctx: TaskContext) -> Result<TaskResult, TaskFailure> {
        let typed = task
            .task
            .as_ref()
            .map(troupe_plan::TaskSpec::try_from)
            .transpose()
            .map_err(|err| into_failure(Error::InvalidArgument(format!("invalid task: {err}"))))?;
        // The plan may tighten the service's sandbox for this task, never loosen it.
        let plan_sandbox = typed
            .as_ref()
            .and_then(|spec| troupe_plan::spec::sandbox_of(&spec.object))
            .and_then(|mode| mode.as_str().parse().ok());
        let test = TestSpec::with_defaults(typed.and_then(|spec| spec.blocks.test));
        let repo = task.repo.as_ref().ok_or_else(|| {
            into_failure(Error::InvalidArgument(
                "claimed task has no repository".to_owned(),
            ))
        })?;
        let (session, task_id, attempt) = match (&task.task, &task.lease) {
            (Some(t), lease) => (
                t.session_id.as_str(),
                t.id.as_str(),
                lease.as_ref().map_or(t.attempt, |l| l.attempt),
            ),
            (None, _) => {
                return Err(into_failure(Error::InvalidArgument(
                    "claimed task has no task".to_owned(),
                )));
            }
        };
        // The task's fence on the remote: a stale attempt's fixes never land, and fixes an
        // earlier attempt landed (its completion lost) are not landed again.
        let remote = Remote::parse(if repo.url.is_empty() {
            &repo.path
        } else {
            &repo.url
        })
        .map_err(|err| into_failure(err.into()))?;
        let mirror = self
            .runner
            .mirrors()
            .open(&remote)
            .await
            .map_err(|err| into_failure(err.into()))?;
        let fencing_token = task.lease.as_ref().map_or(0, |l| l.fencing_token);
        let fence = Attempt {
            session: session.to_owned(),
            task: task_id.to_owned(),
            attempt: attempt.max(1),
            token: if fencing_token > 0 {
                fencing_token
            } else {
                u64::from(attempt.max(1))
            },
        };
        let mut held = match mirror
            .claim(&fence)
            .await
            .map_err(|err| fence_failure(task_id, err))?
        {
            Claim::Held(held) => Some(held),
            Claim::Landed(landed) => {
                tracing::info!(
                    task_id,
                    landed_by = landed.attempt,
                    "fixes already landed; testing the branch again without landing anything"
                );
                None
            }
        };
        // The commit under test: the session branch's head on the remote (the session's base
        // while nothing has landed), fetched by the claim above.
        let head = match mirror
            .repo()
            .branch_head(&repo.branch)
            .await
            .map_err(|err| into_failure(err.into()))?
        {
            Some(head) => head,
            None => Oid::parse(&repo.base_commit).ok_or_else(|| {
                into_failure(Error::InvalidArgument(format!(
                    "session branch `{}` does not exist on {remote} and the claim names no base commit",
                    repo.branch
                )))
            })?,
        };
        ctx.progress(format!(
            "testing {} at {}",
            repo.branch,
            &head.as_str()[..12]
        ));
        let spec = RunSpec {
            repo_path: remote
                .local_path()
                .map(std::path::Path::to_path_buf)
                .unwrap_or_default(),
            remote: remote.clone(),
            git_ref: head.to_string(),
            framework: test.framework,
            coverage_target: test.coverage_target,
            install: test.install,
            timeout: test.timeout,
            test_timeout_seconds: test.test_timeout_seconds,
            coverage_source: test.coverage_source,
            run_id: sanitize(&format!("{session}-{task_id}-a{attempt}")),
            run_number: attempt.max(1),
            fix: test.fix.clone(),
            env: test.env.clone(),
            setup: test.setup.clone(),
            workdir: test.workdir.clone(),
            python: test.python.clone(),
            sandbox: plan_sandbox,
            placeholders: [
                ("plan_dir".to_owned(), task.plan_dir.clone()),
                ("session_id".to_owned(), session.to_owned()),
                ("task_id".to_owned(), task_id.to_owned()),
            ]
            .into_iter()
            .filter(|(_, value)| !value.is_empty())
            .collect(),
            iterations: Some(crate::IterationSink::new({
                let ctx = ctx.clone();
                move |figures| ctx.report_test(figures)
            })),
            usage: Some(
                troupe_backends::UsageMeter::new({
                    let ctx = ctx.clone();
                    move |usage| {
                        ctx.report_tokens(troupe_proto::v1::Usage {
                            input_tokens: usage.input_tokens,
                            output_tokens: usage.output_tokens,
                            cached_input_tokens: usage.cached_input_tokens,
                        });
                    }
                })
                .with_backend({
                    let ctx = ctx.clone();
                    move |backend| ctx.report_backend(backend)
                }),
            ),
        };
        let report = self
            .runner
            .run_tests(&spec, &ctx.cancelled())
            .await
            .map_err(into_failure)?;
        self.notify(session, task_id, &test.layer, &report).await;
        let integrated = match report.fix_loop.as_ref() {
            Some(fix) if fix.succeeded && !fix.final_commit.is_empty() => {
                let source = Oid::parse(&fix.final_commit).ok_or_else(|| {
                    into_failure(Error::Internal(format!(
                        "fix loop produced a malformed commit {:?}",
                        fix.final_commit
                    )))
                })?;
                let Some(held) = held.as_mut() else {
                    return Err(TaskFailure::new(
                        ErrorKind::Superseded,
                        format!(
                            "{task_id}: an earlier attempt already landed fixes; these at {source} are not landed"
                        ),
                        false,
                    ));
                };
                ctx.progress(format!("integrating the test fix into {}", repo.branch));
                let message = format!("troupe: integrate test fixes of {task_id}");
                let base = Oid::parse(&repo.base_commit).unwrap_or_else(|| head.clone());
                let landed = async {
                    mirror.fetch_rev(source.as_str()).await?;
                    let publication = Publication {
                        session_branch: &repo.branch,
                        base: &base,
                        commit: &source,
                        task_branch: None,
                        message: &message,
                        part: None,
                    };
                    let lease = ctx.clone();
                    let lease = ConfirmWith(move || {
                        let lease = lease.clone();
                        async move { lease.confirm_lease().await.map_err(|lost| lost.to_string()) }
                    });
                    mirror.publish(held, &publication, &lease).await
                }
                .await
                .map_err(|err| fence_failure(task_id, err))?;
                Some(landed.commit.to_string())
            }
            _ => None,
        };
        let mut result = verdict(report);
        if let (Some(commit), Ok(done)) = (integrated, result.as_mut()) {
            done.summary.push_str(&format!(
                "; fixes integrated into {} at {commit}",
                repo.branch
            ));
            done.commit = commit;
        }
        result
    }
}

/// A failure to claim the fence or land the fixes, classified as the executor does.
fn fence_failure(task_id: &str, err: troupe_workspace::Error) -> TaskFailure {
    use troupe_workspace::Error as W;
    let (kind, retryable) = match &err {
        W::Conflict { .. } => (ErrorKind::MergeConflict, true),
        W::Superseded { .. } | W::LeaseExpired { .. } => (ErrorKind::Superseded, false),
        W::Unreachable { .. } | W::PushRejected { .. } | W::InvalidRemote { .. } => {
            (ErrorKind::Repository, true)
        }
        _ => (ErrorKind::Internal, true),
    };
    TaskFailure::new(kind, format!("{task_id}: {err}"), retryable)
}

impl TaskHandler for TestRunHandler {
    async fn handle(&self, task: ClaimedTask, ctx: TaskContext) -> Result<TaskResult, TaskFailure> {
        self.run(task, ctx).await
    }
}

/// The task's `test` object with defaults applied.
#[derive(Debug, PartialEq)]
struct TestSpec {
    framework: TestFramework,
    coverage_target: f64,
    install: bool,
    coverage_source: String,
    timeout: Duration,
    test_timeout_seconds: u32,
    /// CCW layer name for the bus records (`L1-unit` by default).
    layer: String,
    fix: Option<FixSpec>,
    env: std::collections::BTreeMap<String, String>,
    setup: Vec<Vec<String>>,
    workdir: String,
    python: String,
}

impl TestSpec {
    /// The task's `test` object as `troupe-plan` typed it, with the test-runner's defaults.
    fn with_defaults(spec: Option<plan::TestSpec>) -> Self {
        let spec = spec.unwrap_or_default();
        let fix = spec.fix.map(|fix| FixSpec {
            backend: fix
                .agent
                .backend
                .unwrap_or_else(|| plan::COMMAND_BACKEND.to_owned()),
            command: fix.agent.command.unwrap_or_default(),
            fallback: fix.agent.fallback,
            scope: match fix.scope {
                plan::FixScope::Tests => FixScope::Tests,
                plan::FixScope::Source => FixScope::Source,
                plan::FixScope::Both => FixScope::Both,
            },
            timeout: fix
                .agent
                .timeout
                .unwrap_or(crate::fix::DEFAULT_AGENT_TIMEOUT),
            max_iterations: fix
                .max_iterations
                .unwrap_or(crate::fix::DEFAULT_MAX_ITERATIONS),
        });
        Self {
            framework: match spec.framework {
                plan::TestFramework::Auto => TestFramework::Unspecified,
                plan::TestFramework::Pytest => TestFramework::Pytest,
                plan::TestFramework::Jest => TestFramework::Jest,
                plan::TestFramework::Vitest => TestFramework::Vitest,
            },
            coverage_target: spec.coverage_target.unwrap_or(0.0),
            install: spec.install.unwrap_or(true),
            coverage_source: spec.coverage_source.unwrap_or_default(),
            timeout: spec
                .timeout_seconds
                .map_or(DEFAULT_TIMEOUT, |secs| Duration::from_secs(u64::from(secs))),
            // 0 turns the per-test timeout off.
            test_timeout_seconds: spec
                .test_timeout_seconds
                .unwrap_or(DEFAULT_TEST_TIMEOUT_SECONDS),
            layer: spec.layer.unwrap_or_else(|| "L1-unit".to_owned()),
            fix,
            env: spec.env,
            setup: spec.setup,
            workdir: spec.workdir.unwrap_or_default(),
            python: spec.python.unwrap_or_default(),
        }
    }
}

/// Completed when PASSED, or when a fix loop reached CCW's success criterion (pass rate ≥ 0.95
/// and coverage ≥ target); else a CHECK_FAILED failure carrying the report.
// The worker API returns `TaskFailure` by value; boxing it here would only be undone.
#[allow(clippy::result_large_err)]
fn verdict(report: TestRunReport) -> Result<TaskResult, TaskFailure> {
    let summary = summarize(&report);
    let outcome = report.outcome();
    let fixed = report.fix_loop.as_ref().is_some_and(|f| f.succeeded);
    let mut details: Vec<String> = report
        .failures
        .iter()
        .take(20)
        .map(|f| {
            format!(
                "{}:{} {} [{}]: {}",
                f.file,
                f.line,
                f.name,
                troupe_proto::names::name(f.criticality()),
                f.message.lines().next().unwrap_or("")
            )
        })
        .collect();
    details.extend(report.warnings.iter().cloned());
    if matches!(
        outcome,
        TestOutcome::RunnerCrashed
            | TestOutcome::Timeout
            | TestOutcome::CollectionError
            | TestOutcome::InstallFailed
            | TestOutcome::SetupFailed
    ) && !report.stderr_tail.is_empty()
    {
        details.push(troupe_process::tail(&report.stderr_tail, 15, 2000));
    }
    let result = TaskResult {
        summary: summary.clone(),
        commit: report.commit.clone(),
        warnings: report.warnings.clone(),
        detail: Some(task_result::Detail::TestRun(report)),
        ..TaskResult::default()
    };
    if outcome == TestOutcome::Passed || fixed {
        Ok(result)
    } else if outcome == TestOutcome::SandboxDenied {
        // The kernel refused the suite (or its install or setup) something outside the run:
        // not a test result, and another attempt would be refused the same.
        let denied = match &result.detail {
            Some(task_result::Detail::TestRun(report)) => report.sandbox_denied.clone(),
            _ => String::new(),
        };
        Err(TaskFailure::new(
            ErrorKind::SandboxDenied,
            format!("test run was denied by the sandbox: {denied}: {summary}"),
            false,
        )
        .with_details(details)
        .with_partial(result))
    } else {
        let reason = why(&result);
        Err(TaskFailure::new(
            ErrorKind::CheckFailed,
            format!(
                "test run {}: {summary}{reason}",
                troupe_proto::names::name(outcome)
            ),
            false,
        )
        .with_details(details)
        .with_partial(result))
    }
}

/// Why a run that never got to its tests ended, for the failure's headline (`troupe run` shows
/// only the first line of each message).
fn why(result: &TaskResult) -> String {
    let Some(task_result::Detail::TestRun(report)) = &result.detail else {
        return String::new();
    };
    let text = match report.outcome() {
        TestOutcome::RunnerCrashed | TestOutcome::Timeout => {
            crate::runner::crash_reason(&report.stderr_tail)
        }
        TestOutcome::InstallFailed => format!(
            "`{}` failed: {}",
            report.installer,
            crate::runner::crash_reason(&report.install_log)
        ),
        TestOutcome::SetupFailed => report
            .warnings
            .iter()
            .find(|w| w.starts_with("setup command"))
            .cloned()
            .unwrap_or_default(),
        TestOutcome::WrongSource => report
            .warnings
            .iter()
            .find(|w| w.starts_with("wrong source"))
            .cloned()
            .unwrap_or_default(),
        _ => String::new(),
    };
    if text.is_empty() {
        String::new()
    } else {
        format!("; {text}")
    }
}

fn summarize(report: &TestRunReport) -> String {
    let t = report.totals.unwrap_or_default();
    let commit = report.commit.get(..12).unwrap_or(&report.commit);
    let mut text = format!(
        "{} at {commit}: {} tests, {} passed, {} failed, {} errors, {} skipped (pass rate {:.1}%)",
        troupe_proto::names::name(report.framework()),
        t.total,
        t.passed,
        t.failed,
        t.errors,
        t.skipped,
        report.pass_rate * 100.0
    );
    match report.coverage.as_ref().and_then(|c| c.overall) {
        Some(pct) if report.coverage_target > 0.0 => {
            text.push_str(&format!(
                "; line coverage {pct:.1}% (target {}%)",
                report.coverage_target
            ));
        }
        Some(pct) => text.push_str(&format!("; line coverage {pct:.1}%")),
        None => text.push_str("; coverage not measured"),
    }
    text
}

fn into_failure(err: Error) -> TaskFailure {
    let message = err.to_string();
    match err {
        Error::InvalidArgument(_) | Error::Unimplemented(_) => {
            TaskFailure::new(ErrorKind::InvalidTask, message, false)
        }
        Error::NotInstalled(_) => TaskFailure::new(ErrorKind::NotInstalled, message, false),
        Error::Install { .. } => TaskFailure::new(ErrorKind::Crash, message, true),
        Error::Workspace(
            troupe_workspace::Error::NotARepo { .. }
            | troupe_workspace::Error::UnknownRevision { .. }
            | troupe_workspace::Error::BranchMissing { .. },
        ) => TaskFailure::new(ErrorKind::InvalidTask, message, false),
        Error::Cancelled
        | Error::Workspace(_)
        | Error::Process { .. }
        | Error::Io { .. }
        | Error::Grpc(_)
        | Error::Internal(_)
        | Error::Children(_) => TaskFailure::new(ErrorKind::Internal, message, true),
    }
}

/// Keeps a run id to `[A-Za-z0-9._-]`.
fn sanitize(id: &str) -> String {
    id.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// A claimed TESTRUN task with `test` as its `test` object, read as the worker reads it.
    fn parse(test: Option<&Value>) -> Result<TestSpec, troupe_plan::PlanError> {
        let mut object = serde_json::Map::new();
        object.insert("id".into(), json!("TESTRUN-1"));
        if let Some(test) = test {
            object.insert("test".into(), test.clone());
        }
        let task = troupe_proto::v1::Task {
            id: "TESTRUN-1".into(),
            role: troupe_proto::v1::Role::TestRunner as i32,
            spec: Some(troupe_proto::json::to_struct(&Value::Object(object))),
            ..troupe_proto::v1::Task::default()
        };
        let spec = troupe_plan::TaskSpec::try_from(&task)?;
        Ok(TestSpec::with_defaults(spec.blocks.test))
    }

    #[test]
    fn a_sandbox_refusal_fails_the_task_as_sandbox_denied() {
        let report = TestRunReport {
            outcome: TestOutcome::SandboxDenied as i32,
            sandbox_denied: "/srv/data/troupe.db".to_owned(),
            ..TestRunReport::default()
        };
        let failure = verdict(report).expect_err("a refusal fails the task");
        assert_eq!(failure.error.kind(), ErrorKind::SandboxDenied);
        assert!(failure.error.message.contains("/srv/data/troupe.db"));
        assert!(!failure.error.retryable);
    }

    #[test]
    fn parses_the_test_object_with_defaults() {
        let spec = parse(None).expect("defaults");
        assert_eq!(
            spec,
            TestSpec {
                framework: TestFramework::Unspecified,
                coverage_target: 0.0,
                install: true,
                coverage_source: String::new(),
                timeout: DEFAULT_TIMEOUT,
                test_timeout_seconds: DEFAULT_TEST_TIMEOUT_SECONDS,
                layer: "L1-unit".to_owned(),
                fix: None,
                env: std::collections::BTreeMap::new(),
                setup: Vec::new(),
                workdir: String::new(),
                python: String::new(),
            }
        );
        let value = json!({"framework": "pytest", "coverage_target": 80, "install": false,
                           "coverage_source": "stats", "timeout_seconds": 120.0, "test_timeout_seconds": 5});
        let spec = parse(Some(&value)).expect("valid");
        assert_eq!(spec.framework, TestFramework::Pytest);
        assert!((spec.coverage_target - 80.0).abs() < f64::EPSILON);
        assert!(!spec.install);
        assert_eq!(spec.coverage_source, "stats");
        assert_eq!(spec.timeout, Duration::from_secs(120));
        assert_eq!(spec.test_timeout_seconds, 5);
        for bad in [
            json!({"framework": "mocha"}),
            json!({"coverage_target": 101}),
            json!({"timeout_seconds": 1.5}),
            json!("x"),
        ] {
            assert!(parse(Some(&bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn parses_the_fix_object() {
        let value = json!({"fix": {"agent": {"backend": "command", "command": ["python3", "fix.py", "{worktree}"]},
                                   "max_iterations": 2, "scope": "both"}});
        let spec = parse(Some(&value)).expect("valid");
        let fix = spec.fix.expect("fix");
        assert_eq!(fix.command, ["python3", "fix.py", "{worktree}"]);
        assert_eq!(fix.max_iterations, 2);
        assert_eq!(fix.scope, FixScope::Both);
        assert_eq!(fix.timeout, crate::fix::DEFAULT_AGENT_TIMEOUT);
        let defaults = json!({"fix": {"agent": {"command": ["x"]}}});
        let fix = parse(Some(&defaults)).expect("valid").fix.expect("fix");
        assert_eq!(
            (fix.backend.as_str(), fix.max_iterations, fix.scope),
            ("command", 3, FixScope::Tests)
        );
        for bad in [
            json!({"fix": {"agent": {"backend": "command"}}}),
            json!({"fix": {"agent": {"command": ["x"]}, "scope": "docs"}}),
            json!({"fix": {"agent": {"backend": "nope", "command": ["x"]}}}),
            json!({"fix": {"agent": {"command": ["x"]}, "max_iterations": 0}}),
            json!({"fix": "yes"}),
        ] {
            assert!(parse(Some(&bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_passed_completes_the_task() {
        let mut report = TestRunReport {
            outcome: TestOutcome::Passed as i32,
            framework: TestFramework::Pytest as i32,
            ..TestRunReport::default()
        };
        assert!(verdict(report.clone()).is_ok());
        report.outcome = TestOutcome::CoverageBelowTarget as i32;
        let failure = verdict(report).expect_err("below target fails");
        assert_eq!(failure.error.kind(), ErrorKind::CheckFailed);
        assert!(!failure.error.retryable);
        assert!(matches!(
            failure.partial.and_then(|p| p.detail),
            Some(task_result::Detail::TestRun(_))
        ));
    }

    #[test]
    fn sanitizes_run_ids() {
        assert_eq!(sanitize("s-1/TESTRUN 001-a2"), "s-1_TESTRUN_001-a2");
    }
}

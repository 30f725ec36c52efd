//! TESTRUN-* tasks from the coordinator.
//!
//! The task's `test` object (`framework`, `coverage_target`, `install` (default true),
//! `coverage_source`, `timeout_seconds`, `test_timeout_seconds`) configures one run at the
//! session branch head. The task completes only when the outcome is PASSED (exit 0, no failing
//! test, coverage at or above the target); any other outcome fails it with CHECK_FAILED, not
//! retryable, with the report as the partial result.

use std::sync::Arc;
use std::time::Duration;

use prost_types::value::Kind;
use serde_json::Value;
use troupe_grpc::worker::{TaskContext, TaskFailure, TaskHandler};
use troupe_proto::v1::{
    ClaimedTask, ErrorKind, TaskResult, TestFramework, TestOutcome, TestRunReport, task_result,
};
use troupe_workspace::Repo;

use crate::runner::{DEFAULT_TEST_TIMEOUT_SECONDS, DEFAULT_TIMEOUT, RunSpec, Runner, outcome_name};
use crate::{Error, detect};

/// Runs TESTRUN-* tasks with a shared [`Runner`].
#[derive(Debug, Clone)]
pub struct TestRunHandler {
    runner: Arc<Runner>,
}

impl TestRunHandler {
    /// A handler running tasks with `runner`.
    pub fn new(runner: Arc<Runner>) -> Self {
        Self { runner }
    }

    async fn run(&self, task: ClaimedTask, ctx: TaskContext) -> Result<TaskResult, TaskFailure> {
        let spec_json = task
            .task
            .as_ref()
            .and_then(|t| t.spec.as_ref())
            .map(struct_to_json)
            .unwrap_or(Value::Null);
        let test = TestSpec::parse(spec_json.get("test")).map_err(into_failure)?;
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
        let opened = Repo::open(&repo.path)
            .await
            .map_err(|err| into_failure(err.into()))?;
        let head = opened
            .resolve(&repo.branch)
            .await
            .map_err(|err| into_failure(err.into()))?;
        ctx.progress(format!(
            "testing {} at {}",
            repo.branch,
            &head.as_str()[..12]
        ));
        let spec = RunSpec {
            repo_path: opened.path().to_owned(),
            git_ref: head.to_string(),
            framework: test.framework,
            coverage_target: test.coverage_target,
            install: test.install,
            timeout: test.timeout,
            test_timeout_seconds: test.test_timeout_seconds,
            coverage_source: test.coverage_source,
            run_id: sanitize(&format!("{session}-{task_id}-a{attempt}")),
            run_number: attempt.max(1),
        };
        let report = self
            .runner
            .run_tests(&spec, &ctx.cancelled())
            .await
            .map_err(into_failure)?;
        verdict(report)
    }
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
}

impl TestSpec {
    fn parse(value: Option<&Value>) -> Result<Self, Error> {
        let empty = serde_json::Map::new();
        let object = match value {
            None | Some(Value::Null) => &empty,
            Some(Value::Object(object)) => object,
            Some(_) => {
                return Err(Error::InvalidArgument(
                    "task field `test` must be an object".to_owned(),
                ));
            }
        };
        let framework = match object.get("framework").and_then(Value::as_str) {
            None | Some("") | Some("auto") => TestFramework::Unspecified,
            Some("pytest") => TestFramework::Pytest,
            Some("jest") => TestFramework::Jest,
            Some("vitest") => TestFramework::Vitest,
            Some(other) => {
                return Err(Error::InvalidArgument(format!(
                    "test.framework `{other}` is not one of pytest, jest, vitest"
                )));
            }
        };
        let number = |key: &str| -> Result<Option<f64>, Error> {
            match object.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Number(n)) => Ok(n.as_f64()),
                Some(_) => Err(Error::InvalidArgument(format!(
                    "test.{key} must be a number"
                ))),
            }
        };
        let seconds = |key: &str| -> Result<Option<u32>, Error> {
            match number(key)? {
                None => Ok(None),
                Some(n) if n >= 1.0 && n <= f64::from(u32::MAX) && n.fract() == 0.0 => {
                    // Checked above: a whole number in u32's range.
                    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                    let n = n as u32;
                    Ok(Some(n))
                }
                Some(n) => Err(Error::InvalidArgument(format!(
                    "test.{key} must be a positive whole number, got {n}"
                ))),
            }
        };
        let coverage_target = number("coverage_target")?.unwrap_or(0.0);
        if !(0.0..=100.0).contains(&coverage_target) {
            return Err(Error::InvalidArgument(format!(
                "test.coverage_target must be between 0 and 100, got {coverage_target}"
            )));
        }
        let install = match object.get("install") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(Error::InvalidArgument(
                    "test.install must be a boolean".to_owned(),
                ));
            }
        };
        let coverage_source = match object.get("coverage_source") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(_) => {
                return Err(Error::InvalidArgument(
                    "test.coverage_source must be a string".to_owned(),
                ));
            }
        };
        Ok(Self {
            framework,
            coverage_target,
            install,
            coverage_source,
            timeout: seconds("timeout_seconds")?
                .map_or(DEFAULT_TIMEOUT, |s| Duration::from_secs(u64::from(s))),
            test_timeout_seconds: seconds("test_timeout_seconds")?
                .unwrap_or(DEFAULT_TEST_TIMEOUT_SECONDS),
        })
    }
}

/// Completed when PASSED, else a CHECK_FAILED failure carrying the report.
// The worker API returns `TaskFailure` by value; boxing it here would only be undone.
#[allow(clippy::result_large_err)]
fn verdict(report: TestRunReport) -> Result<TaskResult, TaskFailure> {
    let summary = summarize(&report);
    let outcome = report.outcome();
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
                f.criticality,
                f.message.lines().next().unwrap_or("")
            )
        })
        .collect();
    details.extend(report.warnings.iter().cloned());
    if matches!(
        outcome,
        TestOutcome::RunnerCrashed | TestOutcome::Timeout | TestOutcome::CollectionError
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
    if outcome == TestOutcome::Passed {
        Ok(result)
    } else {
        Err(TaskFailure::new(
            ErrorKind::CheckFailed,
            format!("test run {}: {summary}", outcome_name(outcome)),
            false,
        )
        .with_details(details)
        .with_partial(result))
    }
}

fn summarize(report: &TestRunReport) -> String {
    let t = report.totals.unwrap_or_default();
    let commit = report.commit.get(..12).unwrap_or(&report.commit);
    let mut text = format!(
        "{} at {commit}: {} tests, {} passed, {} failed, {} errors, {} skipped (pass rate {:.1}%)",
        detect::name(report.framework()),
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
        | Error::Internal(_) => TaskFailure::new(ErrorKind::Internal, message, true),
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

/// A protobuf `Struct` as JSON.
pub(crate) fn struct_to_json(value: &prost_types::Struct) -> Value {
    Value::Object(
        value
            .fields
            .iter()
            .map(|(k, v)| (k.clone(), value_to_json(v)))
            .collect(),
    )
}

fn value_to_json(value: &prost_types::Value) -> Value {
    match &value.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::BoolValue(b)) => Value::Bool(*b),
        Some(Kind::NumberValue(n)) => {
            serde_json::Number::from_f64(*n).map_or(Value::Null, Value::Number)
        }
        Some(Kind::StringValue(s)) => Value::String(s.clone()),
        Some(Kind::ListValue(list)) => {
            Value::Array(list.values.iter().map(value_to_json).collect())
        }
        Some(Kind::StructValue(s)) => struct_to_json(s),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn parses_the_test_object_with_defaults() {
        let spec = TestSpec::parse(None).expect("defaults");
        assert_eq!(
            spec,
            TestSpec {
                framework: TestFramework::Unspecified,
                coverage_target: 0.0,
                install: true,
                coverage_source: String::new(),
                timeout: DEFAULT_TIMEOUT,
                test_timeout_seconds: DEFAULT_TEST_TIMEOUT_SECONDS,
            }
        );
        let value = json!({"framework": "pytest", "coverage_target": 80, "install": false,
                           "coverage_source": "stats", "timeout_seconds": 120.0, "test_timeout_seconds": 5});
        let spec = TestSpec::parse(Some(&value)).expect("valid");
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
            assert!(TestSpec::parse(Some(&bad)).is_err(), "{bad}");
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
    fn converts_structs() {
        let value = json!({"test": {"framework": "pytest", "coverage_target": 80.0, "install": true, "list": [1.0, null]}});
        let proto: prost_types::Struct = prost_types::Struct {
            fields: [(
                "test".to_owned(),
                prost_types::Value {
                    kind: Some(Kind::StructValue(prost_types::Struct {
                        fields: [
                            (
                                "framework".to_owned(),
                                prost_types::Value {
                                    kind: Some(Kind::StringValue("pytest".into())),
                                },
                            ),
                            (
                                "coverage_target".to_owned(),
                                prost_types::Value {
                                    kind: Some(Kind::NumberValue(80.0)),
                                },
                            ),
                            (
                                "install".to_owned(),
                                prost_types::Value {
                                    kind: Some(Kind::BoolValue(true)),
                                },
                            ),
                            (
                                "list".to_owned(),
                                prost_types::Value {
                                    kind: Some(Kind::ListValue(prost_types::ListValue {
                                        values: vec![
                                            prost_types::Value {
                                                kind: Some(Kind::NumberValue(1.0)),
                                            },
                                            prost_types::Value {
                                                kind: Some(Kind::NullValue(0)),
                                            },
                                        ],
                                    })),
                                },
                            ),
                        ]
                        .into_iter()
                        .collect(),
                    })),
                },
            )]
            .into_iter()
            .collect(),
        };
        assert_eq!(struct_to_json(&proto), value);
    }

    #[test]
    fn sanitizes_run_ids() {
        assert_eq!(sanitize("s-1/TESTRUN 001-a2"), "s-1_TESTRUN_001-a2");
    }
}

//! VALIDATE-* tasks from the coordinator.
//!
//! What is checked:
//! - the `files[]` of every upstream task that reported a commit (the executors), each at its
//!   own result commit against that commit's first parent, so a file counts as modified only
//!   when that task's own integration changed it (check names `<TASK-ID>/file:<path>`);
//! - the VALIDATE task's own `files[]` at the session branch head, `modify` measured against
//!   the session's base commit;
//! - the VALIDATE task's own `convergence.verification` at the session branch head (upstream
//!   tasks' verification commands are theirs to run, not re-run here);
//! - the VALIDATE task's own `convergence.criteria` (MANUAL_REVIEW until issue #6).
//!
//! The task completes on PASS or MANUAL_REVIEW (the latter with a warning); FAIL fails it with
//! CHECK_FAILED, not retryable, with the report as the partial result.

use std::sync::Arc;
use std::time::{Duration, Instant};

use prost_types::value::Kind;
use serde_json::Value;
use troupe_grpc::worker::{TaskContext, TaskFailure, TaskHandler};
use troupe_proto::v1::{
    CheckResult, CheckStatus, ClaimedTask, ErrorKind, TaskResult, ValidationReport, Verdict,
    task_result,
};
use troupe_workspace::{Oid, Repo};

use crate::Error;
use crate::validate::{
    DEFAULT_VERIFICATION_TIMEOUT, Validator, check_files, criteria_checks, first_parent, report,
};

/// Runs VALIDATE-* tasks with a shared [`Validator`].
#[derive(Debug, Clone)]
pub struct ValidateHandler {
    validator: Arc<Validator>,
}

impl ValidateHandler {
    /// A handler checking with `validator`.
    pub fn new(validator: Arc<Validator>) -> Self {
        Self { validator }
    }

    async fn run(&self, claimed: ClaimedTask, ctx: TaskContext) -> Result<ValidationReport, Error> {
        let task = claimed
            .task
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("claimed task has no task".to_owned()))?;
        let session_repo = claimed
            .repo
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("claimed task has no repository".to_owned()))?;
        let spec = task
            .spec
            .as_ref()
            .map(struct_to_json)
            .unwrap_or(Value::Null);
        let convergence = TaskConvergence::parse(&spec)?;
        let repo = Repo::open(&session_repo.path).await?;
        let head = repo.resolve(&session_repo.branch).await?;
        ctx.progress(format!(
            "validating {} at {}",
            session_repo.branch,
            &head.as_str()[..12]
        ));

        let mut checks = Vec::new();
        for upstream in &claimed.upstream {
            if upstream.files.is_empty() {
                continue;
            }
            let commit = upstream.result.as_ref().map_or("", |r| r.commit.as_str());
            if commit.is_empty() {
                checks.push(CheckResult {
                    name: format!("{}/files", upstream.task_id),
                    kind: "file".to_owned(),
                    status: CheckStatus::Error as i32,
                    duration_ms: 0,
                    evidence: format!(
                        "upstream task {} reported no commit, so its files cannot be checked",
                        upstream.task_id
                    ),
                    subject: upstream
                        .files
                        .iter()
                        .map(|f| f.path.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                });
                continue;
            }
            let commit = repo.resolve(commit).await?;
            let base = first_parent(&repo, &commit).await?;
            checks.extend(
                check_files(
                    &repo,
                    &commit,
                    base.as_ref(),
                    &upstream.files,
                    &format!("{}/", upstream.task_id),
                )
                .await?,
            );
        }
        if !task.files.is_empty() {
            let base = match Oid::parse(&session_repo.base_commit) {
                Some(base) => Some(base),
                None => first_parent(&repo, &head).await?,
            };
            checks.extend(check_files(&repo, &head, base.as_ref(), &task.files, "").await?);
        }
        if let Some(argv) = &convergence.verification {
            ctx.progress(format!("running verification `{}`", argv.join(" ")));
            checks.push(
                self.validator
                    .verify(&repo, &head, argv, convergence.timeout, &ctx.cancelled())
                    .await?,
            );
        }
        checks.extend(criteria_checks(&convergence.criteria));
        Ok(report(head, checks))
    }
}

impl TaskHandler for ValidateHandler {
    async fn handle(&self, task: ClaimedTask, ctx: TaskContext) -> Result<TaskResult, TaskFailure> {
        let started = Instant::now();
        let report = self.run(task, ctx).await.map_err(into_failure)?;
        tracing::info!(verdict = ?report.verdict(), checks = report.checks.len(), elapsed_ms = started.elapsed().as_millis(), "validation finished");
        verdict(report)
    }
}

/// `convergence.verification`, `convergence.criteria` and the task's `timeout_seconds`.
#[derive(Debug, PartialEq)]
struct TaskConvergence {
    verification: Option<Vec<String>>,
    criteria: Vec<String>,
    timeout: Duration,
}

impl TaskConvergence {
    fn parse(spec: &Value) -> Result<Self, Error> {
        let convergence = spec.get("convergence").unwrap_or(&Value::Null);
        let verification = match convergence.get("verification") {
            None | Some(Value::Null) => None,
            Some(Value::String(line)) if line.trim().is_empty() => None,
            Some(Value::String(line)) => {
                Some(troupe_process::command_line_to_argv(line).map_err(|err| {
                    Error::InvalidArgument(format!(
                        "convergence.verification cannot be parsed: {err}"
                    ))
                })?)
            }
            Some(Value::Array(items)) if !items.is_empty() => Some(
                items
                    .iter()
                    .map(|item| item.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>()
                    .filter(|argv| !argv[0].is_empty())
                    .ok_or_else(|| {
                        Error::InvalidArgument(
                            "convergence.verification must be an array of strings".to_owned(),
                        )
                    })?,
            ),
            Some(_) => {
                return Err(Error::InvalidArgument(
                    "convergence.verification must be a command string or a non-empty argv array"
                        .to_owned(),
                ));
            }
        };
        let criteria = match convergence.get("criteria") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| item.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    Error::InvalidArgument(
                        "convergence.criteria must be an array of strings".to_owned(),
                    )
                })?,
            Some(_) => {
                return Err(Error::InvalidArgument(
                    "convergence.criteria must be an array of strings".to_owned(),
                ));
            }
        };
        let timeout = match spec.get("timeout_seconds").and_then(Value::as_u64) {
            Some(secs) if secs > 0 => Duration::from_secs(secs),
            _ => DEFAULT_VERIFICATION_TIMEOUT,
        };
        Ok(Self {
            verification,
            criteria,
            timeout,
        })
    }
}

/// PASS and MANUAL_REVIEW complete the task; FAIL fails it with the report attached.
// The worker API returns `TaskFailure` by value; boxing it here would only be undone.
#[allow(clippy::result_large_err)]
fn verdict(report: ValidationReport) -> Result<TaskResult, TaskFailure> {
    let count = |status: CheckStatus| {
        report
            .checks
            .iter()
            .filter(|c| c.status() == status)
            .count()
    };
    let (passed, failed, errored, review) = (
        count(CheckStatus::Pass),
        count(CheckStatus::Fail),
        count(CheckStatus::Error),
        count(CheckStatus::ManualReview),
    );
    let summary = format!(
        "validation at {}: {} checks, {passed} passed, {failed} failed, {errored} errored, {review} need manual review",
        report.commit.get(..12).unwrap_or(&report.commit),
        report.checks.len()
    );
    let mut warnings = Vec::new();
    if review > 0 {
        warnings.push(format!("{review} criteria need manual review"));
    }
    let details: Vec<String> = report
        .checks
        .iter()
        .filter(|c| matches!(c.status(), CheckStatus::Fail | CheckStatus::Error))
        .map(|c| {
            format!(
                "{} ({:?}): {}",
                c.name,
                c.status(),
                troupe_process::tail(&c.evidence, 5, 600)
            )
        })
        .collect();
    let outcome = report.verdict();
    let result = TaskResult {
        summary: summary.clone(),
        commit: report.commit.clone(),
        warnings,
        detail: Some(task_result::Detail::Validation(report)),
        ..TaskResult::default()
    };
    match outcome {
        Verdict::Pass | Verdict::ManualReview => Ok(result),
        Verdict::Fail | Verdict::Unspecified => Err(TaskFailure::new(
            ErrorKind::CheckFailed,
            format!("validation failed: {summary}"),
            false,
        )
        .with_details(details)
        .with_partial(result)),
    }
}

fn into_failure(err: Error) -> TaskFailure {
    let message = err.to_string();
    match err {
        Error::InvalidArgument(_)
        | Error::Workspace(
            troupe_workspace::Error::NotARepo { .. }
            | troupe_workspace::Error::UnknownRevision { .. }
            | troupe_workspace::Error::BranchMissing { .. },
        ) => TaskFailure::new(ErrorKind::InvalidTask, message, false),
        Error::Cancelled
        | Error::Workspace(_)
        | Error::Process(_)
        | Error::Io { .. }
        | Error::Grpc(_) => TaskFailure::new(ErrorKind::Internal, message, true),
    }
}

/// A protobuf `Struct` as JSON.
fn struct_to_json(value: &prost_types::Struct) -> Value {
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
    fn parses_convergence() {
        let spec = json!({"convergence": {"criteria": ["a", "b"], "verification": "python -m pytest -q"}, "timeout_seconds": 30});
        let parsed = TaskConvergence::parse(&spec).expect("valid");
        assert_eq!(
            parsed.verification,
            Some(vec![
                "python".into(),
                "-m".into(),
                "pytest".into(),
                "-q".into()
            ])
        );
        assert_eq!(parsed.criteria, ["a", "b"]);
        assert_eq!(parsed.timeout, Duration::from_secs(30));
        let shell = TaskConvergence::parse(
            &json!({"convergence": {"verification": "make test && echo ok"}}),
        )
        .expect("valid");
        assert_eq!(
            shell.verification,
            Some(vec![
                "sh".into(),
                "-c".into(),
                "make test && echo ok".into()
            ])
        );
        let argv = TaskConvergence::parse(&json!({"convergence": {"verification": ["true"]}}))
            .expect("valid");
        assert_eq!(argv.verification, Some(vec!["true".into()]));
        assert_eq!(argv.timeout, DEFAULT_VERIFICATION_TIMEOUT);
        assert!(TaskConvergence::parse(&json!({"convergence": {"verification": [1]}})).is_err());
        assert!(TaskConvergence::parse(&json!({"convergence": {"criteria": "x"}})).is_err());
        assert_eq!(
            TaskConvergence::parse(&Value::Null)
                .expect("empty")
                .verification,
            None
        );
    }

    fn report_with(statuses: &[CheckStatus]) -> ValidationReport {
        let checks: Vec<CheckResult> = statuses
            .iter()
            .map(|s| CheckResult {
                status: *s as i32,
                ..CheckResult::default()
            })
            .collect();
        ValidationReport {
            verdict: crate::validate::verdict(&checks) as i32,
            checks,
            commit: "c".repeat(40),
        }
    }

    #[test]
    fn manual_review_completes_with_a_warning_and_fail_fails() {
        let done = verdict(report_with(&[CheckStatus::Pass, CheckStatus::ManualReview]))
            .expect("completes");
        assert_eq!(done.warnings, ["1 criteria need manual review"]);
        let failure =
            verdict(report_with(&[CheckStatus::Pass, CheckStatus::Fail])).expect_err("fails");
        assert_eq!(failure.error.kind(), ErrorKind::CheckFailed);
        assert!(!failure.error.retryable);
        assert!(matches!(
            failure.partial.and_then(|p| p.detail),
            Some(task_result::Detail::Validation(_))
        ));
    }
}

//! VALIDATE-*, REVIEW-* and VERIFY-* tasks from the coordinator (the id prefix decides).
//!
//! VALIDATE-*:
//! - the `files[]` of every upstream task that reported a commit (the executors), each at its
//!   own result commit against that commit's first parent, so a file counts as modified only
//!   when that task's own integration changed it (check names `<TASK-ID>/file:<path>`);
//! - the task's own `files[]` at the session branch head, `modify` against the session's base;
//! - in one worktree at the head: the task's own `convergence.verification`, syntax and lint
//!   of every file changed since the session's base, and the task's own criteria (typed, then
//!   the judge from the task's `judge` or the validator's `--judge`, else manual review), with
//!   upstream TESTRUN results for `test:` and `coverage` criteria;
//! - each upstream executor task's own criteria (read from the plan in `plan_dir`) at the
//!   head, named `<TASK-ID>/criterion:<n>`, summarised per task in
//!   `ValidationReport.upstream_convergence` for the coordinator to copy onto that task.
//!   PASS or MANUAL_REVIEW completes the task; FAIL fails it (CHECK_FAILED, not retryable).
//!
//! REVIEW-*: the same files and criteria, plus the review of every changed file; BLOCK fails
//! the task, CONDITIONAL completes it with a warning, APPROVE completes it.
//!
//! VERIFY-*: goal-backward: for every upstream executor task, its files, verification command
//! and criteria (from the plan in `plan_dir`) at the session head; gaps go to
//! `verification.md` and to the result. Gaps fail the task (CHECK_FAILED, the report as the
//! partial result) so a session never completes with unverified goals; adding fix tasks from
//! the gaps is the coordinator's job.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::repos::RepoViews;
use tokio_util::sync::CancellationToken;
use troupe_grpc::worker::{TaskContext, TaskFailure, TaskHandler};
use troupe_proto::names;
use troupe_proto::v1::{
    CheckResult, CheckStatus, ClaimedTask, ConvergenceMet, ErrorKind, GoalVerification,
    ReviewVerdict, Role, TaskResult, TestRunReport, UpstreamConvergence, UpstreamResult,
    ValidationReport, Verdict, VerificationStatus, task_result,
};

use crate::Error;
use crate::judge::JudgeConfig;
use crate::validate::{
    DEFAULT_VERIFICATION_TIMEOUT, TreeJob, Validator, check_files, convergence_of, first_parent,
    report,
};
use crate::verify;
use troupe_plan::{TaskKind, TaskSpec};

/// Runs VALIDATE-*, REVIEW-* and VERIFY-* tasks with a shared [`Validator`].
#[derive(Debug, Clone)]
pub struct ValidateHandler {
    validator: Arc<Validator>,
}

impl ValidateHandler {
    /// A handler checking with `validator`.
    pub fn new(validator: Arc<Validator>) -> Self {
        Self { validator }
    }

    /// Runs one claimed task to its result; `progress` receives notes for heartbeats. This is
    /// what [`TaskHandler::handle`] does, callable without a worker loop.
    // The worker API returns `TaskFailure` by value; boxing it here would only be undone.
    #[allow(clippy::result_large_err)]
    pub async fn check(
        &self,
        claimed: ClaimedTask,
        progress: &(dyn Fn(String) + Send + Sync),
        cancel: &CancellationToken,
    ) -> Result<TaskResult, TaskFailure> {
        let started = Instant::now();
        let spec = typed(&claimed).map_err(into_failure)?;
        let kind = spec.kind;
        let report = self
            .run(claimed, &spec, progress, cancel)
            .await
            .map_err(into_failure)?;
        tracing::info!(verdict = ?report.verdict(), checks = report.checks.len(), elapsed_ms = started.elapsed().as_millis(), "validation finished");
        outcome(report, kind)
    }

    async fn run(
        &self,
        claimed: ClaimedTask,
        spec: &TaskSpec,
        progress: &(dyn Fn(String) + Send + Sync),
        cancel: &CancellationToken,
    ) -> Result<ValidationReport, Error> {
        let kind = spec.kind;
        let task = claimed
            .task
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("claimed task has no task".to_owned()))?;
        let session_repo = claimed
            .repo
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("claimed task has no repository".to_owned()))?;
        let convergence = &spec.blocks.convergence;
        let timeout = verification_timeout(spec);
        let own_judge =
            spec.blocks.judge.as_ref().map(|judge| {
                JudgeConfig::from_spec(judge, timeout, self.validator.default_judge())
            });
        let judge = own_judge.as_ref().or(self.validator.default_judge());
        // Everything a check reads comes from the remotes: the session branches and the task
        // branches hold every commit an upstream task reported.
        let mut views = RepoViews::new(&self.validator, &claimed);
        let own = views.own().await?;
        let (repo, head, session_base) = (own.repo.clone(), own.head.clone(), own.base.clone());
        progress(format!(
            "{kind:?} {} at {}",
            session_repo.branch,
            &head.as_str()[..12]
        ));
        let test_runs: Vec<TestRunReport> = claimed
            .upstream
            .iter()
            .filter_map(
                |u| match u.result.as_ref().and_then(|r| r.detail.as_ref()) {
                    Some(task_result::Detail::TestRun(run)) => Some(run.clone()),
                    _ => None,
                },
            )
            .collect();
        let changed = match &session_base {
            Some(base) => Some(repo.changed_paths(base, &head).await?),
            None => None,
        };

        let mut checks = Vec::new();
        let mut verification = None;
        if kind == TaskKind::Verify {
            let (upstream_checks, result) = self
                .verify_upstream(&claimed, &mut views, &test_runs, judge, cancel, progress)
                .await?;
            checks = upstream_checks;
            verification = Some(result);
        } else {
            checks.extend(upstream_file_checks(&claimed, &mut views).await?);
            if kind == TaskKind::Validate {
                checks.extend(
                    self.upstream_criteria(
                        &claimed, &mut views, &test_runs, judge, cancel, progress,
                    )
                    .await?,
                );
            }
        }
        if !task.files.is_empty() {
            checks.extend(check_files(&repo, &head, session_base.as_ref(), &task.files, "").await?);
        }
        let job = TreeJob {
            verification: convergence.verification.as_deref(),
            timeout,
            syntax: kind == TaskKind::Validate,
            review: kind == TaskKind::Review,
            changed,
            criteria: &convergence.criteria,
            prefix: "",
            test_runs: &test_runs,
            judge,
            task_id: &task.id,
            title: &task.title,
            description: &task.description,
            sandbox: plan_sandbox(&spec.object),
        };
        progress(format!("checking {} at {}", task.id, &head.as_str()[..12]));
        let (checks, review) = self
            .validator
            .in_tree(&repo, &head, job, checks, cancel)
            .await?;
        let mut report = report(head.clone(), checks);
        report.review = review;
        report.upstream_convergence = executor_upstream(&claimed)
            .filter_map(|u| {
                let (verified, met) = convergence_of(&report.checks, &format!("{}/", u.task_id));
                (!verified.is_empty()).then(|| UpstreamConvergence {
                    task_id: u.task_id.clone(),
                    convergence_verified: verified,
                    convergence_met: met as i32,
                    commit: head.to_string(),
                    ..UpstreamConvergence::default()
                })
            })
            .collect();
        if let Some(mut result) = verification {
            let tasks = group_by_task(&report.checks);
            let text = verify::render(&verify::Summary {
                task_id: &task.id,
                session_id: &task.session_id,
                phase: spec.phase(),
                commit: head.as_str(),
                tasks: &tasks,
                result: &result,
            });
            let path =
                verify::write(self.validator.data_dir(), &task.session_id, &task.id, &text).await?;
            result.path = path.display().to_string();
            report.verification = Some(result);
        }
        Ok(report)
    }

    /// VALIDATE: every upstream executor task's criteria (from its spec, as the claim carries
    /// it) at its repository's session head, named `<TASK>/criterion:<n>`.
    async fn upstream_criteria(
        &self,
        claimed: &ClaimedTask,
        views: &mut RepoViews<'_>,
        test_runs: &[TestRunReport],
        judge: Option<&JudgeConfig>,
        cancel: &CancellationToken,
        progress: &(dyn Fn(String) + Send + Sync),
    ) -> Result<Vec<CheckResult>, Error> {
        let mut checks = Vec::new();
        for upstream in executor_upstream(claimed) {
            let id = upstream.task_id.as_str();
            let Some(spec) = upstream_spec(upstream)? else {
                continue;
            };
            let convergence = &spec.blocks.convergence;
            if convergence.criteria.is_empty() {
                continue;
            }
            progress(format!("checking the criteria of {id}"));
            let view = views.named(&upstream.repo).await?;
            let prefix = format!("{id}/");
            let job = TreeJob {
                timeout: verification_timeout(&spec),
                criteria: &convergence.criteria,
                prefix: &prefix,
                test_runs,
                judge,
                task_id: id,
                title: &spec.title,
                description: &spec.description,
                sandbox: plan_sandbox(&spec.object),
                ..TreeJob::default()
            };
            let (done, _) = self
                .validator
                .in_tree(&view.repo, &view.head, job, Vec::new(), cancel)
                .await?;
            checks.extend(done);
        }
        Ok(checks)
    }

    /// VERIFY: every upstream executor task's files, verification and criteria at its
    /// repository's session head.
    async fn verify_upstream(
        &self,
        claimed: &ClaimedTask,
        views: &mut RepoViews<'_>,
        test_runs: &[TestRunReport],
        judge: Option<&JudgeConfig>,
        cancel: &CancellationToken,
        progress: &(dyn Fn(String) + Send + Sync),
    ) -> Result<(Vec<CheckResult>, GoalVerification), Error> {
        let targets: Vec<_> = executor_upstream(claimed).collect();
        let mut all = Vec::new();
        let mut gaps = Vec::new();
        let mut passed = 0;
        for upstream in &targets {
            let id = upstream.task_id.as_str();
            progress(format!("verifying {id}"));
            let prefix = format!("{id}/");
            let view = views.named(&upstream.repo).await?;
            let (repo, head) = (&view.repo, &view.head);
            let mut checks =
                check_files(repo, head, view.base.as_ref(), &upstream.files, &prefix).await?;
            let spec = upstream_spec(upstream)?
                .ok_or_else(|| format!("the claim carries no spec of {id}"));
            match spec {
                Ok(spec) => {
                    let convergence = &spec.blocks.convergence;
                    let job = TreeJob {
                        verification: convergence.verification.as_deref(),
                        timeout: verification_timeout(&spec),
                        criteria: &convergence.criteria,
                        prefix: &prefix,
                        test_runs,
                        judge,
                        task_id: id,
                        title: &spec.title,
                        description: &spec.description,
                        sandbox: plan_sandbox(&spec.object),
                        ..TreeJob::default()
                    };
                    let (done, _) = self
                        .validator
                        .in_tree(repo, head, job, checks, cancel)
                        .await?;
                    checks = done;
                    // The verification check is the task's own: name it so.
                    for c in &mut checks {
                        if c.name == "verification" {
                            c.name = format!("{prefix}verification");
                        }
                    }
                }
                Err(reason) => checks.push(CheckResult {
                    name: format!("{prefix}criteria"),
                    kind: troupe_proto::v1::CheckKind::Criterion as i32,
                    status: CheckStatus::ManualReview as i32,
                    duration_ms: 0,
                    evidence: format!("criteria and verification of {id} not checked: {reason}"),
                    subject: format!("convergence of {id}"),
                    ..Default::default()
                }),
            }
            let task_gaps: Vec<_> = checks.iter().filter_map(|c| verify::gap(id, c)).collect();
            if task_gaps.is_empty() {
                passed += 1;
            }
            gaps.extend(task_gaps);
            all.extend(checks);
        }
        let result = GoalVerification {
            status: if gaps.is_empty() {
                VerificationStatus::Passed
            } else {
                VerificationStatus::GapsFound
            } as i32,
            tasks_checked: u32::try_from(targets.len()).unwrap_or(u32::MAX),
            tasks_passed: passed,
            gaps,
            path: String::new(),
            ..GoalVerification::default()
        };
        Ok((all, result))
    }
}

/// The upstream tasks that are executors' (whose promises a validator checks).
fn executor_upstream(claimed: &ClaimedTask) -> impl Iterator<Item = &UpstreamResult> {
    claimed
        .upstream
        .iter()
        .filter(|u| matches!(u.role(), Role::Executor | Role::Unspecified))
}

/// The plan's `sandbox` for a task (its spec): it may tighten the validator's, never loosen it.
fn plan_sandbox(
    object: &serde_json::Map<String, serde_json::Value>,
) -> Option<troupe_process::SandboxMode> {
    troupe_plan::spec::sandbox_of(object).and_then(|mode| mode.as_str().parse().ok())
}

/// The claimed task, typed once by the plan's rules.
fn typed(claimed: &ClaimedTask) -> Result<TaskSpec, Error> {
    let task = claimed
        .task
        .as_ref()
        .ok_or_else(|| Error::InvalidArgument("claimed task has no task".to_owned()))?;
    TaskSpec::try_from(task).map_err(|err| Error::InvalidArgument(format!("invalid task: {err}")))
}

/// An upstream task as the claim carries it, typed by the plan's rules; `None` when the claim
/// carries no spec of it.
fn upstream_spec(upstream: &UpstreamResult) -> Result<Option<TaskSpec>, Error> {
    if upstream
        .spec
        .as_ref()
        .is_none_or(|spec| spec.fields.is_empty())
    {
        return Ok(None);
    }
    TaskSpec::try_from(upstream)
        .map(Some)
        .map_err(|err| Error::InvalidArgument(format!("upstream task {}: {err}", upstream.task_id)))
}

/// The limit of a task's verification command and judge: its `timeout_seconds`, else
/// [`DEFAULT_VERIFICATION_TIMEOUT`].
fn verification_timeout(spec: &TaskSpec) -> Duration {
    spec.timeout.unwrap_or(DEFAULT_VERIFICATION_TIMEOUT)
}

/// Upstream executors' files, each at its own result commit in its own repository.
async fn upstream_file_checks(
    claimed: &ClaimedTask,
    views: &mut RepoViews<'_>,
) -> Result<Vec<CheckResult>, Error> {
    let mut checks = Vec::new();
    for upstream in &claimed.upstream {
        if upstream.files.is_empty() {
            continue;
        }
        let commit = upstream.result.as_ref().map_or("", |r| r.commit.as_str());
        if commit.is_empty() {
            checks.push(CheckResult {
                name: format!("{}/files", upstream.task_id),
                kind: troupe_proto::v1::CheckKind::File as i32,
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
                ..Default::default()
            });
            continue;
        }
        let view = views.named(&upstream.repo).await?;
        let repo = &view.repo;
        let commit = repo.resolve(commit).await?;
        let base = first_parent(repo, &commit).await?;
        checks.extend(
            check_files(
                repo,
                &commit,
                base.as_ref(),
                &upstream.files,
                &format!("{}/", upstream.task_id),
            )
            .await?,
        );
    }
    Ok(checks)
}

/// Checks grouped by their `<TASK>/` prefix, in first-seen order.
fn group_by_task(checks: &[CheckResult]) -> Vec<(String, Vec<CheckResult>)> {
    let mut groups: Vec<(String, Vec<CheckResult>)> = Vec::new();
    for c in checks {
        let task = c
            .name
            .split_once('/')
            .map_or("(this task)", |(t, _)| t)
            .to_owned();
        match groups.iter_mut().find(|(t, _)| *t == task) {
            Some((_, list)) => list.push(c.clone()),
            None => groups.push((task, vec![c.clone()])),
        }
    }
    groups
}

impl TaskHandler for ValidateHandler {
    async fn handle(&self, task: ClaimedTask, ctx: TaskContext) -> Result<TaskResult, TaskFailure> {
        let notes = ctx.clone();
        let progress = move |note: String| notes.progress(note);
        self.check(task, &progress, &ctx.cancelled()).await
    }
}

/// VALIDATE: PASS and MANUAL_REVIEW complete the task, FAIL fails it. REVIEW: BLOCK fails,
/// CONDITIONAL and APPROVE complete. VERIFY: gaps fail. Failures carry the report.
// The worker API returns `TaskFailure` by value; boxing it here would only be undone.
#[allow(clippy::result_large_err)]
fn outcome(report: ValidationReport, kind: TaskKind) -> Result<TaskResult, TaskFailure> {
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
    let mut summary = format!(
        "validation at {}: {} checks, {passed} passed, {failed} failed, {errored} errored, {review} need manual review",
        report.commit.get(..12).unwrap_or(&report.commit),
        report.checks.len()
    );
    if report.convergence_met() != ConvergenceMet::Unspecified {
        summary.push_str(&format!(
            "; convergence-met: {}",
            names::name(report.convergence_met())
        ));
    }
    if !report.upstream_convergence.is_empty() {
        let each: Vec<String> = report
            .upstream_convergence
            .iter()
            .map(|u| format!("{} {}", u.task_id, names::name(u.convergence_met())))
            .collect();
        summary.push_str(&format!("; upstream convergence-met: {}", each.join(", ")));
    }
    let mut warnings = Vec::new();
    if review > 0 {
        warnings.push(format!("{review} checks need manual review"));
    }
    let mut details: Vec<String> = report
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
    let failed_because = match kind {
        TaskKind::Review => {
            let review = report.review.clone().unwrap_or_default();
            let verdict = review.verdict();
            summary.push_str(&format!(
                "; review: {:?} with {} findings",
                verdict,
                review.findings.len()
            ));
            details = review
                .findings
                .iter()
                .filter(|f| f.severity() >= troupe_proto::v1::Severity::Medium)
                .map(|f| {
                    format!(
                        "{:?} {} {}:{}: {}",
                        f.severity(),
                        f.rule,
                        f.file,
                        f.line,
                        f.message
                    )
                })
                .collect();
            match verdict {
                ReviewVerdict::Approve => None,
                ReviewVerdict::Conditional => {
                    warnings.push(format!(
                        "review is CONDITIONAL: {} findings of high or medium severity",
                        details.len()
                    ));
                    None
                }
                ReviewVerdict::Block | ReviewVerdict::Unspecified => {
                    Some("review blocked".to_owned())
                }
            }
        }
        TaskKind::Verify => {
            let v = report.verification.clone().unwrap_or_default();
            summary.push_str(&format!(
                "; verification {}: {}/{} tasks passed, {} gaps ({})",
                names::name(v.status()),
                v.tasks_passed,
                v.tasks_checked,
                v.gaps.len(),
                v.path
            ));
            details = v
                .gaps
                .iter()
                .map(|g| {
                    format!(
                        "{} {} `{}`: expected {}; {}",
                        g.task,
                        names::name(g.r#type()),
                        g.item,
                        g.expected,
                        g.actual
                    )
                })
                .collect();
            (v.status() != VerificationStatus::Passed || matches!(report.verdict(), Verdict::Fail))
                .then(|| "verification found gaps".to_owned())
        }
        // VALIDATE: the validator's plain kind ([`TaskKind::of`] gives no other here).
        _ => matches!(report.verdict(), Verdict::Fail | Verdict::Unspecified)
            .then(|| "validation failed".to_owned()),
    };
    let result = TaskResult {
        summary: summary.clone(),
        commit: report.commit.clone(),
        warnings,
        detail: Some(task_result::Detail::Validation(report)),
        ..TaskResult::default()
    };
    // A check whose command the sandbox refused something fails the task as SANDBOX_DENIED,
    // naming what was denied.
    let denied = result.detail.as_ref().and_then(|detail| match detail {
        task_result::Detail::Validation(report) => report.checks.iter().find_map(|check| {
            check
                .evidence
                .strip_prefix(crate::validate::SANDBOX_DENIED)
                .map(|rest| rest.lines().next().unwrap_or_default().to_owned())
        }),
        _ => None,
    });
    match (failed_because, denied) {
        (None, _) => Ok(result),
        (Some(why), Some(denied)) => Err(TaskFailure::new(
            ErrorKind::SandboxDenied,
            format!("{why}: the sandbox denied {denied}: {summary}"),
            false,
        )
        .with_details(details)
        .with_partial(result)),
        (Some(why), None) => {
            Err(
                TaskFailure::new(ErrorKind::CheckFailed, format!("{why}: {summary}"), false)
                    .with_details(details)
                    .with_partial(result),
            )
        }
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_claim_is_typed_once_with_its_judge_and_timeout() {
        let claim = |spec: serde_json::Value| ClaimedTask {
            task: Some(troupe_proto::v1::Task {
                id: "VALIDATE-1".into(),
                role: Role::Validator as i32,
                spec: Some(troupe_proto::json::to_struct(&spec)),
                ..troupe_proto::v1::Task::default()
            }),
            ..ClaimedTask::default()
        };
        let spec = typed(&claim(json!({
            "convergence": {"criteria": ["a"], "verification": "python -m pytest -q"},
            "judge": ["python3", "judge.py"],
            "timeout_seconds": 30,
        })))
        .expect("valid");
        assert_eq!(spec.kind, TaskKind::Validate);
        assert_eq!(verification_timeout(&spec), Duration::from_secs(30));
        assert_eq!(
            spec.blocks.convergence.verification.as_deref(),
            Some(
                &[
                    "python".to_owned(),
                    "-m".into(),
                    "pytest".into(),
                    "-q".into()
                ][..]
            )
        );
        let judge = JudgeConfig::from_spec(
            spec.blocks.judge.as_ref().expect("judge"),
            verification_timeout(&spec),
            None,
        );
        assert_eq!(judge.command, ["python3", "judge.py"]);
        assert_eq!(judge.timeout, Duration::from_secs(30));
        let defaults = typed(&claim(json!({}))).expect("valid");
        assert_eq!(
            verification_timeout(&defaults),
            DEFAULT_VERIFICATION_TIMEOUT
        );
        // Every problem, in the plan's words, as an invalid task.
        let err = typed(&claim(json!({
            "convergence": {"criteria": "x", "verification": [1]},
            "judge": {"backend": "agent", "endpoint": "http://elsewhere"},
        })))
        .expect_err("invalid");
        let text = err.to_string();
        for needle in [
            "`convergence.criteria`",
            "`convergence.verification",
            "`judge.endpoint`",
        ] {
            assert!(text.contains(needle), "{needle} missing from {text}");
        }
        assert_eq!(into_failure(err).error.kind(), ErrorKind::InvalidTask);
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
            ..ValidationReport::default()
        }
    }

    #[test]
    fn manual_review_completes_with_a_warning_and_fail_fails() {
        let done = outcome(
            report_with(&[CheckStatus::Pass, CheckStatus::ManualReview]),
            TaskKind::Validate,
        )
        .expect("completes");
        assert_eq!(done.warnings, ["1 checks need manual review"]);
        let failure = outcome(
            report_with(&[CheckStatus::Pass, CheckStatus::Fail]),
            TaskKind::Validate,
        )
        .expect_err("fails");
        assert_eq!(failure.error.kind(), ErrorKind::CheckFailed);
        assert!(!failure.error.retryable);
        assert!(matches!(
            failure.partial.and_then(|p| p.detail),
            Some(task_result::Detail::Validation(_))
        ));
    }
}

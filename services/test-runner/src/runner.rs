//! One test run end to end: resolve the commit, check it out in a detached worktree, pick the
//! interpreter (a cached venv on request), run the suite, write `run-N.json`, clean up.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use troupe_proto::v1::{RunTestsRequest, TestFramework, TestOutcome, TestRunReport};
use troupe_workspace::{Oid, Repo};

use crate::Error;
use crate::detect;
use crate::pytest::{self, CoverageSource, PytestRun};
use crate::venv::VenvCache;

/// Wall-clock limit of a run when none is given.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// Per-test limit passed to pytest-timeout when none is given.
pub const DEFAULT_TEST_TIMEOUT_SECONDS: u32 = 60;
/// Longest kept failure message; a report must stay well under gRPC's message limit.
const MAX_MESSAGE_CHARS: usize = 4000;

/// What to run.
#[derive(Clone, Debug)]
pub struct RunSpec {
    /// Absolute path of the git repository.
    pub repo_path: PathBuf,
    /// Commit-ish to test.
    pub git_ref: String,
    /// Framework, or `Unspecified` to detect it.
    pub framework: TestFramework,
    /// Coverage target in percent (0 = none).
    pub coverage_target: f64,
    /// Build or reuse a venv with the repository's requirements.
    pub install: bool,
    /// Wall-clock limit of the run (install excluded).
    pub timeout: Duration,
    /// Per-test limit, when pytest-timeout is available.
    pub test_timeout_seconds: u32,
    /// `--cov` source; empty = the repository's configuration, else `.`.
    pub coverage_source: String,
    /// Names the output directory `<data_dir>/test-runs/<run_id>`.
    pub run_id: String,
    /// N of the `run-N.json` written next to the reports.
    pub run_number: u32,
}

impl RunSpec {
    /// Builds a spec from the RPC request, applying the documented defaults.
    pub fn from_request(request: RunTestsRequest) -> Result<Self, Error> {
        let framework = TestFramework::try_from(request.framework).map_err(|_| {
            Error::InvalidArgument(format!("unknown framework value {}", request.framework))
        })?;
        let spec = Self {
            repo_path: PathBuf::from(&request.repo_path),
            git_ref: if request.r#ref.is_empty() {
                "HEAD".to_owned()
            } else {
                request.r#ref
            },
            framework,
            coverage_target: request.coverage_target,
            install: request.install,
            timeout: match request.timeout_seconds {
                0 => DEFAULT_TIMEOUT,
                secs => Duration::from_secs(u64::from(secs)),
            },
            test_timeout_seconds: match request.test_timeout_seconds {
                0 => DEFAULT_TEST_TIMEOUT_SECONDS,
                secs => secs,
            },
            coverage_source: request.coverage_source,
            run_id: new_run_id(),
            run_number: 1,
        };
        spec.validate()?;
        Ok(spec)
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        if self.repo_path.as_os_str().is_empty() || !self.repo_path.is_absolute() {
            return Err(Error::InvalidArgument(format!(
                "repo_path must be an absolute path, got {:?}",
                self.repo_path.display().to_string()
            )));
        }
        if !(0.0..=100.0).contains(&self.coverage_target) {
            return Err(Error::InvalidArgument(format!(
                "coverage_target must be between 0 and 100, got {}",
                self.coverage_target
            )));
        }
        let safe = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        if self.run_id.is_empty() || self.run_id.starts_with('.') || !self.run_id.chars().all(safe)
        {
            return Err(Error::InvalidArgument(format!(
                "invalid run id {:?}",
                self.run_id
            )));
        }
        Ok(())
    }
}

/// A fresh run id: UTC time plus a random suffix, sortable and unique.
pub(crate) fn new_run_id() -> String {
    let now = chrono::Utc::now().format("%Y%m%dT%H%M%S");
    let random = uuid::Uuid::new_v4().simple().to_string();
    format!("run-{now}-{}", &random[..8])
}

/// Runs test suites; shared by the gRPC service and the worker loop.
#[derive(Debug, Clone)]
pub struct Runner {
    data_dir: PathBuf,
    python: String,
    venvs: VenvCache,
}

impl Runner {
    /// A runner keeping its worktrees, reports and venvs under `data_dir` (absolute).
    pub fn new(data_dir: PathBuf, python: String) -> Self {
        let venvs = VenvCache::new(data_dir.join("venvs"), python.clone());
        Self {
            data_dir,
            python,
            venvs,
        }
    }

    /// Where a run's reports go.
    pub fn out_dir(&self, run_id: &str) -> PathBuf {
        self.data_dir.join("test-runs").join(run_id)
    }

    /// Runs the suite once at `spec.git_ref` and reports what the structured reports say.
    #[tracing::instrument(skip_all, fields(repo = %spec.repo_path.display(), git_ref = %spec.git_ref, run_id = %spec.run_id))]
    pub async fn run_tests(
        &self,
        spec: &RunSpec,
        cancel: &CancellationToken,
    ) -> Result<TestRunReport, Error> {
        spec.validate()?;
        let repo = Repo::open(&spec.repo_path).await?;
        let commit = repo.resolve(&spec.git_ref).await?;
        let out_dir = self.out_dir(&spec.run_id);
        // A run id repeats only when a worker died mid-run; its stale reports must not be read
        // as this run's, and its worktree must go.
        if out_dir.exists() {
            tokio::fs::remove_dir_all(&out_dir)
                .await
                .map_err(|source| Error::Io {
                    path: out_dir.clone(),
                    source,
                })?;
        }
        tokio::fs::create_dir_all(&out_dir)
            .await
            .map_err(|source| Error::Io {
                path: out_dir.clone(),
                source,
            })?;
        let worktree = self
            .data_dir
            .join("worktrees")
            .join("test-runs")
            .join(&spec.run_id);
        if let Some(parent) = worktree.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|source| Error::Io {
                    path: parent.to_owned(),
                    source,
                })?;
        }
        repo.remove_worktree(&worktree).await?;
        repo.add_detached_worktree(&worktree, &commit).await?;
        let result = self
            .run_in(spec, &worktree, &out_dir, &commit, cancel)
            .await;
        if let Err(err) = repo.remove_worktree(&worktree).await {
            tracing::warn!(worktree = %worktree.display(), error = %err, "cannot remove worktree");
        }
        result
    }

    async fn run_in(
        &self,
        spec: &RunSpec,
        worktree: &Path,
        out_dir: &Path,
        commit: &Oid,
        cancel: &CancellationToken,
    ) -> Result<TestRunReport, Error> {
        let framework = match spec.framework {
            TestFramework::Unspecified => detect::detect(worktree)?,
            other => other,
        };
        if framework != TestFramework::Pytest {
            return Err(Error::Unimplemented(format!(
                "running {} suites is not implemented yet (issue #5)",
                detect::name(framework)
            )));
        }
        let mut notes = Vec::new();
        let python = if spec.install {
            let venv = self.venvs.ensure(worktree, cancel).await?;
            if venv.built {
                notes.push(format!("built a venv at {}", venv.python.display()));
            }
            venv.python.display().to_string()
        } else {
            self.python.clone()
        };
        let plugins = pytest::probe(&python, out_dir, cancel).await?;
        if !plugins.pytest {
            return Err(Error::NotInstalled(format!(
                "pytest is not importable by `{python}`; install it there or run with install to build a venv from the repository's requirements"
            )));
        }
        let coverage_source = CoverageSource::choose(&spec.coverage_source, worktree);
        let mut report = pytest::run(
            PytestRun {
                python: &python,
                worktree,
                out_dir,
                plugins,
                coverage_source: coverage_source.clone(),
                coverage_target: spec.coverage_target,
                timeout: spec.timeout,
                test_timeout_seconds: spec.test_timeout_seconds,
            },
            cancel,
        )
        .await?;
        report.commit = commit.to_string();
        for failure in &mut report.failures {
            truncate_chars(&mut failure.message, MAX_MESSAGE_CHARS);
        }
        report.warnings.extend(notes);
        let run_file = out_dir.join(format!("run-{}.json", spec.run_number));
        let json = run_file_json(&report, spec, &coverage_source);
        let text = serde_json::to_string_pretty(&json)
            .map_err(|err| Error::Internal(format!("run file: {err}")))?;
        tokio::fs::write(&run_file, text)
            .await
            .map_err(|source| Error::Io {
                path: run_file.clone(),
                source,
            })?;
        report.report_paths.push(run_file.display().to_string());
        tracing::info!(
            outcome = ?report.outcome(),
            total = report.totals.as_ref().map_or(0, |t| t.total),
            failures = report.failures.len(),
            "test run finished"
        );
        Ok(report)
    }
}

fn truncate_chars(text: &mut String, max: usize) {
    if let Some((cut, _)) = text.char_indices().nth(max) {
        text.truncate(cut);
        text.push_str(" [truncated]");
    }
}

/// Display name of an outcome (`passed`, `tests_failed`, ...).
pub(crate) fn outcome_name(outcome: TestOutcome) -> &'static str {
    match outcome {
        TestOutcome::Passed => "passed",
        TestOutcome::TestsFailed => "tests_failed",
        TestOutcome::LoadError => "load_error",
        TestOutcome::CollectionError => "collection_error",
        TestOutcome::NoTests => "no_tests",
        TestOutcome::Timeout => "timeout",
        TestOutcome::CoverageBelowTarget => "coverage_below_target",
        TestOutcome::RunnerCrashed => "runner_crashed",
        TestOutcome::Unspecified => "unspecified",
    }
}

/// One line summing up the failures, CCW's `failure_summary`.
pub(crate) fn failure_summary(report: &TestRunReport) -> String {
    if report.failures.is_empty() {
        return String::new();
    }
    let shown: Vec<String> = report
        .failures
        .iter()
        .take(3)
        .map(|f| format!("{} ({})", f.name, f.message.lines().next().unwrap_or("")))
        .collect();
    let more = report.failures.len().saturating_sub(shown.len());
    let tail = if more > 0 {
        format!("; and {more} more")
    } else {
        String::new()
    };
    format!(
        "{} failing: {}{tail}",
        report.failures.len(),
        shown.join("; ")
    )
}

/// CCW's keyword-based defect patterns (1.C.9) found in the failure messages.
fn defect_patterns(report: &TestRunReport) -> Vec<&'static str> {
    let mut patterns = Vec::new();
    let mut add = |p| {
        if !patterns.contains(&p) {
            patterns.push(p);
        }
    };
    for failure in &report.failures {
        let m = &failure.message;
        if m.contains("NoneType") || m.contains("null") || m.contains("undefined") {
            add("null_ref");
        }
        if m.to_ascii_lowercase().contains("timeout") || m.contains("timed out") {
            add("async_timing");
        }
        if m.contains("ImportError")
            || m.contains("ModuleNotFoundError")
            || m.contains("Cannot find module")
        {
            add("import");
        }
        if m.starts_with("TypeError") {
            add("type_mismatch");
        }
    }
    patterns
}

/// The `results/run-N.json` document (CCW §2.4 plus its proposed fields).
fn run_file_json(
    report: &TestRunReport,
    spec: &RunSpec,
    coverage_source: &CoverageSource,
) -> serde_json::Value {
    let totals = report.totals.unwrap_or_default();
    let coverage = report.coverage.as_ref().and_then(|c| c.overall);
    let passed = report.outcome() == TestOutcome::Passed;
    serde_json::json!({
        "run_id": format!("run-{:03}", spec.run_number),
        "framework": detect::name(report.framework()),
        "outcome": outcome_name(report.outcome()),
        "pass_rate": report.pass_rate,
        "coverage": coverage,
        "coverage_target": report.coverage_target,
        "coverage_source": coverage_source.describe(),
        "iterations": 1,
        "passed": passed,
        "failure_summary": failure_summary(report),
        "defect_patterns": defect_patterns(report),
        "timestamp": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        "total": totals.total,
        "tests_passed": totals.passed,
        "failed": totals.failed,
        "skipped": totals.skipped,
        "errors": totals.errors,
        "failures": report.failures.iter().map(|f| serde_json::json!({
            "test": f.name,
            "error": f.message,
            "file": f.file,
            "line": f.line,
            "criticality": f.criticality,
        })).collect::<Vec<_>>(),
        "duration_ms": report.duration_ms,
        "command": report.command,
        "exit_code": report.exit_code,
        "report_paths": report.report_paths,
        "commit": report.commit,
        "warnings": report.warnings,
        "troupe_run_id": spec.run_id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(path: &str) -> RunTestsRequest {
        RunTestsRequest {
            repo_path: path.to_owned(),
            ..RunTestsRequest::default()
        }
    }

    #[test]
    fn applies_defaults_and_refuses_bad_requests() {
        let spec = RunSpec::from_request(request("/repo")).expect("valid");
        assert_eq!(spec.git_ref, "HEAD");
        assert_eq!(spec.timeout, DEFAULT_TIMEOUT);
        assert_eq!(spec.test_timeout_seconds, DEFAULT_TEST_TIMEOUT_SECONDS);
        assert!(spec.run_id.starts_with("run-"));
        assert!(matches!(
            RunSpec::from_request(request("relative")),
            Err(Error::InvalidArgument(_))
        ));
        let mut bad = request("/repo");
        bad.coverage_target = 120.0;
        assert!(matches!(
            RunSpec::from_request(bad),
            Err(Error::InvalidArgument(_))
        ));
        let mut bad = request("/repo");
        bad.framework = 42;
        assert!(matches!(
            RunSpec::from_request(bad),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn truncates_on_char_boundaries() {
        let mut text = "é".repeat(10);
        truncate_chars(&mut text, 4);
        assert_eq!(text, "éééé [truncated]");
    }
}

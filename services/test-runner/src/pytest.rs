//! Running Pytest once and turning its structured reports into a [`TestRunReport`].
//!
//! The command is the one test-frameworks.md §1 settled on: JUnit XML (xunit1, for file and
//! line), pytest-json-report, and coverage.py JSON with branch coverage, each written to the
//! run's output directory outside the worktree; `--continue-on-collection-errors` so one broken
//! file does not hide every other result. Results come only from those files and the exit code
//! (§2), never from pytest's console text.

pub(crate) mod coverage;
pub(crate) mod json_report;
pub(crate) mod junit;

use std::path::{Path, PathBuf};
use std::sync::LazyLock;
use std::time::Duration;

use regex::Regex;
use tokio_util::sync::CancellationToken;
use troupe_process::{Command, Termination};
use troupe_proto::v1::{
    Coverage, TestFailure, TestFramework, TestOutcome, TestRunReport, TestTotals,
};

use crate::Error;
use crate::failure::{criticality, strip_ansi};

/// Counts and failures read from one structured report.
#[derive(Debug, Default)]
pub(crate) struct SuiteResults {
    pub(crate) totals: TestTotals,
    /// Collection errors first, then failing and erroring tests.
    pub(crate) failures: Vec<TestFailure>,
    /// Test files that failed to import or parse.
    pub(crate) collection_errors: u32,
    /// Skipped tests by reason (pytest-json-report only).
    pub(crate) skip_reasons: std::collections::BTreeMap<String, u32>,
    /// pytest's rootdir (what node ids are relative to), when the report says.
    pub(crate) root: Option<String>,
}

/// The test file of a pytest node id (the part before the first `::`).
pub(crate) fn test_file_of(nodeid: &str) -> &str {
    nodeid.split("::").next().unwrap_or(nodeid)
}

static FRAME: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(\S[^:]*):(\d+): in ").expect("frame pattern compiles"));
static SYNTAX_LOCATION: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"File "([^"]+)", line (\d+)"#).expect("syntax location pattern compiles")
});

/// A test file that could not be collected, from its collector's long representation: the
/// line is the innermost `file:LINE: in ...` frame in that file (import errors) or the
/// `File "...", line N` of a syntax error.
pub(crate) fn collection_failure(nodeid: &str, longrepr: &str) -> TestFailure {
    let file = test_file_of(nodeid);
    let text = strip_ansi(longrepr);
    let frame_line = text.lines().rev().find_map(|line| {
        let caps = FRAME.captures(line)?;
        (&caps[1] == file).then(|| caps[2].parse().ok()).flatten()
    });
    let syntax_line = || {
        text.lines().rev().find_map(|line| {
            let caps = SYNTAX_LOCATION.captures(line)?;
            let path = &caps[1];
            (path == file || path.ends_with(&format!("/{file}")))
                .then(|| caps[2].parse().ok())
                .flatten()
        })
    };
    let message = json_report::last_error_line(&text);
    TestFailure {
        name: nodeid.to_owned(),
        file: file.to_owned(),
        line: frame_line.or_else(syntax_line).unwrap_or(0),
        criticality: criticality(None, &message) as i32,
        message: if message.is_empty() {
            "collection failed".to_owned()
        } else {
            message
        },
        test_line: 0,
        error_origin: String::new(),
        ..TestFailure::default()
    }
}

/// Which pytest plugins an interpreter can import (§5.8: detect before running).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(default)]
pub(crate) struct Plugins {
    pub(crate) pytest: bool,
    pub(crate) pytest_cov: bool,
    pub(crate) pytest_jsonreport: bool,
    pub(crate) pytest_timeout: bool,
}

const PROBE: &str = r#"
import importlib.util, json, os, sys
out = {}
# Where the project's packages (argv) would be imported from, with the run's sys.path.
origins = {}
for name in sys.argv[1:]:
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        spec = None
    if spec is None:
        origins[name] = None
    elif spec.submodule_search_locations:
        origins[name] = list(spec.submodule_search_locations)
    else:
        origins[name] = [spec.origin]
out["origins"] = origins
# The tools, without the working directory on the path: a stray pytest.py in a repository
# must not answer for the real pytest.
cwd = os.getcwd()
sys.path[:] = [p for p in sys.path if p not in ("", ".", cwd)]
for m in ("pytest", "pytest_cov", "pytest_jsonreport", "pytest_timeout"):
    out[m] = importlib.util.find_spec(m) is not None
# The version from the dist-info beside the package (importlib.metadata scans every
# distribution of the environment: about 0.1 s a run).
out["version"] = None
spec = importlib.util.find_spec("pytest")
if spec is not None and spec.origin:
    site = os.path.dirname(os.path.dirname(spec.origin))
    for entry in sorted(os.listdir(site)):
        if entry.startswith("pytest-") and entry.endswith(".dist-info") and entry[7:8].isdigit():
            out["version"] = entry[len("pytest-"):-len(".dist-info")]
print(json.dumps(out))
"#;

/// What one interpreter probe found.
#[derive(Debug, Default)]
pub(crate) struct Probe {
    pub(crate) plugins: Plugins,
    /// pytest's version.
    pub(crate) version: Option<String>,
    /// Where each asked-for package imports from (`None`: not importable).
    pub(crate) origins: std::collections::BTreeMap<String, Option<Vec<String>>>,
}

/// Asks `python` in one start: which plugins it can import (§5.8: detect before running),
/// pytest's version, and where each of `packages` would be imported from with the run's
/// environment `env` in `cwd`.
pub(crate) async fn probe(
    python: &str,
    cwd: &Path,
    env: &std::collections::BTreeMap<String, String>,
    packages: &[String],
    sandbox: &troupe_process::Sandbox,
    cancel: &CancellationToken,
) -> Result<Probe, Error> {
    let output = Command::new(python)
        .args(["-c", PROBE])
        .args(packages.iter().cloned())
        .cwd(cwd)
        .envs(env.clone())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .timeout(Duration::from_secs(60))
        .sandbox(sandbox.clone())
        .run(cancel)
        .await
        .map_err(|source| Error::process(python, source))?;
    if output.termination == Termination::Cancelled {
        return Err(Error::Cancelled);
    }
    if !output.success() {
        return Err(Error::NotInstalled(format!(
            "`{python}` cannot run the plugin probe (exit {:?}): {}",
            output.exit_code,
            troupe_process::tail(&output.stderr_text(), 5, 1000)
        )));
    }
    let text = output.stdout_text();
    let value: serde_json::Value = serde_json::from_str(text.trim())
        .map_err(|err| Error::Internal(format!("plugin probe printed {text:?}: {err}")))?;
    let version = value
        .get("version")
        .and_then(serde_json::Value::as_str)
        .map(str::to_owned);
    let origins = value
        .get("origins")
        .cloned()
        .map(serde_json::from_value)
        .transpose()
        .map_err(|err| Error::Internal(format!("plugin probe printed {text:?}: {err}")))?
        .unwrap_or_default();
    let plugins = serde_json::from_value(value)
        .map_err(|err| Error::Internal(format!("plugin probe printed {text:?}: {err}")))?;
    Ok(Probe {
        plugins,
        version,
        origins,
    })
}

/// Where pytest-cov takes its source from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum CoverageSource {
    /// The repository configures `source` for coverage.py; pass a bare `--cov`.
    Configured,
    /// `--cov=<path or package>`.
    Explicit(String),
    /// The project's own packages, one `--cov=<name>` each (so files never imported count at
    /// 0 % and the tests themselves are not measured).
    Packages(Vec<String>),
}

impl CoverageSource {
    /// The explicit source if given, else the repository's coverage configuration, else the
    /// project's packages, else `.`.
    pub(crate) fn choose(explicit: &str, root: &Path) -> Self {
        if !explicit.trim().is_empty() {
            Self::Explicit(explicit.trim().to_owned())
        } else if repo_configures_coverage_source(root) {
            Self::Configured
        } else {
            let packages = crate::python::packages(root);
            if packages.is_empty() {
                Self::Explicit(".".to_owned())
            } else {
                Self::Packages(packages)
            }
        }
    }

    fn flags(&self) -> Vec<String> {
        match self {
            Self::Configured => vec!["--cov".to_owned()],
            Self::Explicit(source) => vec![format!("--cov={source}")],
            Self::Packages(names) => names.iter().map(|n| format!("--cov={n}")).collect(),
        }
    }
}

/// The project's own coverage threshold (`fail_under` of coverage.py's report section, or
/// `--cov-fail-under` in pytest's `addopts`), when it sets one.
pub(crate) fn fail_under(root: &Path) -> Option<f64> {
    let read = |name: &str| std::fs::read_to_string(root.join(name)).ok();
    for (file, section) in [
        (".coveragerc", "[report]"),
        ("pyproject.toml", "[tool.coverage.report]"),
        ("setup.cfg", "[coverage:report]"),
        ("tox.ini", "[coverage:report]"),
    ] {
        if let Some(value) = read(file).and_then(|text| section_value(&text, section, "fail_under"))
            && let Ok(number) = value.trim_matches(['"', '\'']).parse::<f64>()
            && number > 0.0
        {
            return Some(number);
        }
    }
    for file in ["pytest.ini", "pyproject.toml", "setup.cfg", "tox.ini"] {
        let Some(text) = read(file) else { continue };
        if let Some(at) = text.find("--cov-fail-under") {
            let number: String = text[at + "--cov-fail-under".len()..]
                .trim_start_matches(['=', ' '])
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            if let Ok(number) = number.parse::<f64>()
                && number > 0.0
            {
                return Some(number);
            }
        }
    }
    None
}

fn section_value(text: &str, section: &str, key: &str) -> Option<String> {
    let mut inside = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == section;
        } else if inside
            && let Some((name, value)) = line.split_once('=')
            && name.trim() == key
        {
            return Some(value.trim().to_owned());
        }
    }
    None
}

/// Whether a coverage.py config file in the repository root sets `source` (or `source_pkgs`)
/// in its run section.
fn repo_configures_coverage_source(root: &Path) -> bool {
    [
        (".coveragerc", "[run]"),
        ("pyproject.toml", "[tool.coverage.run]"),
        ("setup.cfg", "[coverage:run]"),
        ("tox.ini", "[coverage:run]"),
    ]
    .iter()
    .any(|(file, section)| {
        std::fs::read_to_string(root.join(file))
            .is_ok_and(|text| section_sets_source(&text, section))
    })
}

fn section_sets_source(text: &str, section: &str) -> bool {
    let mut inside = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == section;
        } else if inside {
            let key = line.split('=').next().unwrap_or("").trim();
            if line.contains('=') && (key == "source" || key == "source_pkgs") {
                return true;
            }
        }
    }
    false
}

/// Report files of one run, all inside the run's output directory.
#[derive(Clone, Debug)]
pub(crate) struct ReportFiles {
    pub(crate) junit: PathBuf,
    pub(crate) json: PathBuf,
    pub(crate) coverage: PathBuf,
    pub(crate) coverage_data: PathBuf,
}

impl ReportFiles {
    pub(crate) fn new(out_dir: &Path) -> Self {
        Self {
            junit: out_dir.join("junit.xml"),
            json: out_dir.join("report.json"),
            coverage: out_dir.join("coverage.json"),
            coverage_data: out_dir.join(".coverage"),
        }
    }
}

/// The pytest argv for one run (test-frameworks.md §1), given what the interpreter has.
pub(crate) fn command_argv(
    python: &str,
    files: &ReportFiles,
    plugins: Plugins,
    coverage: &CoverageSource,
    test_timeout_seconds: u32,
) -> Vec<String> {
    let mut argv = vec![
        python.to_owned(),
        "-m".to_owned(),
        "pytest".to_owned(),
        "-p".to_owned(),
        "no:cacheprovider".to_owned(),
        format!("--junitxml={}", files.junit.display()),
        "-o".to_owned(),
        "junit_family=xunit1".to_owned(),
    ];
    if plugins.pytest_jsonreport {
        argv.push("--json-report".to_owned());
        argv.push(format!("--json-report-file={}", files.json.display()));
    }
    if plugins.pytest_cov {
        argv.extend(coverage.flags());
        argv.push("--cov-branch".to_owned());
        argv.push(format!("--cov-report=json:{}", files.coverage.display()));
    }
    if plugins.pytest_timeout && test_timeout_seconds > 0 {
        argv.push(format!("--timeout={test_timeout_seconds}"));
    }
    argv.push("--continue-on-collection-errors".to_owned());
    argv
}

/// How pytest's process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Exit {
    /// Exited with this code.
    Code(i32),
    /// Killed at the wall-clock limit.
    TimedOut,
    /// Ended by a signal nobody here sent.
    Signalled,
}

/// Decides the outcome from the exit and the structured results, never from console text.
///
/// PASSED means: exit 0, no failing or erroring test, no collection error, at least one test
/// that was not skipped, and coverage measured and at or above the target when a target is set.
/// Returns the outcome and warnings explaining it.
pub(crate) fn decide(
    exit: Exit,
    results: Option<&SuiteResults>,
    coverage: Option<f64>,
    target: f64,
    fail_under: Option<f64>,
) -> (TestOutcome, Vec<String>) {
    let mut warnings = Vec::new();
    if exit == Exit::TimedOut {
        return (TestOutcome::Timeout, warnings);
    }
    let Some(results) = results else {
        warnings.push("pytest wrote no structured report; see the stderr tail".to_owned());
        return (TestOutcome::RunnerCrashed, warnings);
    };
    if results.collection_errors > 0 {
        return (TestOutcome::CollectionError, warnings);
    }
    let code = match exit {
        Exit::Code(code) => code,
        Exit::Signalled | Exit::TimedOut => {
            warnings.push("pytest was killed by a signal".to_owned());
            return (TestOutcome::RunnerCrashed, warnings);
        }
    };
    match code {
        3 => {
            warnings.push("pytest reported an internal error (exit 3)".to_owned());
            return (TestOutcome::RunnerCrashed, warnings);
        }
        4 => {
            warnings.push("pytest refused its command line or configuration (exit 4)".to_owned());
            return (TestOutcome::RunnerCrashed, warnings);
        }
        _ => {}
    }
    let totals = &results.totals;
    if code == 5 || totals.total == 0 {
        return (TestOutcome::NoTests, warnings);
    }
    if totals.failed > 0 || totals.errors > 0 {
        return (TestOutcome::TestsFailed, warnings);
    }
    if code != 0 {
        if let (1, Some(threshold), Some(_)) = (code, fail_under, coverage) {
            warnings.push(format!(
                "every test passed but the project's own coverage threshold (fail_under {threshold}%) failed the run"
            ));
            return (TestOutcome::CoverageThreshold, warnings);
        }
        warnings.push(format!(
            "pytest exited {code} although its report shows no failing test (interrupted or a plugin error); see the stderr tail"
        ));
        return (TestOutcome::RunnerCrashed, warnings);
    }
    crate::runner::clean_run_outcome(
        totals,
        coverage,
        target,
        "every collected test was skipped",
        warnings,
    )
}

/// `passed / (total - skipped)`, 0 when nothing ran.
pub(crate) fn pass_rate(totals: &TestTotals) -> f64 {
    let ran = totals.total.saturating_sub(totals.skipped);
    if ran == 0 {
        0.0
    } else {
        f64::from(totals.passed) / f64::from(ran)
    }
}

/// What [`run`] needs.
#[derive(Debug)]
pub(crate) struct PytestRun<'a> {
    pub(crate) python: &'a str,
    pub(crate) worktree: &'a Path,
    pub(crate) out_dir: &'a Path,
    pub(crate) plugins: Plugins,
    pub(crate) coverage_source: CoverageSource,
    pub(crate) coverage_target: f64,
    pub(crate) timeout: Duration,
    pub(crate) test_timeout_seconds: u32,
    /// Appended to the command: `--import-mode=importlib` for several packages, node ids or
    /// test files for a subset.
    pub(crate) extra_args: Vec<String>,
    /// Repo-relative directory pytest runs in.
    pub(crate) workdir: &'a Path,
    /// Environment on top of troupe's (the run's `env`, PYTHONPATH).
    pub(crate) env: &'a std::collections::BTreeMap<String, String>,
    /// What the suite may touch.
    pub(crate) sandbox: &'a troupe_process::Sandbox,
}

/// `path` (relative to `base`, or absolute) as a repo-relative path, when inside `worktree`.
fn repo_relative(path: &str, base: &Path, worktree: &Path) -> Option<String> {
    let full = if Path::new(path).is_absolute() {
        PathBuf::from(path)
    } else {
        base.join(path)
    };
    let mut normal = PathBuf::new();
    for component in full.components() {
        match component {
            std::path::Component::ParentDir => {
                normal.pop();
            }
            std::path::Component::CurDir => {}
            other => normal.push(other),
        }
    }
    normal
        .strip_prefix(worktree)
        .ok()
        .map(|rel| rel.display().to_string())
}

/// Arguments for a repository with several Python packages each holding a `tests/` directory
/// (test-frameworks.md §4.4): same-named test modules collide without importlib mode.
pub(crate) fn monorepo_args(root: &Path) -> Vec<String> {
    let packages = std::fs::read_dir(root.join("packages"))
        .map(|entries| {
            entries
                .flatten()
                .filter(|entry| entry.path().join("tests").is_dir())
                .count()
        })
        .unwrap_or(0);
    if packages >= 2 {
        vec!["--import-mode=importlib".to_owned()]
    } else {
        Vec::new()
    }
}

/// Runs pytest once and builds the report (commit and run-file paths are the caller's).
#[tracing::instrument(skip_all, fields(worktree = %run.worktree.display()))]
pub(crate) async fn run(
    run: PytestRun<'_>,
    cancel: &CancellationToken,
) -> Result<TestRunReport, Error> {
    let files = ReportFiles::new(run.out_dir);
    let argv = command_argv(
        run.python,
        &files,
        run.plugins,
        &run.coverage_source,
        run.test_timeout_seconds,
    )
    .into_iter()
    .chain(run.extra_args.iter().cloned())
    .collect::<Vec<_>>();
    let mut warnings = Vec::new();
    if !run.plugins.pytest_jsonreport {
        warnings.push(
            "pytest-json-report is not installed; results come from the junit xml".to_owned(),
        );
    }
    if !run.plugins.pytest_cov {
        warnings.push("pytest-cov is not installed; coverage was not measured".to_owned());
    }
    if !run.plugins.pytest_timeout && run.test_timeout_seconds > 0 {
        warnings
            .push("pytest-timeout is not installed; no per-test timeout was applied".to_owned());
    }
    let output = Command::from_argv(&argv)
        .map_err(|source| Error::process(run.python, source))?
        .cwd(run.worktree.join(run.workdir))
        .envs(run.env.clone())
        .env("COVERAGE_FILE", files.coverage_data.display().to_string())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .timeout(run.timeout)
        .max_output_bytes(256 * 1024)
        .sandbox(run.sandbox.clone())
        .run(cancel)
        .await
        .map_err(|source| Error::process(run.python, source))?;
    let exit = match (output.termination, output.exit_code) {
        (Termination::Cancelled, _) => return Err(Error::Cancelled),
        (Termination::TimedOut | Termination::IdleTimedOut, _) => Exit::TimedOut,
        (Termination::Exited, Some(code)) => Exit::Code(code),
        (Termination::Exited, None) => Exit::Signalled,
    };
    tracing::info!(exit = ?exit, duration_ms = output.duration.as_millis(), "pytest finished");

    let mut report_paths = Vec::new();
    let json = read_if_present(&files.json).await?;
    let junit = read_if_present(&files.junit).await?;
    let results = match (json, junit) {
        (Some(text), _) if run.plugins.pytest_jsonreport => {
            report_paths.push(files.json.display().to_string());
            Some(json_report::parse(&text).map_err(|err| {
                Error::Internal(format!("cannot parse {}: {err}", files.json.display()))
            })?)
        }
        (_, Some(text)) => Some(junit::parse(&text).map_err(|err| {
            Error::Internal(format!("cannot parse {}: {err}", files.junit.display()))
        })?),
        _ => None,
    };
    if files.junit.is_file() {
        report_paths.push(files.junit.display().to_string());
    }
    let cwd = run.worktree.join(run.workdir);
    let mut outside_paths = Vec::new();
    let coverage: Option<Coverage> = match read_if_present(&files.coverage).await? {
        Some(text) => {
            report_paths.push(files.coverage.display().to_string());
            let mut parsed = coverage::parse(&text).map_err(|err| {
                Error::Internal(format!("cannot parse {}: {err}", files.coverage.display()))
            })?;
            // coverage.py names files relative to the cwd when under it, else absolutely; a
            // file outside the worktree is code that is not the commit's.
            outside_paths = crate::source::outside_files(parsed.files.keys(), run.worktree, &cwd);
            parsed.files = parsed
                .files
                .into_iter()
                .filter_map(|(name, pct)| {
                    repo_relative(&name, &cwd, run.worktree).map(|rel| (rel, pct))
                })
                .collect();
            Some(parsed)
        }
        None => {
            if run.plugins.pytest_cov && exit != Exit::TimedOut {
                warnings.push("pytest-cov wrote no coverage report (no data collected or collection interrupted)".to_owned());
            }
            None
        }
    };
    let overall = coverage.as_ref().and_then(|c| c.overall);
    let (mut outcome, why) = decide(
        exit,
        results.as_ref(),
        overall,
        run.coverage_target,
        fail_under(&cwd),
    );
    warnings.extend(why);
    if !outside_paths.is_empty() {
        outcome = TestOutcome::WrongSource;
        warnings.push(crate::source::wrong_source_warning(
            "covered files",
            &outside_paths,
        ));
    }
    if exit == Exit::TimedOut {
        warnings.push(format!(
            "the run hit its {}s wall-clock limit and its process group was killed",
            run.timeout.as_secs()
        ));
    }
    let mut results = results.unwrap_or_default();
    // Node ids and tracebacks are relative to pytest's rootdir; files are reported
    // repo-relative.
    let rootdir = results
        .root
        .as_deref()
        .map_or_else(|| cwd.clone(), PathBuf::from);
    if rootdir != run.worktree {
        for failure in &mut results.failures {
            if let Some(rel) = repo_relative(&failure.file, &rootdir, run.worktree) {
                failure.file = rel;
            }
            if let Some((path, line)) = failure.error_origin.rsplit_once(':')
                && let Some(rel) = repo_relative(path, &rootdir, run.worktree)
            {
                failure.error_origin = format!("{rel}:{line}");
            }
        }
    }
    let mut stderr_tail = troupe_process::tail(&strip_ansi(&output.stderr_text()), 40, 8000);
    if stderr_tail.trim().is_empty()
        && matches!(
            outcome,
            TestOutcome::RunnerCrashed | TestOutcome::Timeout | TestOutcome::CollectionError
        )
    {
        // Pytest prints collection errors and most crashes on stdout.
        stderr_tail = troupe_process::tail(&strip_ansi(&output.stdout_text()), 40, 8000);
    }
    let mut report = TestRunReport {
        framework: TestFramework::Pytest as i32,
        outcome: outcome as i32,
        command: argv,
        exit_code: match exit {
            Exit::Code(code) => code,
            Exit::TimedOut | Exit::Signalled => -1,
        },
        pass_rate: pass_rate(&results.totals),
        totals: Some(results.totals),
        coverage,
        coverage_target: run.coverage_target,
        failures: results.failures,
        duration_ms: u64::try_from(output.duration.as_millis()).unwrap_or(u64::MAX),
        report_paths,
        stderr_tail,
        warnings,
        test_timeout_seconds: run.test_timeout_seconds,
        outside_paths,
        skip_reasons: results.skip_reasons.into_iter().collect(),
        ..TestRunReport::default()
    };
    crate::sandbox::mark_denied(
        &mut report,
        run.sandbox,
        &format!("{}\n{}", output.stdout_text(), output.stderr_text()),
        &cwd,
    );
    Ok(report)
}

async fn read_if_present(path: &Path) -> Result<Option<String>, Error> {
    match tokio::fs::read_to_string(path).await {
        Ok(text) => Ok(Some(text)),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(Error::Io {
            path: path.to_owned(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn results(
        total: u32,
        passed: u32,
        failed: u32,
        skipped: u32,
        collection_errors: u32,
    ) -> SuiteResults {
        SuiteResults {
            totals: TestTotals {
                total,
                passed,
                failed,
                skipped,
                errors: 0,
            },
            failures: Vec::new(),
            collection_errors,
            ..SuiteResults::default()
        }
    }

    #[test]
    fn decides_outcomes_from_exit_and_report() {
        let ok = results(3, 3, 0, 0, 0);
        assert_eq!(
            decide(Exit::Code(0), Some(&ok), Some(90.0), 80.0, None).0,
            TestOutcome::Passed
        );
        assert_eq!(
            decide(Exit::Code(0), Some(&ok), Some(70.0), 80.0, None).0,
            TestOutcome::CoverageBelowTarget
        );
        assert_eq!(
            decide(Exit::Code(0), Some(&ok), None, 80.0, None).0,
            TestOutcome::CoverageBelowTarget
        );
        assert_eq!(
            decide(Exit::Code(0), Some(&ok), None, 0.0, None).0,
            TestOutcome::Passed
        );
        assert_eq!(
            decide(
                Exit::Code(1),
                Some(&results(3, 2, 1, 0, 0)),
                None,
                0.0,
                None
            )
            .0,
            TestOutcome::TestsFailed
        );
        assert_eq!(
            decide(
                Exit::Code(1),
                Some(&results(3, 3, 0, 0, 1)),
                None,
                0.0,
                None
            )
            .0,
            TestOutcome::CollectionError
        );
        assert_eq!(
            decide(
                Exit::Code(5),
                Some(&results(0, 0, 0, 0, 0)),
                None,
                80.0,
                None
            )
            .0,
            TestOutcome::NoTests
        );
        assert_eq!(
            decide(
                Exit::Code(0),
                Some(&results(2, 0, 0, 2, 0)),
                None,
                0.0,
                None
            )
            .0,
            TestOutcome::NoTests
        );
        assert_eq!(
            decide(Exit::TimedOut, None, None, 0.0, None).0,
            TestOutcome::Timeout
        );
        assert_eq!(
            decide(Exit::Code(1), None, None, 0.0, None).0,
            TestOutcome::RunnerCrashed
        );
        assert_eq!(
            decide(
                Exit::Code(4),
                Some(&results(0, 0, 0, 0, 0)),
                None,
                0.0,
                None
            )
            .0,
            TestOutcome::RunnerCrashed
        );
        // The project's own fail_under: its own outcome.
        assert_eq!(
            decide(Exit::Code(1), Some(&ok), Some(60.0), 0.0, Some(90.0)).0,
            TestOutcome::CoverageThreshold
        );
        // Exit 1 with nothing failing is not a pass, and not a test failure either.
        assert_eq!(
            decide(Exit::Code(1), Some(&ok), Some(90.0), 0.0, None).0,
            TestOutcome::RunnerCrashed
        );
    }

    #[test]
    fn pass_rate_excludes_skipped() {
        assert!(
            (pass_rate(&TestTotals {
                total: 6,
                passed: 3,
                failed: 2,
                skipped: 1,
                errors: 0
            }) - 0.6)
                .abs()
                < 1e-9
        );
        assert!(pass_rate(&TestTotals::default()).abs() < f64::EPSILON);
    }

    #[test]
    fn builds_the_documented_command() {
        let files = ReportFiles::new(Path::new("/out"));
        let all = Plugins {
            pytest: true,
            pytest_cov: true,
            pytest_jsonreport: true,
            pytest_timeout: true,
        };
        let argv = command_argv(
            "/venv/bin/python",
            &files,
            all,
            &CoverageSource::Explicit("calc".into()),
            60,
        );
        assert_eq!(
            argv.join(" "),
            "/venv/bin/python -m pytest -p no:cacheprovider --junitxml=/out/junit.xml -o junit_family=xunit1 \
             --json-report --json-report-file=/out/report.json --cov=calc --cov-branch \
             --cov-report=json:/out/coverage.json --timeout=60 --continue-on-collection-errors"
        );
        let bare = Plugins {
            pytest: true,
            ..Plugins::default()
        };
        let argv = command_argv("python3", &files, bare, &CoverageSource::Configured, 60);
        assert!(!argv.iter().any(|a| a.starts_with("--cov")
            || a.starts_with("--json")
            || a.starts_with("--timeout")));
    }

    #[test]
    fn reads_the_projects_own_threshold() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(fail_under(dir.path()), None);
        std::fs::write(
            dir.path().join("pyproject.toml"),
            "[tool.coverage.report]\nfail_under = 95\n",
        )
        .expect("write");
        assert_eq!(fail_under(dir.path()), Some(95.0));
        std::fs::write(
            dir.path().join("pyproject.toml"),
            "[tool.pytest.ini_options]\naddopts = \"--cov-fail-under=80 -q\"\n",
        )
        .expect("write");
        assert_eq!(fail_under(dir.path()), Some(80.0));
    }

    #[test]
    fn finds_configured_coverage_sources() {
        assert!(section_sets_source(
            "[tool.coverage.run]\nbranch = true\nsource = [\"calc\"]\n",
            "[tool.coverage.run]"
        ));
        assert!(!section_sets_source(
            "[tool.coverage.report]\nsource = x\n",
            "[tool.coverage.run]"
        ));
        assert!(section_sets_source("[run]\nsource_pkgs = calc\n", "[run]"));
    }

    #[test]
    fn collection_failure_from_an_import_error() {
        let failure = collection_failure(
            "tests/test_imp.py",
            "Traceback:\nsite/importlib/__init__.py:126: in import_module\n    x\ntests/test_imp.py:3: in <module>\n    from calc.missing import nothing\nE   ModuleNotFoundError: No module named 'calc.missing'",
        );
        assert_eq!(failure.line, 3);
        assert_eq!(
            failure.message,
            "ModuleNotFoundError: No module named 'calc.missing'"
        );
        assert_eq!(troupe_proto::names::name(failure.criticality()), "critical");
    }
}

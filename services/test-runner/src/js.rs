//! Running Jest or Vitest once and turning their JSON reports into a [`TestRunReport`].
//!
//! The commands are test-frameworks.md §1's: the local binary (never `npx`), `CI=true
//! NO_COLOR=1`, results and istanbul `json-summary` coverage written to files in the run's
//! output directory, test locations switched on (`--testLocationInResults` /
//! `--includeTaskLocation`), `--forceExit` for Jest (open handles keep it alive) and
//! `--coverage.reportOnFailure` for Vitest (else a failing run writes no coverage). The
//! verdict follows §2: no results file is a runner crash, `numTotalTests == 0` is "no tests", a
//! file that failed to load is LOAD_ERROR, and a non-zero exit with nothing failing (coverage
//! thresholds, Vitest's unhandled errors) is a crash with the stderr tail kept.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::LazyLock;
use std::time::Duration;

use regex::Regex;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;
use troupe_process::{Command, Termination};
use troupe_proto::v1::{
    Coverage, TestFailure, TestFramework, TestOutcome, TestRunReport, TestTotals,
};

use crate::Error;
use crate::failure::{criticality, leading_exception_type, strip_ansi};
use crate::pytest::{Exit, pass_rate};

/// Which tests a run covers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Selection {
    /// The whole suite.
    All,
    /// Tests related to these repo-relative source files (`--findRelatedTests`, `vitest related`).
    Related(Vec<String>),
    /// These repo-relative test files.
    Files(Vec<String>),
}

/// What a Jest or Vitest binary accepts, probed once per binary and version: the flags its
/// `--help` lists, plus the ones known from its version (Vitest lists dotted `--coverage.*`
/// options only under `--help --coverage`).
#[derive(Clone, Debug, Default)]
pub(crate) struct Capabilities {
    /// The framework's version (`30.5.2`), from its package.json.
    pub(crate) version: Option<String>,
    /// Flags `--help` lists; empty when the probe failed (then every flag is tried).
    listed: BTreeSet<String>,
}

static HELP_FLAG: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?m)^\s+(?:-\w,\s+)?(--[A-Za-z][A-Za-z0-9.-]*)")
        .expect("help flag pattern compiles")
});

impl Capabilities {
    /// Parses `--help` output.
    pub(crate) fn from_help(version: Option<String>, help: &str) -> Self {
        Self {
            version,
            listed: HELP_FLAG
                .captures_iter(help)
                .map(|caps| caps[1].to_owned())
                .collect(),
        }
    }

    /// Whether the binary accepts `flag` (`--testTimeout`, ...).
    pub(crate) fn accepts(&self, flag: &str) -> bool {
        if self.listed.is_empty() {
            return true;
        }
        self.listed.contains(flag)
            || flag.starts_with("--coverage.") && self.listed.contains("--coverage")
    }
}

/// The framework's version from the package that holds the resolved binary
/// (`.bin/jest -> ../jest/bin/jest.js`).
pub(crate) fn version_of(framework: TestFramework, bin: &Path) -> Option<String> {
    let name = troupe_proto::names::name(framework);
    std::fs::canonicalize(bin)
        .ok()
        .and_then(|real| {
            real.ancestors()
                .find(|dir| {
                    dir.file_name()
                        .is_some_and(|n| n == name || n == "jest-cli")
                })
                .map(|dir| dir.join("package.json"))
        })
        .and_then(|manifest| std::fs::read_to_string(manifest).ok())
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|p| p.get("version")?.as_str().map(str::to_owned))
}

/// Probes the binary: its flags from `--help`.
pub(crate) async fn capabilities(
    bin: &Path,
    version: Option<String>,
    cwd: &Path,
    sandbox: &troupe_process::Sandbox,
    cancel: &CancellationToken,
) -> Capabilities {
    let help = Command::new(bin.display().to_string())
        .arg("--help")
        .cwd(cwd)
        .env("CI", "true")
        .env("NO_COLOR", "1")
        .timeout(Duration::from_secs(60))
        .sandbox(sandbox.clone())
        .run(cancel)
        .await;
    let help = match help {
        Ok(output) if output.termination == Termination::Exited => {
            format!("{}\n{}", output.stdout_text(), output.stderr_text())
        }
        _ => String::new(),
    };
    Capabilities::from_help(version, &help)
}

/// What [`run`] needs.
#[derive(Debug)]
pub(crate) struct JsRun<'a> {
    pub(crate) framework: TestFramework,
    /// `node_modules/.bin/<tool>`.
    pub(crate) bin: &'a Path,
    pub(crate) worktree: &'a Path,
    pub(crate) out_dir: &'a Path,
    /// Whether the coverage provider is installed (Jest's is built in).
    pub(crate) coverage: bool,
    pub(crate) coverage_target: f64,
    pub(crate) timeout: Duration,
    pub(crate) test_timeout_seconds: u32,
    pub(crate) selection: Selection,
    /// Extra environment for the child: the run's `env` (tests also use it to learn the test
    /// processes' pids).
    pub(crate) env: &'a BTreeMap<String, String>,
    /// What the binary accepts.
    pub(crate) capabilities: &'a Capabilities,
    /// Repo-relative directory the suite runs in.
    pub(crate) workdir: &'a Path,
    /// What the suite may touch.
    pub(crate) sandbox: &'a troupe_process::Sandbox,
}

/// The argv for one run (test-frameworks.md §1).
pub(crate) fn command_argv(run: &JsRun<'_>) -> Vec<String> {
    let out = run.out_dir;
    let results = format!("--outputFile={}", out.join("results.json").display());
    let coverage_dir = out.join("coverage");
    let mut argv = vec![run.bin.display().to_string()];
    let caps = run.capabilities;
    let timeout_flag = (run.test_timeout_seconds > 0 && caps.accepts("--testTimeout")).then(|| {
        format!(
            "--testTimeout={}",
            u64::from(run.test_timeout_seconds) * 1000
        )
    });
    if run.framework == TestFramework::Jest {
        argv.extend(
            ["--ci", "--json", "--testLocationInResults"]
                .iter()
                .filter(|flag| caps.accepts(flag))
                .map(|s| (*s).to_owned()),
        );
        argv.push(results);
        if run.coverage {
            argv.push("--coverage".to_owned());
            argv.push("--coverageReporters=json-summary".to_owned());
            argv.push("--coverageReporters=json".to_owned());
            argv.push(format!("--coverageDirectory={}", coverage_dir.display()));
        }
        argv.extend(timeout_flag);
        argv.push("--forceExit".to_owned());
        match &run.selection {
            Selection::All => {}
            Selection::Related(files) => {
                if caps.accepts("--passWithNoTests") {
                    argv.push("--passWithNoTests".to_owned());
                }
                argv.push("--findRelatedTests".to_owned());
                argv.extend(files.iter().cloned());
            }
            Selection::Files(files) => {
                argv.push("--runTestsByPath".to_owned());
                argv.extend(files.iter().cloned());
            }
        }
    } else {
        match &run.selection {
            Selection::Related(_) => {
                argv.push("related".to_owned());
                argv.push("--run".to_owned());
            }
            Selection::All | Selection::Files(_) => argv.push("run".to_owned()),
        }
        argv.push("--reporter=json".to_owned());
        if caps.accepts("--includeTaskLocation") {
            argv.push("--includeTaskLocation".to_owned());
        }
        argv.push(results);
        // Vitest's results cache lives in `node_modules/.vite`, the install's, which a
        // confined suite may read but not write (docs/sandbox.md).
        if caps.accepts("--cache") {
            argv.push("--cache=false".to_owned());
        }
        if run.coverage {
            argv.extend(
                [
                    "--coverage.enabled",
                    "--coverage.provider=v8",
                    "--coverage.reporter=json-summary",
                    "--coverage.reporter=json",
                    "--coverage.reportOnFailure",
                ]
                .iter()
                .map(|s| (*s).to_owned()),
            );
            argv.push(format!(
                "--coverage.reportsDirectory={}",
                coverage_dir.display()
            ));
        }
        argv.extend(timeout_flag);
        match &run.selection {
            Selection::All => {}
            Selection::Related(files) | Selection::Files(files) => {
                argv.extend(files.iter().cloned());
            }
        }
    }
    argv
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Results {
    #[serde(default)]
    num_total_tests: u32,
    #[serde(default)]
    num_passed_tests: u32,
    #[serde(default)]
    num_failed_tests: u32,
    #[serde(default)]
    num_pending_tests: u32,
    #[serde(default)]
    num_todo_tests: u32,
    #[serde(default)]
    test_results: Vec<FileResult>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct FileResult {
    #[serde(default)]
    name: String,
    #[serde(default)]
    status: String,
    #[serde(default)]
    message: String,
    #[serde(default)]
    assertion_results: Vec<Assertion>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Assertion {
    #[serde(default)]
    full_name: String,
    #[serde(default)]
    status: String,
    #[serde(default)]
    location: Option<Location>,
    #[serde(default)]
    failure_messages: Vec<String>,
    #[serde(default)]
    duration: Option<f64>,
}

#[derive(Debug, Deserialize)]
struct Location {
    line: u32,
}

/// Per test file (repo-relative, absolute outside the worktree) counts.
pub(crate) type FileTotals = Vec<(String, TestTotals)>;

/// Counts and failures from one results file.
#[derive(Debug, Default)]
pub(crate) struct JsResults {
    pub(crate) totals: TestTotals,
    /// Files that failed to load first, then failing tests.
    pub(crate) failures: Vec<TestFailure>,
    pub(crate) load_errors: u32,
    /// Failures that were per-test timeouts.
    pub(crate) timed_out: u32,
    /// Test files by repo-relative path (absolute when outside the worktree), with counts.
    pub(crate) files: FileTotals,
}

static FRAME: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?:file://)?(/[^\s():]+):(\d+):(\d+)").expect("frame pattern compiles")
});
static CODE_FRAME_LINE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\((\d+):(\d+)\)").expect("code frame pattern compiles"));
/// The marked line of a Babel/Jest code frame: `> 1 | const x = require(...)`.
static CODE_FRAME_MARK: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?m)^\s*>\s*(\d+)\s*\|").expect("code frame mark pattern compiles")
});
/// Vitest 4's JSON reporter loses a timeout's message and writes only this.
const VITEST_LOST_MESSAGE: &str = "Error: STACK_TRACE_ERROR";

/// Frames `(repo-relative path, line)` of a stack that are inside the worktree and outside
/// `node_modules`, in stack order (test-frameworks.md §5.4).
fn repo_frames(text: &str, root: &Path) -> Vec<(String, u32)> {
    let prefix = format!("{}/", root.display());
    FRAME
        .captures_iter(text)
        .filter_map(|caps| {
            let path = caps.get(1)?.as_str();
            let rel = path.strip_prefix(&prefix)?;
            if rel.split('/').any(|part| part == "node_modules") {
                return None;
            }
            Some((rel.to_owned(), caps[2].parse().ok()?))
        })
        .collect()
}

fn relative(path: &str, root: &Path) -> String {
    let prefix = format!("{}/", root.display());
    path.strip_prefix(&prefix).unwrap_or(path).to_owned()
}

/// The message without its stack: the lines before the first `    at ` frame.
fn message_head(text: &str) -> String {
    let head: Vec<&str> = text
        .lines()
        .take_while(|line| !line.trim_start().starts_with("at "))
        .collect();
    head.join("\n").trim().to_owned()
}

fn is_timeout(message: &str) -> bool {
    let lower = message.to_ascii_lowercase();
    lower.contains("exceeded timeout") || lower.contains("timed out in")
}

/// Parses a Jest or Vitest `results.json` (test-frameworks.md §3.1, §3.2). `test_timeout_ms`
/// (0 = unknown) recognises Vitest timeouts whose message the JSON reporter lost.
pub(crate) fn parse_results(
    text: &str,
    root: &Path,
    test_timeout_ms: u64,
    declarations: bool,
) -> Result<JsResults, serde_json::Error> {
    let results: Results = serde_json::from_str(text)?;
    let mut out = JsResults {
        totals: TestTotals {
            total: results.num_total_tests,
            passed: results.num_passed_tests,
            failed: results.num_failed_tests,
            skipped: results.num_pending_tests + results.num_todo_tests,
            errors: 0,
        },
        ..JsResults::default()
    };
    let mut load_failures = Vec::new();
    let mut test_failures = Vec::new();
    for file in &results.test_results {
        let rel = relative(&file.name, root);
        let mut counts = TestTotals::default();
        for test in &file.assertion_results {
            counts.total += 1;
            match test.status.as_str() {
                "passed" => counts.passed += 1,
                "failed" => counts.failed += 1,
                _ => counts.skipped += 1,
            }
        }
        if file.assertion_results.is_empty() && file.status == "failed" {
            counts.errors = 1;
        }
        out.files.push((rel.clone(), counts));
        if file.assertion_results.is_empty() && file.status == "failed" {
            // A file that failed to run: syntax or import error; the message is all there is.
            let message = strip_ansi(&file.message);
            let line = repo_frames(&message, root)
                .into_iter()
                .find(|(path, _)| *path == rel)
                .map(|(_, line)| line)
                .or_else(|| {
                    // Vitest's oxc frame names the file repo-relative: `[ tests/x.test.ts:4:19 ]`.
                    let needle = format!("{rel}:");
                    let at = message.find(&needle)? + needle.len();
                    let digits: String = message[at..]
                        .chars()
                        .take_while(char::is_ascii_digit)
                        .collect();
                    digits.parse().ok()
                })
                .or_else(|| {
                    CODE_FRAME_LINE
                        .captures(&message)
                        .and_then(|caps| caps[1].parse().ok())
                })
                .or_else(|| {
                    CODE_FRAME_MARK
                        .captures(&message)
                        .and_then(|caps| caps[1].parse().ok())
                })
                .unwrap_or(0);
            let text = message
                .trim()
                .trim_start_matches("● Test suite failed to run")
                .trim()
                .to_owned();
            // "Transform failed with 1 error:" says nothing alone; add the line it announces.
            let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
            let mut head = lines.next().unwrap_or("").to_owned();
            if head.ends_with(':')
                && let Some(next) = lines.next()
            {
                head = format!("{head} {next}");
            }
            out.load_errors += 1;
            load_failures.push(TestFailure {
                name: rel.clone(),
                file: rel,
                line,
                criticality: troupe_proto::v1::Severity::Critical as i32,
                message: head,
                test_line: 0,
                error_origin: String::new(),
                ..TestFailure::default()
            });
            continue;
        }
        for test in &file.assertion_results {
            if test.status != "failed" {
                continue;
            }
            let raw = strip_ansi(test.failure_messages.first().map_or("", String::as_str));
            let frames = repo_frames(&raw, root);
            // With the location flag, `location` is where the test is declared. Without it,
            // Vitest 1 still writes one: the first frame of the error, in whichever file that
            // is (its messages carry no stack to tell), so it is not used.
            let test_line = if declarations {
                test.location.as_ref().map_or(0, |l| l.line)
            } else {
                0
            };
            // The failure line is in the test file (`file`); a frame elsewhere is the error's
            // origin, never reported under the test file's name.
            let line = frames
                .iter()
                .find(|(path, _)| *path == rel)
                .map_or(test_line, |(_, line)| *line);
            let mut message = message_head(&raw);
            // Checked against the test's own duration, so only a real timeout is renamed.
            #[allow(clippy::cast_precision_loss)]
            let overran =
                test_timeout_ms > 0 && test.duration.is_some_and(|d| d >= test_timeout_ms as f64);
            if message == VITEST_LOST_MESSAGE && overran {
                message = format!("TestTimeoutError: Test timed out in {test_timeout_ms}ms.");
            }
            if is_timeout(&message) {
                out.timed_out += 1;
            }
            let kind = leading_exception_type(&message);
            test_failures.push(TestFailure {
                name: test.full_name.clone(),
                file: rel.clone(),
                line,
                criticality: criticality(kind, &message) as i32,
                message,
                test_line,
                error_origin: frames
                    .first()
                    .map(|(path, line)| format!("{path}:{line}"))
                    .unwrap_or_default(),
                ..TestFailure::default()
            });
        }
    }
    load_failures.extend(test_failures);
    out.failures = load_failures;
    Ok(out)
}

#[derive(Debug, Deserialize)]
struct Metric {
    #[serde(default)]
    pct: serde_json::Value,
    #[serde(default)]
    total: u64,
    #[serde(default)]
    covered: u64,
}

#[derive(Debug, Deserialize)]
struct FileSummary {
    lines: Option<Metric>,
    statements: Option<Metric>,
    branches: Option<Metric>,
    functions: Option<Metric>,
}

fn pct(metric: Option<&Metric>) -> Option<f64> {
    // `pct` can be the string "Unknown" (test-frameworks.md §3.3).
    metric.and_then(|m| m.pct.as_f64())
}

/// Parses istanbul's `coverage-summary.json`: totals and per-file line %, paths made
/// repo-relative.
pub(crate) fn parse_coverage(text: &str, root: &Path) -> Result<Coverage, serde_json::Error> {
    let summary: BTreeMap<String, FileSummary> = serde_json::from_str(text)?;
    let mut coverage = Coverage::default();
    for (key, file) in summary {
        if key == "total" {
            coverage.lines = pct(file.lines.as_ref());
            coverage.statements = pct(file.statements.as_ref());
            coverage.branches = pct(file.branches.as_ref());
            coverage.functions = pct(file.functions.as_ref());
            coverage.overall = coverage.lines.or(coverage.statements);
        } else if let Some(lines) = pct(file.lines.as_ref()) {
            coverage.files.insert(relative(&key, root), lines);
        }
    }
    Ok(coverage)
}

/// Istanbul's per-file line counts `(covered, total)`, keyed by repo-relative path (what a
/// project's own line coverage is summed from).
pub(crate) fn parse_line_counts(
    text: &str,
    root: &Path,
) -> Result<BTreeMap<String, (u64, u64)>, serde_json::Error> {
    let summary: BTreeMap<String, FileSummary> = serde_json::from_str(text)?;
    Ok(summary
        .into_iter()
        .filter(|(key, _)| key != "total")
        .filter_map(|(key, file)| {
            let lines = file.lines?;
            Some((relative(&key, root), (lines.covered, lines.total)))
        })
        .collect())
}

/// The verdict from the exit and the results file (test-frameworks.md §2).
pub(crate) fn decide(
    exit: Exit,
    results: Option<&JsResults>,
    coverage: Option<f64>,
    target: f64,
    tool: &str,
    own_threshold: bool,
) -> (TestOutcome, Vec<String>) {
    let mut warnings = Vec::new();
    if exit == Exit::TimedOut {
        return (TestOutcome::Timeout, warnings);
    }
    let Some(results) = results else {
        warnings.push(format!(
            "{tool} wrote no results file (configuration or infrastructure error); see the stderr tail"
        ));
        return (TestOutcome::RunnerCrashed, warnings);
    };
    if results.load_errors > 0 {
        return (TestOutcome::LoadError, warnings);
    }
    let totals = &results.totals;
    if totals.failed > 0 {
        return (TestOutcome::TestsFailed, warnings);
    }
    if totals.total == 0 {
        return (TestOutcome::NoTests, warnings);
    }
    match exit {
        Exit::Code(0) => {}
        Exit::Code(code) if own_threshold && coverage.is_some() => {
            warnings.push(format!(
                "every test passed but {tool} exited {code}: the project's own coverage threshold failed the run; see the stderr tail"
            ));
            return (TestOutcome::CoverageThreshold, warnings);
        }
        Exit::Code(code) => {
            warnings.push(format!(
                "{tool} exited {code} although its results show no failing test (an unhandled error or a bad environment); see the stderr tail"
            ));
            return (TestOutcome::RunnerCrashed, warnings);
        }
        Exit::Signalled | Exit::TimedOut => {
            warnings.push(format!("{tool} was killed by a signal"));
            return (TestOutcome::RunnerCrashed, warnings);
        }
    }
    crate::runner::clean_run_outcome(totals, coverage, target, "every test was skipped", warnings)
}

/// Whether the project configures its own coverage threshold (Jest `coverageThreshold`,
/// Vitest `coverage.thresholds` or the older `coverage.lines`-style keys) in the files the
/// framework reads its configuration from.
pub(crate) fn has_own_threshold(framework: TestFramework, dir: &Path) -> bool {
    let (stems, needles): (&[&str], &[&str]) = if framework == TestFramework::Jest {
        (&["jest.config", "package"], &["coverageThreshold"])
    } else {
        (
            &["vitest.config", "vite.config", "vitest.workspace"],
            &["thresholds", "perFile", "100:"],
        )
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|entry| {
        let name = entry.file_name().to_string_lossy().into_owned();
        stems
            .iter()
            .any(|stem| name.starts_with(&format!("{stem}.")))
            && std::fs::read_to_string(entry.path())
                .is_ok_and(|text| needles.iter().any(|n| text.contains(n)))
    })
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

/// Runs Jest or Vitest once; also returns how many failures were per-test timeouts.
#[tracing::instrument(skip_all, fields(worktree = %run.worktree.display()))]
pub(crate) async fn run(
    run: JsRun<'_>,
    cancel: &CancellationToken,
) -> Result<(TestRunReport, u32, FileTotals), Error> {
    let tool = troupe_proto::names::name(run.framework);
    let argv = command_argv(&run);
    let results_path = run.out_dir.join("results.json");
    let summary_path: PathBuf = run.out_dir.join("coverage").join("coverage-summary.json");
    // Stale files from an earlier run in the same directory must not be read as this run's.
    for stale in [&results_path, &summary_path] {
        if stale.exists() {
            tokio::fs::remove_file(stale)
                .await
                .map_err(|source| Error::Io {
                    path: stale.clone(),
                    source,
                })?;
        }
    }
    let output = Command::from_argv(&argv)
        .map_err(|source| Error::process(tool, source))?
        .cwd(run.worktree.join(run.workdir))
        .env("CI", "true")
        .env("NO_COLOR", "1")
        .envs(run.env.clone())
        .timeout(run.timeout)
        .max_output_bytes(256 * 1024)
        .sandbox(run.sandbox.clone())
        .run(cancel)
        .await
        .map_err(|source| Error::process(tool, source))?;
    let exit = match (output.termination, output.exit_code) {
        (Termination::Cancelled, _) => return Err(Error::Cancelled),
        (Termination::TimedOut | Termination::IdleTimedOut, _) => Exit::TimedOut,
        (Termination::Exited, Some(code)) => Exit::Code(code),
        (Termination::Exited, None) => Exit::Signalled,
    };
    tracing::info!(exit = ?exit, duration_ms = output.duration.as_millis(), tool, "js test run finished");
    let mut report_paths = Vec::new();
    let mut warnings = Vec::new();
    if run.framework == TestFramework::Vitest && !argv.iter().any(|a| a == "--includeTaskLocation")
    {
        warnings.push(format!(
            "vitest {} does not accept --includeTaskLocation: its report has no test declaration lines and no stacks, so failure lines are unknown (0)",
            run.capabilities.version.as_deref().unwrap_or("(unknown version)")
        ));
    }
    if run.test_timeout_seconds > 0 && !argv.iter().any(|a| a.starts_with("--testTimeout")) {
        warnings.push(format!(
            "{tool} {} does not accept --testTimeout: its own default per-test timeout applies",
            run.capabilities
                .version
                .as_deref()
                .unwrap_or("(unknown version)")
        ));
    }
    let results = match read_if_present(&results_path).await? {
        Some(text) => {
            report_paths.push(results_path.display().to_string());
            Some(
                parse_results(
                    &text,
                    run.worktree,
                    u64::from(run.test_timeout_seconds) * 1000,
                    argv.iter()
                        .any(|a| a == "--testLocationInResults" || a == "--includeTaskLocation"),
                )
                .map_err(|err| {
                    Error::Internal(format!("cannot parse {}: {err}", results_path.display()))
                })?,
            )
        }
        None => None,
    };
    let coverage = match read_if_present(&summary_path).await? {
        Some(text) => {
            report_paths.push(summary_path.display().to_string());
            let final_path = run.out_dir.join("coverage").join("coverage-final.json");
            if final_path.is_file() {
                report_paths.push(final_path.display().to_string());
            }
            Some(parse_coverage(&text, run.worktree).map_err(|err| {
                Error::Internal(format!("cannot parse {}: {err}", summary_path.display()))
            })?)
        }
        None => {
            if !run.coverage {
                warnings.push(format!(
                    "the coverage provider for {tool} is not installed; coverage was not measured"
                ));
            } else if exit != Exit::TimedOut && results.is_some() {
                warnings.push(format!("{tool} wrote no coverage summary"));
            }
            None
        }
    };
    let overall = coverage.as_ref().and_then(|c| c.overall);
    let own_threshold = has_own_threshold(run.framework, &run.worktree.join(run.workdir))
        || has_own_threshold(run.framework, run.worktree);
    let (mut outcome, why) = decide(
        exit,
        results.as_ref(),
        overall,
        run.coverage_target,
        tool,
        own_threshold,
    );
    warnings.extend(why);
    // Covered files and test files are named by absolute path; one outside the worktree is
    // code that is not the commit's (a workspace link into another checkout).
    let mut outside_paths: Vec<String> = coverage
        .as_ref()
        .map(|c| {
            c.files
                .keys()
                .filter(|k| k.starts_with('/'))
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    if let Some(results) = &results {
        outside_paths.extend(
            results
                .files
                .iter()
                .filter(|(name, _)| name.starts_with('/'))
                .map(|(name, _)| name.clone()),
        );
    }
    outside_paths.sort();
    outside_paths.dedup();
    if !outside_paths.is_empty() {
        outcome = TestOutcome::WrongSource;
        warnings.push(crate::source::wrong_source_warning(
            "covered or test files",
            &outside_paths,
        ));
    }
    if exit == Exit::TimedOut {
        warnings.push(format!(
            "the run hit its {}s wall-clock limit and its process group was killed",
            run.timeout.as_secs()
        ));
    }
    let results = results.unwrap_or_default();
    // Kept for every run: the evidence of what the framework said besides its report.
    let stderr_tail = troupe_process::tail(&strip_ansi(&output.stderr_text()), 40, 8000);
    let mut report = TestRunReport {
        framework: run.framework as i32,
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
        framework_version: run.capabilities.version.clone().unwrap_or_default(),
        projects: Vec::new(),
        ..TestRunReport::default()
    };
    crate::sandbox::mark_denied(
        &mut report,
        run.sandbox,
        &format!("{}\n{}", output.stdout_text(), output.stderr_text()),
        &run.worktree.join(run.workdir),
    );
    Ok((report, results.timed_out, results.files))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROOT: &str = "/proj/jest-proj";

    #[test]
    fn parses_jest_results_with_locations_from_the_stack() {
        let text = r#"{"numFailedTests": 2, "numPassedTests": 3, "numPendingTests": 1, "numTodoTests": 0,
          "numTotalTests": 6, "success": false, "testResults": [
          {"name": "/proj/jest-proj/tests/math.test.js", "status": "failed", "message": "",
           "assertionResults": [
             {"fullName": "math divides numbers (assertion failure)", "status": "failed", "location": {"line": 12, "column": 3},
              "failureMessages": ["Error: expect(received).toBe(expected) // Object.is equality\n\nExpected: 2\nReceived: 2.5\n    at Object.toBe (/proj/jest-proj/tests/math.test.js:13:27)\n    at Promise.finally.completed (/proj/jest-proj/node_modules/jest-circus/build/x.js:1:1)"]},
             {"fullName": "math adds", "status": "passed", "location": {"line": 4, "column": 3}, "failureMessages": []}]},
          {"name": "/proj/jest-proj/tests/strings.test.js", "status": "failed", "message": "",
           "assertionResults": [
             {"fullName": "parseUser handles missing name (thrown error)", "status": "failed", "location": {"line": 7, "column": 1},
              "failureMessages": ["TypeError: Cannot read properties of undefined (reading 'trim')\n    at trim (/proj/jest-proj/src/strings.js:7:28)\n    at Object.parseUser (/proj/jest-proj/tests/strings.test.js:8:16)"]}]}]}"#;
        let results = parse_results(text, Path::new(ROOT), 0, true).expect("parses");
        assert_eq!(
            results.totals,
            TestTotals {
                total: 6,
                passed: 3,
                failed: 2,
                skipped: 1,
                errors: 0
            }
        );
        let first = &results.failures[0];
        assert_eq!(first.file, "tests/math.test.js");
        assert_eq!((first.line, first.test_line), (13, 12));
        assert_eq!(troupe_proto::names::name(first.criticality()), "high");
        assert!(
            first.message.ends_with("Received: 2.5"),
            "{}",
            first.message
        );
        let second = &results.failures[1];
        assert_eq!((second.line, second.test_line), (8, 7));
        assert_eq!(second.error_origin, "src/strings.js:7");
        assert_eq!(troupe_proto::names::name(second.criticality()), "critical");
    }

    #[test]
    fn a_file_that_fails_to_load_is_a_load_error_with_ansi_stripped() {
        let text = "{\"numTotalTests\": 0, \"testResults\": [{\"name\": \"/proj/jest-proj/tests/syntax.test.ts\", \"status\": \"failed\", \"assertionResults\": [],\
          \"message\": \"\\u001b[31mSyntaxError: /proj/jest-proj/tests/syntax.test.ts: Unexpected token (2:18)\\u001b[39m\"}]}";
        let results = parse_results(text, Path::new(ROOT), 0, true).expect("parses");
        assert_eq!(results.load_errors, 1);
        let failure = &results.failures[0];
        assert_eq!(failure.file, "tests/syntax.test.ts");
        assert_eq!(failure.line, 2);
        assert!(!failure.message.contains('\u{1b}'), "{}", failure.message);
        let (outcome, _) = decide(Exit::Code(1), Some(&results), None, 0.0, "jest", false);
        assert_eq!(outcome, TestOutcome::LoadError);
    }

    #[test]
    fn recognises_vitest_timeouts_whose_message_was_lost() {
        let text = r#"{"numTotalTests": 1, "numFailedTests": 1, "testResults": [{"name": "/proj/jest-proj/tests/slow.test.ts",
          "status": "failed", "assertionResults": [{"fullName": "slow", "status": "failed", "duration": 1014.08,
          "location": {"line": 3}, "failureMessages": ["Error: STACK_TRACE_ERROR\n    at /proj/jest-proj/tests/slow.test.ts:3:1"]}]}]}"#;
        let results = parse_results(text, Path::new(ROOT), 1000, true).expect("parses");
        assert_eq!(results.timed_out, 1);
        assert_eq!(
            results.failures[0].message,
            "TestTimeoutError: Test timed out in 1000ms."
        );
        let results = parse_results(text, Path::new(ROOT), 5000, true).expect("parses");
        assert_eq!(results.timed_out, 0);
    }

    #[test]
    fn applies_the_exit_code_rules() {
        let none = JsResults::default();
        assert_eq!(
            decide(Exit::Code(1), Some(&none), None, 0.0, "jest", false).0,
            TestOutcome::NoTests
        );
        assert_eq!(
            decide(Exit::Code(1), None, None, 0.0, "jest", false).0,
            TestOutcome::RunnerCrashed
        );
        let ok = JsResults {
            totals: TestTotals {
                total: 2,
                passed: 2,
                ..TestTotals::default()
            },
            ..JsResults::default()
        };
        assert_eq!(
            decide(Exit::Code(1), Some(&ok), Some(90.0), 0.0, "vitest", false).0,
            TestOutcome::RunnerCrashed
        );
        assert_eq!(
            decide(Exit::Code(0), Some(&ok), Some(50.0), 80.0, "vitest", false).0,
            TestOutcome::CoverageBelowTarget
        );
        assert_eq!(
            decide(Exit::Code(0), Some(&ok), Some(90.0), 80.0, "vitest", false).0,
            TestOutcome::Passed
        );
        assert_eq!(
            decide(Exit::TimedOut, None, None, 0.0, "jest", false).0,
            TestOutcome::Timeout
        );
    }

    #[test]
    fn parses_coverage_summaries_with_unknown_percentages() {
        let text = r#"{"total": {"lines": {"pct": 50}, "statements": {"pct": 45}, "functions": {"pct": 62.5},
            "branches": {"pct": 12.5}, "branchesTrue": {"pct": "Unknown"}},
          "/proj/jest-proj/src/math.js": {"lines": {"pct": 55.55}, "statements": {"pct": 50}, "functions": {"pct": 50}, "branches": {"pct": 50}}}"#;
        let coverage = parse_coverage(text, Path::new(ROOT)).expect("parses");
        assert_eq!(coverage.lines, Some(50.0));
        assert_eq!(coverage.overall, Some(50.0));
        assert_eq!(coverage.functions, Some(62.5));
        assert_eq!(coverage.files.get("src/math.js"), Some(&55.55));
    }

    #[test]
    fn builds_the_documented_commands() {
        let env = BTreeMap::new();
        let caps = Capabilities::default();
        let sandbox = troupe_process::Sandbox::off();
        let mut run = JsRun {
            framework: TestFramework::Vitest,
            bin: Path::new("/w/node_modules/.bin/vitest"),
            worktree: Path::new("/w"),
            out_dir: Path::new("/out"),
            coverage: true,
            coverage_target: 0.0,
            timeout: Duration::from_secs(60),
            test_timeout_seconds: 30,
            selection: Selection::All,
            env: &env,
            capabilities: &caps,
            workdir: Path::new(""),
            sandbox: &sandbox,
        };
        assert_eq!(
            command_argv(&run).join(" "),
            "/w/node_modules/.bin/vitest run --reporter=json --includeTaskLocation --outputFile=/out/results.json \
             --cache=false --coverage.enabled --coverage.provider=v8 --coverage.reporter=json-summary --coverage.reporter=json \
             --coverage.reportOnFailure --coverage.reportsDirectory=/out/coverage --testTimeout=30000"
        );
        run.selection = Selection::Related(vec!["src/math.ts".into()]);
        assert!(
            command_argv(&run)
                .join(" ")
                .starts_with("/w/node_modules/.bin/vitest related --run ")
        );
        run.framework = TestFramework::Jest;
        run.bin = Path::new("/w/node_modules/.bin/jest");
        run.selection = Selection::All;
        assert_eq!(
            command_argv(&run).join(" "),
            "/w/node_modules/.bin/jest --ci --json --testLocationInResults --outputFile=/out/results.json \
             --coverage --coverageReporters=json-summary --coverageReporters=json --coverageDirectory=/out/coverage \
             --testTimeout=30000 --forceExit"
        );
        // Jest 22: no --testTimeout; Vitest 1: no --includeTaskLocation.
        let jest22 = Capabilities::from_help(
            Some("22.4.4".into()),
            "  --ci   Whether to run\n  --json  Prints\n  --testLocationInResults  Add\n  --forceExit  x\n  --coverage  x\n",
        );
        run.capabilities = &jest22;
        let argv = command_argv(&run).join(" ");
        assert!(!argv.contains("--testTimeout"), "{argv}");
        assert!(argv.contains("--testLocationInResults"), "{argv}");
        let vitest1 = Capabilities::from_help(
            Some("1.6.1".into()),
            "  -r, --root <path>  Root\n  --coverage  Enable\n  --testTimeout <timeout>  x\n",
        );
        run.capabilities = &vitest1;
        run.framework = TestFramework::Vitest;
        let argv = command_argv(&run).join(" ");
        assert!(!argv.contains("--includeTaskLocation"), "{argv}");
        assert!(argv.contains("--coverage.reportOnFailure"), "{argv}");
        assert!(argv.contains("--testTimeout=30000"), "{argv}");
    }

    #[test]
    fn without_declarations_vitest_1_locations_are_not_claimed() {
        // Vitest 1's `location` is the error's first frame, here in src/strings.ts, with no
        // stack in the message to say so.
        let text = r#"{"numTotalTests": 1, "numFailedTests": 1, "testResults": [{"name": "/proj/jest-proj/tests/a.test.js",
          "status": "failed", "assertionResults": [{"fullName": " adds", "status": "failed",
          "location": {"line": 7, "column": 28}, "failureMessages": ["Cannot read properties of undefined (reading 'trim')"]}]}]}"#;
        let results = parse_results(text, Path::new(ROOT), 0, false).expect("parses");
        let failure = &results.failures[0];
        assert_eq!((failure.line, failure.test_line), (0, 0));
        assert_eq!(failure.file, "tests/a.test.js");
    }

    #[test]
    fn a_failure_line_is_never_taken_from_another_file() {
        let text = r#"{"numTotalTests": 1, "numFailedTests": 1, "testResults": [{"name": "/proj/jest-proj/tests/a.test.js",
          "status": "failed", "assertionResults": [{"fullName": "a", "status": "failed", "location": {"line": 3},
          "failureMessages": ["TypeError: x\n    at f (/proj/jest-proj/src/a.js:9:2)\n    at g (/proj/jest-proj/node_modules/x/y.js:1:1)"]}]}]}"#;
        let results = parse_results(text, Path::new(ROOT), 0, true).expect("parses");
        let failure = &results.failures[0];
        assert_eq!(
            (failure.file.as_str(), failure.line),
            ("tests/a.test.js", 3)
        );
        assert_eq!(failure.error_origin, "src/a.js:9");
    }
}

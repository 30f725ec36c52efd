//! Deciding criteria: typed ones by a check with evidence, free text by the judge, and
//! everything else MANUAL_REVIEW. Nothing passes by default.

use std::path::Path;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use regex::Regex;
use tokio_util::sync::CancellationToken;
use troupe_proto::v1::{CheckResult, CheckStatus, TestRunReport};

use crate::Error;
use crate::criteria::{Expect, FileExpect, Parsed, Stream, Typed, parse};
use crate::judge::{self, JudgeConfig, JudgeContext};
use crate::tools::{Ran, Tools, combined, strip_prefix};
use crate::validate::{NO_CRITERION_CHECKER, confined, millis};

/// Everything criteria are checked against.
#[derive(Debug)]
pub(crate) struct CriteriaEnv<'a> {
    pub(crate) tools: &'a Tools,
    /// The judge's base sandbox (its backend adds the worktree, read-only, and its home).
    pub(crate) judge_sandbox: &'a troupe_process::Sandbox,
    /// A checkout of the commit.
    pub(crate) worktree: &'a Path,
    /// The validator's scratch directory (judge prompt files).
    pub(crate) scratch: &'a Path,
    /// Limit per command.
    pub(crate) timeout: Duration,
    /// Test-run results for `test:` and `coverage` criteria.
    pub(crate) test_runs: &'a [TestRunReport],
    pub(crate) judge: Option<&'a JudgeConfig>,
    pub(crate) context: JudgeContext<'a>,
    pub(crate) cancel: &'a CancellationToken,
}

/// One check per criterion, named `<prefix>criterion:<n>` (1-based).
pub(crate) async fn criteria_checks(
    env: &CriteriaEnv<'_>,
    criteria: &[String],
    prefix: &str,
) -> Result<Vec<CheckResult>, Error> {
    let mut checks = Vec::with_capacity(criteria.len());
    for (i, criterion) in criteria.iter().enumerate() {
        let started = Instant::now();
        let (status, evidence) = match parse(criterion) {
            Parsed::Typed(typed) => decide(env, &typed).await?,
            Parsed::FreeText { hint } => {
                let hint = hint.map(|h| format!(" ({h})")).unwrap_or_default();
                match env.judge {
                    Some(judge) => {
                        let (status, evidence) = judge::ask(
                            judge,
                            criterion,
                            env.worktree,
                            env.scratch,
                            &env.context,
                            env.judge_sandbox,
                            env.cancel,
                        )
                        .await;
                        // A cancelled judge is not a verdict of any kind.
                        if env.cancel.is_cancelled() {
                            return Err(Error::Cancelled);
                        }
                        (status, format!("{evidence}{hint}"))
                    }
                    None => (
                        CheckStatus::ManualReview,
                        format!("{NO_CRITERION_CHECKER}{hint}"),
                    ),
                }
            }
        };
        checks.push(CheckResult {
            name: format!("{prefix}criterion:{}", i + 1),
            kind: troupe_proto::v1::CheckKind::Criterion as i32,
            status: status as i32,
            duration_ms: millis(started.elapsed()),
            evidence,
            subject: criterion.clone(),
            ..Default::default()
        });
    }
    Ok(checks)
}

async fn decide(env: &CriteriaEnv<'_>, typed: &Typed) -> Result<(CheckStatus, String), Error> {
    Ok(match typed {
        Typed::Command { line, argv, expect } => command(env, line, argv, expect).await?,
        Typed::File { path, expect } => file(env.worktree, path, expect).await,
        Typed::Test { id } => test(env, id).await?,
        Typed::Coverage { min, file } => coverage(env.test_runs, *min, file.as_deref()),
    })
}

async fn command(
    env: &CriteriaEnv<'_>,
    line: &str,
    argv: &[String],
    expect: &[Expect],
) -> Result<(CheckStatus, String), Error> {
    let ran = env
        .tools
        .run(argv, env.worktree, env.timeout, None, env.cancel)
        .await?;
    let output = match ran {
        Ran::Missing(program) => {
            return Ok((
                CheckStatus::Error,
                format!("`{line}` cannot run: `{program}` is not installed"),
            ));
        }
        Ran::TimedOut(output) => {
            return Ok((
                CheckStatus::Error,
                format!(
                    "`{line}` timed out after {}s; its process group was killed\n{}",
                    env.timeout.as_secs(),
                    troupe_process::tail(&combined(&output), 15, 2000)
                ),
            ));
        }
        Ran::Exited(output) => output,
    };
    let (stdout, stderr) = (output.stdout_text(), output.stderr_text());
    let mut ok = true;
    let mut seen = Vec::new();
    for e in expect {
        let (held, what) = match e {
            Expect::Exit(code) => (output.exit_code == Some(*code), format!("exit {code}")),
            Expect::NonZero => (
                output.exit_code.is_some_and(|c| c != 0) || output.signal.is_some(),
                "exit nonzero".to_owned(),
            ),
            Expect::Output {
                stream,
                regex,
                matches,
            } => {
                let text = match stream {
                    Stream::Stdout => stdout.clone(),
                    Stream::Stderr => stderr.clone(),
                    Stream::Both => format!("{stdout}\n{stderr}"),
                };
                let found = regex.find(&text).map(|m| m.as_str().to_owned());
                let op = if *matches { "~" } else { "!~" };
                let held = found.is_some() == *matches;
                let note = match (&found, matches) {
                    (Some(m), true) => format!(" (matched {:?})", truncate(m)),
                    (Some(m), false) => format!(" (but found {:?})", truncate(m)),
                    _ => String::new(),
                };
                (held, format!("{stream} {op} /{}/{note}", regex.as_str()))
            }
        };
        ok &= held;
        seen.push(format!("{} {what}", if held { "ok" } else { "NOT" }));
    }
    let exit = match (output.exit_code, output.signal) {
        (Some(code), _) => format!("exit {code}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => "no exit status".to_owned(),
    };
    let tail = troupe_process::tail(&strip_prefix(&combined(&output), env.worktree), 15, 2000);
    Ok((
        if ok {
            CheckStatus::Pass
        } else {
            CheckStatus::Fail
        },
        format!(
            "`{line}`: {exit} in {:.1}s; {}\n{tail}",
            output.duration.as_secs_f64(),
            seen.join("; ")
        )
        .trim_end()
        .to_owned(),
    ))
}

fn truncate(text: &str) -> String {
    text.chars().take(120).collect()
}

async fn file(worktree: &Path, path: &str, expect: &FileExpect) -> (CheckStatus, String) {
    if !confined(path) {
        return (
            CheckStatus::Error,
            format!("path {path:?} escapes the repository root; refused"),
        );
    }
    let full = worktree.join(path);
    let exists = full.exists();
    match expect {
        FileExpect::Exists => match tokio::fs::metadata(&full).await {
            Ok(meta) => (
                CheckStatus::Pass,
                format!("{path} exists ({} bytes)", meta.len()),
            ),
            Err(_) => (CheckStatus::Fail, format!("{path} does not exist")),
        },
        FileExpect::Absent if exists => (CheckStatus::Fail, format!("{path} exists")),
        FileExpect::Absent => (CheckStatus::Pass, format!("{path} is absent")),
        FileExpect::Contains(regex) | FileExpect::Lacks(regex) => {
            let want = matches!(expect, FileExpect::Contains(_));
            let text = match tokio::fs::read(&full).await {
                Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
                Err(_) => return (CheckStatus::Fail, format!("{path} does not exist")),
            };
            match regex.find(&text) {
                Some(m) => {
                    let line = text[..m.start()].matches('\n').count() + 1;
                    let content = text.lines().nth(line - 1).unwrap_or("").trim();
                    let at = format!("{path}:{line}: {}", truncate(content));
                    if want {
                        (
                            CheckStatus::Pass,
                            format!("/{}/ matches at {at}", regex.as_str()),
                        )
                    } else {
                        (
                            CheckStatus::Fail,
                            format!("/{}/ must not match but does at {at}", regex.as_str()),
                        )
                    }
                }
                None => {
                    let lines = text.lines().count();
                    if want {
                        (
                            CheckStatus::Fail,
                            format!(
                                "no match for /{}/ in {path} ({lines} lines)",
                                regex.as_str()
                            ),
                        )
                    } else {
                        (
                            CheckStatus::Pass,
                            format!(
                                "no match for /{}/ in {path} ({lines} lines)",
                                regex.as_str()
                            ),
                        )
                    }
                }
            }
        }
    }
}

/// What a test report says about one test.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Passed,
    Failed(String),
    Skipped,
}

async fn test(env: &CriteriaEnv<'_>, id: &str) -> Result<(CheckStatus, String), Error> {
    // 1. A failure an upstream test run recorded.
    for run in env.test_runs {
        if let Some(failure) = run.failures.iter().find(|f| same_test(&f.name, id)) {
            let place = if failure.line > 0 {
                format!("{}:{}: ", failure.file, failure.line)
            } else if !failure.file.is_empty() {
                format!("{}: ", failure.file)
            } else {
                String::new()
            };
            return Ok((
                CheckStatus::Fail,
                format!(
                    "{id} failed in the test run at {}: {place}{}",
                    short(&run.commit),
                    troupe_process::tail(&failure.message, 8, 1200)
                ),
            ));
        }
    }
    // 2. The run's own structured reports, when this machine can read them.
    for run in env.test_runs {
        for path in &run.report_paths {
            let Ok(text) = tokio::fs::read_to_string(path).await else {
                continue;
            };
            let found = if path.ends_with(".json") {
                json_report_outcome(&text, id)
            } else if path.ends_with(".xml") {
                junit_outcome(&text, id)
            } else {
                None
            };
            if let Some(outcome) = found {
                let from = format!("{path} (test run at {})", short(&run.commit));
                return Ok(match outcome {
                    Outcome::Passed => (
                        CheckStatus::Pass,
                        format!("{id} passed according to {from}"),
                    ),
                    Outcome::Skipped => (
                        CheckStatus::Fail,
                        format!("{id} was skipped, not passed, according to {from}"),
                    ),
                    Outcome::Failed(why) => (
                        CheckStatus::Fail,
                        format!("{id} failed according to {from}: {why}"),
                    ),
                });
            }
        }
    }
    // 3. Run it: pytest node ids only.
    if !(id.contains(".py") && (id.contains("::") || id.ends_with(".py"))) {
        return Ok((
            CheckStatus::Error,
            format!(
                "no test-run result lists {id}, and only pytest ids (path.py::name) can be run directly"
            ),
        ));
    }
    let argv: Vec<String> = [
        "python3",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--no-header",
        id,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let ran = env
        .tools
        .run(&argv, env.worktree, env.timeout, None, env.cancel)
        .await?;
    Ok(match ran {
        Ran::Missing(program) => (
            CheckStatus::Error,
            format!("cannot run {id}: `{program}` is not installed"),
        ),
        Ran::TimedOut(output) => (
            CheckStatus::Error,
            format!(
                "pytest {id} timed out after {:.0}s\n{}",
                output.duration.as_secs_f64(),
                troupe_process::tail(&combined(&output), 10, 1500)
            ),
        ),
        Ran::Exited(output) => {
            let tail =
                troupe_process::tail(&strip_prefix(&combined(&output), env.worktree), 15, 2000);
            match output.exit_code {
                Some(0) => (
                    CheckStatus::Pass,
                    format!("`{}`: exit 0\n{tail}", argv.join(" ")),
                ),
                Some(1) => (
                    CheckStatus::Fail,
                    format!("`{}`: exit 1 (test failed)\n{tail}", argv.join(" ")),
                ),
                Some(4 | 5) => (
                    CheckStatus::Fail,
                    format!(
                        "`{}`: {id} was not found or not collected\n{tail}",
                        argv.join(" ")
                    ),
                ),
                _ if tail.contains("No module named pytest") => (
                    CheckStatus::Error,
                    format!("cannot run {id}: pytest is not installed for python3"),
                ),
                code => (
                    CheckStatus::Error,
                    format!(
                        "`{}`: pytest could not run (exit {code:?})\n{tail}",
                        argv.join(" ")
                    ),
                ),
            }
        }
    })
}

fn short(commit: &str) -> &str {
    commit.get(..12).unwrap_or(commit)
}

/// Test names match exactly, or as a pytest node id suffix / a report's full name.
fn same_test(name: &str, id: &str) -> bool {
    name == id || name.ends_with(&format!("::{id}")) || name.ends_with(&format!("/{id}"))
}

fn json_report_outcome(text: &str, id: &str) -> Option<Outcome> {
    let report: serde_json::Value = serde_json::from_str(text).ok()?;
    let test = report.get("tests")?.as_array()?.iter().find(|t| {
        t.get("nodeid")
            .and_then(|n| n.as_str())
            .is_some_and(|n| same_test(n, id))
    })?;
    Some(
        match test.get("outcome").and_then(|o| o.as_str()).unwrap_or("") {
            "passed" => Outcome::Passed,
            "skipped" => Outcome::Skipped,
            other => Outcome::Failed(format!("outcome {other}")),
        },
    )
}

static TESTCASE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?s)<testcase\b([^>]*?)(?:/>|>(.*?)</testcase>)")
        .expect("testcase pattern is valid")
});
static ATTR: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r#"(\w+)="([^"]*)""#).expect("attribute pattern is valid"));

fn junit_outcome(text: &str, id: &str) -> Option<Outcome> {
    let (file, name) = id.split_once("::").map_or(("", id), |(f, n)| (f, n));
    let name = name.rsplit("::").next().unwrap_or(name);
    for case in TESTCASE.captures_iter(text) {
        let attrs: Vec<(String, String)> = ATTR
            .captures_iter(case.get(1).map_or("", |m| m.as_str()))
            .map(|c| (c[1].to_owned(), c[2].to_owned()))
            .collect();
        let attr = |key: &str| {
            attrs
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
        };
        if attr("name") != Some(name) {
            continue;
        }
        if !file.is_empty() {
            let module = file.trim_end_matches(".py").replace('/', ".");
            let file_ok = attr("file") == Some(file)
                || attr("classname")
                    .is_some_and(|c| c == module || c.starts_with(&format!("{module}.")));
            if !file_ok {
                continue;
            }
        }
        let body = case.get(2).map_or("", |m| m.as_str());
        return Some(if body.contains("<failure") || body.contains("<error") {
            Outcome::Failed("failure recorded in the junit report".to_owned())
        } else if body.contains("<skipped") {
            Outcome::Skipped
        } else {
            Outcome::Passed
        });
    }
    None
}

fn coverage(runs: &[TestRunReport], min: f64, file: Option<&str>) -> (CheckStatus, String) {
    // The latest run that measured coverage decides.
    let Some((run, cov)) = runs
        .iter()
        .rev()
        .find_map(|r| r.coverage.as_ref().map(|c| (r, c)))
    else {
        return (
            CheckStatus::Error,
            "no test-run result with coverage is available; a coverage criterion needs an upstream TESTRUN task that measures coverage (or test_runs in the request)".to_owned(),
        );
    };
    let (what, value) = match file {
        Some(path) => match cov.files.get(path) {
            Some(v) => (format!("line coverage of {path}"), *v),
            None => {
                return (
                    CheckStatus::Fail,
                    format!(
                        "{path} is not in the coverage report of the test run at {}",
                        short(&run.commit)
                    ),
                );
            }
        },
        None => match cov.overall.or(cov.lines).or(cov.statements) {
            Some(v) => ("overall coverage".to_owned(), v),
            None => {
                return (
                    CheckStatus::Error,
                    format!(
                        "the test run at {} reported no overall coverage figure",
                        short(&run.commit)
                    ),
                );
            }
        },
    };
    let from = format!(
        "test run at {} ({})",
        short(&run.commit),
        run.command.join(" ")
    );
    if value >= min {
        (
            CheckStatus::Pass,
            format!("{what} is {value:.1}% >= {min}% in the {from}"),
        )
    } else {
        (
            CheckStatus::Fail,
            format!("{what} is {value:.1}% < {min}% in the {from}"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn junit_and_json_reports_name_outcomes() {
        let xml = r#"<testsuite><testcase classname="tests.test_a" name="test_ok" file="tests/test_a.py" time="0.1"/><testcase classname="tests.test_a" name="test_bad" file="tests/test_a.py"><failure message="x">boom</failure></testcase><testcase classname="tests.test_a" name="test_skip"><skipped/></testcase></testsuite>"#;
        assert_eq!(
            junit_outcome(xml, "tests/test_a.py::test_ok"),
            Some(Outcome::Passed)
        );
        assert!(matches!(
            junit_outcome(xml, "tests/test_a.py::test_bad"),
            Some(Outcome::Failed(_))
        ));
        assert_eq!(
            junit_outcome(xml, "tests/test_a.py::test_skip"),
            Some(Outcome::Skipped)
        );
        assert_eq!(junit_outcome(xml, "tests/test_b.py::test_ok"), None);
        let json = r#"{"tests": [{"nodeid": "tests/test_a.py::test_ok", "outcome": "passed"}, {"nodeid": "tests/test_a.py::test_bad", "outcome": "failed"}]}"#;
        assert_eq!(
            json_report_outcome(json, "tests/test_a.py::test_ok"),
            Some(Outcome::Passed)
        );
        assert!(matches!(
            json_report_outcome(json, "tests/test_a.py::test_bad"),
            Some(Outcome::Failed(_))
        ));
        assert_eq!(
            json_report_outcome(json, "tests/test_a.py::test_none"),
            None
        );
    }

    #[test]
    fn coverage_floor_uses_the_latest_run() {
        use troupe_proto::v1::Coverage;
        let run = |overall: f64| TestRunReport {
            coverage: Some(Coverage {
                overall: Some(overall),
                files: [("a.py".to_owned(), 50.0)].into(),
                ..Coverage::default()
            }),
            commit: "c".repeat(40),
            ..TestRunReport::default()
        };
        assert_eq!(
            coverage(&[run(50.0), run(85.0)], 80.0, None).0,
            CheckStatus::Pass
        );
        assert_eq!(
            coverage(&[run(85.0), run(70.0)], 80.0, None).0,
            CheckStatus::Fail
        );
        assert_eq!(
            coverage(&[run(85.0)], 60.0, Some("a.py")).0,
            CheckStatus::Fail
        );
        assert_eq!(
            coverage(&[run(85.0)], 60.0, Some("b.py")).0,
            CheckStatus::Fail
        );
        assert_eq!(coverage(&[], 60.0, None).0, CheckStatus::Error);
    }
}

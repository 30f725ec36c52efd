//! pytest-json-report's `report.json` (test-frameworks.md §3.5).
//!
//! Facts this parser relies on: `summary` keys are absent when their count is 0;
//! `tests[].lineno` is 0-based while `crash.lineno` and `traceback[].lineno` are 1-based;
//! `crash.path` is absolute and `traceback[].path` repo-relative; collection errors live only in
//! `collectors[]` (outcome `failed`, text in `longrepr`) and are not counted in `summary`.

use serde::Deserialize;
use troupe_proto::v1::{TestFailure, TestTotals};

use super::{SuiteResults, collection_failure, test_file_of};
use crate::failure::{criticality, is_type_name, leading_exception_type, strip_ansi, with_type};

#[derive(Debug, Deserialize)]
struct Report {
    #[serde(default)]
    root: String,
    #[serde(default)]
    summary: Summary,
    #[serde(default)]
    collectors: Vec<Collector>,
    #[serde(default)]
    tests: Vec<Test>,
}

#[derive(Debug, Default, Deserialize)]
struct Summary {
    #[serde(default)]
    passed: u32,
    #[serde(default)]
    failed: u32,
    #[serde(default)]
    skipped: u32,
    #[serde(default)]
    error: u32,
    #[serde(default)]
    xfailed: u32,
    #[serde(default)]
    xpassed: u32,
    #[serde(default)]
    total: u32,
}

#[derive(Debug, Deserialize)]
struct Collector {
    #[serde(default)]
    nodeid: String,
    #[serde(default)]
    outcome: String,
    #[serde(default)]
    longrepr: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Test {
    nodeid: String,
    #[serde(default)]
    lineno: Option<u32>,
    outcome: String,
    #[serde(default)]
    setup: Option<Phase>,
    #[serde(default)]
    call: Option<Phase>,
    #[serde(default)]
    teardown: Option<Phase>,
}

#[derive(Debug, Deserialize)]
struct Phase {
    #[serde(default)]
    outcome: String,
    #[serde(default)]
    crash: Option<Crash>,
    #[serde(default)]
    traceback: Vec<Frame>,
    #[serde(default)]
    longrepr: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Crash {
    #[serde(default)]
    path: String,
    #[serde(default)]
    lineno: u32,
    #[serde(default)]
    message: String,
}

#[derive(Debug, Deserialize)]
struct Frame {
    #[serde(default)]
    path: String,
    #[serde(default)]
    lineno: u32,
    #[serde(default)]
    message: String,
}

/// Parses a `report.json`.
///
/// Counting: `xfailed` counts as skipped and a non-strict `xpassed` as passed (a strict xpass
/// is reported by pytest as `failed`), so `pass_rate = passed / (total - skipped)` stays
/// meaningful.
pub(crate) fn parse(text: &str) -> Result<SuiteResults, serde_json::Error> {
    let report: Report = serde_json::from_str(text)?;
    let s = &report.summary;
    let totals = TestTotals {
        total: s.total,
        passed: s.passed + s.xpassed,
        failed: s.failed,
        skipped: s.skipped + s.xfailed,
        errors: s.error,
    };
    let mut failures: Vec<TestFailure> = report
        .collectors
        .iter()
        .filter(|c| c.outcome == "failed")
        .map(|c| collection_failure(&c.nodeid, c.longrepr.as_deref().unwrap_or("")))
        .collect();
    let collection_errors = u32::try_from(failures.len()).unwrap_or(u32::MAX);
    failures.extend(
        report
            .tests
            .iter()
            .filter(|t| t.outcome == "failed" || t.outcome == "error")
            .map(test_failure),
    );
    let mut skip_reasons = std::collections::BTreeMap::new();
    for test in report.tests.iter().filter(|t| t.outcome == "skipped") {
        let reason = [&test.setup, &test.call]
            .into_iter()
            .flatten()
            .find(|phase| phase.outcome == "skipped")
            .and_then(|phase| phase.longrepr.as_deref())
            .map(skip_reason)
            .unwrap_or_default();
        *skip_reasons.entry(reason).or_insert(0) += 1;
    }
    Ok(SuiteResults {
        totals,
        failures,
        collection_errors,
        skip_reasons,
        root: (!report.root.is_empty()).then(|| report.root.clone()),
    })
}

/// The reason of a skip from its long representation, `('/x/tests/t.py', 5, 'Skipped: why')`.
fn skip_reason(longrepr: &str) -> String {
    let text = longrepr.trim();
    let reason = text
        .find("Skipped: ")
        .map_or(text, |at| &text[at + "Skipped: ".len()..]);
    reason
        .trim_end_matches(')')
        .trim_end_matches(['\'', '"'])
        .trim()
        .to_owned()
}

fn test_failure(test: &Test) -> TestFailure {
    let file = test_file_of(&test.nodeid);
    let phase = [&test.setup, &test.call, &test.teardown]
        .into_iter()
        .flatten()
        .find(|phase| phase.outcome == "failed");
    let Some(phase) = phase else {
        // An `error`/`failed` test without a failed phase: only the declaration is known.
        return TestFailure {
            name: test.nodeid.clone(),
            file: file.to_owned(),
            line: test.lineno.map_or(0, |l| l + 1),
            message: format!("test {}", test.outcome),
            criticality: troupe_proto::v1::Severity::Medium as i32,
            test_line: test.lineno.map_or(0, |l| l + 1),
            error_origin: String::new(),
            ..TestFailure::default()
        };
    };
    // The failure line inside the test file: the last traceback frame in that file, else the
    // crash location when it is in that file, else the test's own (0-based) declaration line.
    let line = phase
        .traceback
        .iter()
        .rev()
        .find(|frame| frame.path == file)
        .map(|frame| frame.lineno)
        .or_else(|| {
            phase
                .crash
                .as_ref()
                .filter(|crash| crash.path.ends_with(file) && crash.lineno > 0)
                .map(|crash| crash.lineno)
        })
        .or(test.lineno.map(|l| l + 1))
        .unwrap_or(0);
    let crash_message = phase
        .crash
        .as_ref()
        .map(|crash| strip_ansi(crash.message.trim()))
        .filter(|m| !m.is_empty())
        .or_else(|| {
            phase
                .longrepr
                .as_deref()
                .map(|l| last_error_line(&strip_ansi(l)))
        })
        .unwrap_or_default();
    // pytest puts the exception type in the last traceback frame's message (an assertion's
    // crash message is only `assert 2.5 == 2`).
    let exception = phase
        .traceback
        .last()
        .map(|frame| frame.message.trim())
        .filter(|m| is_type_name(m))
        .or_else(|| leading_exception_type(&crash_message));
    let mut message = with_type(exception, &crash_message);
    if test.outcome == "error" && phase_name(test, phase) != "call" {
        message = format!("error in {}: {message}", phase_name(test, phase));
    }
    // Where the error was raised: the crash location, repo-relative when inside the repo.
    let error_origin = phase
        .traceback
        .last()
        .filter(|frame| !frame.path.starts_with('/') && frame.lineno > 0)
        .map(|frame| format!("{}:{}", frame.path, frame.lineno))
        .unwrap_or_default();
    TestFailure {
        name: test.nodeid.clone(),
        file: file.to_owned(),
        line,
        criticality: criticality(exception, &message) as i32,
        message,
        test_line: test.lineno.map_or(0, |l| l + 1),
        error_origin,
        ..TestFailure::default()
    }
}

fn phase_name(test: &Test, phase: &Phase) -> &'static str {
    let same =
        |candidate: &Option<Phase>| candidate.as_ref().is_some_and(|p| std::ptr::eq(p, phase));
    if same(&test.setup) {
        "setup"
    } else if same(&test.teardown) {
        "teardown"
    } else {
        "call"
    }
}

/// The last `E   ...` line of a pytest long representation, or its last non-empty line.
pub(super) fn last_error_line(longrepr: &str) -> String {
    longrepr
        .lines()
        .rev()
        .find_map(|line| {
            line.strip_prefix('E')
                .filter(|rest| rest.starts_with(' '))
                .map(str::trim)
        })
        .or_else(|| {
            longrepr
                .lines()
                .rev()
                .map(str::trim)
                .find(|l| !l.is_empty())
        })
        .unwrap_or("")
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    // Trimmed from a real pytest 9.2.0 / pytest-json-report 1.5.0 run.
    const REPORT: &str = r#"{
      "exitcode": 1, "root": "/tmp/pyproj",
      "summary": {"passed": 1, "failed": 2, "skipped": 1, "error": 1, "total": 5, "collected": 5},
      "collectors": [
        {"nodeid": "", "outcome": "passed", "result": []},
        {"nodeid": "tests/test_imp.py", "outcome": "failed", "result": [],
         "longrepr": "ImportError while importing test module '/tmp/pyproj/tests/test_imp.py'.\nHint: make sure your test modules/packages have valid Python names.\nTraceback:\n/usr/lib/python3.11/importlib/__init__.py:126: in import_module\n    return _bootstrap._gcd_import(name[level:], package, level)\ntests/test_imp.py:1: in <module>\n    from calc.missing import nothing\nE   ModuleNotFoundError: No module named 'calc.missing'"}
      ],
      "tests": [
        {"nodeid": "tests/test_ops.py::test_add", "lineno": 4, "outcome": "passed",
         "setup": {"outcome": "passed"}, "call": {"outcome": "passed"}, "teardown": {"outcome": "passed"}},
        {"nodeid": "tests/test_ops.py::test_divide_fails", "lineno": 8, "outcome": "failed",
         "setup": {"outcome": "passed"},
         "call": {"outcome": "failed",
                  "crash": {"path": "/tmp/pyproj/tests/test_ops.py", "lineno": 10, "message": "assert 2.5 == 2\n +  where 2.5 = divide(10, 4)"},
                  "traceback": [{"path": "tests/test_ops.py", "lineno": 10, "message": "AssertionError"}],
                  "longrepr": "..."},
         "teardown": {"outcome": "passed"}},
        {"nodeid": "tests/test_ops.py::test_parse_raises", "lineno": 12, "outcome": "failed",
         "setup": {"outcome": "passed"},
         "call": {"outcome": "failed",
                  "crash": {"path": "/tmp/pyproj/calc/ops.py", "lineno": 12, "message": "KeyError: 'name'"},
                  "traceback": [{"path": "tests/test_ops.py", "lineno": 14, "message": ""},
                                {"path": "calc/ops.py", "lineno": 12, "message": "KeyError"}]},
         "teardown": {"outcome": "passed"}},
        {"nodeid": "tests/test_ops.py::test_skipped", "lineno": 16, "outcome": "skipped",
         "setup": {"outcome": "skipped", "longrepr": "('/tmp/pyproj/tests/test_ops.py', 17, 'Skipped: not now')"}},
        {"nodeid": "tests/test_ops.py::test_setup_error", "lineno": 26, "outcome": "error",
         "setup": {"outcome": "failed",
                   "crash": {"path": "/tmp/pyproj/tests/test_ops.py", "lineno": 24, "message": "RuntimeError: fixture exploded"},
                   "traceback": [{"path": "tests/test_ops.py", "lineno": 24, "message": "RuntimeError"}]}}
      ]
    }"#;

    #[test]
    fn parses_totals_failures_and_collection_errors() {
        let parsed = parse(REPORT).expect("report parses");
        assert_eq!(
            parsed.totals,
            TestTotals {
                total: 5,
                passed: 1,
                failed: 2,
                skipped: 1,
                errors: 1
            }
        );
        assert_eq!(parsed.collection_errors, 1);
        let names: Vec<&str> = parsed.failures.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "tests/test_imp.py",
                "tests/test_ops.py::test_divide_fails",
                "tests/test_ops.py::test_parse_raises",
                "tests/test_ops.py::test_setup_error"
            ]
        );

        let import = &parsed.failures[0];
        assert_eq!(
            (import.file.as_str(), import.line),
            ("tests/test_imp.py", 1)
        );
        assert_eq!(
            import.message,
            "ModuleNotFoundError: No module named 'calc.missing'"
        );
        assert_eq!(troupe_proto::names::name(import.criticality()), "critical");

        let assertion = &parsed.failures[1];
        assert_eq!(
            (assertion.file.as_str(), assertion.line),
            ("tests/test_ops.py", 10)
        );
        assert_eq!(
            assertion.message,
            "AssertionError: assert 2.5 == 2\n +  where 2.5 = divide(10, 4)"
        );
        assert_eq!(troupe_proto::names::name(assertion.criticality()), "high");

        // The crash is in the source file; the line reported is the call inside the test.
        let raised = &parsed.failures[2];
        assert_eq!(
            (raised.file.as_str(), raised.line),
            ("tests/test_ops.py", 14)
        );
        assert_eq!(raised.message, "KeyError: 'name'");
        assert_eq!(troupe_proto::names::name(raised.criticality()), "medium");

        let setup = &parsed.failures[3];
        assert_eq!(setup.line, 24);
        assert_eq!(
            setup.message,
            "error in setup: RuntimeError: fixture exploded"
        );
    }

    #[test]
    fn missing_summary_keys_are_zero() {
        let parsed =
            parse(r#"{"exitcode": 5, "summary": {"total": 0, "collected": 0}, "tests": []}"#)
                .expect("report parses");
        assert_eq!(parsed.totals, TestTotals::default());
        assert!(parsed.failures.is_empty());
    }

    #[test]
    fn syntax_error_collector_takes_its_line_from_the_file_frame() {
        let report = r#"{"summary": {"total": 0, "collected": 0}, "collectors": [{"nodeid": "tests/test_syn.py",
          "outcome": "failed", "longrepr": "/usr/lib/python3.11/ast.py:50: in parse\n    return compile(source, filename, mode, flags,\nE     File \"/tmp/pyproj/tests/test_syn.py\", line 3\nE       def test_broken(:\nE                       ^\nE   SyntaxError: invalid syntax"}]}"#;
        let parsed = parse(report).expect("report parses");
        let failure = &parsed.failures[0];
        assert_eq!(
            (failure.file.as_str(), failure.line),
            ("tests/test_syn.py", 3)
        );
        assert_eq!(failure.message, "SyntaxError: invalid syntax");
        assert_eq!(troupe_proto::names::name(failure.criticality()), "critical");
    }
}

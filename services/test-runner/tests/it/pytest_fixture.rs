//! Pytest on the fixture project: counts, failing node ids, lines and coverage compared with
//! pytest-json-report's and coverage.py's own files from the same run (and with the values
//! seen running pytest directly in the fixture, hard-coded below).

use std::collections::BTreeMap;

use troupe_proto::v1::{RunTestsRequest, TestFramework, TestOutcome, TestTotals};
use troupe_testkit::git_repo;

use super::support::{fixture_repo, read_json, report_file};
use super::{run_tests, start};

fn request(repo: &std::path::Path) -> RunTestsRequest {
    RunTestsRequest {
        repo_path: repo.display().to_string(),
        install: true,
        ..RunTestsRequest::default()
    }
}

#[tokio::test]
async fn pytest_baseline_is_reported_as_pytest_reports_it() {
    let repo = fixture_repo("pytest-proj", &[], &[], None);
    let service = start().await;
    let report = run_tests(&service, request(repo.path()))
        .await
        .expect("run");

    assert_eq!(report.framework(), TestFramework::Pytest);
    assert_eq!(report.outcome(), TestOutcome::TestsFailed, "{report:#?}");
    assert_eq!(
        report.totals,
        Some(TestTotals {
            total: 6,
            passed: 3,
            failed: 2,
            skipped: 1,
            errors: 0
        })
    );
    let own = read_json(&report_file(&report, "report.json"));
    let summary = &own["summary"];
    let totals = report.totals.expect("totals");
    assert_eq!(u64::from(totals.total), summary["total"]);
    assert_eq!(u64::from(totals.passed), summary["passed"]);
    assert_eq!(u64::from(totals.failed), summary["failed"]);
    assert_eq!(u64::from(totals.skipped), summary["skipped"]);
    // Failing node ids, the failure line (last traceback frame in the test file) and the
    // declaration line (0-based `lineno` + 1), straight from pytest-json-report.
    let mut expected: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for test in own["tests"].as_array().expect("tests") {
        if test["outcome"] != "failed" {
            continue;
        }
        let nodeid = test["nodeid"].as_str().expect("nodeid");
        let file = nodeid.split("::").next().expect("file");
        let line = test["call"]["traceback"]
            .as_array()
            .expect("traceback")
            .iter()
            .rev()
            .find(|frame| frame["path"] == file)
            .and_then(|frame| frame["lineno"].as_u64())
            .expect("frame in the test file");
        let declared = test["lineno"].as_u64().expect("lineno") + 1;
        expected.insert(nodeid.to_owned(), (line, declared));
    }
    let ours: BTreeMap<String, (u64, u64)> = report
        .failures
        .iter()
        .map(|f| (f.name.clone(), (u64::from(f.line), u64::from(f.test_line))))
        .collect();
    assert_eq!(ours, expected);
    assert_eq!(
        ours.get("tests/test_mathops.py::TestMath::test_divides_numbers_assertion_failure"),
        Some(&(14, 13))
    );
    let thrown = report
        .failures
        .iter()
        .find(|f| {
            f.name
                .ends_with("test_parse_user_missing_name_thrown_error")
        })
        .expect("thrown");
    assert_eq!(thrown.message, "KeyError: 'name'");
    assert_eq!(thrown.error_origin, "src/calc/strings.py:10");
    // Coverage: coverage.py's statement and branch percentages (not its mixed total).
    let coverage_json = read_json(&report_file(&report, "coverage.json"));
    let coverage = report.coverage.clone().expect("coverage");
    assert_eq!(
        coverage.lines,
        coverage_json["totals"]["percent_statements_covered"].as_f64()
    );
    assert_eq!(
        coverage.branches,
        coverage_json["totals"]["percent_branches_covered"].as_f64()
    );
    assert_eq!(coverage.functions, None);
    service.stop().await;
}

#[tokio::test]
async fn pytest_syntax_and_import_errors_are_collection_errors() {
    let service = start().await;
    for (scenario, dest, needle) in [
        ("test_syntax.py.txt", "tests/test_syntax.py", "SyntaxError"),
        (
            "test_importerr.py.txt",
            "tests/test_importerr.py",
            "ModuleNotFoundError: No module named 'calc.does_not_exist'",
        ),
    ] {
        let repo = fixture_repo("pytest-proj", &[], &[(scenario, dest)], None);
        let report = run_tests(&service, request(repo.path()))
            .await
            .expect("run");
        assert_eq!(
            report.outcome(),
            TestOutcome::CollectionError,
            "{scenario}: {report:#?}"
        );
        // --continue-on-collection-errors: the other six tests still ran.
        assert_eq!(report.totals.expect("totals").total, 6, "{scenario}");
        let broken = &report.failures[0];
        assert_eq!(broken.file, dest);
        assert_eq!(troupe_proto::names::name(broken.criticality()), "critical");
        assert!(broken.message.contains(needle), "{}", broken.message);
    }
    service.stop().await;
}

#[tokio::test]
async fn pytest_timeouts_on_every_test_are_retried_once_with_more_time() {
    let repo = fixture_repo(
        "pytest-proj",
        &["tests/test_mathops.py", "tests/test_strings.py"],
        &[("test_slow.py.txt", "tests/test_slow.py")],
        None,
    );
    let service = start().await;
    let mut req = request(repo.path());
    req.test_timeout_seconds = 1;
    let report = run_tests(&service, req).await.expect("run");
    assert_eq!(report.outcome(), TestOutcome::Passed, "{report:#?}");
    assert!(report.timeout_retried);
    assert_eq!(report.test_timeout_seconds, 4);
    assert!(report.command.iter().any(|a| a == "--timeout=4"));
    service.stop().await;
}

#[tokio::test]
async fn several_python_packages_run_in_importlib_mode() {
    let dir = tempfile::tempdir().expect("tempdir");
    let core = |ok: bool| {
        format!(
            "def test_core():\n    assert {}\n\n\ndef test_more():\n    assert True\n",
            if ok { "True" } else { "1 == 2" }
        )
    };
    let (a, b) = (core(true), core(false));
    git_repo(
        dir.path(),
        &[
            ("requirements-dev.txt", super::REQUIREMENTS),
            (
                "pyproject.toml",
                "[tool.pytest.ini_options]\ntestpaths = [\"packages\"]\n",
            ),
            ("packages/a/tests/test_core.py", &a),
            ("packages/b/tests/test_core.py", &b),
        ],
    )
    .expect("repo");
    let service = start().await;
    let report = run_tests(&service, request(dir.path())).await.expect("run");
    assert_eq!(
        report.totals,
        Some(TestTotals {
            total: 4,
            passed: 3,
            failed: 1,
            skipped: 0,
            errors: 0
        }),
        "{report:#?}"
    );
    assert_eq!(
        report.failures[0].name,
        "packages/b/tests/test_core.py::test_core"
    );
    assert!(
        report
            .command
            .iter()
            .any(|a| a == "--import-mode=importlib")
    );
    service.stop().await;
}

//! Jest 30 and Vitest 4 on the fixture projects (installed by scripts/setup/30-node-fixtures.sh).
//!
//! Every count, failing name, line and coverage figure is compared with the framework's own
//! `results.json` and `coverage-summary.json` from the same run, and also with the values seen
//! when running the documented command directly in the fixture (hard-coded below).

use std::collections::BTreeMap;

use troupe_proto::v1::{RunTestsRequest, TestFramework, TestOutcome, TestRunReport, TestTotals};

use super::support::{fixture_repo, gone, read_json, report_file};
use super::{run_tests, start};

fn js_request(repo: &std::path::Path) -> RunTestsRequest {
    RunTestsRequest {
        repo_path: repo.display().to_string(),
        ..RunTestsRequest::default()
    }
}

/// What the framework's own files say, next to the report.
fn assert_matches_framework_reports(report: &TestRunReport) {
    let results = read_json(&report_file(report, "results.json"));
    let totals = report.totals.expect("totals");
    assert_eq!(u64::from(totals.total), results["numTotalTests"]);
    assert_eq!(u64::from(totals.passed), results["numPassedTests"]);
    assert_eq!(u64::from(totals.failed), results["numFailedTests"]);
    assert_eq!(
        u64::from(totals.skipped),
        results["numPendingTests"].as_u64().expect("pending")
            + results["numTodoTests"].as_u64().expect("todo")
    );
    // Failing tests: same names, and the declaration lines are the frameworks' `location`.
    let mut own: BTreeMap<String, u64> = BTreeMap::new();
    for file in results["testResults"].as_array().expect("testResults") {
        for test in file["assertionResults"].as_array().expect("assertions") {
            if test["status"] == "failed" {
                own.insert(
                    test["fullName"].as_str().expect("name").to_owned(),
                    test["location"]["line"].as_u64().expect("location"),
                );
            }
        }
    }
    let ours: BTreeMap<String, u64> = report
        .failures
        .iter()
        .map(|f| (f.name.clone(), u64::from(f.test_line)))
        .collect();
    assert_eq!(ours, own);
    let summary = read_json(&report_file(report, "coverage-summary.json"));
    let coverage = report.coverage.clone().expect("coverage");
    for (key, ours) in [
        ("lines", coverage.lines),
        ("statements", coverage.statements),
        ("branches", coverage.branches),
        ("functions", coverage.functions),
    ] {
        assert_eq!(ours, summary["total"][key]["pct"].as_f64(), "{key}");
    }
}

fn failure<'a>(report: &'a TestRunReport, name: &str) -> &'a troupe_proto::v1::TestFailure {
    report
        .failures
        .iter()
        .find(|f| f.name == name)
        .unwrap_or_else(|| panic!("no failure {name} in {:#?}", report.failures))
}

#[tokio::test]
async fn jest_baseline_is_reported_as_jest_reports_it() {
    let repo = fixture_repo("jest-proj", &[], &[], None);
    let service = start().await;
    // Framework detected from package.json; node_modules of the checkout reused.
    let mut req = js_request(repo.path());
    req.coverage_target = 60.0;
    let report = run_tests(&service, req).await.expect("run");

    assert_eq!(report.framework(), TestFramework::Jest);
    assert_eq!(report.outcome(), TestOutcome::TestsFailed, "{report:#?}");
    assert_eq!(report.exit_code, 1);
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
    assert_matches_framework_reports(&report);
    let math = failure(&report, "math divides numbers (assertion failure)");
    assert_eq!(
        (math.file.as_str(), math.line, math.test_line),
        ("tests/math.test.js", 13, 12)
    );
    assert_eq!(troupe_proto::names::name(math.criticality()), "high");
    assert!(math.message.contains("Received: 2.5"), "{}", math.message);
    let thrown = failure(&report, "parseUser handles missing name (thrown error)");
    assert_eq!(
        (thrown.file.as_str(), thrown.line, thrown.test_line),
        ("tests/strings.test.js", 8, 7)
    );
    assert_eq!(thrown.error_origin, "src/strings.js:7");
    assert_eq!(
        thrown.message,
        "TypeError: Cannot read properties of undefined (reading 'trim')"
    );
    assert_eq!(troupe_proto::names::name(thrown.criticality()), "critical");
    // Seen when running jest 30.5.2's documented command in the fixture directly.
    let coverage = report.coverage.clone().expect("coverage");
    assert_eq!(coverage.lines, Some(64.28));
    assert_eq!(coverage.statements, Some(60.0));
    assert_eq!(coverage.branches, Some(50.0));
    assert_eq!(coverage.functions, Some(62.5));
    assert_eq!(coverage.files.get("src/unused.js"), Some(&0.0));
    assert_eq!(coverage.files.get("src/math.js"), Some(&71.42));
    for flag in [
        "--ci",
        "--json",
        "--testLocationInResults",
        "--forceExit",
        "--testTimeout=60000",
    ] {
        assert!(report.command.iter().any(|a| a == flag), "{flag}");
    }
    assert!(report.command[0].ends_with("node_modules/.bin/jest"));

    let run_file = read_json(&report_file(&report, "run-1.json"));
    assert_eq!(run_file["framework"], "jest");
    assert_eq!(run_file["outcome"], "tests_failed");
    assert_eq!(run_file["passed"], false);
    assert_eq!(run_file["total"], 6);
    assert_eq!(run_file["exit_code"], 1);
    assert_eq!(run_file["coverage"], 64.28);
    assert_eq!(run_file["failures"].as_array().expect("failures").len(), 2);
    assert_eq!(run_file["defect_patterns"], serde_json::json!(["null_ref"]));
    assert!(
        run_file["failure_summary"]
            .as_str()
            .expect("summary")
            .starts_with("2 failing: ")
    );
    service.stop().await;
}

#[tokio::test]
async fn vitest_baseline_is_reported_as_vitest_reports_it() {
    let repo = fixture_repo("vitest-proj", &[], &[], None);
    let service = start().await;
    let report = run_tests(&service, js_request(repo.path()))
        .await
        .expect("run");

    assert_eq!(report.framework(), TestFramework::Vitest);
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
    assert_matches_framework_reports(&report);
    let math = failure(&report, "math divides numbers (assertion failure)");
    assert_eq!(
        (math.file.as_str(), math.line, math.test_line),
        ("tests/math.test.ts", 14, 13)
    );
    assert_eq!(
        math.message,
        "AssertionError: expected 2.5 to be 2 // Object.is equality"
    );
    assert_eq!(troupe_proto::names::name(math.criticality()), "high");
    let thrown = failure(&report, "parseUser handles missing name (thrown error)");
    assert_eq!((thrown.line, thrown.test_line), (9, 8));
    assert_eq!(thrown.error_origin, "src/strings.ts:7");
    // Seen when running vitest 4.1.12's documented command in the fixture directly.
    let coverage = report.coverage.clone().expect("coverage");
    assert_eq!(coverage.lines, Some(63.63));
    assert_eq!(coverage.statements, Some(58.33));
    assert_eq!(coverage.branches, Some(50.0));
    assert_eq!(coverage.functions, Some(62.5));
    assert_eq!(coverage.files.get("src/unused.ts"), Some(&0.0));
    for flag in [
        "run",
        "--reporter=json",
        "--includeTaskLocation",
        "--coverage.reportOnFailure",
    ] {
        assert!(report.command.iter().any(|a| a == flag), "{flag}");
    }
    service.stop().await;
}

#[tokio::test]
async fn files_that_fail_to_load_are_load_errors() {
    let service = start().await;
    for (fixture, scenario, dest, needle, line) in [
        (
            "jest-proj",
            "syntax.test.js.txt",
            "tests/syntax.test.js",
            "SyntaxError",
            2,
        ),
        (
            "jest-proj",
            "importerr.test.js.txt",
            "tests/importerr.test.js",
            "Cannot find module './does-not-exist'",
            1,
        ),
        (
            "vitest-proj",
            "syntax.test.ts.txt",
            "tests/syntax.test.ts",
            "Transform failed with 1 error: [PARSE_ERROR] Expected `,` or `)` but found `;`",
            4,
        ),
        (
            "vitest-proj",
            "importerr.test.ts.txt",
            "tests/importerr.test.ts",
            "Cannot find module './does-not-exist'",
            0,
        ),
    ] {
        let repo = fixture_repo(fixture, &[], &[(scenario, dest)], None);
        let report = run_tests(&service, js_request(repo.path()))
            .await
            .expect("run");
        assert_eq!(
            report.outcome(),
            TestOutcome::LoadError,
            "{scenario}: {report:#?}"
        );
        // The other files still ran: jest and vitest keep going past a broken file.
        let totals = report.totals.expect("totals");
        assert_eq!((totals.total, totals.failed), (6, 2), "{scenario}");
        let broken = &report.failures[0];
        assert_eq!(broken.file, dest, "{scenario}");
        assert_eq!(troupe_proto::names::name(broken.criticality()), "critical");
        assert!(
            broken.message.contains(needle),
            "{scenario}: {}",
            broken.message
        );
        assert!(!broken.message.contains('\u{1b}'), "{}", broken.message);
        if line > 0 {
            assert_eq!(broken.line, line, "{scenario}: {broken:#?}");
        }
    }
    service.stop().await;
}

#[tokio::test]
async fn a_synchronous_infinite_loop_is_killed_at_the_wall_clock() {
    let pid_dirs = tempfile::tempdir().expect("pid dirs");
    let service = super::start_granting(&[pid_dirs.path()]).await;
    for (fixture, scenario, dest) in [
        ("jest-proj", "hang.test.js.txt", "tests/hang.test.js"),
        ("vitest-proj", "hang.test.ts.txt", "tests/hang.test.ts"),
    ] {
        let pids = tempfile::tempdir_in(pid_dirs.path()).expect("pid dir");
        let pid_file = pids.path().join("pids");
        let repo = fixture_repo(fixture, &[], &[(scenario, dest)], Some(&pid_file));
        let mut req = js_request(repo.path());
        req.timeout_seconds = 8;
        let started = std::time::Instant::now();
        let report = run_tests(&service, req).await.expect("run");
        assert_eq!(report.outcome(), TestOutcome::Timeout, "{report:#?}");
        assert_eq!(report.exit_code, -1);
        assert!(started.elapsed().as_secs() < 30, "{:?}", started.elapsed());
        let text = std::fs::read_to_string(&pid_file).expect("the hanging test started");
        let pids: Vec<u32> = text
            .split_whitespace()
            .map(|p| p.parse().expect("pid"))
            .collect();
        assert!(!pids.is_empty());
        for pid in pids {
            assert!(gone(pid), "{fixture}: test process {pid} survived");
        }
    }
    service.stop().await;
}

#[tokio::test]
async fn when_every_test_times_out_the_timeout_is_raised_once() {
    let service = start().await;
    for (fixture, remove, scenario, dest) in [
        (
            "jest-proj",
            ["tests/math.test.js", "tests/strings.test.js"],
            "slow.test.js.txt",
            "tests/slow.test.js",
        ),
        (
            "vitest-proj",
            ["tests/math.test.ts", "tests/strings.test.ts"],
            "slow.test.ts.txt",
            "tests/slow.test.ts",
        ),
    ] {
        let repo = fixture_repo(fixture, &remove, &[(scenario, dest)], None);
        let mut req = js_request(repo.path());
        req.test_timeout_seconds = 1;
        let report = run_tests(&service, req).await.expect("run");
        assert_eq!(report.outcome(), TestOutcome::Passed, "{report:#?}");
        assert!(report.timeout_retried);
        assert_eq!(report.test_timeout_seconds, 4);
        assert!(report.command.iter().any(|a| a == "--testTimeout=4000"));
        assert!(
            report
                .warnings
                .iter()
                .any(|w| w.contains("every test timed out at 1s")),
            "{:?}",
            report.warnings
        );
    }
    service.stop().await;
}

#[tokio::test]
async fn monorepo_projects_run_as_one_suite() {
    let service = start().await;
    let jest_modules = super::support::fixture_dir("jest-proj").join("node_modules");
    let vitest_modules = super::support::fixture_dir("vitest-proj").join("node_modules");
    let jest_pkg = |name: &str, pass: bool| {
        vec![
            (
                format!("packages/{name}/package.json"),
                format!(r#"{{"name": "{name}", "private": true}}"#),
            ),
            (
                format!("packages/{name}/jest.config.js"),
                format!("module.exports = {{ displayName: '{name}', testEnvironment: 'node' }};\n"),
            ),
            (
                format!("packages/{name}/index.test.js"),
                format!(
                    "test('{name} works', () => {{\n  expect(1 + 1).toBe({});\n}});\n",
                    if pass { 2 } else { 3 }
                ),
            ),
        ]
    };
    let mut files = vec![
        (
            "package.json".to_owned(),
            r#"{"private": true, "workspaces": ["packages/*"], "devDependencies": {"jest": "30.5.2"}}"#.to_owned(),
        ),
        (
            "jest.config.js".to_owned(),
            "module.exports = { projects: ['<rootDir>/packages/*'] };\n".to_owned(),
        ),
        (".gitignore".to_owned(), "node_modules\n".to_owned()),
    ];
    files.extend(jest_pkg("a", true));
    files.extend(jest_pkg("b", false));
    let jest = tempfile::tempdir().expect("tempdir");
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(p, c)| (p.as_str(), c.as_str()))
        .collect();
    troupe_testkit::git_repo(jest.path(), &refs).expect("repo");
    std::os::unix::fs::symlink(&jest_modules, jest.path().join("node_modules")).expect("link");
    let report = run_tests(&service, js_request(jest.path()))
        .await
        .expect("run");
    assert_eq!(report.framework(), TestFramework::Jest);
    assert_eq!(
        report.totals,
        Some(TestTotals {
            total: 2,
            passed: 1,
            failed: 1,
            skipped: 0,
            errors: 0
        }),
        "{report:#?}"
    );
    assert_eq!(report.failures[0].file, "packages/b/index.test.js");

    let vitest = tempfile::tempdir().expect("tempdir");
    let pkg = |name: &str, pass: bool| {
        vec![
            (
                format!("packages/{name}/vitest.config.ts"),
                format!(
                    "import {{ defineProject }} from 'vitest/config';\nexport default defineProject({{ test: {{ name: '{name}' }} }});\n"
                ),
            ),
            (
                format!("packages/{name}/index.test.ts"),
                format!(
                    "import {{ expect, test }} from 'vitest';\n\ntest('{name} works', () => {{\n  expect(1 + 1).toBe({});\n}});\n",
                    if pass { 2 } else { 3 }
                ),
            ),
        ]
    };
    let mut files = vec![
        (
            "package.json".to_owned(),
            r#"{"private": true, "type": "module", "devDependencies": {"vitest": "4.1.12"}}"#
                .to_owned(),
        ),
        (
            "vitest.config.ts".to_owned(),
            "import { defineConfig } from 'vitest/config';\nexport default defineConfig({ test: { projects: ['packages/*'] } });\n".to_owned(),
        ),
        (".gitignore".to_owned(), "node_modules\n".to_owned()),
    ];
    files.extend(pkg("a", true));
    files.extend(pkg("b", false));
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(p, c)| (p.as_str(), c.as_str()))
        .collect();
    troupe_testkit::git_repo(vitest.path(), &refs).expect("repo");
    std::os::unix::fs::symlink(&vitest_modules, vitest.path().join("node_modules")).expect("link");
    let report = run_tests(&service, js_request(vitest.path()))
        .await
        .expect("run");
    assert_eq!(report.framework(), TestFramework::Vitest);
    assert_eq!(
        report.totals,
        Some(TestTotals {
            total: 2,
            passed: 1,
            failed: 1,
            skipped: 0,
            errors: 0
        }),
        "{report:#?}"
    );
    assert_eq!(report.failures[0].file, "packages/b/index.test.ts");
    service.stop().await;
}

#[tokio::test]
async fn install_uses_npm_once_and_then_the_cache() {
    let repo = fixture_repo("vitest-proj", &[], &[], None);
    // A checkout with nothing installed: the runner installs from package-lock.json.
    std::fs::remove_file(repo.path().join("node_modules")).expect("unlink");
    let service = start().await;
    let mut req = js_request(repo.path());
    req.install = true;
    let first = run_tests(&service, req.clone()).await.expect("run");
    assert_eq!(first.outcome(), TestOutcome::TestsFailed, "{first:#?}");
    assert_eq!(first.totals.expect("totals").total, 6);
    assert!(
        first
            .warnings
            .iter()
            .any(|w| w.starts_with("installed node_modules with `npm")
                || w.starts_with("reused the node_modules cached")),
        "{:?}",
        first.warnings
    );
    assert!(first.warnings.iter().any(|w| w == "package manager: npm"));
    let second = run_tests(&service, req).await.expect("run");
    assert!(
        second
            .warnings
            .iter()
            .any(|w| w.starts_with("reused the node_modules cached")),
        "{:?}",
        second.warnings
    );
    assert_eq!(second.totals, first.totals);
    service.stop().await;
}

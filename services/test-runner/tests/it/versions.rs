//! Older framework versions run with the flags they accept (Jest 22: no `--testTimeout`;
//! Vitest 1: no `--includeTaskLocation`), and their numbers equal the framework's own, run
//! directly with the same flags on a clean checkout of the same commit, before and after a
//! one-line bug in a task's commit.

use std::collections::BTreeMap;
use std::path::Path;

use troupe_proto::v1::{RunTestsRequest, TestOutcome, TestRunReport};

use super::support::{checkout_of, commit_on_branch, fixture_dir, fixture_repo, read_json, run};
use super::{run_tests, start};

/// The framework run directly in `dir` with `flags`; returns results.json and the coverage
/// summary.
fn directly(dir: &Path, tool: &str, flags: &[&str]) -> (serde_json::Value, serde_json::Value) {
    let out = tempfile::tempdir().expect("tempdir");
    let results = out.path().join("results.json");
    let coverage = out.path().join("coverage");
    let mut args: Vec<String> = flags.iter().map(|f| (*f).to_owned()).collect();
    args.push(format!("--outputFile={}", results.display()));
    if tool == "jest" {
        args.push(format!("--coverageDirectory={}", coverage.display()));
    } else {
        args.push(format!(
            "--coverage.reportsDirectory={}",
            coverage.display()
        ));
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let output = run(
        &dir.join("node_modules/.bin").join(tool),
        &args,
        dir,
        &[("CI", "true".to_owned()), ("NO_COLOR", "1".to_owned())],
    );
    assert!(results.is_file(), "{tool} wrote no results: {output:?}");
    (
        read_json(&results),
        read_json(&coverage.join("coverage-summary.json")),
    )
}

fn failing(results: &serde_json::Value) -> Vec<String> {
    let mut names: Vec<String> = results["testResults"]
        .as_array()
        .expect("testResults")
        .iter()
        .flat_map(|file| {
            file["assertionResults"]
                .as_array()
                .expect("assertions")
                .iter()
        })
        .filter(|t| t["status"] == "failed")
        .map(|t| t["fullName"].as_str().expect("name").to_owned())
        .collect();
    names.sort();
    names
}

fn assert_same(report: &TestRunReport, results: &serde_json::Value, summary: &serde_json::Value) {
    let totals = report.totals.expect("totals");
    assert_eq!(
        u64::from(totals.total),
        results["numTotalTests"],
        "{report:#?}"
    );
    assert_eq!(u64::from(totals.passed), results["numPassedTests"]);
    assert_eq!(u64::from(totals.failed), results["numFailedTests"]);
    let mut ours: Vec<String> = report.failures.iter().map(|f| f.name.clone()).collect();
    ours.sort();
    assert_eq!(ours, failing(results));
    let coverage = report.coverage.clone().expect("coverage");
    assert_eq!(coverage.lines, summary["total"]["lines"]["pct"].as_f64());
    assert_eq!(
        coverage.statements,
        summary["total"]["statements"]["pct"].as_f64()
    );
}

#[tokio::test]
async fn jest_22_and_vitest_1_run_with_the_flags_they_accept() {
    let service = start().await;
    for (fixture, tool, version, flags, refused, file) in [
        (
            "jest22-proj",
            "jest",
            "22.4.4",
            vec![
                "--ci",
                "--json",
                "--testLocationInResults",
                "--coverage",
                "--coverageReporters=json-summary",
                "--forceExit",
            ],
            "--testTimeout",
            "src/math.js",
        ),
        (
            "vitest1-proj",
            "vitest",
            "1.6.1",
            vec![
                "run",
                "--reporter=json",
                "--coverage.enabled",
                "--coverage.provider=v8",
                "--coverage.reporter=json-summary",
                "--coverage.reportOnFailure",
                "--testTimeout=60000",
            ],
            "--includeTaskLocation",
            "src/math.ts",
        ),
    ] {
        let repo = fixture_repo(fixture, &[], &[], None);
        let installed = fixture_dir(fixture).join("node_modules");
        let task = commit_on_branch(
            repo.path(),
            "task",
            &[(file, "return a + b;", "return a - b;")],
        );
        for rev in ["main", task.as_str()] {
            let direct = checkout_of(repo.path(), rev);
            let dir = direct.path().join("co");
            std::os::unix::fs::symlink(&installed, dir.join("node_modules")).expect("link");
            let (results, summary) = directly(&dir, tool, &flags);
            let report = run_tests(
                &service,
                RunTestsRequest {
                    repo_path: repo.path().display().to_string(),
                    r#ref: rev.to_owned(),
                    ..RunTestsRequest::default()
                },
            )
            .await
            .expect("run");
            assert_eq!(
                report.outcome(),
                TestOutcome::TestsFailed,
                "{fixture} {rev}: {report:#?}"
            );
            assert_eq!(report.framework_version, version, "{fixture}");
            assert!(
                !report.command.iter().any(|a| a.starts_with(refused)),
                "{fixture}: {:?}",
                report.command
            );
            assert_same(&report, &results, &summary);
            // Failure lines are in the test file they name, or unknown (Vitest 1 says nothing).
            let lines: BTreeMap<String, (String, u32)> = report
                .failures
                .iter()
                .map(|f| (f.name.clone(), (f.file.clone(), f.line)))
                .collect();
            for (name, (file, line)) in &lines {
                assert!(file.starts_with("tests/"), "{fixture}: {name} in {file}");
                if tool == "jest" {
                    assert!(*line > 0, "{fixture}: {name}");
                }
            }
            if rev != "main" {
                // The bug in the task's commit shows: one more failing test than on main.
                assert_eq!(report.failures.len(), 3, "{fixture}: {lines:?}");
            }
        }
    }
    service.stop().await;
}

#[tokio::test]
async fn jest_30_with_ts_jest_reports_typescript_lines() {
    let repo = fixture_repo("jest-ts-proj", &[], &[], None);
    let installed = fixture_dir("jest-ts-proj").join("node_modules");
    let task = commit_on_branch(
        repo.path(),
        "task",
        &[
            ("src/money.ts", "(100 - percent)", "(100 + percent)"),
            ("src/money.ts", "(\\d{2})$", "(\\d{3})$"),
        ],
    );
    let direct = checkout_of(repo.path(), &task);
    let dir = direct.path().join("co");
    std::os::unix::fs::symlink(&installed, dir.join("node_modules")).expect("link");
    let (results, summary) = directly(
        &dir,
        "jest",
        &[
            "--ci",
            "--json",
            "--testLocationInResults",
            "--coverage",
            "--coverageReporters=json-summary",
            "--forceExit",
        ],
    );
    let service = start().await;
    let report = run_tests(
        &service,
        RunTestsRequest {
            repo_path: repo.path().display().to_string(),
            r#ref: task.clone(),
            ..RunTestsRequest::default()
        },
    )
    .await
    .expect("run");
    assert_eq!(report.outcome(), TestOutcome::TestsFailed, "{report:#?}");
    assert_same(&report, &results, &summary);
    let lines: BTreeMap<&str, (u32, u32, &str)> = report
        .failures
        .iter()
        .map(|f| {
            (
                f.name.as_str(),
                (f.line, f.test_line, f.error_origin.as_str()),
            )
        })
        .collect();
    // TypeScript lines (ts-jest's source maps), in the test file; a throw in the source is its
    // origin, never the failure line.
    assert_eq!(
        lines.get("money a quarter off"),
        Some(&(10, 9, "tests/money.test.ts:10"))
    );
    assert_eq!(
        lines.get("money parses an amount"),
        Some(&(14, 13, "src/money.ts:20"))
    );
    assert!(
        report.framework_version.starts_with("30."),
        "{}",
        report.framework_version
    );
    service.stop().await;
}

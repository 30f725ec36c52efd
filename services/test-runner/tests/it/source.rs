//! Never a false green: the suite tests the commit asked for, not the user's checkout.
//!
//! Each test makes a repository whose checkout (on `main`, left clean) has the project
//! installed the way developers do it (an npm workspace's `node_modules` with workspace links,
//! a src-layout package installed editable), commits a one-line bug on a task branch only,
//! runs the framework directly on a clean checkout of that commit, and then troupe: the
//! numbers must be the framework's, the bug must show, and code that can only come from
//! elsewhere is WRONG_SOURCE with its path named.

use std::collections::BTreeMap;
use std::path::Path;

use troupe_proto::v1::{RunTestsRequest, TestFramework, TestOutcome, TestRunReport, TestTotals};
use troupe_testkit::git;

use super::support::{
    checkout_of, commit_on_branch, editable_interpreter, fixture_dir, fixture_repo,
    npm_like_modules, read_json, run, tools_python,
};
use super::{run_tests, start};

const WORKSPACE_LINKS: &[(&str, &str)] =
    &[("@fx/a", "../../packages/a"), ("@fx/b", "../../packages/b")];

/// Jest's documented command run directly in `dir`; returns results.json and the coverage
/// summary.
fn jest_directly(dir: &Path) -> (serde_json::Value, serde_json::Value) {
    let out = tempfile::tempdir().expect("tempdir");
    let jest = dir.join("node_modules/.bin/jest");
    let results = out.path().join("results.json");
    let coverage = out.path().join("coverage");
    let output = run(
        &jest,
        &[
            "--ci",
            "--json",
            "--testLocationInResults",
            &format!("--outputFile={}", results.display()),
            "--coverage",
            "--coverageReporters=json-summary",
            &format!("--coverageDirectory={}", coverage.display()),
            "--forceExit",
        ],
        dir,
        &[("CI", "true".to_owned()), ("NO_COLOR", "1".to_owned())],
    );
    assert!(results.is_file(), "jest wrote no results: {output:?}");
    (
        read_json(&results),
        read_json(&coverage.join("coverage-summary.json")),
    )
}

/// Failing tests by name with their declaration line, from a Jest results file.
fn failing(results: &serde_json::Value) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for file in results["testResults"].as_array().expect("testResults") {
        for test in file["assertionResults"].as_array().expect("assertions") {
            if test["status"] == "failed" {
                out.insert(
                    test["fullName"].as_str().expect("name").to_owned(),
                    test["location"]["line"].as_u64().unwrap_or(0),
                );
            }
        }
    }
    out
}

fn assert_same_as_jest(
    report: &TestRunReport,
    results: &serde_json::Value,
    summary: &serde_json::Value,
) {
    let totals = report.totals.expect("totals");
    assert_eq!(
        u64::from(totals.total),
        results["numTotalTests"],
        "{report:#?}"
    );
    assert_eq!(u64::from(totals.passed), results["numPassedTests"]);
    assert_eq!(u64::from(totals.failed), results["numFailedTests"]);
    let ours: BTreeMap<String, u64> = report
        .failures
        .iter()
        .map(|f| (f.name.clone(), u64::from(f.test_line)))
        .collect();
    assert_eq!(ours, failing(results));
    let coverage = report.coverage.clone().expect("coverage");
    assert_eq!(coverage.lines, summary["total"]["lines"]["pct"].as_f64());
    assert_eq!(
        coverage.branches,
        summary["total"]["branches"]["pct"].as_f64()
    );
}

fn request(repo: &Path, rev: &str) -> RunTestsRequest {
    RunTestsRequest {
        repo_path: repo.display().to_string(),
        r#ref: rev.to_owned(),
        ..RunTestsRequest::default()
    }
}

#[tokio::test]
async fn npm_workspace_links_resolve_to_the_tested_commit() {
    let installed = fixture_dir("jest-proj").join("node_modules");
    let repo = fixture_repo("npm-workspace", &[], &[], None);
    // The user's checkout: installed with workspace links into itself.
    npm_like_modules(repo.path(), &installed, WORKSPACE_LINKS);
    let task = commit_on_branch(
        repo.path(),
        "task",
        &[(
            "packages/a/src/index.js",
            "(100 - percent)",
            "(100 + percent)",
        )],
    );
    // The framework itself, on a clean checkout of the task's commit.
    let direct = checkout_of(repo.path(), &task);
    let direct_dir = direct.path().join("co");
    npm_like_modules(&direct_dir, &installed, WORKSPACE_LINKS);
    let (results, summary) = jest_directly(&direct_dir);
    assert_eq!(
        results["numFailedTests"], 1,
        "the bug shows when run directly"
    );

    let service = start().await;
    let report = run_tests(&service, request(repo.path(), "task"))
        .await
        .expect("run");
    assert_eq!(report.framework(), TestFramework::Jest);
    assert_eq!(report.outcome(), TestOutcome::TestsFailed, "{report:#?}");
    assert_eq!(report.commit, task);
    assert_same_as_jest(&report, &results, &summary);
    let failure = &report.failures[0];
    assert_eq!(failure.name, "checkout applies a discount");
    assert_eq!(failure.file, "packages/b/test/checkout.test.js");
    assert!(
        report.outside_paths.is_empty(),
        "{:?}",
        report.outside_paths
    );
    // Coverage names the worktree's files, repo-relative, never the checkout's.
    let coverage = report.coverage.clone().expect("coverage");
    assert!(
        coverage.files.contains_key("packages/a/src/index.js"),
        "{:?}",
        coverage.files
    );
    // Per workspace package counts.
    let projects: Vec<(String, u32, u32)> = report
        .projects
        .iter()
        .map(|p| {
            let t = p.totals.unwrap_or_default();
            (p.name.clone(), t.total, t.failed)
        })
        .collect();
    assert_eq!(
        projects,
        [("@fx/a".to_owned(), 1, 0), ("@fx/b".to_owned(), 3, 1)]
    );

    // The checkout's own commit passes, and the checkout was not touched.
    let main = run_tests(&service, request(repo.path(), "main"))
        .await
        .expect("run");
    assert_eq!(main.outcome(), TestOutcome::Passed, "{main:#?}");
    assert_eq!(
        main.totals,
        Some(TestTotals {
            total: 4,
            passed: 4,
            ..TestTotals::default()
        })
    );
    assert_eq!(
        git(repo.path(), &["status", "--porcelain"]).expect("status"),
        ""
    );
    assert_eq!(
        git(repo.path(), &["rev-parse", "--abbrev-ref", "HEAD"])
            .expect("head")
            .trim(),
        "main"
    );

    // A workspace link that points at another copy of the package cannot be re-made inside the
    // worktree: the run refuses to claim numbers, naming the link.
    let elsewhere = tempfile::tempdir().expect("tempdir");
    let copy = elsewhere.path().join("a");
    std::fs::create_dir_all(copy.join("src")).expect("mkdir");
    for file in ["package.json", "src/index.js"] {
        std::fs::copy(repo.path().join("packages/a").join(file), copy.join(file)).expect("copy");
    }
    let link = repo.path().join("node_modules/@fx/a");
    std::fs::remove_file(&link).expect("unlink");
    std::os::unix::fs::symlink(&copy, &link).expect("link");
    let wrong = run_tests(&service, request(repo.path(), "task"))
        .await
        .expect("run");
    assert_eq!(wrong.outcome(), TestOutcome::WrongSource, "{wrong:#?}");
    assert!(
        wrong
            .outside_paths
            .iter()
            .any(|p| p.contains("@fx/a ->") && p.contains(&copy.display().to_string())),
        "{:?}",
        wrong.outside_paths
    );
    assert!(wrong.warnings.iter().any(|w| w.starts_with("wrong source")));
    service.stop().await;
}

/// pytest's documented command run directly in `dir` with `python`; returns the json report
/// and coverage.py's JSON.
fn pytest_directly(
    python: &Path,
    dir: &Path,
    env: &[(&str, String)],
) -> (serde_json::Value, serde_json::Value) {
    let out = tempfile::tempdir().expect("tempdir");
    let report = out.path().join("report.json");
    let coverage = out.path().join("coverage.json");
    let mut env = env.to_vec();
    env.push((
        "COVERAGE_FILE",
        out.path().join(".coverage").display().to_string(),
    ));
    let output = run(
        python,
        &[
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--json-report",
            &format!("--json-report-file={}", report.display()),
            "--cov=pricing",
            "--cov-branch",
            &format!("--cov-report=json:{}", coverage.display()),
        ],
        dir,
        &env,
    );
    assert!(report.is_file(), "pytest wrote no report: {output:?}");
    (read_json(&report), read_json(&coverage))
}

fn failing_nodeids(report: &serde_json::Value) -> Vec<String> {
    report["tests"]
        .as_array()
        .expect("tests")
        .iter()
        .filter(|t| t["outcome"] == "failed")
        .map(|t| t["nodeid"].as_str().expect("nodeid").to_owned())
        .collect()
}

#[tokio::test]
async fn an_editable_install_of_the_checkout_does_not_answer_for_the_commit() {
    let repo = fixture_repo("pysrc-proj", &[], &[], None);
    let scratch = tempfile::tempdir().expect("tempdir");
    // The user's interpreter has the checkout installed editable.
    let python = editable_interpreter(scratch.path(), repo.path());
    let task = commit_on_branch(
        repo.path(),
        "task",
        &[("src/pricing/cart.py", "(100 - percent)", "(100 + percent)")],
    );
    let direct = checkout_of(repo.path(), &task);
    let direct_dir = direct.path().join("co");
    // That interpreter alone tests the checkout: green on the buggy commit.
    let (fooled, _) = pytest_directly(&python, &direct_dir, &[]);
    assert_eq!(
        fooled["summary"]["failed"],
        serde_json::Value::Null,
        "{fooled}"
    );
    // The framework at the commit, its own code on the path: the bug shows.
    let src = direct_dir.join("src").display().to_string();
    let (results, coverage) = pytest_directly(&tools_python(), &direct_dir, &[("PYTHONPATH", src)]);
    assert_eq!(
        failing_nodeids(&results),
        ["tests/test_cart.py::test_discount_applies_percent"]
    );

    let service = start().await;
    let mut req = request(repo.path(), "task");
    req.python = python.display().to_string();
    req.framework = TestFramework::Pytest as i32;
    let report = run_tests(&service, req).await.expect("run");
    assert_eq!(report.outcome(), TestOutcome::TestsFailed, "{report:#?}");
    let names: Vec<&str> = report.failures.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, failing_nodeids(&results));
    let totals = report.totals.expect("totals");
    assert_eq!(u64::from(totals.total), results["summary"]["total"]);
    assert_eq!(u64::from(totals.passed), results["summary"]["passed"]);
    // Line coverage as coverage.py computes it, on the worktree's files.
    let ours = report.coverage.clone().expect("coverage");
    let theirs = coverage["totals"]["percent_statements_covered"]
        .as_f64()
        .expect("percent");
    assert!((ours.lines.expect("lines") - theirs).abs() < 1e-9);
    assert!(
        ours.files.contains_key("src/pricing/cart.py"),
        "{:?}",
        ours.files
    );
    assert!(
        report.command.iter().any(|a| a == "--cov=pricing"),
        "{:?}",
        report.command
    );
    assert_eq!(
        report.env.get("PYTHONPATH").map(|p| p.ends_with("/src")),
        Some(true)
    );
    assert_eq!(report.python, python.display().to_string());
    service.stop().await;
}

#[tokio::test]
async fn a_package_imported_from_another_checkout_is_wrong_source() {
    let dir = tempfile::tempdir().expect("tempdir");
    troupe_testkit::git_repo(
        dir.path(),
        &[
            (
                "packages/core/pyproject.toml",
                "[build-system]\nrequires = [\"setuptools>=61\"]\nbuild-backend = \"setuptools.build_meta\"\n\n[project]\nname = \"core\"\nversion = \"0.1.0\"\n\n[tool.setuptools.package-dir]\n\"\" = \"lib\"\n",
            ),
            ("packages/core/lib/core/__init__.py", "def double(x):\n    return x * 2\n"),
            ("packages/app/src/app/__init__.py", "from core import double\n\n\ndef quad(x):\n    return double(double(x))\n"),
            ("packages/app/tests/test_app.py", "from app import quad\n\n\ndef test_quad():\n    assert quad(2) == 8\n"),
            (".gitignore", "*.egg-info\n__pycache__\n"),
        ],
    )
    .expect("repo");
    let scratch = tempfile::tempdir().expect("tempdir");
    let python = editable_interpreter(scratch.path(), &dir.path().join("packages/core"));
    let service = start().await;
    let mut req = request(dir.path(), "HEAD");
    req.python = python.display().to_string();
    req.workdir = "packages/app".to_owned();
    req.framework = TestFramework::Pytest as i32;
    let report = run_tests(&service, req).await.expect("run");
    assert_eq!(report.outcome(), TestOutcome::WrongSource, "{report:#?}");
    let expected = format!(
        "core: {}",
        std::fs::canonicalize(dir.path().join("packages/core/lib/core"))
            .expect("canonical")
            .display()
    );
    assert_eq!(report.outside_paths, [expected]);
    assert_eq!(report.workdir, "packages/app");
    assert!(report.totals.is_none() || report.totals.expect("totals").total == 0);
    service.stop().await;
}

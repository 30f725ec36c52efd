//! The fix loop with fake fixing agents: a small Python script run by the `command` backend
//! that replaces text in files of the worktree (`edit.py <worktree> <path> <old> <new> ...`).

use std::path::{Path, PathBuf};

use troupe_proto::v1::{FixOptions, FixScope, RunTestsRequest, TestOutcome};
use troupe_testkit::git;

use super::support::{fixture_repo, read_json, report_file};
use super::{run_tests, start};

pub(crate) const EDIT_AGENT: &str = r#"import sys
worktree, edits = sys.argv[1], sys.argv[2:]
prompt = sys.stdin.read()
assert "PURPOSE: Fix failing tests" in prompt, prompt
for i in range(0, len(edits), 3):
    path, old, new = edits[i:i + 3]
    full = f"{worktree}/{path}"
    text = open(full).read()
    assert old in text, (path, old)
    open(full, "w").write(text.replace(old, new))
"#;

fn agent(dir: &Path) -> PathBuf {
    let path = dir.join("edit.py");
    std::fs::write(&path, EDIT_AGENT).expect("agent");
    path
}

fn fix_request(
    repo: &Path,
    agent: &Path,
    edits: &[&str],
    scope: FixScope,
    max_iterations: u32,
) -> RunTestsRequest {
    let mut command = vec![
        "python3".to_owned(),
        agent.display().to_string(),
        "{worktree}".to_owned(),
    ];
    command.extend(edits.iter().map(|s| (*s).to_owned()));
    RunTestsRequest {
        repo_path: repo.display().to_string(),
        install: true,
        max_iterations,
        fix: Some(FixOptions {
            backend: "command".to_owned(),
            command,
            scope: scope as i32,
            timeout_seconds: 60,
            fallback: Vec::new(),
        }),
        ..RunTestsRequest::default()
    }
}

#[tokio::test]
async fn a_fix_that_breaks_a_passing_test_is_reverted() {
    let repo = fixture_repo("pytest-proj", &[], &[], None);
    let tools = tempfile::tempdir().expect("tempdir");
    let agent = agent(tools.path());
    let service = start().await;
    let req = fix_request(
        repo.path(),
        &agent,
        &["tests/test_strings.py", "== \"HI!\"", "== \"NOPE\""],
        FixScope::Tests,
        1,
    );
    let report = run_tests(&service, req).await.expect("run");

    let fix = report.fix_loop.clone().expect("fix loop ran");
    assert!(!fix.succeeded);
    assert_eq!(fix.iterations.len(), 1);
    let step = &fix.iterations[0];
    assert_eq!(step.verdict, "reverted_worse", "{step:#?}");
    assert_eq!(step.strategy, "conservative");
    assert_eq!(step.new_failures, ["tests/test_strings.py::test_shouts"]);
    assert!(!step.commit.is_empty());
    // Affected tests ran first: the changed test file itself.
    assert!(
        step.affected_command
            .iter()
            .any(|a| a == "tests/test_strings.py"),
        "{:?}",
        step.affected_command
    );
    assert!(fix.final_commit.is_empty());
    // The report is the state before the reverted fix: the two original failures only.
    assert_eq!(report.outcome(), TestOutcome::TestsFailed);
    let names: Vec<&str> = report.failures.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "tests/test_mathops.py::TestMath::test_divides_numbers_assertion_failure",
            "tests/test_strings.py::test_parse_user_missing_name_thrown_error"
        ]
    );
    let run_file = read_json(&report_file(&report, "run-1.json"));
    assert_eq!(
        run_file["fix_loop"]["iterations"][0]["verdict"],
        "reverted_worse"
    );
    assert_eq!(run_file["iterations"], 2);
    service.stop().await;
}

#[tokio::test]
async fn edits_outside_the_fix_scope_are_refused() {
    let repo = fixture_repo("pytest-proj", &[], &[], None);
    let tools = tempfile::tempdir().expect("tempdir");
    let agent = agent(tools.path());
    let service = start().await;
    // "Fixes" the failing assertion by changing the source, which a tests-only scope forbids.
    let req = fix_request(
        repo.path(),
        &agent,
        &["src/calc/mathops.py", "return a / b", "return a // b"],
        FixScope::Unspecified,
        2,
    );
    let report = run_tests(&service, req).await.expect("run");

    let fix = report.fix_loop.clone().expect("fix loop ran");
    assert_eq!(fix.scope(), FixScope::Unspecified);
    assert_eq!(fix.iterations.len(), 2);
    for step in &fix.iterations {
        assert_eq!(step.verdict, "reverted_out_of_scope", "{step:#?}");
        assert_eq!(step.out_of_scope_paths, ["src/calc/mathops.py"]);
        assert!(step.commit.is_empty());
        assert!(step.detail.contains("scope `tests`"), "{}", step.detail);
    }
    assert!(!fix.succeeded);
    assert_eq!(report.totals.expect("totals").failed, 2);
    service.stop().await;
}

#[tokio::test]
async fn flaky_tests_are_reported_and_a_good_fix_is_kept() {
    let markers = tempfile::tempdir().expect("tempdir");
    let marker = markers.path().join("flaky-ran");
    let repo = fixture_repo(
        "pytest-proj",
        &[],
        &[("test_flaky.py.txt", "tests/test_flaky.py")],
        Some(&marker),
    );
    let tools = tempfile::tempdir().expect("tempdir");
    let agent = agent(tools.path());
    let service = start().await;
    let req = fix_request(
        repo.path(),
        &agent,
        &[
            "tests/test_mathops.py",
            "divide(10, 4) == 2",
            "divide(10, 4) == 2.5",
            "tests/test_strings.py",
            "    user = parse_user('{\"age\": 3}')\n    assert user[\"age\"] == 3",
            "    import pytest\n\n    with pytest.raises(KeyError):\n        parse_user('{\"age\": 3}')",
        ],
        FixScope::Tests,
        3,
    );
    let report = run_tests(&service, req).await.expect("run");

    let fix = report.fix_loop.clone().expect("fix loop ran");
    assert_eq!(
        fix.flaky_tests,
        ["tests/test_flaky.py::test_fails_only_the_first_time"]
    );
    assert!(fix.succeeded, "{fix:#?}");
    assert_eq!(fix.iterations.len(), 1);
    let step = &fix.iterations[0];
    assert_eq!(step.verdict, "kept", "{step:#?}");
    assert!((step.pass_rate - 1.0).abs() < f64::EPSILON);
    assert_eq!(fix.final_commit, step.commit);
    assert_eq!(fix.pass_rate_history.len(), 2);
    assert_eq!(report.outcome(), TestOutcome::Passed, "{report:#?}");
    assert_eq!(report.commit, fix.final_commit);
    // The checkpoint is a commit in the repository, on top of the tested one, with the fix.
    let parent = git(
        repo.path(),
        &["rev-parse", &format!("{}^", fix.final_commit)],
    )
    .expect("parent");
    assert_eq!(
        parent.trim(),
        git(repo.path(), &["rev-parse", "HEAD"])
            .expect("head")
            .trim()
    );
    let fixed = git(
        repo.path(),
        &[
            "show",
            &format!("{}:tests/test_mathops.py", fix.final_commit),
        ],
    )
    .expect("show");
    assert!(fixed.contains("divide(10, 4) == 2.5"));
    assert!(
        report
            .warnings
            .iter()
            .any(|w| w.starts_with("flaky") && w.contains("test_fails_only_the_first_time")),
        "{:?}",
        report.warnings
    );
    service.stop().await;
}

#[tokio::test]
async fn jest_and_vitest_fixes_run_the_affected_tests_first() {
    let tools = tempfile::tempdir().expect("tempdir");
    let agent = agent(tools.path());
    let service = start().await;
    for (fixture, ext, related) in [
        ("jest-proj", "js", "--findRelatedTests"),
        ("vitest-proj", "ts", "related"),
    ] {
        let repo = fixture_repo(fixture, &[], &[], None);
        let math = format!("tests/math.test.{ext}");
        let strings = format!("tests/strings.test.{ext}");
        let mut req = fix_request(
            repo.path(),
            &agent,
            &[
                &math,
                "expect(divide(10, 4)).toBe(2);",
                "expect(divide(10, 4)).toBe(2.5);",
                &strings,
                "const user = parseUser('{\"age\": 3}');\n  expect(user.age).toBe(3);",
                "expect(() => parseUser('{\"age\": 3}')).toThrow(TypeError);",
            ],
            FixScope::Tests,
            3,
        );
        req.install = false;
        let report = run_tests(&service, req).await.expect("run");
        let fix = report.fix_loop.clone().expect("fix loop ran");
        assert!(fix.succeeded, "{fixture}: {fix:#?}");
        let step = &fix.iterations[0];
        assert_eq!(step.verdict, "kept");
        assert!(
            step.affected_command.iter().any(|a| a == related),
            "{fixture}: {:?}",
            step.affected_command
        );
        let affected = step.affected_totals.expect("affected totals");
        assert_eq!((affected.total, affected.failed), (6, 0), "{fixture}");
        assert_eq!(
            report.outcome(),
            TestOutcome::Passed,
            "{fixture}: {report:#?}"
        );
        let totals = report.totals.expect("totals");
        assert_eq!((totals.passed, totals.failed, totals.skipped), (5, 0, 1));
    }
    service.stop().await;
}

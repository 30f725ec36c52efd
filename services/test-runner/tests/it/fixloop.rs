//! The fix loop with fake fixing agents: a small Python script run by the `command` backend
//! that replaces text in files of the worktree (`edit.py <worktree> <path> <old> <new> ...`).

use std::path::{Path, PathBuf};

use troupe_proto::v1::{FixOptions, FixScope, RunTestsRequest, TestOutcome};
use troupe_testkit::git;

use super::support::{EDIT_AGENT, fixture_repo, read_json, report_file};
use super::{run_tests, start};

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
    assert_eq!(
        troupe_proto::names::name(step.verdict()),
        "reverted_worse",
        "{step:#?}"
    );
    assert_eq!(troupe_proto::names::name(step.strategy()), "conservative");
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
        assert_eq!(
            troupe_proto::names::name(step.verdict()),
            "reverted_out_of_scope",
            "{step:#?}"
        );
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
    let service = super::start_granting(&[markers.path()]).await;
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
    assert_eq!(
        troupe_proto::names::name(step.verdict()),
        "kept",
        "{step:#?}"
    );
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
        assert_eq!(troupe_proto::names::name(step.verdict()), "kept");
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

/// The CLI's program: on PATH, or where scripts/setup/50-agent-clis.sh installs it.
fn cli_program(name: &str) -> String {
    if troupe_process::which(name).is_some() {
        return name.to_owned();
    }
    let installed = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/tools/npm/bin")
        .join(name);
    assert!(
        installed.is_file(),
        "`{name}` is not installed: run scripts/setup/50-agent-clis.sh (scripts/test does)"
    );
    installed.display().to_string()
}

/// The executor's backend configuration file pointing `backend` at the scripted model server.
fn backends_toml(backend: &str, base: &str) -> String {
    let (endpoint, model) = match backend {
        "codex" => (format!("{base}/v1"), "gpt-5.5"),
        "claude" => (base.to_owned(), "fake-model"),
        // `-m` spares gemini its router call.
        "gemini" => (base.to_owned(), "gemini-2.5-flash"),
        _ => (format!("{base}/v1"), "fake-model"),
    };
    // The built-in `agent` loop is no program: it talks to the endpoint itself.
    let command = if backend == "agent" {
        String::new()
    } else {
        format!("command = {:?}\n", cli_program(backend))
    };
    format!(
        "fallback = []\nretries = 0\n\n[backends.{backend}]\n{command}model = {model:?}\nendpoint = {endpoint:?}\napi_key = \"fake-key\"\nfast_fail = true\ntimeout_seconds = 120\n"
    )
}

/// 199 passing tests and one whose expectation is wrong (the fix belongs in the test), plus
/// one test whose failure the scripted agent "fixes" in the source, outside a tests scope.
fn two_hundred_tests(dir: &Path, with_source_bait: bool) {
    let mut files = [
        ("calc/__init__.py".to_owned(), String::new()),
        (
            "calc/ops.py".to_owned(),
            "def add(a, b):\n    return a + b\n\n\ndef half(x):\n    return x / 2\n".to_owned(),
        ),
        (
            "tests/test_many.py".to_owned(),
            "import pytest\n\nfrom calc.ops import add\n\n\n@pytest.mark.parametrize('n', range(199))\ndef test_add(n):\n    assert add(n, 1) == n + 1\n".to_owned(),
        ),
        (
            "tests/test_edge.py".to_owned(),
            "from calc.ops import half\n\n\ndef test_half_of_three():\n    assert half(3) == 1\n".to_owned(),
        ),
    ];
    if with_source_bait {
        files[3].1 = "from calc.ops import half\n\n\ndef test_half_rounds_down():\n    assert half(3) == 1\n".to_owned();
    }
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(p, c)| (p.as_str(), c.as_str()))
        .collect();
    troupe_testkit::git_repo(dir, &refs).expect("repo");
}

async fn start_with_backends(toml: &str, dir: &Path) -> troupe_testkit::TestService {
    let file = dir.join("backends.toml");
    std::fs::write(&file, toml).expect("config");
    let config = troupe_test_runner::Config {
        listen: "127.0.0.1:0".parse().expect("address"),
        data_dir: super::data_dir(),
        coordinator_url: None,
        python: super::support::tools_python().display().to_string(),
        worker_id: None,
        concurrency: 1,
        backends_config: Some(file),
        worker: troupe_grpc::worker::WorkerTuning::default(),
        security: Default::default(),
        sandbox: Default::default(),
    };
    troupe_testkit::TestService::spawn(move |listener, shutdown| {
        troupe_test_runner::run(config, listener, shutdown)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_fixes_one_failure_in_two_hundred_within_scope() {
    fixes_one_failure_in_two_hundred_within_scope("codex").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_fixes_one_failure_in_two_hundred_within_scope() {
    fixes_one_failure_in_two_hundred_within_scope("claude").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_fixes_one_failure_in_two_hundred_within_scope() {
    fixes_one_failure_in_two_hundred_within_scope("gemini").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen_fixes_one_failure_in_two_hundred_within_scope() {
    fixes_one_failure_in_two_hundred_within_scope("qwen").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_fixes_one_failure_in_two_hundred_within_scope() {
    fixes_one_failure_in_two_hundred_within_scope("opencode").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_loop_fixes_one_failure_in_two_hundred_within_scope() {
    fixes_one_failure_in_two_hundred_within_scope("agent").await;
}

/// The fix loop with `backend` (a real CLI, or the built-in agent loop) against the scripted
/// model: one failure in 200 repaired within a tests-only scope, then an out-of-scope edit
/// reverted.
async fn fixes_one_failure_in_two_hundred_within_scope(backend: &str) {
    use troupe_modelserver::{Action, ModelServer, Script};
    // The scripted model: a failing test about rounding down is "fixed" in the source (out
    // of a tests-only scope); any other failure is fixed in its test. Codex edits through its
    // shell; the others read, then write (claude's acceptEdits allows file edits, not
    // arbitrary commands, and some tools refuse to overwrite a file not read first).
    let edit = |backend: &str, path: &str, content: &str, sed: &str| {
        if backend == "codex" {
            vec![Action::Shell {
                command: format!("sed -i '{sed}' {path}"),
            }]
        } else {
            vec![
                Action::ReadFile {
                    path: path.to_owned(),
                },
                Action::WriteFile {
                    path: path.to_owned(),
                    content: content.to_owned(),
                },
            ]
        }
    };
    {
        let script = Script::default()
            .rule(
                "test_half_rounds_down",
                edit(
                    backend,
                    "calc/ops.py",
                    "def add(a, b):\n    return a + b\n\n\ndef half(x):\n    return x // 2\n",
                    "s/x \\/ 2/x \\/\\/ 2/",
                ),
            )
            .rule(
                "Fix failing tests",
                edit(
                    backend,
                    "tests/test_edge.py",
                    "from calc.ops import half\n\n\ndef test_half_of_three():\n    assert half(3) == 1.5\n",
                    "s/half(3) == 1$/half(3) == 1.5/",
                ),
            );
        let (url, server) = ModelServer::start(script).await.expect("model server");
        let dir = tempfile::tempdir().expect("tempdir");
        let service = start_with_backends(&backends_toml(backend, &url), dir.path()).await;
        let fix = |repo: &Path| RunTestsRequest {
            repo_path: repo.display().to_string(),
            max_iterations: 2,
            fix: Some(FixOptions {
                backend: backend.to_owned(),
                scope: FixScope::Tests as i32,
                timeout_seconds: 90,
                ..FixOptions::default()
            }),
            ..RunTestsRequest::default()
        };

        let repo = dir.path().join("app");
        two_hundred_tests(&repo, false);
        let report = run_tests(&service, fix(&repo)).await.expect("run");
        let loop_ = report
            .fix_loop
            .clone()
            .expect("the loop runs at a 0.995 pass rate");
        assert!(loop_.succeeded, "{backend}: {loop_:#?}");
        assert!(
            (loop_.pass_rate_history[0] - 199.0 / 200.0).abs() < 1e-9,
            "{backend}: {:?}",
            loop_.pass_rate_history
        );
        let step = &loop_.iterations[0];
        assert_eq!(
            troupe_proto::names::name(step.verdict()),
            "kept",
            "{backend}: {step:#?}"
        );
        assert_eq!(step.backend, backend);
        let usage = step.usage.expect("usage recorded");
        assert!(
            usage.input_tokens >= 2 * troupe_modelserver::INPUT_TOKENS,
            "{backend}: {usage:?}"
        );
        assert_eq!(loop_.usage, Some(usage));
        assert_eq!(
            report.outcome(),
            TestOutcome::Passed,
            "{backend}: {report:#?}"
        );
        assert_eq!(report.totals.expect("totals").passed, 200);
        let fixed = git(
            &repo,
            &[
                "show",
                &format!("{}:tests/test_edge.py", loop_.final_commit),
            ],
        )
        .expect("show");
        assert!(fixed.contains("half(3) == 1.5"), "{backend}: {fixed}");

        // An edit outside the tests-only scope is reverted, and nothing is kept.
        let bait = dir.path().join("bait");
        two_hundred_tests(&bait, true);
        let report = run_tests(&service, fix(&bait)).await.expect("run");
        let loop_ = report.fix_loop.clone().expect("loop");
        // Nothing was kept; CCW's criterion (pass rate >= 0.95) still holds at 199 of 200.
        assert!(loop_.succeeded, "{backend}: {loop_:#?}");
        assert_eq!(loop_.iterations.len(), 2);
        assert_eq!(report.outcome(), TestOutcome::TestsFailed);
        for step in &loop_.iterations {
            assert_eq!(
                troupe_proto::names::name(step.verdict()),
                "reverted_out_of_scope",
                "{backend}: {step:#?}"
            );
            assert_eq!(step.out_of_scope_paths, ["calc/ops.py"]);
        }
        assert!(loop_.final_commit.is_empty());
        assert_eq!(report.totals.expect("totals").failed, 1);
        service.stop().await;
        drop(server);
    }
}

#[tokio::test]
async fn a_backend_that_is_not_installed_falls_back_along_the_chain() {
    let dir = tempfile::tempdir().expect("tempdir");
    let service = start_with_backends(
        "fallback = []\nretries = 0\n\n[backends.codex]\ncommand = \"/nonexistent/codex\"\n",
        dir.path(),
    )
    .await;
    let agent = agent(dir.path());
    let repo = fixture_repo("pytest-proj", &[], &[], None);
    let mut req = fix_request(
        repo.path(),
        &agent,
        &[
            "tests/test_mathops.py",
            "divide(10, 4) == 2",
            "divide(10, 4) == 2.5",
        ],
        FixScope::Tests,
        1,
    );
    let fix = req.fix.as_mut().expect("fix");
    fix.backend = "codex".to_owned();
    fix.fallback = vec!["command".to_owned()];
    let report = run_tests(&service, req).await.expect("run");
    let loop_ = report.fix_loop.clone().expect("loop");
    let step = &loop_.iterations[0];
    assert_eq!(
        troupe_proto::names::name(step.verdict()),
        "kept",
        "{step:#?}"
    );
    assert_eq!(step.backend, "command");
    assert_eq!(step.fallbacks, ["codex"]);
    assert_eq!(
        report.totals.expect("totals").failed,
        1,
        "one of two failures fixed"
    );
    service.stop().await;
}

//! TESTRUN tasks end to end through gRPC: a real coordinator (SQLite), the test-runner as its
//! worker, a plan whose TESTRUN task has `test.fix`, and a fake fixing agent. The fix that
//! makes the suite pass is committed and integrated into the session branch; the run is
//! recorded on the bus as `state_update` and `tests_passed`.

use troupe_proto::v1::coordinator_client::CoordinatorClient;
use troupe_proto::v1::task_result::Detail;
use troupe_proto::v1::{
    CreateSessionRequest, GetSessionRequest, GetStateRequest, ListMessagesRequest, TaskState,
    TestOutcome,
};
use troupe_testkit::{TestService, eventually, git};

use super::test_runner_support::{EDIT_AGENT, fixture_repo};

/// The test-runner's data directory for these tests (its venv and node caches persist).
fn data_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("troupe-e2e-testrun")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn testrun_tasks_fix_and_integrate_for_each_framework() {
    let data = tempfile::tempdir().expect("tempdir");
    let coordinator_dir = data.path().join("coordinator");
    let coordinator = TestService::spawn(move |listener, shutdown| {
        troupe_coordinator::run(
            troupe_coordinator::Config::new(coordinator_dir),
            listener,
            shutdown,
        )
    })
    .await;
    let runner_config = troupe_test_runner::Config {
        listen: "127.0.0.1:0".parse().expect("address"),
        data_dir: data_dir(),
        coordinator_url: Some(coordinator.url()),
        python: "python3".to_owned(),
        worker_id: Some("test-runner-it".to_owned()),
        worker: Default::default(),
        concurrency: 1,
        backends_config: None,
        security: Default::default(),
        sandbox: Default::default(),
    };
    let runner = TestService::spawn(move |listener, shutdown| {
        troupe_test_runner::run(runner_config, listener, shutdown)
    })
    .await;
    let agent = data.path().join("edit.py");
    std::fs::write(&agent, EDIT_AGENT).expect("agent");
    let mut client = CoordinatorClient::connect(coordinator.url())
        .await
        .expect("connect");

    for (fixture, framework, edits) in [
        (
            "jest-proj",
            "jest",
            vec![
                "tests/math.test.js",
                "expect(divide(10, 4)).toBe(2);",
                "expect(divide(10, 4)).toBe(2.5);",
                "tests/strings.test.js",
                "const user = parseUser('{\"age\": 3}');\n  expect(user.age).toBe(3);",
                "expect(() => parseUser('{\"age\": 3}')).toThrow(TypeError);",
            ],
        ),
        (
            "vitest-proj",
            "vitest",
            vec![
                "tests/math.test.ts",
                "expect(divide(10, 4)).toBe(2);",
                "expect(divide(10, 4)).toBe(2.5);",
                "tests/strings.test.ts",
                "const user = parseUser('{\"age\": 3}');\n  expect(user.age).toBe(3);",
                "expect(() => parseUser('{\"age\": 3}')).toThrow(TypeError);",
            ],
        ),
        (
            "pytest-proj",
            "pytest",
            vec![
                "tests/test_mathops.py",
                "divide(10, 4) == 2",
                "divide(10, 4) == 2.5",
                "tests/test_strings.py",
                "    user = parse_user('{\"age\": 3}')\n    assert user[\"age\"] == 3",
                "    import pytest\n\n    with pytest.raises(KeyError):\n        parse_user('{\"age\": 3}')",
            ],
        ),
    ] {
        let repo = fixture_repo(fixture, &[], &[], None);
        let mut command = vec![
            "python3".to_owned(),
            agent.display().to_string(),
            "{worktree}".to_owned(),
        ];
        command.extend(edits.iter().map(|s| (*s).to_owned()));
        let plan = serde_json::json!({
            "name": format!("fix-{framework}"),
            "description": "run the suite and fix the failing tests",
            "repos": {"app": {"path": repo.path().display().to_string()}},
            "tasks": [{
                "id": "TESTRUN-001",
                "title": "Run the tests and fix them",
                "description": "run the suite; fix failing tests (tests only)",
                "depends_on": [],
                "test": {
                    "framework": framework,
                    "coverage_target": 0,
                    "fix": {
                        "agent": {"backend": "command", "command": command},
                        "max_iterations": 3,
                        "scope": "tests"
                    }
                }
            }]
        });
        let created = client
            .create_session(CreateSessionRequest {
                plan_json: plan.to_string(),
                ..CreateSessionRequest::default()
            })
            .await
            .expect("create session")
            .into_inner();
        let session = created.session.expect("session");
        let task = eventually(&format!("{framework} TESTRUN-001 to finish"), || {
            let mut client = client.clone();
            let id = session.id.clone();
            async move {
                let got = client
                    .get_session(GetSessionRequest {
                        session_id: id,
                        ..Default::default()
                    })
                    .await
                    .ok()?
                    .into_inner();
                got.tasks.into_iter().find(|t| {
                    matches!(
                        t.state(),
                        TaskState::Completed | TaskState::Failed | TaskState::Blocked
                    )
                })
            }
        })
        .await;
        assert_eq!(task.state(), TaskState::Completed, "{framework}: {task:#?}");
        let result = task.result.clone().expect("result");
        let Some(Detail::TestRun(report)) = result.detail.clone() else {
            panic!("{framework}: no test report in {result:#?}");
        };
        assert_eq!(report.outcome(), TestOutcome::Passed, "{framework}");
        let fix = report.fix_loop.clone().expect("fix loop");
        assert!(fix.succeeded, "{framework}: {fix:#?}");
        assert_eq!(
            troupe_proto::names::name(fix.iterations[0].verdict()),
            "kept"
        );
        // The fix is on the session branch now.
        let branch = format!("troupe/{}", session.id);
        let head = git(repo.path(), &["rev-parse", &branch]).expect("branch");
        assert_eq!(head.trim(), result.commit, "{framework}");
        let merged = git(
            repo.path(),
            &["merge-base", "--is-ancestor", &fix.final_commit, &branch],
        );
        assert!(merged.is_ok(), "{framework}: fix not integrated");
        // The bus has the CCW records.
        let messages = client
            .list_messages(ListMessagesRequest {
                session_id: session.id.clone(),
                from: "test-runner".to_owned(),
                r#type: "tests_passed".to_owned(),
                ..ListMessagesRequest::default()
            })
            .await
            .expect("messages")
            .into_inner()
            .messages;
        assert_eq!(messages.len(), 1, "{framework}");
        let state = client
            .get_state(GetStateRequest {
                session_id: session.id.clone(),
                role: "test-runner".to_owned(),
            })
            .await
            .expect("state")
            .into_inner();
        let state = state.role_state.get("test-runner").expect("role state");
        for key in [
            "execution_results",
            "defect_patterns",
            "effective_test_patterns",
            "coverage_history",
        ] {
            assert!(state.fields.contains_key(key), "{framework}: {key}");
        }
    }
    runner.stop().await;
    coordinator.stop().await;
}

/// A plan's TESTRUN task with `test.python`, `test.env`, `test.setup` and `test.workdir`,
/// whose session starts at a task's commit with a one-line bug (the user's checkout is on a
/// clean `main` with the project installed editable): the task fails naming the failing test,
/// and a failing setup command's reason is the first line of the task's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_tests_the_commit_it_names_with_its_env_setup_and_workdir() {
    let data = tempfile::tempdir().expect("tempdir");
    let coordinator_dir = data.path().join("coordinator");
    let coordinator = TestService::spawn(move |listener, shutdown| {
        troupe_coordinator::run(
            troupe_coordinator::Config::new(coordinator_dir),
            listener,
            shutdown,
        )
    })
    .await;
    let runner_config = troupe_test_runner::Config {
        listen: "127.0.0.1:0".parse().expect("address"),
        data_dir: data_dir(),
        coordinator_url: Some(coordinator.url()),
        python: "python3".to_owned(),
        worker_id: Some("test-runner-plan-it".to_owned()),
        concurrency: 1,
        backends_config: None,
        worker: troupe_grpc::worker::WorkerTuning::default(),
        security: Default::default(),
        sandbox: Default::default(),
    };
    let runner = TestService::spawn(move |listener, shutdown| {
        troupe_test_runner::run(runner_config, listener, shutdown)
    })
    .await;
    let mut client = CoordinatorClient::connect(coordinator.url())
        .await
        .expect("connect");

    let repo = fixture_repo("pysrc-proj", &[], &[], None);
    let scratch = tempfile::tempdir().expect("tempdir");
    let python = super::test_runner_support::editable_interpreter(scratch.path(), repo.path());
    super::test_runner_support::commit_on_branch(
        repo.path(),
        "task",
        &[("src/pricing/cart.py", "(100 - percent)", "(100 + percent)")],
    );
    let tools = super::test_runner_support::tools_python()
        .display()
        .to_string();
    for (name, setup, expect) in [
        (
            "bug",
            serde_json::json!([[tools, "-c", "open('built.txt', 'w').write('ok')"]]),
            "tests/test_cart.py::test_discount_applies_percent",
        ),
        (
            "setup",
            serde_json::json!([[
                tools,
                "-c",
                "import sys; sys.exit('cannot build the catalogue')"
            ]]),
            "setup command",
        ),
    ] {
        let plan = serde_json::json!({
            "name": format!("plan-{name}"),
            "description": "test the task's commit",
            "repos": {"app": {"path": repo.path().display().to_string(), "base": "task"}},
            "tasks": [{
                "id": "TESTRUN-001",
                "title": "Run the tests",
                "description": "run the suite",
                "depends_on": [],
                "test": {
                    "framework": "pytest",
                    "install": false,
                    "python": python.display().to_string(),
                    "env": {"TZ": "UTC", "LC_ALL": "C.UTF-8"},
                    "setup": setup,
                    "workdir": "",
                    "test_timeout_seconds": 0
                }
            }]
        });
        let session = client
            .create_session(CreateSessionRequest {
                plan_json: plan.to_string(),
                ..CreateSessionRequest::default()
            })
            .await
            .expect("create session")
            .into_inner()
            .session
            .expect("session");
        let task = eventually(&format!("{name}: TESTRUN-001 to finish"), || {
            let mut client = client.clone();
            let id = session.id.clone();
            async move {
                let got = client
                    .get_session(GetSessionRequest {
                        session_id: id,
                        ..Default::default()
                    })
                    .await
                    .ok()?
                    .into_inner();
                got.tasks.into_iter().find(|t| {
                    matches!(
                        t.state(),
                        TaskState::Completed | TaskState::Failed | TaskState::Blocked
                    )
                })
            }
        })
        .await;
        assert_eq!(task.state(), TaskState::Failed, "{name}: {task:#?}");
        let error = task.last_error.clone().expect("error");
        let first_line = error.message.lines().next().unwrap_or("");
        assert!(
            first_line.contains(expect) || error.details.iter().any(|d| d.contains(expect)),
            "{name}: {error:#?}"
        );
        if name == "setup" {
            assert!(
                first_line.contains("cannot build the catalogue"),
                "{first_line}"
            );
        }
        let report = task
            .result
            .as_ref()
            .and_then(|r| r.detail.clone())
            .and_then(|d| match d {
                Detail::TestRun(report) => Some(report),
                _ => None,
            })
            .expect("the report comes with the failure");
        assert_eq!(report.env.get("TZ").map(String::as_str), Some("UTC"));
        assert!(
            report.command.iter().all(|a| !a.starts_with("--timeout")),
            "{:?}",
            report.command
        );
        if name == "bug" {
            assert_eq!(report.outcome(), TestOutcome::TestsFailed, "{report:#?}");
            assert_eq!(report.setup_steps.len(), 1);
        } else {
            assert_eq!(report.outcome(), TestOutcome::SetupFailed, "{report:#?}");
        }
    }
    // The user's checkout: still on a clean main.
    assert_eq!(
        git(repo.path(), &["status", "--porcelain"]).expect("status"),
        ""
    );
    runner.stop().await;
    coordinator.stop().await;
}

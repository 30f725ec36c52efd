//! A bad plan fails fast, names every problem, and stores nothing.

use troupe_proto::v1::{CreateSessionRequest, ListSessionsRequest};

use crate::support;

const CYCLIC_PLAN: &str = r#"{
  "name": "broken",
  "repos": {"app": {"template": "repo"}},
  "tasks": [
    {"id": "IMPL-001", "title": "a", "depends_on": ["IMPL-002"]},
    {"id": "IMPL-002", "title": "b", "depends_on": ["IMPL-001"]},
    {"id": "IMPL-003", "title": "c", "depends_on": ["IMPL-404"]},
    {"id": "DANCE-001", "title": "d", "depends_on": []}
  ]
}"#;

#[tokio::test]
async fn a_bad_plan_is_refused_with_every_problem_and_nothing_is_stored() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let coordinator = support::ChildService::start(
        "troupe-coordinator",
        &["--data-dir", &data.path().display().to_string()],
        &[],
    )
    .await?;
    let mut client = troupe_grpc::coordinator_client(&coordinator.url())?;
    let status = client
        .create_session(CreateSessionRequest {
            plan_json: CYCLIC_PLAN.to_owned(),
            base_dir: support::quickstart_dir().display().to_string(),
            ..Default::default()
        })
        .await
        .expect_err("a cyclic plan must be refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    let message = status.message();
    for expected in ["IMPL-001 -> IMPL-002 -> IMPL-001", "IMPL-404", "DANCE-001"] {
        assert!(
            message.contains(expected),
            "{expected:?} not named in:\n{message}"
        );
    }
    let sessions = client
        .list_sessions(ListSessionsRequest::default())
        .await?
        .into_inner()
        .sessions;
    assert!(
        sessions.is_empty(),
        "a refused plan left sessions behind: {sessions:?}"
    );
    coordinator
        .terminate(std::time::Duration::from_secs(20))
        .await?;
    Ok(())
}

/// Valid ids, titles and graph; every problem is inside a task's `agent`, `test`, `judge`,
/// `convergence` or loop block, which intake used to accept and a worker refused minutes later.
const BAD_BLOCKS_PLAN: &str = r#"{
  "name": "bad-blocks",
  "sandbox": "none",
  "repos": {"app": {"template": "repo"}},
  "tasks": [
    {"id": "IMPL-001", "title": "a",
     "agent": {"backend": "nonesuch", "env": {"K": 1}},
     "convergence": {"verification": []}},
    {"id": "IMPL-002", "title": "b", "agent": {"backend": "command", "command": []}},
    {"id": "TESTRUN-001", "title": "c", "depends_on": ["IMPL-001"], "sandbox": "strict",
     "test": {"framework": "mocha", "env": {"AWS_SECRET_ACCESS_KEY": "x"},
              "fix": {"agent": {"backend": "command"}}, "gc": {"max_rounds": 500}}},
    {"id": "VALIDATE-001", "title": "d", "depends_on": ["IMPL-001"],
     "judge": {"backend": "claude", "api_key": "sk-from-a-plan"},
     "gap_closure": {"agent": {"command": "make && make fix"}}}
  ]
}"#;

#[tokio::test]
async fn bad_task_blocks_are_refused_at_intake_with_every_problem_and_nothing_is_stored()
-> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let coordinator = support::ChildService::start(
        "troupe-coordinator",
        &["--data-dir", &data.path().display().to_string()],
        &[],
    )
    .await?;
    let mut client = troupe_grpc::coordinator_client(&coordinator.url())?;
    let status = client
        .create_session(CreateSessionRequest {
            plan_json: BAD_BLOCKS_PLAN.to_owned(),
            base_dir: support::quickstart_dir().display().to_string(),
            ..Default::default()
        })
        .await
        .expect_err("a plan with bad blocks must be refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    let message = status.message();
    let expected = [
        "task IMPL-001: `agent.backend` names unknown backend `nonesuch`",
        "task IMPL-001: `agent.env.K` must be a string, got a number",
        "task IMPL-001: `convergence.verification` is empty",
        "task IMPL-002: `agent.command` is empty",
        "task TESTRUN-001: `test.framework` `mocha` is not one of",
        "task TESTRUN-001: `test.env.AWS_SECRET_ACCESS_KEY` is not a variable a suite may get",
        "task TESTRUN-001: `test.fix.agent.command` is missing",
        "task TESTRUN-001: `test.gc.agent` is missing",
        "task TESTRUN-001: `test.gc.max_rounds` must be a whole number from 1 to 100",
        "task TESTRUN-001: `sandbox` must be \"enforce\", \"warn\" or \"off\", got \"strict\"",
        "task VALIDATE-001: `judge.api_key` is not a judge setting a plan may give",
        "task VALIDATE-001: `gap_closure.agent.command` uses shell syntax",
    ];
    for line in expected {
        assert!(message.contains(line), "{line:?} not named in:\n{message}");
    }
    let plan_level = "plan: `sandbox` must be \"enforce\", \"warn\" or \"off\", got \"none\"";
    assert!(
        message.contains(plan_level),
        "{plan_level:?} not named in:\n{message}"
    );
    assert_eq!(
        message
            .lines()
            .filter(|line| line.starts_with("task "))
            .count(),
        expected.len(),
        "one line per problem, nothing else:\n{message}"
    );
    assert!(
        !message.contains("sk-from-a-plan"),
        "the refusal echoes a secret:\n{message}"
    );
    let sessions = client
        .list_sessions(ListSessionsRequest::default())
        .await?
        .into_inner()
        .sessions;
    assert!(
        sessions.is_empty(),
        "a refused plan left sessions behind: {sessions:?}"
    );
    coordinator
        .terminate(std::time::Duration::from_secs(20))
        .await?;
    Ok(())
}

#[tokio::test]
async fn troupe_run_exits_2_on_a_bad_plan() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("plan.json"), CYCLIC_PLAN)?;
    std::fs::create_dir(dir.path().join("repo"))?;
    std::fs::write(dir.path().join("repo/README.md"), "x\n")?;
    let output = tokio::process::Command::new(support::binary("troupe"))
        .arg("run")
        .arg(dir.path())
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "stderr:\n{stderr}");
    assert!(
        stderr.contains("IMPL-001 -> IMPL-002 -> IMPL-001"),
        "stderr:\n{stderr}"
    );
    Ok(())
}

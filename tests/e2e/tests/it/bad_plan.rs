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

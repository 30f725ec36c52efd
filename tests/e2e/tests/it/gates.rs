//! Approval gates against `troupe up` as its own process, behind tokens: a gated task waits in
//! `waiting_approval` (not a stall) through a restart of the server, grpcurl approves one gate
//! and the CLI rejects another, and the session's events say who answered and why.

use std::time::Duration;

use anyhow::Context as _;
use troupe_proto::v1::{
    CreateSessionRequest, GetSessionRequest, GetSessionResponse, TaskState, WatchSessionRequest,
};

use crate::support::{ChildService, binary};

const CLIENT: &str = "gate-client-token-0123456789";
const WORKER: &str = "gate-worker-token-0123456789";

/// Creates a session of `plan` with its repositories under `base_dir`; returns its id.
async fn create(
    connector: &troupe_grpc::Connector,
    url: &str,
    plan: &serde_json::Value,
    base_dir: &std::path::Path,
) -> anyhow::Result<String> {
    Ok(connector
        .coordinator_client(url)?
        .create_session(CreateSessionRequest {
            plan_json: plan.to_string(),
            base_dir: base_dir.display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .session
        .context("session")?
        .id)
}

/// The session's view; owned arguments, so `eventually` closures can call it.
async fn get(
    connector: troupe_grpc::Connector,
    url: String,
    session: String,
) -> anyhow::Result<GetSessionResponse> {
    Ok(connector
        .coordinator_client(&url)?
        .get_session(GetSessionRequest {
            session_id: session,
            ..Default::default()
        })
        .await?
        .into_inner())
}

fn state_of(view: &GetSessionResponse, id: &str) -> TaskState {
    view.tasks
        .iter()
        .find(|task| task.id == id)
        .and_then(|task| TaskState::try_from(task.state).ok())
        .unwrap_or(TaskState::Unspecified)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gates_wait_through_a_restart_and_take_answers_from_grpcurl_and_the_cli()
-> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    troupe_testkit::git_repo(&data.path().join("repo"), &[("README.md", "hello\n")])?;
    let token_file = data.path().join("client.token");
    std::fs::write(&token_file, CLIENT)?;
    let tokens = format!("client:{CLIENT} worker:{WORKER}");
    let up_dir = data.path().join("up").display().to_string();
    let up_args = ["up", "--data-dir", up_dir.as_str()];
    let env = [("TROUPE_AUTH_TOKENS", tokens.as_str())];
    let up = ChildService::start("troupe", &up_args, &env).await?;
    let addr = up.addr;
    let url = up.url();
    let connector = troupe_grpc::Connector::new(&troupe_grpc::auth::Credentials {
        token_file: Some(token_file.clone()),
        ..Default::default()
    })
    .await?;

    let agent = serde_json::json!({"backend": "command", "timeout_seconds": 60, "command": [
        "python3", "-c", "import pathlib, sys; pathlib.Path(sys.argv[1] + '.txt').write_text('x\\n')",
        "{task_id}"]});
    let plan = serde_json::json!({"name": "gates", "repos": {"app": {"path": "repo"}}, "tasks": [
        {"id": "IMPL-1", "title": "build", "agent": agent},
        {"id": "IMPL-2", "title": "ship", "depends_on": ["IMPL-1"], "agent": agent,
         "approval": "check the build"},
        {"id": "IMPL-3", "title": "drop the old API", "depends_on": ["IMPL-1"], "agent": agent,
         "approval": true},
        {"id": "IMPL-4", "title": "after the drop", "depends_on": ["IMPL-3"], "agent": agent}]});
    let session = create(&connector, &url, &plan, data.path()).await?;
    troupe_testkit::eventually_within("both gates waiting", Duration::from_secs(60), || {
        let (connector, url, session) = (connector.clone(), url.clone(), session.clone());
        async move {
            let view = get(connector, url, session).await.ok()?;
            (state_of(&view, "IMPL-2") == TaskState::WaitingApproval
                && state_of(&view, "IMPL-3") == TaskState::WaitingApproval)
                .then_some(())
        }
    })
    .await;

    // The gates hold across a restart of the server, and `check` tells them from a stall.
    up.terminate(Duration::from_secs(20)).await?;
    let up = ChildService::start_at("troupe", addr, &up_args, &env, None).await?;
    let view = get(connector.clone(), url.clone(), session.clone()).await?;
    assert_eq!(state_of(&view, "IMPL-2"), TaskState::WaitingApproval);
    assert_eq!(state_of(&view, "IMPL-3"), TaskState::WaitingApproval);
    assert_eq!(
        view.session
            .context("session")?
            .counts
            .context("counts")?
            .waiting_approval,
        2
    );
    let token_arg = token_file.display().to_string();
    let check = tokio::process::Command::new(binary("troupe"))
        .args([
            "check",
            &session,
            "--connect",
            &url,
            "--token-file",
            &token_arg,
        ])
        .output()
        .await?;
    let check = String::from_utf8_lossy(&check.stdout);
    assert!(check.contains("waiting_approval IMPL-2"), "{check}");
    assert!(!check.contains("stalled"), "{check}");

    // grpcurl approves IMPL-2, as docs/grpcurl.md shows.
    let approve = tokio::process::Command::new("grpcurl")
        .args(["-plaintext", "-H", &format!("authorization: Bearer {CLIENT}"), "-d"])
        .arg(
            serde_json::json!({"sessionId": session, "taskId": "IMPL-2", "note": "build looks right"})
                .to_string(),
        )
        .args([&addr.to_string(), "troupe.v1.Coordinator/ApproveTask"])
        .output()
        .await
        .context("grpcurl (scripts/setup/10-python-tools.sh)")?;
    let approved = String::from_utf8_lossy(&approve.stdout);
    assert!(
        approve.status.success(),
        "{approved}{}",
        String::from_utf8_lossy(&approve.stderr)
    );
    let approved: serde_json::Value = serde_json::from_str(&approved)?;
    assert_eq!(approved["task"]["state"], "TASK_STATE_READY", "{approved}");

    // A worker token may not answer a gate; a task that is not waiting cannot be answered.
    let as_worker = tokio::process::Command::new("grpcurl")
        .args([
            "-plaintext",
            "-H",
            &format!("authorization: Bearer {WORKER}"),
            "-d",
        ])
        .arg(serde_json::json!({"sessionId": session, "taskId": "IMPL-3"}).to_string())
        .args([&addr.to_string(), "troupe.v1.Coordinator/RejectTask"])
        .output()
        .await?;
    assert!(
        String::from_utf8_lossy(&as_worker.stderr).contains("PermissionDenied"),
        "{}",
        String::from_utf8_lossy(&as_worker.stderr)
    );
    let again = tokio::process::Command::new(binary("troupe"))
        .args([
            "approve",
            &session,
            "IMPL-1",
            "--connect",
            &url,
            "--token-file",
            &token_arg,
        ])
        .output()
        .await?;
    assert_eq!(again.status.code(), Some(70));
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("not waiting for approval"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );

    // The CLI rejects IMPL-3: it fails, and IMPL-4 after it is skipped.
    let reject = tokio::process::Command::new(binary("troupe"))
        .args(["reject", &session, "IMPL-3", "--note", "not this release"])
        .args(["--connect", &url, "--token-file", &token_arg])
        .output()
        .await?;
    assert!(
        reject.status.success(),
        "{}",
        String::from_utf8_lossy(&reject.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&reject.stdout).trim(),
        "IMPL-3 is failed"
    );

    let end =
        troupe_testkit::eventually_within("the session to end", Duration::from_secs(90), || {
            let (connector, url, session) = (connector.clone(), url.clone(), session.clone());
            async move {
                let view = get(connector, url, session).await.ok()?;
                (state_of(&view, "IMPL-2") == TaskState::Completed
                    && state_of(&view, "IMPL-4") == TaskState::Skipped)
                    .then_some(view)
            }
        })
        .await;
    let rejected = end
        .tasks
        .iter()
        .find(|t| t.id == "IMPL-3")
        .context("IMPL-3")?;
    let error = rejected.last_error.as_ref().context("an error")?;
    assert_eq!(error.kind, troupe_proto::v1::ErrorKind::Rejected as i32);

    // The answers and who gave them are events on the session.
    let mut events = connector
        .coordinator_client(&url)?
        .watch_session(WatchSessionRequest {
            session_id: session.clone(),
            after_sequence: 0,
            follow: false,
        })
        .await?
        .into_inner();
    let mut reasons = Vec::new();
    while let Some(event) = events.message().await? {
        if let Some(troupe_proto::v1::session_event::Kind::Task(t)) = event.kind {
            reasons.push(format!("{} {}", t.task_id, t.reason));
        }
    }
    let said = |needle: &str| reasons.iter().any(|reason| reason.contains(needle));
    assert!(
        said("IMPL-2 dependencies completed; waiting for approval: check the build"),
        "{reasons:#?}"
    );
    assert!(said("IMPL-2 approved by token sha256:"), "{reasons:#?}");
    assert!(said(": build looks right"), "{reasons:#?}");
    assert!(said("IMPL-3 rejected by token sha256:"), "{reasons:#?}");
    assert!(
        reasons.iter().all(|reason| !reason.contains(CLIENT)),
        "{reasons:#?}"
    );
    up.terminate(Duration::from_secs(20)).await?;
    Ok(())
}

/// A role's checkpoints against `troupe up` behind tokens: `executor:before` holds the
/// executor tasks through a restart of the server until grpcurl approves it (a task it holds
/// cannot be answered alone; `executor:after` cannot be answered before the executors are
/// done); `executor:after` then holds the test task downstream until the CLI rejects it. The
/// answers and who gave them are events; a plan with bad checkpoints is refused with every
/// problem listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_hold_a_roles_stage_through_a_restart_and_take_answers() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    troupe_testkit::git_repo(
        &data.path().join("repo"),
        &[
            ("README.md", "hello\n"),
            ("tests/test_ok.py", "def test_ok():\n    assert True\n"),
        ],
    )?;
    let token_file = data.path().join("client.token");
    std::fs::write(&token_file, CLIENT)?;
    let tokens = format!("client:{CLIENT} worker:{WORKER}");
    let up_dir = data.path().join("up").display().to_string();
    let up_args = ["up", "--data-dir", up_dir.as_str()];
    let env = [("TROUPE_AUTH_TOKENS", tokens.as_str())];
    let up = ChildService::start("troupe", &up_args, &env).await?;
    let addr = up.addr;
    let url = up.url();
    let connector = troupe_grpc::Connector::new(&troupe_grpc::auth::Credentials {
        token_file: Some(token_file.clone()),
        ..Default::default()
    })
    .await?;

    // Every problem of the checkpoints at once.
    let agent = serde_json::json!({"backend": "command", "timeout_seconds": 60, "command": [
        "python3", "-c", "import pathlib, sys; pathlib.Path(sys.argv[1] + '.txt').write_text('x\\n')",
        "{task_id}"]});
    let bad = serde_json::json!({"name": "bad-checkpoints", "repos": {"app": {"path": "repo"}},
        "tasks": [{"id": "IMPL-1", "title": "build", "agent": agent}],
        "checkpoints": [{"role": "executor", "when": "later"},
                        {"role": "validator", "when": "after"}]});
    let refused = connector
        .coordinator_client(&url)?
        .create_session(CreateSessionRequest {
            plan_json: bad.to_string(),
            base_dir: data.path().display().to_string(),
            ..Default::default()
        })
        .await
        .expect_err("bad checkpoints are refused");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    for problem in [
        "checkpoints[0]: `when` must be before or after",
        "checkpoints[1]: no task of the plan has role `validator`",
    ] {
        assert!(refused.message().contains(problem), "{}", refused.message());
    }

    let plan = serde_json::json!({"name": "checkpoints", "repos": {"app": {"path": "repo"}},
        "checkpoints": [
            {"role": "executor", "when": "before", "approval": "ready to build?"},
            {"role": "executor", "when": "after", "approval": "check the build"}],
        "tasks": [
            {"id": "IMPL-1", "title": "build", "agent": agent},
            {"id": "IMPL-2", "title": "build more", "agent": agent},
            {"id": "TEST-1", "title": "test the build", "depends_on": ["IMPL-1", "IMPL-2"],
             "test": {"framework": "pytest", "coverage_target": 0}}]});
    let session = create(&connector, &url, &plan, data.path()).await?;
    let view = get(connector.clone(), url.clone(), session.clone()).await?;
    assert_eq!(state_of(&view, "IMPL-1"), TaskState::WaitingApproval);
    assert_eq!(state_of(&view, "IMPL-2"), TaskState::WaitingApproval);

    // The checkpoint holds across a restart, and `check` tells it from a stall.
    up.terminate(Duration::from_secs(20)).await?;
    let up = ChildService::start_at("troupe", addr, &up_args, &env, None).await?;
    let view = get(connector.clone(), url.clone(), session.clone()).await?;
    assert_eq!(state_of(&view, "IMPL-1"), TaskState::WaitingApproval);
    assert_eq!(state_of(&view, "IMPL-2"), TaskState::WaitingApproval);
    let token_arg = token_file.display().to_string();
    let troupe = |args: Vec<String>| {
        let token_arg = token_arg.clone();
        let url = url.clone();
        async move {
            tokio::process::Command::new(binary("troupe"))
                .args(&args)
                .args(["--connect", &url, "--token-file", &token_arg])
                .output()
                .await
        }
    };
    let check = troupe(vec!["check".into(), session.clone()]).await?;
    let check = String::from_utf8_lossy(&check.stdout);
    assert!(check.contains("waiting_approval IMPL-1"), "{check}");
    assert!(!check.contains("stalled"), "{check}");

    // A task the checkpoint holds is not answered alone; `after` is not reached yet.
    let alone = troupe(vec!["approve".into(), session.clone(), "IMPL-1".into()]).await?;
    assert_eq!(alone.status.code(), Some(70));
    assert!(
        String::from_utf8_lossy(&alone.stderr)
            .contains("waits at checkpoint executor:before: answer the checkpoint"),
        "{}",
        String::from_utf8_lossy(&alone.stderr)
    );
    let grpcurl = |method: &str, body: serde_json::Value| {
        let method = format!("troupe.v1.Coordinator/{method}");
        async move {
            tokio::process::Command::new("grpcurl")
                .args([
                    "-plaintext",
                    "-H",
                    &format!("authorization: Bearer {CLIENT}"),
                    "-d",
                ])
                .arg(body.to_string())
                .args([&addr.to_string(), &method])
                .output()
                .await
                .context("grpcurl (scripts/setup/10-python-tools.sh)")
        }
    };
    let early = grpcurl(
        "ApproveTask",
        serde_json::json!({"sessionId": session, "checkpoint": "executor:after"}),
    )
    .await?;
    assert!(
        String::from_utf8_lossy(&early.stderr)
            .contains("checkpoint executor:after is not reached yet: 2 executor task(s)"),
        "{}",
        String::from_utf8_lossy(&early.stderr)
    );

    // grpcurl approves `executor:before`: both executor tasks are released.
    let approve = grpcurl(
        "ApproveTask",
        serde_json::json!({"sessionId": session, "checkpoint": "executor:before",
            "note": "go ahead"}),
    )
    .await?;
    let approved = String::from_utf8_lossy(&approve.stdout);
    assert!(
        approve.status.success(),
        "{approved}{}",
        String::from_utf8_lossy(&approve.stderr)
    );
    let approved: serde_json::Value = serde_json::from_str(&approved)?;
    let mut released: Vec<&str> = approved["released"]
        .as_array()
        .context("released")?
        .iter()
        .map(|t| t["id"].as_str().unwrap_or_default())
        .collect();
    released.sort_unstable();
    assert_eq!(released, ["IMPL-1", "IMPL-2"], "{approved}");
    assert!(approved["task"].is_null(), "{approved}");

    // Once both executors are done, the test task downstream waits at `executor:after`.
    troupe_testkit::eventually_within(
        "TEST-1 waiting at executor:after",
        Duration::from_secs(90),
        || {
            let (connector, url, session) = (connector.clone(), url.clone(), session.clone());
            async move {
                let view = get(connector, url, session).await.ok()?;
                (state_of(&view, "IMPL-1") == TaskState::Completed
                    && state_of(&view, "IMPL-2") == TaskState::Completed
                    && state_of(&view, "TEST-1") == TaskState::WaitingApproval)
                    .then_some(())
            }
        },
    )
    .await;
    // The CLI rejects it: the test task fails as REJECTED and the session ends.
    let reject = troupe(vec![
        "reject".into(),
        session.clone(),
        "--role".into(),
        "executor".into(),
        "--when".into(),
        "after".into(),
        "--note".into(),
        "the build is wrong".into(),
    ])
    .await?;
    assert!(
        reject.status.success(),
        "{}",
        String::from_utf8_lossy(&reject.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&reject.stdout).trim(),
        "checkpoint executor:after is rejected\nTEST-1 is failed"
    );
    let again = troupe(vec![
        "approve".into(),
        session.clone(),
        "--checkpoint".into(),
        "executor:after".into(),
    ])
    .await?;
    assert_eq!(again.status.code(), Some(70));
    let end = get(connector.clone(), url.clone(), session.clone()).await?;
    let rejected = end
        .tasks
        .iter()
        .find(|t| t.id == "TEST-1")
        .context("TEST-1")?;
    assert_eq!(
        rejected.last_error.as_ref().map(|e| e.kind),
        Some(troupe_proto::v1::ErrorKind::Rejected as i32)
    );
    assert_eq!(
        end.session.context("session")?.state,
        troupe_proto::v1::SessionState::Failed as i32
    );

    // The answers and who gave them are events on the session.
    let mut events = connector
        .coordinator_client(&url)?
        .watch_session(WatchSessionRequest {
            session_id: session.clone(),
            after_sequence: 0,
            follow: false,
        })
        .await?
        .into_inner();
    let mut said = Vec::new();
    while let Some(event) = events.message().await? {
        match event.kind {
            Some(troupe_proto::v1::session_event::Kind::Task(t)) => {
                said.push(format!("{} {}", t.task_id, t.reason));
            }
            Some(troupe_proto::v1::session_event::Kind::Message(m)) => said.push(m.summary),
            _ => {}
        }
    }
    let has = |needle: &str| said.iter().any(|line| line.contains(needle));
    for needle in [
        "IMPL-2 checkpoint executor:before approved by token sha256:",
        ": go ahead",
        "TEST-1 dependencies completed; waiting for approval: at checkpoint executor:after: check the build",
        "TEST-1 checkpoint executor:after rejected by token sha256:",
        "[coordinator] checkpoint executor:after rejected by token sha256:",
    ] {
        assert!(has(needle), "{needle}: {said:#?}");
    }
    assert!(
        said.iter().any(|line| line.starts_with("IMPL-1 ")
            && line.ends_with(
                "; waiting for approval: at checkpoint executor:before: ready to build?"
            )),
        "{said:#?}"
    );
    assert!(said.iter().all(|line| !line.contains(CLIENT)), "{said:#?}");
    up.terminate(Duration::from_secs(20)).await?;
    Ok(())
}

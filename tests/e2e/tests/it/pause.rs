//! `troupe pause`, `check` and `resume` against a coordinator binary.

use std::process::Output;

use crate::support::{self, ChildService, binary};

async fn troupe(args: &[&str]) -> anyhow::Result<Output> {
    Ok(tokio::process::Command::new(binary("troupe"))
        .args(args)
        .output()
        .await?)
}

fn stdout_of(output: &Output) -> String {
    assert!(
        output.status.success(),
        "troupe failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test]
async fn troupe_pause_stops_a_session_and_resume_continues_it() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    troupe_testkit::git_repo(&data.path().join("repo"), &[("README.md", "hello\n")])?;
    let coordinator = ChildService::start(
        "troupe-coordinator",
        &[
            "--data-dir",
            &data.path().join("coord").display().to_string(),
        ],
        &[],
    )
    .await?;
    let url = coordinator.url();
    let plan = serde_json::json!({"name": "pause-cli", "repos": {"app": {"path": "repo"}},
        "tasks": [{"id": "IMPL-1", "title": "one"}, {"id": "IMPL-2", "title": "two"}]});
    let created = support::create_session(&url, &plan, data.path()).await?;
    let session = created.session.expect("session").id;

    let paused =
        stdout_of(&troupe(&["pause", &session, "--reason", "lunch", "--connect", &url]).await?);
    assert!(
        paused.contains(&format!("session {session} is paused")),
        "{paused}"
    );
    assert!(paused.contains("nothing is running"), "{paused}");
    let check = stdout_of(&troupe(&["check", &session, "--connect", &url]).await?);
    assert!(check.contains(&format!("{session} [paused]")), "{check}");
    let resumed = stdout_of(&troupe(&["resume", &session, "--connect", &url]).await?);
    assert!(
        resumed.contains(&format!("{session} [active]")),
        "{resumed}"
    );

    // Pausing a session that ended fails with the coordinator's reason.
    let mut client = troupe_grpc::coordinator_client(&url)?;
    client
        .cancel_session(troupe_proto::v1::CancelSessionRequest {
            session_id: session.clone(),
            reason: String::new(),
        })
        .await?;
    let refused = troupe(&["pause", &session, "--connect", &url]).await?;
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("cannot be paused"), "{stderr}");

    coordinator
        .terminate(std::time::Duration::from_secs(20))
        .await?;
    Ok(())
}

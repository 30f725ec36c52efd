//! The README's grpcurl examples, run as written (examples/grpcurl/tour.sh).

use crate::support::ChildService;

#[tokio::test]
async fn every_rpc_works_with_grpcurl_as_the_readme_shows() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let coordinator = ChildService::start(
        "troupe-coordinator",
        &[
            "--data-dir",
            &data.path().join("coordinator").display().to_string(),
        ],
        &[],
    )
    .await?;
    let up = ChildService::start(
        "troupe",
        &[
            "up",
            "--data-dir",
            &data.path().join("up").display().to_string(),
        ],
        &[],
    )
    .await?;

    let script = troupe_testkit::workspace_root().join("examples/grpcurl/tour.sh");
    let output = tokio::process::Command::new("bash")
        .arg(&script)
        .env("COORD", coordinator.addr.to_string())
        .env("UP", up.addr.to_string())
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "tour failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    assert!(stderr.contains("tour complete"), "stderr:\n{stderr}");
    // The direct RPCs answered with real results, not empty messages.
    assert!(
        stdout.contains("\"commit\""),
        "ExecuteTask returned no commit:\n{stdout}"
    );
    assert!(
        stdout.contains("VERDICT_"),
        "Validate returned no verdict:\n{stdout}"
    );
    assert!(
        stdout.contains("TEST_OUTCOME_PASSED"),
        "RunTests did not pass:\n{stdout}"
    );

    coordinator
        .terminate(std::time::Duration::from_secs(20))
        .await?;
    up.terminate(std::time::Duration::from_secs(20)).await?;
    Ok(())
}

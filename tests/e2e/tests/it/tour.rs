//! The grpcurl walkthrough (docs/grpcurl.md), followed in order as written, on a coordinator that
//! has already run another session: examples/grpcurl/tour.sh first, then the page's blocks.

use crate::support::ChildService;

/// The addresses the page uses; the test's servers listen on free ports instead.
const DOC_COORDINATOR: &str = "127.0.0.1:7071";
const DOC_UP: &str = "127.0.0.1:7070";

#[tokio::test]
async fn the_grpcurl_walkthrough_runs_in_order_after_another_session() -> anyhow::Result<()> {
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
    let root = troupe_testkit::workspace_root();

    // Another session first: the tour script runs the same calls, and checks their answers.
    let output = tokio::process::Command::new("bash")
        .arg(root.join("examples/grpcurl/tour.sh"))
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

    // Then the page, block by block in order, as a reader pastes it into one shell.
    let page = std::fs::read_to_string(root.join("docs/grpcurl.md"))?;
    let blocks = crate::docs::code_blocks(&page, "sh");
    let (start, steps) = blocks.split_first().expect("the page has shell blocks");
    assert!(
        start.contains(&format!("troupe-coordinator --listen {DOC_COORDINATOR}"))
            && start.contains(&format!("troupe up --listen {DOC_UP}")),
        "the first block starts the two servers this test starts:\n{start}"
    );
    let script = steps
        .join("\n")
        .replace(DOC_COORDINATOR, &coordinator.addr.to_string())
        .replace(DOC_UP, &up.addr.to_string());
    let output = tokio::process::Command::new("bash")
        .arg("-c")
        .arg(format!("set -euo pipefail\n{script}"))
        .current_dir(&root)
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the walkthrough failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    // Every refusal the page shows is the coordinator's answer, word for word: one token
    // ahead of the task's, then one behind it.
    let shown: Vec<&str> = page
        .lines()
        .filter_map(|line| line.strip_prefix("#   Message: "))
        .collect();
    assert_eq!(shown.len(), 2, "the page shows two refusals");
    assert!(
        shown[0].contains("ahead of the current token"),
        "{}",
        shown[0]
    );
    assert!(
        shown[1].contains("behind the current token"),
        "{}",
        shown[1]
    );
    for message in shown {
        assert!(
            stderr.contains(&format!("Message: {message}")),
            "`{message}` not in:\n{stderr}"
        );
    }
    // GetPlanAssets returned the plan's agent scripts, one path a line.
    assert!(
        stdout.lines().any(|line| line == "agents/add_median.py"),
        "no plan asset listed:\n{stdout}"
    );
    // The calls answered with real results, in the session the page created.
    for expected in [
        "\"task\": \"IMPL-002\"",
        "SESSION_STATE_PAUSED",
        "SESSION_STATE_ACTIVE",
        "\"commit\"",
        "VERDICT_",
        "TEST_OUTCOME_PASSED",
    ] {
        assert!(stdout.contains(expected), "`{expected}` not in:\n{stdout}");
    }

    coordinator
        .terminate(std::time::Duration::from_secs(20))
        .await?;
    up.terminate(std::time::Duration::from_secs(20)).await?;
    Ok(())
}

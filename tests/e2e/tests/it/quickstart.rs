//! The quickstart plan, end to end: in one process, in four processes, and through the CLI.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::support::{self, ChildService};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn quickstart_completes_with_all_services_in_one_process() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let shutdown = CancellationToken::new();
    let (embedded, url) = support::start_embedded(data.path(), &shutdown).await?;

    let response = support::run_quickstart(&url).await?;
    support::assert_quickstart_completed(&response)?;

    shutdown.cancel();
    embedded.wait().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart_completes_with_four_service_processes() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let dir = |name: &str| data.path().join(name).display().to_string();
    let coordinator = ChildService::start(
        "troupe-coordinator",
        &["--data-dir", &dir("coordinator")],
        &[],
    )
    .await?;
    let url = coordinator.url();
    let mut workers = Vec::new();
    for name in ["troupe-executor", "troupe-validator", "troupe-test-runner"] {
        let worker_dir = dir(name);
        workers.push(
            ChildService::start(
                name,
                &["--data-dir", &worker_dir, "--coordinator-url", &url],
                &[],
            )
            .await?,
        );
    }

    let response = support::run_quickstart(&url).await?;
    support::assert_quickstart_completed(&response)?;

    for worker in workers {
        let name = worker.name.clone();
        let status = worker.terminate(Duration::from_secs(20)).await?;
        assert!(status.success(), "{name} exited with {status}");
    }
    let status = coordinator.terminate(Duration::from_secs(20)).await?;
    assert!(status.success(), "coordinator exited with {status}");
    Ok(())
}

#[tokio::test]
async fn troupe_run_prints_a_report_and_exits_zero() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let output = tokio::process::Command::new(support::binary("troupe"))
        .arg("run")
        .arg(support::quickstart_dir())
        .arg("--data-dir")
        .arg(data.path())
        .env_remove("RUST_LOG")
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "troupe run failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    for expected in [
        "IMPL-001       completed",
        "IMPL-002       completed",
        "VALIDATE-001   completed",
        "REVIEW-001     completed",
        "TESTRUN-001    completed",
        "VERIFY-001     completed",
        "fix loop: 1 iteration(s), succeeded",
        "tests passed: 6 passed, 0 failed, 0 skipped of 6",
        "session completed: 6 completed",
        "commits are on branch troupe/quickstart-",
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in:\n{stdout}"
        );
    }
    Ok(())
}

/// `troupe run my-plan.json`: a plan file with any name runs, VERIFY included (the validator
/// reads the upstream criteria from its claim, never a `plan.json` beside the plan).
#[tokio::test]
async fn troupe_run_a_plan_file_with_any_name_runs_its_verify_task() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let plans = tempfile::tempdir()?;
    let copy = std::process::Command::new("cp")
        .arg("-R")
        .arg(support::quickstart_dir())
        .arg(plans.path().join("demo"))
        .status()?;
    anyhow::ensure!(copy.success(), "cp failed: {copy}");
    let dir = plans.path().join("demo");
    std::fs::rename(dir.join("plan.json"), dir.join("my-plan.json"))?;
    let output = tokio::process::Command::new(support::binary("troupe"))
        .arg("run")
        .arg(dir.join("my-plan.json"))
        .arg("--data-dir")
        .arg(data.path())
        .env_remove("RUST_LOG")
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "troupe run failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    assert!(!dir.join("plan.json").exists(), "no plan.json appeared");
    for expected in ["VERIFY-001     completed", "session completed: 6 completed"] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in:\n{stdout}"
        );
    }
    Ok(())
}

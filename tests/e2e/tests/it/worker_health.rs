//! A worker's readiness follows its coordinator: a real validator process reports its service
//! NOT_SERVING while the real coordinator it claims from is stopped, and SERVING again once
//! the coordinator runs again; its overall health (the liveness probe's) stays SERVING.

use std::time::Duration;

use tonic_health::pb::health_check_response::ServingStatus;

use crate::support::{ChildService, free_addr, health};

const VALIDATOR: &str = "troupe.v1.Validator";

async fn wait_for(url: &str, service: &str, want: ServingStatus) {
    troupe_testkit::eventually(&format!("{service:?} at {url} to be {want:?}"), || async {
        health(url, service).await.ok().filter(|s| *s == want)
    })
    .await;
}

#[tokio::test]
async fn a_worker_is_not_serving_while_its_coordinator_is_down() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let coordinator_data = dir.path().join("coordinator").display().to_string();
    let validator_data = dir.path().join("validator").display().to_string();
    let addr = free_addr();
    let coordinator = ChildService::start_at(
        "troupe-coordinator",
        addr,
        &["--data-dir", &coordinator_data],
        &[],
        None,
    )
    .await?;
    let coordinator_url = coordinator.url();
    let validator = ChildService::start(
        "troupe-validator",
        &[
            "--data-dir",
            &validator_data,
            "--coordinator-url",
            &coordinator_url,
            "--rpc-timeout-seconds",
            "2",
        ],
        &[],
    )
    .await?;
    let url = validator.url();
    validator.wait_serving(VALIDATOR).await?;
    // Claims long-poll and succeed: it stays SERVING while the coordinator runs.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(health(&url, VALIDATOR).await?, ServingStatus::Serving);

    coordinator.terminate(Duration::from_secs(20)).await?;
    wait_for(&url, VALIDATOR, ServingStatus::NotServing).await;
    // Alive all the same: restarting it would not bring the coordinator back.
    assert_eq!(health(&url, "").await?, ServingStatus::Serving);

    let coordinator = ChildService::start_at(
        "troupe-coordinator",
        addr,
        &["--data-dir", &coordinator_data],
        &[],
        None,
    )
    .await?;
    wait_for(&url, VALIDATOR, ServingStatus::Serving).await;
    assert_eq!(health(&url, "").await?, ServingStatus::Serving);

    validator.terminate(Duration::from_secs(20)).await?;
    coordinator.terminate(Duration::from_secs(20)).await?;
    Ok(())
}

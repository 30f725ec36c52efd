//! Graceful shutdown: on SIGTERM health flips to NOT_SERVING, in-flight calls drain, the
//! process exits 0 within its bound.

use std::time::Duration;

use tokio_stream::StreamExt;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use troupe_proto::v1::{ClaimTasksRequest, Role};

use crate::support::ChildService;

#[tokio::test]
async fn sigterm_flips_health_drains_calls_and_exits_zero() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let up = ChildService::start(
        "troupe",
        &["up", "--data-dir", &data.path().display().to_string()],
        &[],
    )
    .await?;
    let url = up.url();

    // A health watch sees every status change of the coordinator.
    let mut health = HealthClient::new(troupe_grpc::channel(&url)?);
    let mut watch = health
        .watch(HealthCheckRequest {
            service: "troupe.v1.Coordinator".into(),
        })
        .await?
        .into_inner();
    let first = watch
        .next()
        .await
        .expect("watch yields the current status")?;
    assert_eq!(first.status, ServingStatus::Serving as i32);

    // An in-flight long-poll that would otherwise wait 20 s.
    let mut client = troupe_grpc::coordinator_client(&url)?;
    let in_flight = tokio::spawn(async move {
        client
            .claim_tasks(ClaimTasksRequest {
                worker_id: "shutdown-test".into(),
                roles: vec![Role::Executor as i32],
                max_tasks: 1,
                wait: Some(troupe_proto::prost_types::Duration {
                    seconds: 20,
                    nanos: 0,
                }),
                ..Default::default()
            })
            .await
    });
    // Let the call reach the server before the signal.
    troupe_testkit::eventually("the long-poll to be in flight", || async {
        (!in_flight.is_finished()).then_some(())
    })
    .await;

    let started = tokio::time::Instant::now();
    let exit = tokio::spawn(up.terminate(Duration::from_secs(15)));

    let flipped = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(update) = watch.next().await {
            if update.is_ok_and(|u| u.status == ServingStatus::NotServing as i32) {
                return true;
            }
        }
        false
    })
    .await
    .unwrap_or(false);
    assert!(flipped, "health never reported NOT_SERVING during shutdown");

    let status = exit.await??;
    assert!(status.success(), "troupe up exited with {status}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "shutdown took {:?}",
        started.elapsed()
    );
    // The long-poll ended (answered empty, or cut at the end of the drain) instead of hanging.
    let answered = tokio::time::timeout(Duration::from_secs(5), in_flight).await;
    assert!(answered.is_ok(), "the in-flight call never ended");
    Ok(())
}

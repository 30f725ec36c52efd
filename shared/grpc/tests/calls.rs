//! Which failed calls are transient, and that a deadline holds against a server that never
//! answers: real sockets, a real tonic server, the real coordinator client.

use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tokio_util::sync::CancellationToken;
use troupe_grpc::{ServeOptions, Services, coordinator_client, is_transient, timed, within};
use troupe_proto::v1::HeartbeatRequest;

fn heartbeat() -> HeartbeatRequest {
    HeartbeatRequest {
        session_id: "s".into(),
        task_id: "t".into(),
        fencing_token: 1,
        ..HeartbeatRequest::default()
    }
}

async fn heartbeat_at(url: &str, timeout: Duration) -> Result<(), tonic::Status> {
    let mut client = coordinator_client(url).expect("client");
    within(timeout, client.heartbeat(timed(heartbeat(), timeout)))
        .await
        .map(drop)
}

#[tokio::test]
async fn a_refused_connection_is_transient() {
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a port that was free");
    let status = heartbeat_at(&format!("http://{addr}"), Duration::from_secs(5))
        .await
        .expect_err("nobody listens");
    assert!(is_transient(&status), "{status:?}");
}

/// What a `SIGSTOP`'d server looks like from outside: the kernel accepts the connection and
/// buffers the request, and nothing ever answers.
#[tokio::test]
async fn a_server_that_never_answers_costs_the_deadline_then_is_transient() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let held = tokio::spawn(async move {
        let mut sockets = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            sockets.push(socket);
        }
    });
    let started = Instant::now();
    let status = heartbeat_at(&url, Duration::from_millis(300))
        .await
        .expect_err("no answer");
    let waited = started.elapsed();
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    assert!(is_transient(&status));
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(2),
        "waited {waited:?}"
    );
    held.abort();
}

/// A server that dies mid-call (`kill -9`): the connection closes under the request.
#[tokio::test]
async fn a_connection_dropped_mid_call_is_transient() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            // Read the request's first bytes, then vanish.
            let mut buffer = [0u8; 64];
            let _ = socket.read(&mut buffer).await;
            drop(socket);
        }
    });
    let status = heartbeat_at(&url, Duration::from_secs(5))
        .await
        .expect_err("the server vanished");
    assert!(is_transient(&status), "{status:?}");
}

/// A server's considered answer is not transient, whatever its code.
#[tokio::test]
async fn a_servers_refusal_is_not_transient() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let stop = CancellationToken::new();
    let server = tokio::spawn(troupe_grpc::serve(
        listener,
        Services::new(),
        stop.clone(),
        ServeOptions::default(),
    ));
    // No coordinator is mounted here: the server answers UNIMPLEMENTED.
    let status = heartbeat_at(&url, Duration::from_secs(5))
        .await
        .expect_err("no coordinator");
    assert_eq!(status.code(), tonic::Code::Unimplemented, "{status:?}");
    assert!(!is_transient(&status));
    // Health knows no such service: NOT_FOUND.
    let mut health =
        tonic_health::pb::health_client::HealthClient::new(troupe_grpc::channel(&url).unwrap());
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .await
        .expect_err("unknown service");
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    assert!(!is_transient(&status));
    for code in [tonic::Code::FailedPrecondition, tonic::Code::Internal] {
        assert!(!is_transient(&tonic::Status::new(code, "answered")));
    }
    for code in [
        tonic::Code::Unavailable,
        tonic::Code::DeadlineExceeded,
        tonic::Code::ResourceExhausted,
        tonic::Code::Aborted,
    ] {
        assert!(is_transient(&tonic::Status::new(code, "try again")));
    }
    stop.cancel();
    server.await.expect("join").expect("served");
}

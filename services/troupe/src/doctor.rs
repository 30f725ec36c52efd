//! `troupe doctor`: what a server serves (each troupe service's health), and, where an
//! executor answers, its agent backends: installed or not, versions, where each one's
//! credential comes from, and with `--probe` one live call each. A coordinator alone has no
//! backends to list: doctor says so and where to ask instead, rather than failing.

use std::fmt::Write as _;

use anyhow::Context as _;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
use troupe_grpc::Connector;
use troupe_proto::v1::{ListBackendsRequest, executor_client::ExecutorClient};

/// The troupe services a server may serve, with the names doctor prints.
const SERVICES: [(&str, &str); 4] = [
    ("troupe.v1.Coordinator", "coordinator"),
    ("troupe.v1.Executor", "executor"),
    ("troupe.v1.Validator", "validator"),
    ("troupe.v1.TestRunner", "test-runner"),
];

/// What doctor found.
#[derive(Debug)]
pub struct Report {
    /// What it prints.
    pub text: String,
    /// Whether a `--probe` live call failed.
    pub probe_failed: bool,
}

/// Asks the server at `url` what it serves and, when it serves an executor, its backends.
pub async fn check(connector: &Connector, url: &str, probe: bool) -> anyhow::Result<Report> {
    let channel = connector.channel(url)?;
    let mut health = HealthClient::new(channel.clone());
    let mut text = format!("server {url}\n");
    let mut executor = false;
    for (name, label) in SERVICES {
        let status = match health
            .check(HealthCheckRequest {
                service: name.to_owned(),
            })
            .await
        {
            Ok(answer) => match ServingStatus::try_from(answer.into_inner().status) {
                Ok(ServingStatus::Serving) => "serving",
                Ok(ServingStatus::NotServing) => "not serving",
                _ => "unknown",
            },
            Err(status) if status.code() == tonic::Code::NotFound => "not served here",
            Err(status) => {
                return Err(anyhow::Error::new(status))
                    .with_context(|| format!("asking {url} for its health"));
            }
        };
        executor |= name == "troupe.v1.Executor" && status != "not served here";
        let _ = writeln!(text, "  {label:<12} {status}");
    }
    if !executor {
        let _ = writeln!(
            text,
            "no executor here, so no backends to list: ask one (`troupe doctor --connect \
             http://executor:7072`), a `troupe up`, or run `troupe doctor` without --connect on \
             the machine that runs the agents"
        );
        return Ok(Report {
            text,
            probe_failed: false,
        });
    }
    // A live probe runs each usable CLI once, one after another.
    let deadline = std::time::Duration::from_secs(if probe { 900 } else { 60 });
    let listed = ExecutorClient::with_interceptor(channel, connector.outbound(deadline))
        .max_decoding_message_size(connector.max_message())
        .list_backends(ListBackendsRequest { probe })
        .await
        .with_context(|| format!("listing backends at {url}"))?
        .into_inner();
    let _ = writeln!(
        text,
        "{:<9} {:<10} {:<24} detail",
        "backend", "available", "version"
    );
    let mut probe_failed = false;
    for b in listed.backends {
        let available = if b.available { "yes" } else { "no" };
        let _ = writeln!(
            text,
            "{:<9} {available:<10} {:<24} {}",
            b.name, b.version, b.detail
        );
        if !b.credential.is_empty() {
            let _ = writeln!(text, "{:<9} credential {}", "", b.credential);
        }
        if !b.probe.is_empty() {
            probe_failed |= !b.probe.starts_with("ok ");
            let _ = writeln!(text, "{:<9} probe      {}", "", b.probe);
        }
    }
    Ok(Report { text, probe_failed })
}

//! What authentication costs per call: sequential unary calls through `serve()` on loopback,
//! with no authentication, with a bearer token, and with mTLS (a client certificate; the
//! handshake is paid once per connection, so the calls measure the steady state).
//!
//! ```text
//! cargo bench -p troupe-grpc --bench auth -- --calls 5000
//! ```
//!
//! No business service is mounted, so each call is answered UNIMPLEMENTED by the router once
//! the auth layer let it through: the number is the transport, the layer and the router, the
//! part authentication changes.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use tokio_util::sync::CancellationToken;
use troupe_grpc::auth::{Access, Credentials, Security, ServerAuth};
use troupe_grpc::{Connector, ServeOptions, Services};
use troupe_proto::v1::HeartbeatRequest;
use troupe_testkit::pki::Pki;

#[derive(Debug, Parser)]
struct Args {
    /// Calls per mode (after 200 warm-up calls).
    #[arg(long, default_value_t = 5000)]
    calls: usize,
    /// Cargo passes `--bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

const TOKEN: &str = "bench-worker-token-0123456789";

async fn measure(
    name: &str,
    security: Security,
    client: Credentials,
    calls: usize,
) -> anyhow::Result<()> {
    let auth = ServerAuth::load(&security).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop = CancellationToken::new();
    let server = tokio::spawn(troupe_grpc::serve(
        listener,
        Services::new(),
        stop.clone(),
        ServeOptions::with_auth(auth),
    ));
    let scheme = if security.credentials.tls_cert.is_some() {
        "https"
    } else {
        "http"
    };
    let connector = Connector::new(&client).await?;
    let mut coordinator = connector.coordinator_client(&format!("{scheme}://{addr}"))?;
    let mut samples = Vec::with_capacity(calls);
    for i in 0..calls + 200 {
        let started = Instant::now();
        let status = coordinator
            .heartbeat(HeartbeatRequest::default())
            .await
            .expect_err("no coordinator is mounted");
        anyhow::ensure!(
            status.code() == tonic::Code::Unimplemented,
            "{name}: {status:?}"
        );
        if i >= 200 {
            samples.push(started.elapsed());
        }
    }
    samples.sort();
    let total: Duration = samples.iter().sum();
    let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    println!(
        "{name:<8} {calls} calls: mean {:>7.1} µs  p50 {:>7.1} µs  p99 {:>7.1} µs",
        total.as_secs_f64() * 1e6 / samples.len() as f64,
        at(0.50).as_secs_f64() * 1e6,
        at(0.99).as_secs_f64() * 1e6,
    );
    stop.cancel();
    server.await.context("server task")??;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = tempfile::tempdir()?;
    let pki = Pki::new(dir.path(), "ca")?;
    let server = pki.server("server", &["127.0.0.1"], None)?;
    let client = pki.client("bench", Some("worker"))?;
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, format!("worker:{TOKEN}\n"))?;
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN)?;

    measure(
        "open",
        Security::default(),
        Credentials::default(),
        args.calls,
    )
    .await?;
    measure(
        "token",
        Security {
            access: Access {
                auth_tokens_file: Some(tokens),
                ..Access::default()
            },
            ..Security::default()
        },
        Credentials {
            token_file: Some(token_file),
            ..Credentials::default()
        },
        args.calls,
    )
    .await?;
    measure(
        "mtls",
        Security {
            access: Access {
                tls_client_ca: Some(pki.ca_cert.clone()),
                ..Access::default()
            },
            credentials: Credentials {
                tls_cert: Some(server.cert.clone()),
                tls_key: Some(server.key.clone()),
                ..Credentials::default()
            },
        },
        Credentials {
            tls_ca: Some(pki.ca_cert.clone()),
            tls_cert: Some(client.cert),
            tls_key: Some(client.key),
            ..Credentials::default()
        },
        args.calls,
    )
    .await?;
    Ok(())
}

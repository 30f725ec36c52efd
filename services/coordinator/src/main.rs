//! `troupe-coordinator`: serves the Coordinator gRPC service.

use anyhow::Context as _;
use clap::Parser;

/// The troupe coordinator: sessions, task DAG scheduling, leases and the message bus.
#[derive(Debug, Parser)]
#[command(name = "troupe-coordinator", version)]
struct Cli {
    #[command(flatten)]
    config: troupe_coordinator::Config,
    #[command(flatten)]
    tuning: troupe_coordinator::Tuning,
    #[command(flatten)]
    metrics: troupe_telemetry::metrics::MetricsArgs,
    #[command(flatten)]
    web: troupe_coordinator::WebArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let telemetry = troupe_telemetry::init("troupe-coordinator").context("telemetry init")?;
    let result = serve(cli.config, cli.tuning, (cli.metrics, cli.web)).await;
    if let Err(err) = &result {
        tracing::error!(error = %format!("{err:#}"), "coordinator stopped");
    }
    telemetry.shutdown().await;
    result
}

async fn serve(
    config: troupe_coordinator::Config,
    tuning: troupe_coordinator::Tuning,
    (metrics, web): (
        troupe_telemetry::metrics::MetricsArgs,
        troupe_coordinator::WebArgs,
    ),
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("bind {}", config.listen))?;
    let shutdown = troupe_grpc::shutdown_token();
    troupe_coordinator::run_with_metrics(config, tuning, (&metrics, &web), listener, shutdown)
        .await?;
    Ok(())
}

//! `troupe-coordinator`: serves the Coordinator gRPC service.

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
    let listen = cli.config.listen;
    troupe_grpc::boot::run_binary("troupe-coordinator", listen, |listener, shutdown| {
        troupe_coordinator::run_with_metrics(
            cli.config,
            cli.tuning,
            (&cli.metrics, &cli.web),
            listener,
            shutdown,
        )
    })
    .await?;
    Ok(())
}

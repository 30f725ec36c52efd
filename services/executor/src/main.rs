//! `troupe-executor`: implements tasks with agent backends (RPC and executor worker).

use anyhow::Context;
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "troupe-executor",
    version,
    about = "Implements tasks with agent backends in per-task git worktrees"
)]
struct Cli {
    #[command(flatten)]
    config: troupe_executor::Config,
    #[command(flatten)]
    metrics: troupe_telemetry::metrics::MetricsArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let telemetry = troupe_telemetry::init("troupe-executor").context("initialising telemetry")?;
    let shutdown = troupe_grpc::shutdown_token();
    let result = async {
        let listener = tokio::net::TcpListener::bind(cli.config.listen)
            .await
            .with_context(|| format!("binding {}", cli.config.listen))?;
        troupe_telemetry::metrics::spawn(
            &cli.metrics,
            Vec::new(),
            shutdown.clone().cancelled_owned(),
        )
        .await?;
        troupe_executor::run(cli.config, listener, shutdown)
            .await
            .context("executor failed")
    }
    .await;
    telemetry.shutdown().await;
    result
}

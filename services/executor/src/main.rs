//! `troupe-executor`: implements tasks with agent backends (RPC and executor worker).

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
    let listen = cli.config.listen;
    troupe_grpc::boot::run_binary("troupe-executor", listen, |listener, shutdown| {
        troupe_executor::run_with_metrics(cli.config, &cli.metrics, listener, shutdown)
    })
    .await?;
    Ok(())
}

//! `troupe-test-runner`: runs test suites for troupe (RPC and TESTRUN-* worker).

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "troupe-test-runner",
    version,
    about = "Runs Jest, Vitest and Pytest suites, fixes failing tests, reports structured results"
)]
struct Cli {
    #[command(flatten)]
    config: troupe_test_runner::Config,
    #[command(flatten)]
    metrics: troupe_telemetry::metrics::MetricsArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let listen = cli.config.listen;
    troupe_grpc::boot::run_binary("troupe-test-runner", listen, |listener, shutdown| {
        troupe_test_runner::run_with_metrics(cli.config, &cli.metrics, listener, shutdown)
    })
    .await?;
    Ok(())
}

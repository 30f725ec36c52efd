//! `troupe-test-runner`: runs test suites for troupe (RPC and TESTRUN-* worker).

use anyhow::Context;
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
    let telemetry =
        troupe_telemetry::init("troupe-test-runner").context("initialising telemetry")?;
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
        troupe_test_runner::run(cli.config, listener, shutdown)
            .await
            .context("test-runner failed")
    }
    .await;
    telemetry.shutdown().await;
    result
}

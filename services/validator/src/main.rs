//! `troupe-validator`: checks task results for troupe (RPC and VALIDATE-* worker).

use anyhow::Context;
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "troupe-validator",
    version,
    about = "Checks files, syntax, lint, criteria, reviews and goals with evidence"
)]
struct Cli {
    #[command(flatten)]
    config: troupe_validator::Config,
    #[command(flatten)]
    checks: troupe_validator::CheckConfig,
    #[command(flatten)]
    metrics: troupe_telemetry::metrics::MetricsArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let telemetry = troupe_telemetry::init("troupe-validator").context("initialising telemetry")?;
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
        troupe_validator::run_with(cli.config, cli.checks, listener, shutdown)
            .await
            .context("validator failed")
    }
    .await;
    telemetry.shutdown().await;
    result
}

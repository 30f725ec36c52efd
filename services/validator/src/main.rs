//! `troupe-validator`: checks task results for troupe (RPC and VALIDATE-* worker).

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
    let listen = cli.config.listen;
    troupe_grpc::boot::run_binary("troupe-validator", listen, |listener, shutdown| {
        troupe_validator::run_with(cli.config, cli.checks, &cli.metrics, listener, shutdown)
    })
    .await?;
    Ok(())
}

//! The `troupe` command: parses arguments, sets up telemetry and hands over to [`troupe::cli`].

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = troupe::cli::Cli::parse();
    if cli.prints_only() {
        sigpipe::reset();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::from(70);
        }
    };
    runtime.block_on(async move {
        // `up` is a server and logs at info; the other commands print their own output.
        let default_filter = if cli.is_server() { "info" } else { "warn" };
        let telemetry = match troupe_telemetry::init_with_filter("troupe", default_filter) {
            Ok(guard) => guard,
            Err(err) => {
                eprintln!("error: {err}");
                return ExitCode::from(70);
            }
        };
        let code = troupe::cli::main(cli).await;
        telemetry.shutdown().await;
        code
    })
}

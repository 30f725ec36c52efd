//! The scripted model server as a process of its own, for scripts that drive a session by hand
//! (`scripts/pictures.sh`): one rule, as the tests build them, and the server runs until
//! SIGINT or SIGTERM.
//!
//! `serve TRIGGER PATH CONTENT [SLEEP_SECONDS]`: when the prompt contains TRIGGER, the model
//! asks the agent to run `sleep SLEEP_SECONDS` (if given), then to write CONTENT to PATH, then
//! says it is done. Prints the base URL on the first line of stdout.

use tokio::signal::unix::{SignalKind, signal};
use troupe_modelserver::{Action, ModelServer, Script};

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [trigger, path, content, rest @ ..] = args.as_slice() else {
        eprintln!("usage: serve TRIGGER PATH CONTENT [SLEEP_SECONDS]");
        std::process::exit(2);
    };
    let mut actions = Vec::new();
    if let Some(seconds) = rest.first() {
        let seconds: u32 = seconds.parse().map_err(|_| {
            std::io::Error::other(format!("SLEEP_SECONDS must be a number, not {seconds}"))
        })?;
        actions.push(Action::Shell {
            command: format!("sleep {seconds}"),
        });
    }
    actions.push(Action::WriteFile {
        path: path.clone(),
        content: content.clone(),
    });
    let (url, _server) = ModelServer::start(Script::default().rule(trigger, actions)).await?;
    println!("{url}");
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(())
}

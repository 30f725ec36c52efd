//! Command-line interface of `troupe`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use troupe_proto::v1::{CreateSessionRequest, GetSessionRequest, WatchSessionRequest};

use crate::embedded::{Embedded, EmbeddedConfig};
use crate::{plan_file, report};

/// Exit code of a plan that ran and did not complete.
const EXIT_PLAN_FAILED: u8 = 1;
/// Exit code of a plan refused before anything ran (invalid plan, missing file).
const EXIT_PLAN_INVALID: u8 = 2;
/// Exit code of an infrastructure failure (cannot bind, store error).
const EXIT_INTERNAL: u8 = 70;

/// troupe runs teams of coding agents: a plan's tasks go to a coordinator, executors
/// implement them in git worktrees, validators and test-runners check the result.
#[derive(Debug, Parser)]
#[command(name = "troupe", version)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

impl Cli {
    /// Whether the command is a long-running server (it logs at info by default).
    pub fn is_server(&self) -> bool {
        matches!(self.command, Command::Up(_))
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serves the coordinator, executor, test-runner and validator in one process on one port.
    Up(UpArgs),
    /// Runs a plan to the end and prints a report; exits 1 if the plan did not complete.
    Run(RunArgs),
    /// Prints a session's tasks and their outcomes from a running server.
    Status(SessionArgs),
    /// Streams a session's events from a running server until it ends.
    Watch(WatchArgs),
}

#[derive(Debug, clap::Args)]
struct UpArgs {
    /// Address to listen on.
    #[arg(long, env = "TROUPE_LISTEN", default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    #[command(flatten)]
    embedded: EmbeddedArgs,
}

#[derive(Debug, clap::Args)]
struct EmbeddedArgs {
    /// Directory for the SQLite store, worktrees, venvs and reports.
    #[arg(long, env = "TROUPE_DATA_DIR", default_value = ".troupe")]
    data_dir: PathBuf,
    /// Executor tasks run at once.
    #[arg(long, env = "TROUPE_EXECUTOR_CONCURRENCY", default_value_t = 2)]
    executor_concurrency: usize,
    /// Python used by the test-runner when a task does not ask for a venv.
    #[arg(long, env = "TROUPE_PYTHON", default_value = "python3")]
    python: String,
}

impl EmbeddedArgs {
    fn config(&self) -> EmbeddedConfig {
        EmbeddedConfig {
            data_dir: self.data_dir.clone(),
            executor_concurrency: self.executor_concurrency,
            python: self.python.clone(),
        }
    }
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Plan file (JSON or TOML), or a directory holding plan.json / plan.toml.
    plan: PathBuf,
    /// Repository to work in: `PATH` for the plan's default repo, `NAME=PATH` for a named one.
    #[arg(long = "repo", value_name = "[NAME=]PATH")]
    repos: Vec<String>,
    /// Submit to a running server (such as `troupe up`) instead of starting one in-process.
    #[arg(long, env = "TROUPE_CONNECT", value_name = "URL")]
    connect: Option<String>,
    #[command(flatten)]
    embedded: EmbeddedArgs,
}

#[derive(Debug, clap::Args)]
struct SessionArgs {
    /// Session id.
    session: String,
    /// Server to ask.
    #[arg(
        long,
        env = "TROUPE_CONNECT",
        default_value = "http://127.0.0.1:7070",
        value_name = "URL"
    )]
    connect: String,
}

#[derive(Debug, clap::Args)]
struct WatchArgs {
    #[command(flatten)]
    session: SessionArgs,
    /// Start after this event sequence number.
    #[arg(long, default_value_t = 0)]
    after: u64,
}

/// Runs the parsed command and returns the process exit code.
pub async fn main(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Up(args) => up(args).await,
        Command::Run(args) => run(args).await,
        Command::Status(args) => status(args).await,
        Command::Watch(args) => watch(args).await,
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(EXIT_INTERNAL)
        }
    }
}

async fn up(args: UpArgs) -> anyhow::Result<ExitCode> {
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let shutdown = troupe_grpc::shutdown_token();
    let embedded = Embedded::start(args.embedded.config(), listener, shutdown).await?;
    eprintln!(
        "troupe is up on {}: coordinator, executor, test-runner and validator (data in {})",
        troupe_grpc::url_for(embedded.addr()),
        args.embedded.data_dir.display()
    );
    embedded.wait().await?;
    Ok(ExitCode::SUCCESS)
}

async fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let plan = match plan_file::load(&args.plan) {
        Ok(plan) => plan,
        Err(err) => {
            eprintln!("error: {err}");
            return Ok(ExitCode::from(EXIT_PLAN_INVALID));
        }
    };
    let repo_paths = match parse_repo_args(&args.repos) {
        Ok(paths) => paths,
        Err(err) => {
            eprintln!("error: {err:#}");
            return Ok(ExitCode::from(EXIT_PLAN_INVALID));
        }
    };

    let shutdown = CancellationToken::new();
    let (url, embedded) = match &args.connect {
        Some(url) => (url.clone(), None),
        None => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .context("binding a loopback port for the in-process services")?;
            let embedded =
                Embedded::start(args.embedded.config(), listener, shutdown.clone()).await?;
            (troupe_grpc::url_for(embedded.addr()), Some(embedded))
        }
    };

    let outcome = submit_and_follow(&url, plan, repo_paths).await;
    if let Some(embedded) = embedded {
        shutdown.cancel();
        embedded.wait().await?;
    }
    outcome
}

async fn submit_and_follow(
    url: &str,
    plan: plan_file::PlanFile,
    repo_paths: std::collections::HashMap<String, String>,
) -> anyhow::Result<ExitCode> {
    let mut client = troupe_grpc::coordinator_client(url)?;
    let created = client
        .create_session(CreateSessionRequest {
            plan_json: plan.json,
            base_dir: plan.base_dir.display().to_string(),
            repo_paths,
            dry_run: false,
        })
        .await;
    let created = match created {
        Ok(response) => response.into_inner(),
        Err(status) if status.code() == tonic::Code::InvalidArgument => {
            eprintln!(
                "error: plan {} was refused:\n{}",
                plan.path.display(),
                status.message()
            );
            return Ok(ExitCode::from(EXIT_PLAN_INVALID));
        }
        Err(status) => bail!("creating the session failed: {}", status.message()),
    };
    let session = created.session.context("coordinator returned no session")?;
    print!("{}", report::session_header(&session, &created.tasks));

    let mut events = client
        .watch_session(WatchSessionRequest {
            session_id: session.id.clone(),
            after_sequence: 0,
            follow: false,
        })
        .await
        .context("watching the session")?
        .into_inner();
    while let Some(event) = events.next().await {
        let event = event.context("session event stream failed")?;
        if let Some(line) = report::event_line(&event) {
            println!("{line}");
        }
    }

    let final_state = client
        .get_session(GetSessionRequest {
            session_id: session.id.clone(),
        })
        .await
        .context("reading the final session")?
        .into_inner();
    print!("{}", report::final_report(&final_state));
    let completed = final_state
        .session
        .as_ref()
        .is_some_and(|s| s.state == troupe_proto::v1::SessionState::Completed as i32);
    Ok(if completed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_PLAN_FAILED)
    })
}

/// Parses `--repo` values: `PATH` names the default repo (key `""`), `NAME=PATH` a named one.
fn parse_repo_args(values: &[String]) -> anyhow::Result<std::collections::HashMap<String, String>> {
    let mut paths = std::collections::HashMap::new();
    for value in values {
        let (name, path) = match value.split_once('=') {
            Some((name, path)) if !name.contains('/') => (name.to_owned(), path),
            _ => (String::new(), value.as_str()),
        };
        let absolute =
            std::path::absolute(path).with_context(|| format!("resolving --repo {value}"))?;
        if paths
            .insert(name.clone(), absolute.display().to_string())
            .is_some()
        {
            bail!(
                "--repo given twice for {}",
                if name.is_empty() {
                    "the default repo"
                } else {
                    &name
                }
            );
        }
    }
    Ok(paths)
}

async fn status(args: SessionArgs) -> anyhow::Result<ExitCode> {
    let mut client = troupe_grpc::coordinator_client(&args.connect)?;
    let response = client
        .get_session(GetSessionRequest {
            session_id: args.session,
        })
        .await
        .map_err(|status| anyhow::anyhow!("{}", status.message()))?
        .into_inner();
    print!("{}", report::final_report(&response));
    Ok(ExitCode::SUCCESS)
}

async fn watch(args: WatchArgs) -> anyhow::Result<ExitCode> {
    let mut client = troupe_grpc::coordinator_client(&args.session.connect)?;
    let mut events = client
        .watch_session(WatchSessionRequest {
            session_id: args.session.session,
            after_sequence: args.after,
            follow: false,
        })
        .await
        .map_err(|status| anyhow::anyhow!("{}", status.message()))?
        .into_inner();
    while let Some(event) = events.next().await {
        let event = event.map_err(|status| anyhow::anyhow!("{}", status.message()))?;
        if let Some(line) = report::event_line(&event) {
            println!("{line}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_args_name_the_default_or_a_named_repo() {
        let paths = parse_repo_args(&["/tmp/a".into(), "web=/tmp/b".into()]).unwrap();
        assert_eq!(paths[""], "/tmp/a");
        assert_eq!(paths["web"], "/tmp/b");
    }

    #[test]
    fn a_repo_given_twice_is_refused() {
        let err = parse_repo_args(&["/tmp/a".into(), "/tmp/b".into()]).unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");
    }

    #[test]
    fn cli_parses_run_with_repo_and_connect() {
        let cli = Cli::try_parse_from([
            "troupe",
            "run",
            "examples/quickstart",
            "--repo",
            "/tmp/x",
            "--connect",
            "http://127.0.0.1:7070",
        ])
        .unwrap();
        assert!(!cli.is_server());
    }
}

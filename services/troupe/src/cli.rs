//! Command-line interface of `troupe`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use troupe_proto::v1::{CreateSessionRequest, GetSessionRequest};

use troupe_grpc::Connector;
use troupe_grpc::auth::{Credentials, Security};

use crate::embedded::{Embedded, EmbeddedConfig};
use crate::follow::Follower;
use crate::{ccw_export, follow, plan_file, report};

/// Exit code of a plan that ran and did not complete.
const EXIT_PLAN_FAILED: u8 = 1;
/// Exit code of a plan refused before anything ran (invalid plan, missing file).
const EXIT_PLAN_INVALID: u8 = 2;
/// Exit code when the coordinator could not be reached (after `--reconnect-seconds` of
/// trying, for the commands that follow a session).
const EXIT_UNREACHABLE: u8 = 69;
/// Exit code of an infrastructure failure (cannot bind, store error, a refused request).
const EXIT_INTERNAL: u8 = 70;

/// The exit codes, as `--help` prints them.
const EXIT_CODES: &str = "\
Exit codes:
  0   success; for `run` and `import`, every task completed; for `watch`, the session ended
  1   `run` / `import`: the plan ran and did not complete (a task failed, was skipped, ...)
  2   the plan was refused before anything ran (invalid plan, missing file), or bad arguments
  69  the coordinator could not be reached; `run --connect`, `import --connect` and `watch`
      first reconnect for up to --reconnect-seconds (default 300) of continuous outage
  70  any other error (cannot bind, store error, a request the coordinator refused)
  130 `up`: a second SIGINT/SIGTERM during shutdown";

/// troupe runs teams of coding agents: a plan's tasks go to a coordinator, executors
/// implement them in git worktrees, validators and test-runners check the result.
#[derive(Debug, Parser)]
#[command(name = "troupe", version, after_help = EXIT_CODES)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

impl Cli {
    /// Whether the command is a long-running server (it logs at info by default).
    pub fn is_server(&self) -> bool {
        matches!(self.command, Command::Up(_))
    }

    /// Whether the command only prints what a server answers: nothing in this process writes
    /// to a child's pipe, so a closed stdout (`troupe status S | head`) may end it quietly by
    /// SIGPIPE, as it ends other Unix tools, instead of a panic in `println!`.
    pub fn prints_only(&self) -> bool {
        match &self.command {
            Command::Import(args) => args.print,
            Command::Status(_)
            | Command::Watch(_)
            | Command::Check(_)
            | Command::Resume(_)
            | Command::Pause(_)
            | Command::Cancel(_)
            | Command::Approve(_)
            | Command::Reject(_)
            | Command::Graph(_)
            | Command::Report(_)
            | Command::Export(_) => true,
            Command::Doctor(args) => args.connect.is_some(),
            Command::Up(_) | Command::Run(_) => false,
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serves the coordinator, executor, test-runner and validator in one process on one port.
    Up(UpArgs),
    /// Runs a plan to the end and prints a report; exits 1 if the plan did not complete.
    #[command(after_help = EXIT_CODES)]
    Run(RunArgs),
    /// Prints a session's tasks and their outcomes from a running server.
    Status(SessionArgs),
    /// Streams a session's events from a running server until it ends.
    #[command(after_help = EXIT_CODES)]
    Watch(WatchArgs),
    /// Imports a CCW session folder as a plan and runs it like `run`.
    #[command(after_help = EXIT_CODES)]
    Import(ImportArgs),
    /// Exports a session from a running server to a CCW-compatible session folder.
    Export(ExportArgs),
    /// Prints a session's status graph, workers, blockers and stalls (read-only).
    Check(SessionArgs),
    /// Reconciles a session (orphaned, failed, blocked tasks back in play), then prints `check`.
    Resume(SessionArgs),
    /// Pauses a session: running tasks finish, nothing new starts until `resume`.
    Pause(PauseArgs),
    /// Lists the agent backends (installed or not, versions) via `Executor.ListBackends`, and
    /// this kernel's Landlock ABI (whether `--sandbox enforce` can work).
    Doctor(DoctorArgs),
    /// Cancels a session: nothing new starts, running tasks are told to stop.
    Cancel(CancelArgs),
    /// Approves a task waiting at its approval gate (it becomes ready), or a role's checkpoint
    /// (`--role`, `--checkpoint`: every task it holds becomes ready).
    Approve(GateArgs),
    /// Rejects a task waiting at its approval gate, or a role's checkpoint (the tasks it guards
    /// fail); what depends on them follows the plan's `on_failure`.
    Reject(GateArgs),
    /// Prints a session's DAG with each task's state and duration, grouped by repo and wave.
    Graph(GraphArgs),
    /// Prints where a session's time and tokens went: per task, per repo, per backend.
    Report(ReportArgs),
}

#[derive(Debug, clap::Args)]
struct CancelArgs {
    #[command(flatten)]
    session: SessionArgs,
    /// Why, recorded in the event log.
    #[arg(long, default_value = "")]
    reason: String,
}

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("gate").required(true).args(["task", "role", "checkpoint"])))]
struct GateArgs {
    #[command(flatten)]
    session: SessionArgs,
    /// The task waiting for approval.
    task: Option<String>,
    /// A role's checkpoint instead of a task: `executor`, `validator` or `test-runner`.
    #[arg(long, conflicts_with_all = ["task", "checkpoint"])]
    role: Option<String>,
    /// With `--role`: the checkpoint before the role's first task or after its last.
    #[arg(long, requires = "role", value_parser = ["before", "after"], default_value = "after")]
    when: String,
    /// A role's checkpoint by its id, `ROLE:WHEN` (`executor:after`).
    #[arg(long, conflicts_with = "task")]
    checkpoint: Option<String>,
    /// Why, recorded with the answer (and, for a rejection, as the task's error).
    #[arg(long, default_value = "")]
    note: String,
}

#[derive(Debug, clap::Args)]
struct GraphArgs {
    #[command(flatten)]
    session: SessionArgs,
    /// Output format.
    #[arg(long, value_enum, default_value = "mermaid")]
    format: troupe_view::graph::Format,
}

#[derive(Debug, clap::Args)]
struct ReportArgs {
    #[command(flatten)]
    session: SessionArgs,
    /// Output format.
    #[arg(long, value_enum, default_value = "md")]
    format: crate::session_report::Format,
    /// Price table (TOML, per backend: `[claude]` `input_per_mtok = 3.0`, `output_per_mtok`,
    /// `cached_input_per_mtok`); without it the report shows tokens and no cost.
    #[arg(long, env = "TROUPE_PRICES", value_name = "FILE")]
    prices: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct DoctorArgs {
    /// Ask this running executor (or `troupe up`); default: probe here with an in-process one.
    #[arg(long, value_name = "URL")]
    connect: Option<String>,
    /// Backend configuration file for the in-process probe (as the executor's `--config`).
    #[arg(long, env = "TROUPE_EXECUTOR_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Also make one tiny live call with each usable backend (a one-word prompt, read-only).
    #[arg(long)]
    probe: bool,
    #[command(flatten)]
    credentials: Credentials,
}

#[derive(Debug, clap::Args)]
struct UpArgs {
    /// Address to listen on.
    #[arg(long, env = "TROUPE_LISTEN", default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    #[command(flatten)]
    embedded: EmbeddedArgs,
    /// What the server accepts (tokens, client certificates) and its own certificate.
    #[command(flatten)]
    security: Security,
    #[command(flatten)]
    metrics: troupe_telemetry::metrics::MetricsArgs,
    #[command(flatten)]
    web: troupe_coordinator::WebArgs,
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
    /// The embedded server's settings; `security` decides who may call it.
    fn config(&self, security: Security) -> EmbeddedConfig {
        EmbeddedConfig {
            data_dir: self.data_dir.clone(),
            executor_concurrency: self.executor_concurrency,
            python: self.python.clone(),
            security,
        }
    }
}

#[derive(Debug, clap::Args)]
struct ReconnectArgs {
    /// When the coordinator goes away mid-session, reconnect (with backoff, resuming the
    /// event stream where it broke) for up to this many seconds of continuous outage, then
    /// exit 69; 0 gives up at the first failure.
    #[arg(long, env = "TROUPE_RECONNECT_SECONDS", default_value_t = 300.0)]
    reconnect_seconds: f64,
}

impl ReconnectArgs {
    fn budget(&self) -> anyhow::Result<std::time::Duration> {
        std::time::Duration::try_from_secs_f64(self.reconnect_seconds).with_context(|| {
            format!(
                "--reconnect-seconds must be a number of seconds, not {}",
                self.reconnect_seconds
            )
        })
    }
}

#[derive(Debug, clap::Args)]
struct ViewArgs {
    /// One line per event even on a terminal (no progress bars); a pipe or file always gets
    /// lines.
    #[arg(long, env = "TROUPE_PLAIN")]
    plain: bool,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Plan file (JSON or TOML), or a directory holding plan.json / plan.toml.
    plan: PathBuf,
    /// Repository to work in: `PATH` or `URL` for the plan's default repo, `NAME=PATH` or
    /// `NAME=URL` for a named one (file://, git://, ssh://, https://; credentials come from
    /// the services' --git-credentials, never from here).
    #[arg(long = "repo", value_name = "[NAME=]PATH|URL")]
    repos: Vec<String>,
    /// Submit to a running server (such as `troupe up`) instead of starting one in-process.
    #[arg(long, env = "TROUPE_CONNECT", value_name = "URL")]
    connect: Option<String>,
    #[command(flatten)]
    reconnect: ReconnectArgs,
    #[command(flatten)]
    view: ViewArgs,
    #[command(flatten)]
    embedded: EmbeddedArgs,
    /// Credentials for `--connect`.
    #[command(flatten)]
    credentials: Credentials,
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
    #[command(flatten)]
    credentials: Credentials,
}

impl SessionArgs {
    async fn client(&self) -> anyhow::Result<troupe_grpc::CoordinatorClient> {
        let connector = Connector::new(&self.credentials).await?;
        Ok(connector.coordinator_client(&self.connect)?)
    }
}

#[derive(Debug, clap::Args)]
struct WatchArgs {
    #[command(flatten)]
    session: SessionArgs,
    /// Start after this event sequence number.
    #[arg(long, default_value_t = 0)]
    after: u64,
    #[command(flatten)]
    reconnect: ReconnectArgs,
    #[command(flatten)]
    view: ViewArgs,
}

#[derive(Debug, clap::Args)]
struct ImportArgs {
    /// CCW session folder (holding team-session.json and task-analysis.json).
    dir: PathBuf,
    /// Repository to work in: `PATH` or `URL` for the plan's default repo, `NAME=PATH` or
    /// `NAME=URL` for a named one (file://, git://, ssh://, https://; credentials come from
    /// the services' --git-credentials, never from here).
    #[arg(long = "repo", value_name = "[NAME=]PATH|URL")]
    repos: Vec<String>,
    /// Directory that `{plan_dir}` and relative repo paths resolve against (default: the folder).
    #[arg(long, value_name = "DIR")]
    plan_dir: Option<PathBuf>,
    /// Print the converted native plan and exit without running it.
    #[arg(long)]
    print: bool,
    /// Submit to a running server (such as `troupe up`) instead of starting one in-process.
    #[arg(long, env = "TROUPE_CONNECT", value_name = "URL")]
    connect: Option<String>,
    #[command(flatten)]
    reconnect: ReconnectArgs,
    #[command(flatten)]
    view: ViewArgs,
    #[command(flatten)]
    embedded: EmbeddedArgs,
    /// Credentials for `--connect`.
    #[command(flatten)]
    credentials: Credentials,
}

#[derive(Debug, clap::Args)]
struct PauseArgs {
    #[command(flatten)]
    session: SessionArgs,
    /// Why, recorded in the event log and the `session_paused` message.
    #[arg(long, default_value = "")]
    reason: String,
}

#[derive(Debug, clap::Args)]
struct ExportArgs {
    #[command(flatten)]
    session: SessionArgs,
    /// Folder to write (created; must be absent or empty).
    dir: PathBuf,
}

/// Runs the parsed command and returns the process exit code.
pub async fn main(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Up(args) => up(args).await,
        Command::Run(args) => run(args).await,
        Command::Status(args) => status(args).await,
        Command::Watch(args) => watch(args).await,
        Command::Import(args) => import(args).await,
        Command::Export(args) => export(args).await,
        Command::Check(args) => check(args).await,
        Command::Resume(args) => resume(args).await,
        Command::Pause(args) => pause(args).await,
        Command::Doctor(args) => doctor(args).await,
        Command::Cancel(args) => cancel(args).await,
        Command::Approve(args) => answer_gate(args, true).await,
        Command::Reject(args) => answer_gate(args, false).await,
        Command::Graph(args) => graph(args).await,
        Command::Report(args) => session_report(args).await,
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(if follow::is_unreachable(&err) {
                EXIT_UNREACHABLE
            } else {
                EXIT_INTERNAL
            })
        }
    }
}

async fn up(args: UpArgs) -> anyhow::Result<ExitCode> {
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let shutdown = troupe_grpc::shutdown_token();
    let embedded = Embedded::start(
        args.embedded.config(args.security.clone()),
        listener,
        shutdown.clone(),
    )
    .await?;
    if let Some(web) = embedded.serve_web(&args.web, &args.security).await? {
        eprintln!("web view on http://{web}/");
    }
    troupe_telemetry::metrics::spawn(
        &args.metrics,
        embedded.metrics_refresh(),
        shutdown.cancelled_owned(),
    )
    .await?;
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
    run_plan(
        plan,
        &args.repos,
        args.connect.as_deref(),
        &args.credentials,
        (&args.reconnect, &args.view),
        &args.embedded,
    )
    .await
}

/// Submits a loaded plan to `connect`, or to in-process services when `None`, and follows it
/// to the end (shared by `run` and `import`).
async fn run_plan(
    plan: plan_file::PlanFile,
    repos: &[String],
    connect: Option<&str>,
    credentials: &Credentials,
    (reconnect, view): (&ReconnectArgs, &ViewArgs),
    embedded_args: &EmbeddedArgs,
) -> anyhow::Result<ExitCode> {
    let budget = reconnect.budget()?;
    let repo_paths = match parse_repo_args(repos) {
        Ok(paths) => paths,
        Err(err) => {
            eprintln!("error: {err:#}");
            return Ok(ExitCode::from(EXIT_PLAN_INVALID));
        }
    };

    // A template repository given a URL starts the remote with the template, when empty.
    if repo_paths.values().any(|location| location.contains("://")) {
        match crate::seed::seed_templates(&plan.json, &plan.base_dir, &repo_paths).await {
            Ok(seeded) => {
                for line in seeded {
                    out(&format!("{line}\n"));
                }
            }
            Err(why) => {
                eprintln!("error: {why}");
                return Ok(ExitCode::from(EXIT_PLAN_INVALID));
            }
        }
    }

    let shutdown = CancellationToken::new();
    let (url, connector, embedded) = match connect {
        Some(url) => (url.to_owned(), Connector::new(credentials).await?, None),
        None => {
            // On loopback, for this process only: open, as `troupe up` on loopback.
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .context("binding a loopback port for the in-process services")?;
            let config = embedded_args.config(Security::default());
            let embedded = Embedded::start(config, listener, shutdown.clone()).await?;
            let url = troupe_grpc::url_for(embedded.addr());
            (url, Connector::default(), Some(embedded))
        }
    };

    let outcome = submit_and_follow(&connector, &url, (budget, view.plain), plan, repo_paths).await;
    if let Some(embedded) = embedded {
        shutdown.cancel();
        embedded.wait().await?;
    }
    outcome
}

async fn submit_and_follow(
    connector: &Connector,
    url: &str,
    (budget, plain): (std::time::Duration, bool),
    plan: plan_file::PlanFile,
    repo_paths: std::collections::HashMap<String, String>,
) -> anyhow::Result<ExitCode> {
    let assets = match crate::assets::collect(&plan.json, &plan.base_dir) {
        Ok(assets) => assets,
        Err(why) => {
            eprintln!("error: plan {}: {why}", plan.path.display());
            return Ok(ExitCode::from(EXIT_PLAN_INVALID));
        }
    };
    let mut follower = Follower::new(connector, url, budget)?;
    // A large plan goes in pieces: no one message need hold it whole.
    let upload = plan.json.len() > follow::PLAN_PIECE;
    let request = CreateSessionRequest {
        plan_json: plan.json,
        base_dir: plan.base_dir.display().to_string(),
        repo_paths,
        dry_run: false,
        assets,
        max_tasks: 0,
    };
    let created = if upload {
        follower.upload_plan(request).await
    } else {
        follower.create_session(request).await
    };
    let created = match created {
        Ok(response) => response,
        Err(err) => match err.downcast_ref::<follow::CallFailed>() {
            Some(follow::CallFailed(status)) if status.code() == tonic::Code::InvalidArgument => {
                eprintln!(
                    "error: plan {} was refused:\n{}",
                    plan.path.display(),
                    status.message()
                );
                return Ok(ExitCode::from(EXIT_PLAN_INVALID));
            }
            _ => return Err(err.context("creating the session failed")),
        },
    };
    let session = created.session.context("coordinator returned no session")?;
    out(&report::session_header(&session, created.waves));

    // The live view sizes its bars by every task, not the first page's.
    let tasks = if crate::live::is_live(plain) {
        follower
            .with_the_rest(&session.id, created.tasks, created.next_page_token)
            .await?
    } else {
        Vec::new()
    };
    let mut view = crate::live::for_stdout(plain, &tasks);
    let followed = follower.follow_events(&session.id, 0, view.as_mut()).await;
    view.finish();
    followed?;

    let final_state = follower
        .get_session(&session.id)
        .await
        .context("reading the final session")?;
    out(&report::final_report(&final_state));
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

/// Prints to stdout for `run` and `import`, which host services in this process and so keep
/// SIGPIPE ignored: a reader that went away (`| head`) stops the printing, not the run.
fn out(text: &str) {
    use std::io::Write as _;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}

/// Parses `--repo` values: `PATH` or `URL` names the default repo (key `""`), `NAME=PATH` or
/// `NAME=URL` a named one. Paths are made absolute; URLs go as given.
fn parse_repo_args(values: &[String]) -> anyhow::Result<std::collections::HashMap<String, String>> {
    let mut paths = std::collections::HashMap::new();
    for value in values {
        let (name, path) = match value.split_once('=') {
            Some((name, path)) if !name.contains('/') => (name.to_owned(), path),
            _ => (String::new(), value.as_str()),
        };
        let location = if path.contains("://") {
            path.to_owned()
        } else {
            std::path::absolute(path)
                .with_context(|| format!("resolving --repo {value}"))?
                .display()
                .to_string()
        };
        if paths.insert(name.clone(), location).is_some() {
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
    let mut client = args.client().await?;
    let response = client
        .get_session(GetSessionRequest {
            session_id: args.session,
            ..Default::default()
        })
        .await
        .map_err(follow::CallFailed)?
        .into_inner();
    print!("{}", report::final_report(&response));
    Ok(ExitCode::SUCCESS)
}

async fn watch(args: WatchArgs) -> anyhow::Result<ExitCode> {
    let connector = Connector::new(&args.session.credentials).await?;
    let mut follower = Follower::new(&connector, &args.session.connect, args.reconnect.budget()?)?;
    let session = &args.session.session;
    let tasks = if crate::live::is_live(args.view.plain) {
        follower.all_tasks(session).await?
    } else {
        Vec::new()
    };
    let mut view = crate::live::for_stdout(args.view.plain, &tasks);
    let followed = follower
        .follow_events(session, args.after, view.as_mut())
        .await;
    view.finish();
    followed?;
    Ok(ExitCode::SUCCESS)
}

async fn import(args: ImportArgs) -> anyhow::Result<ExitCode> {
    let document = match troupe_plan::ccw::import_session(&args.dir) {
        Ok(document) => document,
        Err(err) => {
            eprintln!(
                "error: ccw session {} was refused:\n{err}",
                args.dir.display()
            );
            return Ok(ExitCode::from(EXIT_PLAN_INVALID));
        }
    };
    if args.print {
        println!("{}", serde_json::to_string_pretty(&document)?);
        return Ok(ExitCode::SUCCESS);
    }
    let path = std::path::absolute(&args.dir).context("resolving the session folder")?;
    let base_dir = match &args.plan_dir {
        Some(dir) => std::path::absolute(dir).context("resolving --plan-dir")?,
        None => path.clone(),
    };
    let mut repos = args.repos.clone();
    // A CCW session names no repository: it works on the project it sits in.
    if repos.is_empty() && document.get("repos").is_none() {
        match troupe_plan::ccw::project_root(&path) {
            Some(root) => repos.push(root.display().to_string()),
            None => {
                eprintln!(
                    "error: ccw session {} names no repository and is not under <project>/.workflow/.team/: pass --repo PATH",
                    args.dir.display()
                );
                return Ok(ExitCode::from(EXIT_PLAN_INVALID));
            }
        }
    }
    let plan = plan_file::PlanFile {
        json: document.to_string(),
        base_dir,
        path,
    };
    run_plan(
        plan,
        &repos,
        args.connect.as_deref(),
        &args.credentials,
        (&args.reconnect, &args.view),
        &args.embedded,
    )
    .await
}

async fn export(args: ExportArgs) -> anyhow::Result<ExitCode> {
    let connector = Connector::new(&args.session.credentials).await?;
    let summary = ccw_export::export(
        &connector,
        &args.session.connect,
        &args.session.session,
        &args.dir,
    )
    .await?;
    println!(
        "exported session {} to {}: {} tasks, {} messages, {} files",
        args.session.session,
        args.dir.display(),
        summary.tasks,
        summary.messages,
        summary.files.len()
    );
    Ok(ExitCode::SUCCESS)
}

/// `troupe check`: the coordinator's read-only `CheckSession`, printed as a status graph.
async fn check(args: SessionArgs) -> anyhow::Result<ExitCode> {
    let mut client = args.client().await?;
    let status = client
        .check_session(troupe_proto::v1::CheckSessionRequest {
            session_id: args.session,
            ..Default::default()
        })
        .await
        .context("checking the session")?
        .into_inner();
    print!("{}", status_report(&status));
    Ok(ExitCode::SUCCESS)
}

/// `troupe resume`: `ResumeSession`, then the changes it made and the status graph.
async fn resume(args: SessionArgs) -> anyhow::Result<ExitCode> {
    let mut client = args.client().await?;
    let resumed = client
        .resume_session(troupe_proto::v1::ResumeSessionRequest {
            session_id: args.session,
        })
        .await
        .context("resuming the session")?
        .into_inner();
    if resumed.reconciled.is_empty() {
        println!("nothing to reconcile");
    }
    for change in &resumed.reconciled {
        println!(
            "{}: {} -> {} ({})",
            change.task_id,
            report::task_state_name(change.from),
            report::task_state_name(change.to),
            change.reason
        );
    }
    if let Some(status) = &resumed.status {
        print!("{}", status_report(status));
    }
    Ok(ExitCode::SUCCESS)
}

/// `troupe pause`: `PauseSession`, then what still runs.
async fn pause(args: PauseArgs) -> anyhow::Result<ExitCode> {
    let mut client = args.session.client().await?;
    let paused = client
        .pause_session(troupe_proto::v1::PauseSessionRequest {
            session_id: args.session.session,
            reason: args.reason,
        })
        .await
        .context("pausing the session")?
        .into_inner();
    if let Some(session) = &paused.session {
        println!(
            "session {} is {}",
            session.id,
            report::session_state_name(session.state)
        );
    }
    if paused.running_task_ids.is_empty() {
        println!("nothing is running");
    } else {
        println!(
            "still running (their results will be recorded): {}",
            paused.running_task_ids.join(", ")
        );
    }
    println!("`troupe resume` continues it");
    Ok(ExitCode::SUCCESS)
}

/// `troupe cancel`: `CancelSession`, then the session's state.
async fn cancel(args: CancelArgs) -> anyhow::Result<ExitCode> {
    let mut client = args.session.client().await?;
    let cancelled = client
        .cancel_session(troupe_proto::v1::CancelSessionRequest {
            session_id: args.session.session,
            reason: args.reason,
        })
        .await
        .map_err(follow::CallFailed)?
        .into_inner();
    if let Some(session) = &cancelled.session {
        println!(
            "session {} is {}",
            session.id,
            report::session_state_name(session.state)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `troupe approve` / `troupe reject`: answers a task's approval gate or a role's checkpoint.
async fn answer_gate(args: GateArgs, approve: bool) -> anyhow::Result<ExitCode> {
    let mut client = args.session.client().await?;
    let checkpoint = match (&args.role, args.checkpoint) {
        (Some(role), _) => format!("{role}:{}", args.when),
        (None, Some(checkpoint)) => checkpoint,
        (None, None) => String::new(),
    };
    let (session_id, task_id, note) = (
        args.session.session,
        args.task.unwrap_or_default(),
        args.note,
    );
    let (task, released) = if approve {
        let answer = client
            .approve_task(troupe_proto::v1::ApproveTaskRequest {
                session_id,
                task_id,
                note,
                checkpoint: checkpoint.clone(),
            })
            .await
            .map_err(follow::CallFailed)?
            .into_inner();
        (answer.task, answer.released)
    } else {
        let answer = client
            .reject_task(troupe_proto::v1::RejectTaskRequest {
                session_id,
                task_id,
                note,
                checkpoint: checkpoint.clone(),
            })
            .await
            .map_err(follow::CallFailed)?
            .into_inner();
        (answer.task, answer.released)
    };
    if !checkpoint.is_empty() {
        let verb = if approve { "approved" } else { "rejected" };
        println!("checkpoint {checkpoint} is {verb}");
    }
    for task in task.iter().chain(&released) {
        println!("{} is {}", task.id, report::task_state_name(task.state));
    }
    Ok(ExitCode::SUCCESS)
}

/// Reads a session and every one of its tasks (for `graph` and `report`).
async fn get_session(args: &SessionArgs) -> anyhow::Result<troupe_proto::v1::GetSessionResponse> {
    let mut client = args.client().await?;
    Ok(follow::whole_session(&mut client, &args.session)
        .await
        .map_err(follow::CallFailed)?)
}

/// `troupe graph`: the session's DAG as Mermaid, DOT or SVG.
async fn graph(args: GraphArgs) -> anyhow::Result<ExitCode> {
    let response = get_session(&args.session).await?;
    let now = chrono::Utc::now();
    let nodes: Vec<troupe_view::graph::Node> = response
        .tasks
        .iter()
        .map(|task| troupe_view::graph::Node::from_task(task, now))
        .collect();
    print!(
        "{}",
        troupe_view::graph::render(args.format, &args.session.session, &nodes)
    );
    Ok(ExitCode::SUCCESS)
}

/// `troupe report`: time, attempts, tokens and cost per task, repo and backend.
async fn session_report(args: ReportArgs) -> anyhow::Result<ExitCode> {
    let prices = match &args.prices {
        Some(path) => crate::session_report::load_prices(path)?,
        None => Default::default(),
    };
    let response = get_session(&args.session).await?;
    let report = crate::session_report::build(&response, &prices);
    print!("{}", crate::session_report::render(args.format, &report)?);
    Ok(ExitCode::SUCCESS)
}

/// `troupe doctor`: the server's services, one line per backend (see [`crate::doctor`]), then
/// what this kernel's Landlock support means for the sandbox.
async fn doctor(args: DoctorArgs) -> anyhow::Result<ExitCode> {
    let connected = args.connect.is_some();
    let shutdown = CancellationToken::new();
    let scratch = std::env::temp_dir().join(format!("troupe-doctor-{}", std::process::id()));
    let (url, connector, server) = match args.connect {
        Some(url) => (url, Connector::new(&args.credentials).await?, None),
        None => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let config = troupe_executor::Config {
                listen: listener.local_addr()?,
                data_dir: scratch.clone(),
                coordinator_url: None,
                concurrency: 1,
                worker_id: None,
                worker: Default::default(),
                backends_config: args.config,
                validator_url: None,
                phase_concurrency: 1,
                summary_dir: String::new(),
                security: Default::default(),
                sandbox: troupe_process::sandbox::SandboxArgs::from_env()
                    .map_err(anyhow::Error::msg)?,
            };
            let url = troupe_grpc::url_for(config.listen);
            let stop = shutdown.clone();
            (
                url,
                Connector::default(),
                Some(tokio::spawn(troupe_executor::run(config, listener, stop))),
            )
        }
    };
    let checked = crate::doctor::check(&connector, &url, args.probe).await;
    shutdown.cancel();
    if let Some(server) = server {
        server.await.context("in-process executor")??;
        let _ = std::fs::remove_dir_all(&scratch);
    }
    let report = checked?;
    print!("{}", report.text);
    // This machine's kernel, with the mode the TROUPE_SANDBOX* variables give here.
    let sandbox = troupe_process::sandbox::SandboxArgs::from_env().map_err(anyhow::Error::msg)?;
    println!(
        "{}{}",
        troupe_process::sandbox::support(
            troupe_process::sandbox::landlock_abi(),
            sandbox.mode,
            sandbox.connect_ports.is_some(),
        ),
        if connected {
            " [this machine's kernel, not the executor's]"
        } else {
            ""
        }
    );
    // A failed live call is worth a non-zero exit: scripts check the machine with it.
    Ok(if report.probe_failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Renders a `CheckSession` answer: progress, tasks by wave, workers, blockers, gaps, stall.
fn status_report(status: &troupe_proto::v1::CheckSessionResponse) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    if let Some(session) = &status.session {
        let _ = writeln!(
            out,
            "{} [{}] {}% complete",
            session.id,
            report::session_state_name(session.state),
            status.percent_complete
        );
    }
    let multi_repo = status
        .session
        .as_ref()
        .is_some_and(|session| session.repos.len() > 1);
    for wave in &status.waves {
        let _ = writeln!(out, "wave {}", wave.number);
        for node in status.graph.iter().filter(|node| node.wave == wave.number) {
            let mut line = format!(
                "  {:<8} {} {}",
                troupe_proto::names::name(node.status()),
                node.task_id,
                node.title
            );
            if multi_repo {
                let _ = write!(line, " [{}]", node.repo);
            }
            if !node.waiting_on.is_empty()
                && node.status() == troupe_proto::v1::GraphStatus::Pending
            {
                let _ = write!(line, " (waits on {})", node.waiting_on.join(", "));
            }
            // A done task's last heartbeat note ("running backend …") no longer says anything.
            if !node.progress.is_empty() && node.status() != troupe_proto::v1::GraphStatus::Done {
                let _ = write!(line, " - {}", node.progress);
            }
            let _ = writeln!(out, "{line}");
        }
        // A large session's status lists some of each wave's tasks (`troupe graph` lists all).
        let listed = u32::try_from(wave.task_ids.len()).unwrap_or(u32::MAX);
        if wave.task_count > listed {
            let _ = writeln!(out, "  ... and {} more", wave.task_count - listed);
        }
    }
    if status.graph_omitted > 0 {
        let _ = writeln!(
            out,
            "{} task(s) not listed: `troupe graph` lists every task",
            status.graph_omitted
        );
    }
    for worker in &status.active_workers {
        let elapsed = worker.elapsed.map_or(0, |elapsed| elapsed.seconds);
        let _ = writeln!(
            out,
            "worker {} runs {} (attempt {}, {elapsed}s)",
            worker.worker_id, worker.task_id, worker.attempt
        );
    }
    for blocker in &status.blockers {
        let _ = writeln!(
            out,
            "blocker {} from {}: {}",
            blocker.id, blocker.from, blocker.summary
        );
    }
    for gap in &status.capability_gaps {
        let _ = writeln!(out, "capability gap: {}", gap.message);
    }
    for wait in &status.quota_waits {
        let _ = writeln!(out, "quota: {}", wait.message);
    }
    if let Some(stall) = &status.stall {
        let _ = writeln!(out, "{}", stall.summary);
        for task in &stall.tasks {
            let _ = writeln!(out, "  {}: {}", task.task_id, task.reason);
        }
        let listed = u32::try_from(stall.tasks.len()).unwrap_or(u32::MAX);
        if stall.task_count > listed {
            let _ = writeln!(out, "  ... and {} more", stall.task_count - listed);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_shows_heartbeat_notes_of_unfinished_tasks_only() {
        use troupe_proto::v1::{CheckSessionResponse, GraphStatus, StatusNode, Wave};
        let node = |id: &str, status: GraphStatus| StatusNode {
            task_id: id.to_owned(),
            wave: 1,
            status: status as i32,
            progress: format!("note of {id}"),
            ..StatusNode::default()
        };
        let status = CheckSessionResponse {
            graph: vec![
                node("A", GraphStatus::Done),
                node("B", GraphStatus::Running),
            ],
            waves: vec![Wave {
                number: 1,
                task_ids: vec!["A".to_owned(), "B".to_owned()],
                task_count: 2,
            }],
            ..CheckSessionResponse::default()
        };
        let report = status_report(&status);
        assert!(report.contains("note of B"), "{report}");
        assert!(!report.contains("note of A"), "{report}");
    }

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
    fn cli_parses_import_and_export() {
        let cli = Cli::try_parse_from([
            "troupe",
            "import",
            "ccw/session",
            "--repo",
            "/tmp/x",
            "--print",
        ])
        .unwrap();
        assert!(matches!(
            cli.command,
            Command::Import(ImportArgs { print: true, .. })
        ));
        let cli =
            Cli::try_parse_from(["troupe", "export", "s-1", "out", "--connect", "http://h:1"])
                .unwrap();
        let Command::Export(args) = cli.command else {
            panic!("not export")
        };
        assert_eq!(args.session.session, "s-1");
        assert_eq!(args.dir, PathBuf::from("out"));
        assert_eq!(args.session.connect, "http://h:1");
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

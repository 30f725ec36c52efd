//! The troupe validator: checks a task's result with evidence, and nothing passes by default.
//!
//! Checks: files against a commit range (`create` exists and is non-empty, `modify` exists and
//! changed, `delete` absent); then, in one detached worktree at the commit, the verification
//! command (argv, pass iff exit 0, timeout kills its process group), syntax and lint of the
//! changed files by language, convergence criteria (typed criteria decided by a check, free
//! text by a judge that must cite evidence that exists, else MANUAL_REVIEW), and for REVIEW-*
//! a four-dimension review with an APPROVE / CONDITIONAL / BLOCK verdict. VERIFY-* checks every
//! upstream task's promises at the session head and writes `verification.md` with its gaps.
//! The verdict is FAIL on any failed or errored check, else MANUAL_REVIEW when any check needs
//! review, else PASS. The service answers `Validator.Validate` and, with `--coordinator-url`,
//! claims validator tasks as a worker.

mod check;
mod criteria;
mod grpc;
mod judge;
mod lexer;
mod repos;
mod review;
mod syntax;
mod tools;
mod validate;
mod verify;
mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use troupe_grpc::Services;
use troupe_grpc::worker::{WorkerSettings, run_worker_if_configured};
use troupe_proto::v1::Role;
use troupe_proto::v1::validator_server::ValidatorServer;
use troupe_telemetry::metrics::MetricsArgs;

pub use judge::JudgeConfig;
pub use review::LONG_FILE_LINES;
pub use tools::Tools;
pub use validate::{
    DEFAULT_VERIFICATION_TIMEOUT, NO_CRITERION_CHECKER, Validation, Validator, verdict,
};
pub use worker::ValidateHandler;

/// Configuration of the validator service.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// Address to serve gRPC on.
    #[arg(long, env = "TROUPE_LISTEN", default_value = "127.0.0.1:7074")]
    pub listen: SocketAddr,
    /// Directory for the worktrees verification commands run in and records of live child
    /// process groups (`children/`), killed at the next start if they outlived this process.
    #[arg(long, env = "TROUPE_DATA_DIR", default_value = ".troupe")]
    pub data_dir: PathBuf,
    /// Coordinator to claim VALIDATE-* tasks from; without it only the RPC is served.
    #[arg(long, env = "TROUPE_COORDINATOR_URL")]
    pub coordinator_url: Option<String>,
    /// Worker id (default `validator-<hostname>-<pid>`).
    #[arg(long, env = "TROUPE_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Lease and call deadlines of the worker loop.
    #[command(flatten)]
    pub worker: troupe_grpc::worker::WorkerTuning,
    /// Validations at once as a worker.
    #[arg(long, env = "TROUPE_VALIDATOR_CONCURRENCY", default_value_t = 1)]
    pub concurrency: usize,
    /// Authentication: accepted tokens and client certificates, this server's certificate,
    /// and the credentials of its own calls.
    #[command(flatten)]
    pub security: troupe_grpc::auth::Security,
}

/// Settings of the checks themselves. The binary takes them as flags; embedders that build
/// [`Config`] themselves get them from the environment ([`CheckConfig::from_env`]).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct CheckConfig {
    /// Directories searched first for check tools (tsc, ruff, flake8, ...) and put first on
    /// their `PATH`; `:`-separated in the environment.
    #[arg(
        long = "tool-dir",
        env = "TROUPE_VALIDATOR_TOOL_DIRS",
        value_delimiter = ':'
    )]
    pub tool_dirs: Vec<PathBuf>,
    /// Judge for free-text criteria when a task names none: a command line (split without a
    /// shell) that reads the criterion and evidence as JSON on stdin and answers JSON.
    #[arg(long, env = "TROUPE_VALIDATOR_JUDGE", conflicts_with = "judge_config")]
    pub judge: Option<String>,
    /// Judge for free-text criteria when a task names none, as a TOML file: `backend`
    /// (`codex`, `claude`, `gemini`, `qwen`, `opencode`, `agent` or `command`) and the
    /// executor's backend settings (`command`, `model`, `endpoint`, `api_key_env`,
    /// `env_allow`, `timeout_seconds`, ...). The backend runs read-only in the worktree.
    #[arg(long, env = "TROUPE_VALIDATOR_JUDGE_CONFIG")]
    pub judge_config: Option<PathBuf>,
    /// Wall-clock limit per judged criterion.
    #[arg(
        long,
        env = "TROUPE_VALIDATOR_JUDGE_TIMEOUT_SECONDS",
        default_value_t = 300
    )]
    pub judge_timeout_seconds: u64,
    /// Landlock confinement of verification commands.
    #[command(flatten)]
    pub sandbox: troupe_process::sandbox::SandboxArgs,
}

impl CheckConfig {
    /// The `TROUPE_VALIDATOR_*` variables (tool dirs, judge, judge config, judge timeout) only.
    pub fn from_env() -> Result<Self, Error> {
        #[derive(clap::Parser)]
        struct FromEnv {
            #[command(flatten)]
            checks: CheckConfig,
        }
        <FromEnv as clap::Parser>::try_parse_from(["troupe-validator"])
            .map(|parsed| parsed.checks)
            .map_err(|err| Error::InvalidArgument(format!("validator settings: {err}")))
    }

    fn judge(&self) -> Result<Option<JudgeConfig>, Error> {
        let timeout = Duration::from_secs(match self.judge_timeout_seconds {
            0 => 300,
            secs => secs,
        });
        if let Some(path) = &self.judge_config {
            let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
                path: path.clone(),
                source,
            })?;
            return JudgeConfig::from_toml(&text, timeout)
                .map(Some)
                .map_err(|err| {
                    Error::InvalidArgument(format!("judge config {}: {err}", path.display()))
                });
        }
        match self.judge.as_deref().map(str::trim) {
            None | Some("") => Ok(None),
            Some(line) => Ok(Some(JudgeConfig::command(
                troupe_process::command_line_to_argv(line).map_err(|err| {
                    Error::InvalidArgument(format!("--judge cannot be parsed: {err}"))
                })?,
                timeout,
            ))),
        }
    }
}

/// Errors of the validator. A check that fails is not an error: it is a FAIL in the report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request or task is malformed.
    #[error("{0}")]
    InvalidArgument(String),
    /// The validation was cancelled.
    #[error("cancelled")]
    Cancelled,
    /// Git: repository, revision or worktree.
    #[error(transparent)]
    Workspace(#[from] troupe_workspace::Error),
    /// A child could not be supervised.
    #[error(transparent)]
    Process(troupe_process::Error),
    /// File system.
    #[error("i/o error on {}: {source}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Serving or the worker loop failed.
    #[error(transparent)]
    Grpc(#[from] troupe_grpc::Error),
}

/// The opened service.
#[derive(Debug, Clone)]
pub struct App {
    config: Config,
    validator: Arc<Validator>,
    connector: troupe_grpc::Connector,
    _lock: Arc<troupe_grpc::DataDirLock>,
    /// Its health entry once mounted, flipped by the worker loop.
    health: Option<troupe_grpc::ServiceHealth>,
}

impl App {
    /// Creates the data directory and the validator; check settings come from the environment.
    pub async fn open(config: Config) -> Result<Self, Error> {
        Self::open_with(config, CheckConfig::from_env()?).await
    }

    /// Creates the data directory and the validator with explicit check settings.
    pub async fn open_with(mut config: Config, checks: CheckConfig) -> Result<Self, Error> {
        config.data_dir = troupe_grpc::prepare_data_dir(&config.data_dir)
            .await
            .map_err(|source| Error::Io {
                path: config.data_dir.clone(),
                source,
            })?;
        let lock = troupe_grpc::lock_data_dir(&config.data_dir, "validator").map_err(|source| {
            Error::Io {
                path: config.data_dir.clone(),
                source,
            }
        })?;
        let children = config.data_dir.join("children");
        let killed = troupe_process::supervise_children(&children)
            .await
            .map_err(Error::Process)?;
        if !killed.is_empty() {
            tracing::warn!(groups = ?killed, "killed child processes left alive by a previous run");
        }
        let validator = Arc::new(
            Validator::new(config.data_dir.clone())
                .with_credentials(Arc::new(match &config.worker.git_credentials {
                    Some(path) => troupe_workspace::Credentials::load(path)?,
                    None => troupe_workspace::Credentials::none(),
                }))
                .with_tools(Tools::new(checks.tool_dirs.clone()))
                .with_sandbox(checks.sandbox.clone())
                .with_judge(checks.judge()?),
        );
        validator.recover().await?;
        let connector = troupe_grpc::Connector::new(&config.security.credentials).await?;
        Ok(Self {
            config,
            validator,
            connector,
            _lock: Arc::new(lock),
            health: None,
        })
    }

    /// Calls the coordinator with `connector` instead of the configured credentials.
    pub fn with_connector(mut self, connector: troupe_grpc::Connector) -> Self {
        self.connector = connector;
        self
    }

    /// The validator, for in-process callers.
    pub fn validator(&self) -> Arc<Validator> {
        Arc::clone(&self.validator)
    }
}

impl troupe_grpc::boot::Service for App {
    type Error = Error;

    /// Adds `troupe.v1.Validator` to a shared server.
    fn mount(&mut self, services: &mut Services) {
        self.health = Some(services.health_of(
            <ValidatorServer<grpc::ValidatorService> as tonic::server::NamedService>::NAME,
        ));
        let limit = self.config.security.credentials.max_message();
        services.add(
            ValidatorServer::new(grpc::ValidatorService::new(self.validator()))
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
        );
    }

    /// Runs the VALIDATE-* worker loop when a coordinator is configured, else waits for shutdown.
    async fn run_background(self, shutdown: CancellationToken) -> Result<(), Error> {
        let settings = WorkerSettings {
            coordinator_url: self.config.coordinator_url.clone(),
            worker_id: self.config.worker_id.clone(),
            role: Role::Validator,
            concurrency: self.config.concurrency,
            tuning: &self.config.worker,
            connector: &self.connector,
            data_dir: &self.config.data_dir,
            health: self.health.clone(),
            // Their tasks are not routed by backend (see `troupe_plan::backend::routes`).
            capabilities: Vec::new(),
            auto_backend: String::new(),
        };
        run_worker_if_configured(
            settings,
            Arc::new(ValidateHandler::new(self.validator())),
            shutdown,
        )
        .await?;
        Ok(())
    }
}

/// Serves the RPC (and the worker loop when configured) on `listener` until `shutdown`;
/// check settings come from the environment.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let metrics = MetricsArgs::default();
    run_with(
        config,
        CheckConfig::from_env()?,
        &metrics,
        listener,
        shutdown,
    )
    .await
}

/// [`run`] with explicit check settings, serving metrics as `metrics` says.
pub async fn run_with(
    config: Config,
    checks: CheckConfig,
    metrics: &MetricsArgs,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let auth = troupe_grpc::auth::ServerAuth::load(&config.security).await?;
    let app = App::open_with(config, checks).await?;
    troupe_grpc::boot::serve(app, auth, metrics, listener, shutdown).await
}

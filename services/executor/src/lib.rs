//! The troupe executor: implements IMPL/EXEC tasks by driving an agent backend in a per-task
//! git worktree.
//!
//! Each attempt gets its own worktree under `<data_dir>/worktrees/<session>/<task>-<attempt>`
//! on the task branch `troupe-task/<session>/<task>`, made from the session branch's current
//! head. The backend runs there with the handoff prompt on stdin (and in
//! `<data_dir>/attempts/.../prompt.md`); whatever it changed is committed, checked against the
//! task's `files[]`/`focus_paths`, and integrated into `troupe/<session>` without touching any
//! checkout. The service answers `Executor.ExecuteTask` (one task outside any session) and
//! `Executor.ListBackends`, and with `--coordinator-url` claims executor tasks as a worker.

mod execute;
mod grpc;
mod metrics;
mod mode;
mod phase;
mod pre_analysis;
mod prompt;
mod spec;
mod validation;
mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use troupe_grpc::Services;
use troupe_grpc::worker::{TaskFailure, WorkerSettings, run_worker_if_configured};
use troupe_proto::v1::Role;
use troupe_proto::v1::executor_server::ExecutorServer;
use troupe_telemetry::metrics::MetricsArgs;

pub use execute::{
    ContextRepo, DEFAULT_SUMMARY_DIR, Executor, Job, Options, Progress, Target, task_branch,
};
pub use grpc::TASK_ERROR_METADATA;
pub use prompt::UpstreamNote;
pub use spec::{DEFAULT_AGENT_TIMEOUT, ScopePolicy, TaskSpec, struct_to_json};
pub use worker::ExecuteHandler;

/// Configuration of the executor service.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// Address to serve gRPC on.
    #[arg(long, env = "TROUPE_LISTEN", default_value = "127.0.0.1:7072")]
    pub listen: SocketAddr,
    /// Directory for worktrees (`worktrees/`), attempt files such as prompts (`attempts/`) and
    /// records of live agent process groups (`children/`), killed at the next start if they
    /// outlived this process.
    #[arg(long, env = "TROUPE_DATA_DIR", default_value = ".troupe")]
    pub data_dir: PathBuf,
    /// Coordinator to claim executor tasks from; without it only the RPCs are served.
    #[arg(long, env = "TROUPE_COORDINATOR_URL")]
    pub coordinator_url: Option<String>,
    /// Tasks run at once as a worker.
    #[arg(long, env = "TROUPE_EXECUTOR_CONCURRENCY", default_value_t = 2)]
    pub concurrency: usize,
    /// Worker id (default `executor-<hostname>-<pid>`).
    #[arg(long, env = "TROUPE_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Lease and call deadlines of the worker loop.
    #[command(flatten)]
    pub worker: troupe_grpc::worker::WorkerTuning,
    /// Backend configuration file (TOML: per-backend command, model, endpoint, env allow-list,
    /// timeouts; fallback chain and retries).
    #[arg(long = "config", env = "TROUPE_EXECUTOR_CONFIG")]
    pub backends_config: Option<PathBuf>,
    /// Validator to self-validate each task's commit with (`Validate`: files, verification,
    /// convergence criteria, syntax). Without it results say that self-validation was skipped.
    #[arg(long, env = "TROUPE_VALIDATOR_URL")]
    pub validator_url: Option<String>,
    /// Tasks of one EXEC-* phase wave run at once.
    #[arg(long, env = "TROUPE_EXECUTOR_PHASE_CONCURRENCY", default_value_t = 4)]
    pub phase_concurrency: usize,
    /// Repository directory for `summary-<ID>.md`, committed on each task branch; empty
    /// writes none.
    #[arg(long, env = "TROUPE_EXECUTOR_SUMMARY_DIR", default_value = DEFAULT_SUMMARY_DIR)]
    pub summary_dir: String,
    /// Authentication: accepted tokens and client certificates, this server's certificate,
    /// and the credentials of its own calls.
    #[command(flatten)]
    pub security: troupe_grpc::auth::Security,
    /// Landlock confinement of agents and pre_analysis commands.
    #[command(flatten)]
    pub sandbox: troupe_process::sandbox::SandboxArgs,
}

/// Errors of the executor.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request is malformed.
    #[error("{0}")]
    InvalidArgument(String),
    /// `ExecuteTask` was asked to create a branch that exists.
    #[error("branch `{branch}` already exists at {current}")]
    BranchExists {
        /// The branch.
        branch: String,
        /// Where it points.
        current: String,
    },
    /// The task ran and failed; the classified error is inside.
    #[error("{}", .0.error.message)]
    Task(Box<TaskFailure>),
    /// Git: repository, revision, worktree.
    #[error(transparent)]
    Workspace(#[from] troupe_workspace::Error),
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
    /// The backend configuration file is unusable.
    #[error(transparent)]
    Config(#[from] troupe_backends::ConfigError),
    /// Supervising child processes (the reaper or the records under `children/`) failed.
    #[error(transparent)]
    Children(troupe_process::Error),
}

/// The opened service.
#[derive(Debug, Clone)]
pub struct App {
    config: Config,
    executor: Arc<Executor>,
    _lock: Arc<troupe_grpc::DataDirLock>,
    /// Its health entry once mounted, flipped by the worker loop.
    health: Option<troupe_grpc::ServiceHealth>,
}

impl App {
    /// Creates the data directory (made absolute: agents run with the worktree as cwd).
    pub async fn open(config: Config) -> Result<Self, Error> {
        let connector = troupe_grpc::Connector::new(&config.security.credentials).await?;
        Self::open_connected(config, connector).await
    }

    /// [`App::open`] whose calls (to the coordinator and the validator) use `connector`.
    pub async fn open_connected(
        mut config: Config,
        connector: troupe_grpc::Connector,
    ) -> Result<Self, Error> {
        metrics::register();
        config.data_dir = troupe_grpc::prepare_data_dir(&config.data_dir)
            .await
            .map_err(|source| Error::Io {
                path: config.data_dir.clone(),
                source,
            })?;
        let backends = match &config.backends_config {
            Some(path) => troupe_backends::BackendsConfig::load(path)?,
            None => troupe_backends::BackendsConfig::default(),
        };
        if config.phase_concurrency == 0 {
            return Err(Error::InvalidArgument(
                "--phase-concurrency must be at least 1".to_owned(),
            ));
        }
        let options = Options {
            validator_url: config.validator_url.clone().filter(|url| !url.is_empty()),
            phase_concurrency: config.phase_concurrency,
            summary_dir: Some(config.summary_dir.trim().to_owned()).filter(|d| !d.is_empty()),
            connector,
            sandbox: config.sandbox.clone(),
        };
        let lock = troupe_grpc::lock_data_dir(&config.data_dir, "executor").map_err(|source| {
            Error::Io {
                path: config.data_dir.clone(),
                source,
            }
        })?;
        // Before the worktrees are cleared: orphaned agents of a dead run may still write there.
        let children = config.data_dir.join("children");
        let killed = troupe_process::supervise_children(&children)
            .await
            .map_err(Error::Children)?;
        if !killed.is_empty() {
            tracing::warn!(groups = ?killed, "killed child processes left alive by a previous run");
        }
        let credentials = match &config.worker.git_credentials {
            Some(path) => troupe_workspace::Credentials::load(path)?,
            None => troupe_workspace::Credentials::none(),
        };
        let executor = Arc::new(
            Executor::with_options(config.data_dir.clone(), backends, options)
                .with_credentials(Arc::new(credentials)),
        );
        // Worktrees of attempts that died with an earlier run: their tasks come back from the
        // coordinator and start over from the remote.
        executor.recover().await?;
        Ok(Self {
            config,
            executor,
            _lock: Arc::new(lock),
            health: None,
        })
    }

    /// The executor, for in-process callers.
    pub fn executor(&self) -> Arc<Executor> {
        Arc::clone(&self.executor)
    }
}

impl troupe_grpc::boot::Service for App {
    type Error = Error;

    /// Adds `troupe.v1.Executor` to a shared server.
    fn mount(&mut self, services: &mut Services) {
        self.health = Some(services.health_of(
            <ExecutorServer<grpc::ExecutorService> as tonic::server::NamedService>::NAME,
        ));
        let limit = self.config.security.credentials.max_message();
        services.add(
            ExecutorServer::new(grpc::ExecutorService::new(self.executor()))
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
        );
    }

    /// Runs the executor worker loop when a coordinator is configured, else waits for shutdown.
    async fn run_background(self, shutdown: CancellationToken) -> Result<(), Error> {
        // The probe below can take seconds: the worker's families are scraped meanwhile.
        troupe_grpc::worker::register_metrics();
        // What `troupe doctor` sees here (installed, with a credential), so the coordinator
        // routes tasks to workers that can run their backend; probed once, at start.
        let capabilities = match &self.config.coordinator_url {
            Some(_) => {
                let infos = self.executor.probe().await;
                let offered: Vec<String> = infos
                    .iter()
                    .filter(|info| info.available)
                    .map(|info| troupe_plan::backend::capability(&info.name))
                    .collect();
                tracing::info!(backends = ?offered, "backends this worker can run");
                offered
            }
            None => Vec::new(),
        };
        let settings = WorkerSettings {
            coordinator_url: self.config.coordinator_url.clone(),
            worker_id: self.config.worker_id.clone(),
            role: Role::Executor,
            concurrency: self.config.concurrency,
            tuning: &self.config.worker,
            connector: &self.executor.options().connector,
            data_dir: &self.config.data_dir,
            health: self.health.clone(),
            capabilities,
            auto_backend: self.executor.config().auto_backend.clone(),
        };
        run_worker_if_configured(
            settings,
            Arc::new(ExecuteHandler::new(self.executor())),
            shutdown,
        )
        .await?;
        Ok(())
    }
}

/// Serves the RPCs (and the worker loop when configured) on `listener` until `shutdown`.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    run_with_metrics(config, &MetricsArgs::default(), listener, shutdown).await
}

/// [`run`], serving metrics as `metrics` says.
pub async fn run_with_metrics(
    config: Config,
    metrics: &MetricsArgs,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let auth = troupe_grpc::auth::ServerAuth::load(&config.security).await?;
    troupe_grpc::boot::serve(App::open(config).await?, auth, metrics, listener, shutdown).await
}

//! The troupe test-runner: runs a repository's Jest (≥ 22), Vitest (≥ 1) or Pytest (≥ 7) suite
//! at a commit, in a detached worktree, and reports totals, failures and coverage read from the
//! framework's structured reports (never from its console text).
//!
//! Jest and Vitest run from the project's local binaries with only the flags the installed
//! version accepts, results and istanbul coverage written to files (docs/test-frameworks.md §1,
//! §8); Pytest uses JUnit XML, pytest-json-report and coverage.py JSON. The code under test is
//! the worktree's own: workspace links are re-made inside it, the Python import roots go first
//! on `PYTHONPATH`, and anything resolving elsewhere is WRONG_SOURCE (`source`). Installs follow
//! the project (npm, pnpm, yarn, bun; pyproject extras and groups, requirements, uv.lock), the
//! run's `setup` commands, `env` and `workdir` apply, and every run is one process group killed
//! at a wall-clock limit; when every test hits the per-test timeout the run is retried once with
//! a longer one. With `fix`, CCW's fix loop (flaky re-run, strategy, any agent backend with the
//! executor's retry and fallback policy, scope check, checkpoint commits, revert-if-worse) runs
//! on the worktree. The service answers `TestRunner.RunTests` and, with `--coordinator-url`,
//! claims TESTRUN-* tasks as a worker, integrates successful fixes into the session branch and
//! reports `state_update` and `tests_passed` / `tests_failed` on the bus.

#![recursion_limit = "256"]

mod detect;
mod failure;
mod fix;
mod grpc;
mod js;
mod node;
mod poetry;
mod project_venv;
mod pytest;
mod python;
mod runner;
mod sandbox;
mod setup;
mod source;
mod venv;
mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use troupe_grpc::Services;
use troupe_grpc::worker::{WorkerSettings, run_worker_if_configured};
use troupe_proto::v1::Role;
use troupe_proto::v1::test_runner_server::TestRunnerServer;
use troupe_telemetry::metrics::MetricsArgs;

pub use fix::{
    DEFAULT_AGENT_TIMEOUT, DEFAULT_MAX_ITERATIONS, FixSpec, IterationSink, PASS_RATE_TARGET,
};
pub use runner::{DEFAULT_TEST_TIMEOUT_SECONDS, DEFAULT_TIMEOUT, RunSpec, Runner};
pub use worker::TestRunHandler;

/// Configuration of the test-runner service.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// Address to serve gRPC on.
    #[arg(long, env = "TROUPE_LISTEN", default_value = "127.0.0.1:7073")]
    pub listen: SocketAddr,
    /// Directory for worktrees, reports (`test-runs/<run id>/`), cached venvs (`venvs/`) and
    /// cached JS installs (`node/`) and records of live child process groups (`children/`),
    /// killed at the next start if they outlived this process.
    #[arg(long, env = "TROUPE_DATA_DIR", default_value = ".troupe")]
    pub data_dir: PathBuf,
    /// Coordinator to claim TESTRUN-* tasks from; without it only the RPC is served.
    #[arg(long, env = "TROUPE_COORDINATOR_URL")]
    pub coordinator_url: Option<String>,
    /// Default Python interpreter for pytest and its venvs; a run's `python`, or the project's
    /// `requires-python` when this one does not satisfy it, chooses another.
    #[arg(long, env = "TROUPE_PYTHON", default_value = "python3")]
    pub python: String,
    /// Worker id (default `test-runner-<hostname>-<pid>`).
    #[arg(long, env = "TROUPE_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Lease and call deadlines of the worker loop.
    #[command(flatten)]
    pub worker: troupe_grpc::worker::WorkerTuning,
    /// Test runs at once as a worker.
    #[arg(long, env = "TROUPE_TEST_RUNNER_CONCURRENCY", default_value_t = 1)]
    pub concurrency: usize,
    /// The executor's backend configuration file (TOML), used to build fix agents (codex,
    /// claude, gemini, qwen, opencode, agent, command) with the same commands, endpoints, keys,
    /// timeouts, fallback chain and retries as the executor.
    #[arg(long = "backends-config", env = "TROUPE_EXECUTOR_CONFIG")]
    pub backends_config: Option<PathBuf>,
    /// Authentication: accepted tokens and client certificates, this server's certificate,
    /// and the credentials of its own calls.
    #[command(flatten)]
    pub security: troupe_grpc::auth::Security,
    /// Confinement of installers, `test.setup` commands and the suites (Landlock; see
    /// docs/sandbox.md).
    #[command(flatten)]
    pub sandbox: troupe_process::sandbox::SandboxArgs,
}

/// Errors of the test-runner.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request or task is malformed.
    #[error("{0}")]
    InvalidArgument(String),
    /// A feature that is not there yet.
    #[error("{0}")]
    Unimplemented(String),
    /// A tool the run needs is missing from the interpreter.
    #[error("{0}")]
    NotInstalled(String),
    /// Building the venv failed.
    #[error("install step `{step}` failed: {detail}")]
    Install {
        /// The step (`create venv`, `pip install -r requirements.txt`, ...).
        step: String,
        /// Exit code and output tail.
        detail: String,
    },
    /// The run was cancelled.
    #[error("cancelled")]
    Cancelled,
    /// Git: repository, revision or worktree.
    #[error(transparent)]
    Workspace(#[from] troupe_workspace::Error),
    /// A child could not be started or supervised.
    #[error("running `{program}`: {source}")]
    Process {
        /// The program.
        program: String,
        /// The cause.
        #[source]
        source: troupe_process::Error,
    },
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
    /// Anything else (an unreadable report).
    #[error("{0}")]
    Internal(String),
    /// Supervising child processes (the reaper or the records under `children/`) failed.
    #[error(transparent)]
    Children(troupe_process::Error),
}

impl Error {
    pub(crate) fn process(program: &str, source: troupe_process::Error) -> Self {
        match source {
            troupe_process::Error::NotFound { program } => {
                Self::NotInstalled(format!("program `{program}` not found"))
            }
            source => Self::Process {
                program: program.to_owned(),
                source,
            },
        }
    }
}

/// The opened service: a [`Runner`] plus the configuration.
#[derive(Debug, Clone)]
pub struct App {
    config: Config,
    runner: Arc<Runner>,
    connector: troupe_grpc::Connector,
    /// Its health entry once mounted, flipped by the worker loop.
    health: Option<troupe_grpc::ServiceHealth>,
}

impl App {
    /// Creates the data directory and the runner.
    pub async fn open(mut config: Config) -> Result<Self, Error> {
        config.data_dir = troupe_grpc::prepare_data_dir(&config.data_dir)
            .await
            .map_err(|source| Error::Io {
                path: config.data_dir.clone(),
                source,
            })?;
        let children = config.data_dir.join("children");
        let killed = troupe_process::supervise_children(&children)
            .await
            .map_err(Error::Children)?;
        if !killed.is_empty() {
            tracing::warn!(groups = ?killed, "killed child processes left alive by a previous run");
        }
        let backends = match &config.backends_config {
            Some(path) => troupe_backends::BackendsConfig::load(path)
                .map_err(|err| Error::InvalidArgument(err.to_string()))?,
            None => troupe_backends::BackendsConfig::default(),
        };
        let credentials = match &config.worker.git_credentials {
            Some(path) => troupe_workspace::Credentials::load(path)?,
            None => troupe_workspace::Credentials::none(),
        };
        let runner = Arc::new(
            Runner::new(config.data_dir.clone(), config.python.clone())
                .with_backends(backends)
                .with_credentials(Arc::new(credentials))
                .with_sandbox(config.sandbox.clone()),
        );
        let connector = troupe_grpc::Connector::new(&config.security.credentials).await?;
        Ok(Self {
            config,
            runner,
            connector,
            health: None,
        })
    }

    /// Calls the coordinator with `connector` instead of the configured credentials.
    pub fn with_connector(mut self, connector: troupe_grpc::Connector) -> Self {
        self.connector = connector;
        self
    }

    /// The runner, for in-process callers.
    pub fn runner(&self) -> Arc<Runner> {
        Arc::clone(&self.runner)
    }
}

impl troupe_grpc::boot::Service for App {
    type Error = Error;

    /// Adds `troupe.v1.TestRunner` to a shared server.
    fn mount(&mut self, services: &mut Services) {
        self.health = Some(services.health_of(
            <TestRunnerServer<grpc::TestRunnerService> as tonic::server::NamedService>::NAME,
        ));
        let limit = self.config.security.credentials.max_message();
        services.add(
            TestRunnerServer::new(grpc::TestRunnerService::new(self.runner()))
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
        );
    }

    /// Runs the TESTRUN-* worker loop when a coordinator is configured, else waits for shutdown.
    async fn run_background(self, shutdown: CancellationToken) -> Result<(), Error> {
        let mut handler = TestRunHandler::new(self.runner());
        if let Some(url) = &self.config.coordinator_url {
            // Results also go to the bus (state_update, tests_passed / tests_failed).
            handler = handler.with_coordinator(
                self.connector.coordinator_client(url)?,
                self.config.worker.rpc_timeout()?,
            );
        }
        let settings = WorkerSettings {
            coordinator_url: self.config.coordinator_url.clone(),
            worker_id: self.config.worker_id.clone(),
            role: Role::TestRunner,
            concurrency: self.config.concurrency,
            tuning: &self.config.worker,
            connector: &self.connector,
            data_dir: &self.config.data_dir,
            health: self.health.clone(),
            // Their tasks are not routed by backend (see `troupe_plan::backend::routes`).
            capabilities: Vec::new(),
            auto_backend: String::new(),
        };
        run_worker_if_configured(settings, Arc::new(handler), shutdown).await?;
        Ok(())
    }
}

/// Serves the RPC (and the worker loop when configured) on `listener` until `shutdown`.
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

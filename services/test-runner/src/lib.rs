//! The troupe test-runner: runs a repository's test suite once at a commit, in a detached
//! worktree, and reports totals, failures and coverage read from the framework's structured
//! reports (never from its console text).
//!
//! Pytest is supported (issue #2): JUnit XML, pytest-json-report and coverage.py JSON from one
//! run, an optional cached venv built from the repository's requirement files, the whole
//! process group killed at the wall-clock limit. Jest and Vitest are detected but running them
//! is refused until issue #5. The service answers `TestRunner.RunTests` and, with
//! `--coordinator-url`, claims TESTRUN-* tasks as a worker.

mod detect;
mod failure;
mod grpc;
mod pytest;
mod runner;
mod venv;
mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use troupe_grpc::worker::{WorkerConfig, default_worker_id, run_worker};
use troupe_grpc::{ServeOptions, Services};
use troupe_proto::v1::Role;
use troupe_proto::v1::test_runner_server::TestRunnerServer;

pub use runner::{DEFAULT_TEST_TIMEOUT_SECONDS, DEFAULT_TIMEOUT, RunSpec, Runner};
pub use worker::TestRunHandler;

/// Configuration of the test-runner service.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// Address to serve gRPC on.
    #[arg(long, env = "TROUPE_LISTEN", default_value = "127.0.0.1:7073")]
    pub listen: SocketAddr,
    /// Directory for worktrees, reports (`test-runs/<run id>/`) and cached venvs (`venvs/`).
    #[arg(long, env = "TROUPE_DATA_DIR", default_value = ".troupe")]
    pub data_dir: PathBuf,
    /// Coordinator to claim TESTRUN-* tasks from; without it only the RPC is served.
    #[arg(long, env = "TROUPE_COORDINATOR_URL")]
    pub coordinator_url: Option<String>,
    /// Python interpreter used when a run does not ask for an install (and to build venvs).
    #[arg(long, env = "TROUPE_PYTHON", default_value = "python3")]
    pub python: String,
    /// Worker id (default `test-runner-<hostname>-<pid>`).
    #[arg(long, env = "TROUPE_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Test runs at once as a worker.
    #[arg(long, env = "TROUPE_TEST_RUNNER_CONCURRENCY", default_value_t = 1)]
    pub concurrency: usize,
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
}

impl App {
    /// Creates the data directory and the runner.
    pub async fn open(mut config: Config) -> Result<Self, Error> {
        tokio::fs::create_dir_all(&config.data_dir)
            .await
            .map_err(|source| Error::Io {
                path: config.data_dir.clone(),
                source,
            })?;
        // Children run with the worktree as cwd, so every path handed to them is absolute.
        config.data_dir = tokio::fs::canonicalize(&config.data_dir)
            .await
            .map_err(|source| Error::Io {
                path: config.data_dir.clone(),
                source,
            })?;
        let runner = Arc::new(Runner::new(config.data_dir.clone(), config.python.clone()));
        Ok(Self { config, runner })
    }

    /// The runner, for in-process callers.
    pub fn runner(&self) -> Arc<Runner> {
        Arc::clone(&self.runner)
    }

    /// Adds `troupe.v1.TestRunner` to a shared server.
    pub fn mount(&self, services: &mut Services) {
        services.add(TestRunnerServer::new(grpc::TestRunnerService::new(
            self.runner(),
        )));
    }

    /// Runs the TESTRUN-* worker loop when a coordinator is configured, else waits for shutdown.
    pub async fn run_background(self, shutdown: CancellationToken) -> Result<(), Error> {
        let Some(url) = self.config.coordinator_url.clone() else {
            shutdown.cancelled().await;
            return Ok(());
        };
        let worker_id = self
            .config
            .worker_id
            .clone()
            .unwrap_or_else(|| default_worker_id("test-runner"));
        let mut worker = WorkerConfig::new(url, worker_id, vec![Role::TestRunner]);
        worker.concurrency = self.config.concurrency.max(1);
        run_worker(
            worker,
            Arc::new(TestRunHandler::new(self.runner())),
            shutdown,
        )
        .await?;
        Ok(())
    }
}

/// Serves the RPC (and the worker loop when configured) on `listener` until `shutdown`.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let app = App::open(config).await?;
    let mut services = Services::new();
    app.mount(&mut services);
    let stop = shutdown.child_token();
    // A test run plus a venv build can take long; callers that want less set a deadline.
    let options = ServeOptions {
        default_deadline: Some(Duration::from_secs(2 * 3600)),
        ..ServeOptions::default()
    };
    let serve = async {
        let result = troupe_grpc::serve(listener, services, stop.clone(), options)
            .await
            .map_err(Error::from);
        stop.cancel();
        result
    };
    let background = async {
        let result = app.run_background(stop.clone()).await;
        stop.cancel();
        result
    };
    let (served, worked) = tokio::join!(serve, background);
    served.and(worked)
}

//! The troupe validator: checks a task's result with evidence, and nothing passes by default.
//!
//! Checks (issue #2): files against a commit range (`create` exists and is non-empty, `modify`
//! exists and changed, `delete` absent), a verification command run as an argv vector in a
//! detached worktree (pass iff exit 0, with a timeout that kills its process group), and
//! convergence criteria, which come out MANUAL_REVIEW until typed criteria or a judge exist
//! (issue #6). The verdict is FAIL on any failed or errored check, else MANUAL_REVIEW when any
//! check needs review, else PASS. The service answers `Validator.Validate` and, with
//! `--coordinator-url`, claims VALIDATE-* tasks as a worker.

mod grpc;
mod validate;
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
use troupe_proto::v1::validator_server::ValidatorServer;

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
    /// Directory for the worktrees verification commands run in.
    #[arg(long, env = "TROUPE_DATA_DIR", default_value = ".troupe")]
    pub data_dir: PathBuf,
    /// Coordinator to claim VALIDATE-* tasks from; without it only the RPC is served.
    #[arg(long, env = "TROUPE_COORDINATOR_URL")]
    pub coordinator_url: Option<String>,
    /// Worker id (default `validator-<hostname>-<pid>`).
    #[arg(long, env = "TROUPE_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Validations at once as a worker.
    #[arg(long, env = "TROUPE_VALIDATOR_CONCURRENCY", default_value_t = 1)]
    pub concurrency: usize,
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
}

impl App {
    /// Creates the data directory and the validator.
    pub async fn open(mut config: Config) -> Result<Self, Error> {
        tokio::fs::create_dir_all(&config.data_dir)
            .await
            .map_err(|source| Error::Io {
                path: config.data_dir.clone(),
                source,
            })?;
        config.data_dir = tokio::fs::canonicalize(&config.data_dir)
            .await
            .map_err(|source| Error::Io {
                path: config.data_dir.clone(),
                source,
            })?;
        let validator = Arc::new(Validator::new(config.data_dir.clone()));
        Ok(Self { config, validator })
    }

    /// The validator, for in-process callers.
    pub fn validator(&self) -> Arc<Validator> {
        Arc::clone(&self.validator)
    }

    /// Adds `troupe.v1.Validator` to a shared server.
    pub fn mount(&self, services: &mut Services) {
        services.add(ValidatorServer::new(grpc::ValidatorService::new(
            self.validator(),
        )));
    }

    /// Runs the VALIDATE-* worker loop when a coordinator is configured, else waits for shutdown.
    pub async fn run_background(self, shutdown: CancellationToken) -> Result<(), Error> {
        let Some(url) = self.config.coordinator_url.clone() else {
            shutdown.cancelled().await;
            return Ok(());
        };
        let worker_id = self
            .config
            .worker_id
            .clone()
            .unwrap_or_else(|| default_worker_id("validator"));
        let mut worker = WorkerConfig::new(url, worker_id, vec![Role::Validator]);
        worker.concurrency = self.config.concurrency.max(1);
        run_worker(
            worker,
            Arc::new(ValidateHandler::new(self.validator())),
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
    // Verification commands may run for a while; callers that want less set a deadline.
    let options = ServeOptions {
        default_deadline: Some(Duration::from_secs(3600)),
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

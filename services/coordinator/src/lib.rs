//! The troupe coordinator: the single source of truth for sessions, their task DAG, leases and
//! the message bus (`proto/troupe/v1/coordinator.proto`).
//!
//! Plans are validated with troupe-plan and stored atomically in SQLite (WAL) with a session
//! branch `troupe/<session>` created in each repository. Workers claim ready tasks under leases
//! with fencing tokens; a reaper returns expired leases. Every state change appends an event
//! with a per-session, gap-free sequence that `WatchSession` streams. Entry points: [`run`], or
//! [`App`] to mount the service on a shared server.

mod convert;
mod error;
mod grpc;
mod sched;
mod service;
mod store;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use crate::error::Error;
use crate::service::Coordinator;
use crate::store::Store;

/// How often the reaper looks for expired leases and due retries.
const REAPER_INTERVAL: Duration = Duration::from_millis(250);

/// Coordinator settings, from flags or `TROUPE_*` environment variables.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// Address to serve gRPC on.
    #[arg(long, env = "TROUPE_LISTEN", default_value = "127.0.0.1:7071")]
    pub listen: SocketAddr,
    /// Directory for the database and template repositories.
    #[arg(long, env = "TROUPE_DATA_DIR", default_value = ".troupe")]
    pub data_dir: PathBuf,
    /// Database URL such as `sqlite:///var/lib/troupe/troupe.db` (default: `troupe.db` in the data dir).
    #[arg(long, env = "TROUPE_DATABASE_URL")]
    pub database_url: Option<String>,
}

impl Config {
    /// Returns a configuration for `data_dir` with the default listen address and database.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 7071)),
            data_dir: data_dir.into(),
            database_url: None,
        }
    }
}

/// The opened coordinator: store and scheduler state. Cheap to clone.
#[derive(Debug, Clone)]
pub struct App {
    inner: Arc<Coordinator>,
}

impl App {
    /// Creates the data directory, opens the database and applies migrations.
    pub async fn open(config: Config) -> Result<Self, Error> {
        tokio::fs::create_dir_all(&config.data_dir)
            .await
            .map_err(|source| Error::Io {
                path: config.data_dir.display().to_string(),
                source,
            })?;
        let data_dir = tokio::fs::canonicalize(&config.data_dir)
            .await
            .map_err(|source| Error::Io {
                path: config.data_dir.display().to_string(),
                source,
            })?;
        let store = match &config.database_url {
            Some(url) if url.starts_with("sqlite:") => Store::open_url(url).await?,
            Some(url) => {
                return Err(Error::InvalidArgument(format!(
                    "database url `{url}` is not supported yet: only sqlite is (postgres is issue #3)"
                )));
            }
            // A file path rather than a URL, so data dirs with `?` or `#` in them work.
            None => Store::open_file(&data_dir.join("troupe.db")).await?,
        };
        tracing::info!(data_dir = %data_dir.display(), "coordinator store open");
        Ok(Self {
            inner: Arc::new(Coordinator::new(store, data_dir)),
        })
    }

    /// Adds the Coordinator gRPC service to a shared server.
    pub fn mount(&self, services: &mut troupe_grpc::Services) {
        services.add(grpc::server(Arc::clone(&self.inner)));
    }

    /// Runs the lease reaper until `shutdown`, then ends open event streams.
    pub async fn run_background(self, shutdown: CancellationToken) -> Result<(), Error> {
        self.inner
            .run_reaper(REAPER_INTERVAL, shutdown.clone())
            .await;
        self.inner.stop();
        Ok(())
    }
}

/// Serves the coordinator on `listener` until `shutdown` is cancelled.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let app = App::open(config).await?;
    let mut services = troupe_grpc::Services::new();
    app.mount(&mut services);
    let background = app.run_background(shutdown.clone());
    let serve = troupe_grpc::serve(
        listener,
        services,
        shutdown.clone(),
        troupe_grpc::ServeOptions::default(),
    );
    let (served, background) = tokio::join!(
        async {
            let result = serve.await;
            // If serving fails, stop the background work too.
            shutdown.cancel();
            result
        },
        background
    );
    served?;
    background
}

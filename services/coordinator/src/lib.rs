//! The troupe coordinator: the single source of truth for sessions, their task DAG, leases and
//! the message bus (`proto/troupe/v1/coordinator.proto`).
//!
//! Plans are validated with troupe-plan and stored atomically in SQLite (WAL, the default) or
//! PostgreSQL (several coordinators may share one) with a session
//! branch `troupe/<session>` created in each repository. Workers claim ready tasks under leases
//! with fencing tokens; a reaper returns expired leases. Every state change appends an event
//! with a per-session, gap-free sequence that `WatchSession` streams. Entry points: [`run`], or
//! [`App`] to mount the service on a shared server.
//!
//! # Layout
//!
//! Each layer calls only the layers below it. `task` (the task and its state machine) and
//! `check` (CCW's status report) are free of I/O and serve every layer.
//! - `grpc`: the adapter. tonic types stop here, and `grpc/convert.rs` builds the wire form of
//!   each response from what the domain returns.
//! - `service`: the domain operations behind the RPCs: `sessions` (intake, with `repos`;
//!   reads; `check`, `resume`, `pause`, `cancel`), `workers` (the worker protocol with its
//!   long-polling claims, and the reaper) and `bus` (messages, role state, the event stream).
//! - `group_commit`: the worker protocol's writes (claim, heartbeat, complete) batched into
//!   shared transactions, per session on PostgreSQL; `turns` and `demand` decide where a
//!   completion's `claim_next` goes.
//! - `lifecycle`: every state change, one module each (`create`, `claim`, `heartbeat`,
//!   `complete`, `fail`, `fix_round`, `reap`, `resume`, `pause`, `cancel`). A change loads
//!   what it needs through the tables, decides with `task`, and writes through the tables.
//! - `store`: SQL only, one module per table (`sessions`, `tasks`, `events`, `messages`,
//!   `workers`; `migrations` is their schema), over `store::transactions`: the transaction
//!   and the events it holds back until it commits.
//!
//! At the bottom the rule is transactions → tables → lifecycle: lifecycle code writes no SQL,
//! and the store decides no state change. So a failed TESTRUN spawns its FIX task in
//! `lifecycle/fix_round.rs` (called by `lifecycle/fail.rs`), which decides the round and
//! writes it.

mod check;
mod convert;
mod demand;
mod error;
mod group_commit;
mod grpc;
mod lifecycle;
mod metrics;
mod picks;
mod quota;
mod repos;
mod service;
mod store;
mod task;
mod turns;
mod web;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use crate::error::Error;
use crate::service::Coordinator;
use crate::store::Store;
pub use crate::web::WebArgs;

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
    /// Database URL: `sqlite:///var/lib/troupe/troupe.db` or `postgres://user@host/db`
    /// (default: `troupe.db` in the data dir). Several coordinators may share one PostgreSQL.
    #[arg(long, env = "TROUPE_DATABASE_URL")]
    pub database_url: Option<String>,
    /// Authentication: accepted tokens and client certificates and this server's certificate.
    #[command(flatten)]
    pub security: troupe_grpc::auth::Security,
}

impl Config {
    /// Returns a configuration for `data_dir` with the default listen address and database.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 7071)),
            data_dir: data_dir.into(),
            database_url: None,
            security: troupe_grpc::auth::Security::default(),
        }
    }
}

/// Coordinator tuning beyond [`Config`], from flags or `TROUPE_*` environment variables.
#[derive(Debug, Clone, clap::Args)]
pub struct Tuning {
    /// Report a capability gap (a `capability_gap` message and in `check`) when ready tasks of
    /// a role have had no worker claiming that role for this many seconds.
    #[arg(long, env = "TROUPE_CAPABILITY_GAP_SECONDS", default_value_t = 60.0)]
    pub capability_gap_seconds: f64,
    /// Weigh a new session's tasks that give no estimate by what tasks of their role took in
    /// this many of the newest sessions (the median of their last completed attempts); 0
    /// weighs them by the plan alone.
    #[arg(long, env = "TROUPE_LEARN_FROM_SESSIONS", default_value_t = 10)]
    pub learn_from_sessions: u32,
    /// Credentials for private repositories, by URL prefix (a TOML file of `[[remote]]`
    /// rules: `prefix` plus `token_file`, `token_env` or `ssh_key_file`); intake resolves each
    /// repository's base commit with them. Never taken from a plan.
    #[arg(long, env = "TROUPE_GIT_CREDENTIALS")]
    pub git_credentials: Option<PathBuf>,
    /// A provider quota, enforced across every worker when tasks are claimed:
    /// `<backend>=in_flight:N,per_minute:N` (either part may be left out), such as
    /// `claude=in_flight:3,per_minute:30`. Repeat the flag for more backends (in the
    /// variable, separate them with `;`). See docs/quotas.md.
    #[arg(long = "quota", env = "TROUPE_QUOTA", value_delimiter = ';')]
    pub quotas: Vec<String>,
    /// How long a provider's 429 pauses claims of its backend when it names no reset time
    /// (`retry-after`, or the CLI's own "try again in").
    #[arg(long, env = "TROUPE_QUOTA_PAUSE_SECONDS", default_value_t = 30.0)]
    pub quota_pause_seconds: f64,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            capability_gap_seconds: 60.0,
            learn_from_sessions: 10,
            git_credentials: None,
            quotas: Vec::new(),
            quota_pause_seconds: 30.0,
        }
    }
}

/// The opened coordinator: store and scheduler state. Cheap to clone.
#[derive(Debug, Clone)]
pub struct App {
    inner: Arc<Coordinator>,
    /// The largest message the service accepts or sends (`--max-message-bytes`).
    max_message: usize,
}

impl App {
    /// Creates the data directory, opens the database and applies migrations.
    pub async fn open(config: Config) -> Result<Self, Error> {
        Self::open_tuned(config, Tuning::default()).await
    }

    /// [`App::open`] with non-default tuning.
    pub async fn open_tuned(config: Config, tuning: Tuning) -> Result<Self, Error> {
        let capability_gap = Duration::try_from_secs_f64(tuning.capability_gap_seconds)
            .map_err(|err| Error::InvalidArgument(format!("capability gap seconds: {err}")))?;
        let quota_pause = Duration::try_from_secs_f64(tuning.quota_pause_seconds)
            .map_err(|err| Error::InvalidArgument(format!("quota pause seconds: {err}")))?;
        let quotas = quota::Quotas::new(quota::parse_limits(&tuning.quotas)?, quota_pause);
        let data_dir = troupe_grpc::prepare_data_dir(&config.data_dir)
            .await
            .map_err(|source| Error::Io {
                path: config.data_dir.display().to_string(),
                source,
            })?;
        let store = match &config.database_url {
            Some(url)
                if url.starts_with("sqlite:")
                    || url.starts_with("postgres://")
                    || url.starts_with("postgresql://") =>
            {
                Store::open_url(url).await?
            }
            Some(url) => {
                return Err(Error::InvalidArgument(format!(
                    "database url `{url}` is not supported: use sqlite:// or postgres://"
                )));
            }
            // A file path rather than a URL, so data dirs with `?` or `#` in them work.
            None => Store::open_file(&data_dir.join("troupe.db")).await?,
        };
        tracing::info!(data_dir = %data_dir.display(), "coordinator store open");
        // Registered now, so a scrape shows every family before the first task.
        metrics::metrics();
        let credentials = match &tuning.git_credentials {
            Some(path) => troupe_workspace::Credentials::load(path)?,
            None => troupe_workspace::Credentials::none(),
        };
        let inner = Arc::new(Coordinator::new(
            store,
            data_dir,
            Arc::new(credentials),
            capability_gap,
            tuning.learn_from_sessions,
            Arc::new(quotas),
        ));
        // Tasks running before a restart count against their quotas from the first claim.
        inner.rebuild_quotas().await?;
        Ok(Self {
            max_message: config.security.credentials.max_message(),
            inner,
        })
    }

    /// Serves the read-only web view when `web` names an address, behind the tokens `security`
    /// accepts, until `shutdown`. Returns the address it serves on.
    pub async fn serve_web(
        &self,
        web: &WebArgs,
        security: &troupe_grpc::auth::Security,
        shutdown: CancellationToken,
    ) -> Result<Option<SocketAddr>, Error> {
        let Some(addr) = web.web_listen else {
            return Ok(None);
        };
        let auth = troupe_grpc::auth::ServerAuth::load(security).await?;
        auth.check_listen(addr)?;
        let listener = TcpListener::bind(addr).await.map_err(|source| Error::Io {
            path: format!("web view listen address {addr}"),
            source,
        })?;
        let bound = listener.local_addr().map_err(|source| Error::Io {
            path: format!("web view listen address {addr}"),
            source,
        })?;
        let adapter = grpc::adapter(Arc::clone(&self.inner));
        tokio::spawn(async move {
            if let Err(err) = web::serve(adapter, auth, listener, shutdown.cancelled_owned()).await
            {
                tracing::error!(error = %err, "the web view stopped");
            }
        });
        tracing::info!(addr = %bound, "serving the web view");
        Ok(Some(bound))
    }
}

impl troupe_grpc::boot::Service for App {
    type Error = Error;

    /// Adds the Coordinator gRPC service to a shared server.
    fn mount(&mut self, services: &mut troupe_grpc::Services) {
        services.add(grpc::server(Arc::clone(&self.inner), self.max_message));
    }

    /// What a scrape of the metrics endpoint reads first: the tasks by state and the ready
    /// depth per role, from the store.
    fn metrics_refresh(&self) -> Vec<troupe_telemetry::metrics::Refresh> {
        vec![metrics::refresh(self.inner.store().clone())]
    }

    /// Runs the lease reaper until `shutdown`, then ends open event streams.
    async fn run_background(self, shutdown: CancellationToken) -> Result<(), Error> {
        tokio::join!(
            self.inner.run_reaper(REAPER_INTERVAL, shutdown.clone()),
            self.inner.run_change_listener(shutdown.clone()),
            self.inner.run_change_publisher(shutdown.clone()),
        );
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
    run_tuned(config, Tuning::default(), listener, shutdown).await
}

/// [`run`] with non-default tuning.
pub async fn run_tuned(
    config: Config,
    tuning: Tuning,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let metrics = troupe_telemetry::metrics::MetricsArgs::default();
    run_with_metrics(
        config,
        tuning,
        (&metrics, &WebArgs::default()),
        listener,
        shutdown,
    )
    .await
}

/// [`run_tuned`], serving metrics and the web view as `metrics` and `web` say.
pub async fn run_with_metrics(
    config: Config,
    tuning: Tuning,
    (metrics, web): (&troupe_telemetry::metrics::MetricsArgs, &WebArgs),
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let auth = troupe_grpc::auth::ServerAuth::load(&config.security).await?;
    let security = config.security.clone();
    let app = App::open_tuned(config, tuning).await?;
    app.serve_web(web, &security, shutdown.clone()).await?;
    troupe_grpc::boot::serve(app, auth, metrics, listener, shutdown).await
}

//! All four services in one process on one listener: the embedded default.
//!
//! The coordinator, executor, test-runner and validator are mounted on one gRPC server; the
//! three workers claim tasks from the coordinator through that same server's address, exactly
//! as they would across machines, so the embedded mode exercises the real worker protocol.
//! Opening the executor, test-runner and validator also supervises this process's children
//! (one reaper, records under `<data_dir>/children`), so agents die with `troupe up`/`run` and
//! orphans of a killed run are killed at the next start.
//! When the server requires credentials, its own workers authenticate with a token made at
//! start that lives only in this process's memory (scope `worker`); over TLS they verify the
//! server with `--tls-ca`, as the first DNS name of its certificate.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use troupe_grpc::boot::Service as _;

/// Settings of the embedded server.
#[derive(Clone, Debug)]
pub struct EmbeddedConfig {
    /// Data directory shared by the four services (each uses its own subdirectories).
    pub data_dir: PathBuf,
    /// Executor tasks run at once.
    pub executor_concurrency: usize,
    /// Python for test runs that do not ask for a venv.
    pub python: String,
    /// What the server accepts, and the CA its own workers verify it with.
    pub security: troupe_grpc::auth::Security,
}

/// A running embedded server.
#[derive(Debug)]
pub struct Embedded {
    addr: SocketAddr,
    tasks: JoinSet<anyhow::Result<()>>,
    shutdown: CancellationToken,
    /// For the metrics: a scrape first reads the coordinator's task gauges.
    coordinator: troupe_coordinator::App,
}

impl Embedded {
    /// Opens every service, mounts them on `listener` and starts the workers.
    pub async fn start(
        config: EmbeddedConfig,
        listener: TcpListener,
        shutdown: CancellationToken,
    ) -> anyhow::Result<Self> {
        let addr = listener
            .local_addr()
            .context("reading the listener address")?;
        let mut auth = troupe_grpc::auth::ServerAuth::load(&config.security)
            .await
            .context("loading the authentication settings")?;
        let (url, connector) = own_connection(&mut auth, &config.security, addr).await?;
        std::fs::create_dir_all(&config.data_dir)
            .with_context(|| format!("creating data dir {}", config.data_dir.display()))?;
        let data_dir = std::path::absolute(&config.data_dir).context("resolving the data dir")?;
        // The in-process services read the same `TROUPE_SANDBOX*` variables their binaries do.
        let sandbox =
            troupe_process::sandbox::SandboxArgs::from_env().map_err(anyhow::Error::msg)?;

        let mut coordinator = troupe_coordinator::App::open(troupe_coordinator::Config {
            listen: addr,
            data_dir: data_dir.clone(),
            database_url: None,
            security: Default::default(),
        })
        .await
        .context("opening the coordinator")?;
        let mut executor = troupe_executor::App::open_connected(
            troupe_executor::Config {
                listen: addr,
                data_dir: data_dir.clone(),
                coordinator_url: Some(url.clone()),
                concurrency: config.executor_concurrency,
                worker_id: None,
                worker: Default::default(),
                backends_config: std::env::var_os("TROUPE_EXECUTOR_CONFIG").map(Into::into),
                // The validator is mounted on this same server.
                validator_url: Some(url.clone()),
                phase_concurrency: std::env::var("TROUPE_EXECUTOR_PHASE_CONCURRENCY")
                    .ok()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(4),
                summary_dir: std::env::var("TROUPE_EXECUTOR_SUMMARY_DIR")
                    .unwrap_or_else(|_| troupe_executor::DEFAULT_SUMMARY_DIR.to_owned()),
                security: Default::default(),
                sandbox: sandbox.clone(),
            },
            connector.clone(),
        )
        .await
        .context("opening the executor")?;
        let mut test_runner = troupe_test_runner::App::open(troupe_test_runner::Config {
            listen: addr,
            data_dir: data_dir.clone(),
            coordinator_url: Some(url.clone()),
            python: config.python.clone(),
            worker_id: None,
            worker: Default::default(),
            concurrency: 1,
            backends_config: std::env::var_os("TROUPE_EXECUTOR_CONFIG").map(Into::into),
            security: Default::default(),
            sandbox: sandbox.clone(),
        })
        .await
        .context("opening the test-runner")?
        .with_connector(connector.clone());
        let mut validator = troupe_validator::App::open(troupe_validator::Config {
            listen: addr,
            data_dir,
            coordinator_url: Some(url),
            worker_id: None,
            worker: Default::default(),
            concurrency: 2,
            security: Default::default(),
        })
        .await
        .context("opening the validator")?
        .with_connector(connector);

        let metrics_app = coordinator.clone();
        let mut services = troupe_grpc::Services::new();
        coordinator.mount(&mut services);
        executor.mount(&mut services);
        test_runner.mount(&mut services);
        validator.mount(&mut services);

        let mut tasks = JoinSet::new();
        let serve_shutdown = shutdown.clone();
        tasks.spawn(async move {
            troupe_grpc::serve(
                listener,
                services,
                serve_shutdown,
                troupe_grpc::ServeOptions::with_auth(auth),
            )
            .await
            .context("grpc server")
        });
        spawn_part(
            &mut tasks,
            "coordinator",
            coordinator.run_background(shutdown.clone()),
        );
        spawn_part(
            &mut tasks,
            "executor",
            executor.run_background(shutdown.clone()),
        );
        spawn_part(
            &mut tasks,
            "test-runner",
            test_runner.run_background(shutdown.clone()),
        );
        spawn_part(
            &mut tasks,
            "validator",
            validator.run_background(shutdown.clone()),
        );
        Ok(Self {
            addr,
            tasks,
            shutdown,
            coordinator: metrics_app,
        })
    }

    /// What a metrics endpoint for this process runs before each scrape.
    pub fn metrics_refresh(&self) -> Vec<troupe_telemetry::metrics::Refresh> {
        self.coordinator.metrics_refresh()
    }

    /// Serves the coordinator's web view as `web` says, behind the tokens `security` accepts.
    pub async fn serve_web(
        &self,
        web: &troupe_coordinator::WebArgs,
        security: &troupe_grpc::auth::Security,
    ) -> anyhow::Result<Option<SocketAddr>> {
        Ok(self
            .coordinator
            .serve_web(web, security, self.shutdown.clone())
            .await?)
    }

    /// The address everything is served on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits until every part has stopped. A part that fails stops the others, and its error
    /// is returned.
    pub async fn wait(mut self) -> anyhow::Result<()> {
        let mut first_error = None;
        while let Some(joined) = self.tasks.join_next().await {
            let outcome = joined
                .map_err(anyhow::Error::from)
                .and_then(|result| result);
            if let Err(err) = outcome {
                if first_error.is_none() {
                    tracing::error!(error = %format!("{err:#}"), "embedded service failed, stopping the others");
                    first_error = Some(err);
                }
                self.shutdown.cancel();
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// The URL and credentials the in-process workers reach this server with: its port on
/// loopback; a fresh `worker` token when the server requires credentials; over TLS, the CA
/// of `--tls-ca` and the first DNS name of the server's certificate.
async fn own_connection(
    auth: &mut troupe_grpc::auth::ServerAuth,
    security: &troupe_grpc::auth::Security,
    addr: SocketAddr,
) -> anyhow::Result<(String, troupe_grpc::Connector)> {
    use troupe_grpc::auth::{Credentials, Scope, Scopes, Token};
    let loopback = if addr.is_ipv4() {
        std::net::IpAddr::from([127, 0, 0, 1])
    } else {
        std::net::IpAddr::from(std::net::Ipv6Addr::LOCALHOST)
    };
    let own = SocketAddr::new(loopback, addr.port());
    let mut connector = if auth.is_tls() {
        let Some(ca) = &security.credentials.tls_ca else {
            anyhow::bail!(
                "serving TLS needs --tls-ca (TROUPE_TLS_CA) too: the CA that signed --tls-cert,                  with which the in-process workers verify this server"
            );
        };
        let credentials = Credentials {
            tls_ca: Some(ca.clone()),
            ..Credentials::default()
        };
        let mut connector = troupe_grpc::Connector::new(&credentials).await?;
        if let Some(name) = auth.server_names().first() {
            connector = connector.with_domain(name.clone());
        }
        connector
    } else {
        troupe_grpc::Connector::default()
    };
    if auth.is_enforced() {
        let token = Token::generate();
        auth.accept(
            &token,
            Scopes::of(&[Scope::Worker]),
            "the in-process workers",
        );
        connector = connector.with_token(token);
    }
    let scheme = if auth.is_tls() { "https" } else { "http" };
    Ok((format!("{scheme}://{own}"), connector))
}

/// Runs one part of the embedded server, naming it in its error.
fn spawn_part<E>(
    tasks: &mut JoinSet<anyhow::Result<()>>,
    name: &'static str,
    part: impl std::future::Future<Output = Result<(), E>> + Send + 'static,
) where
    E: std::error::Error + Send + Sync + 'static,
{
    tasks.spawn(async move { part.await.context(name) });
}

//! The boot shape the four services share, so each one's `lib.rs` names only what differs
//! (how its [`Service`] opens) and each `main.rs` only parses its flags.
//!
//! A binary runs [`run_binary`]: telemetry, a listener, a token cancelled by SIGTERM or Ctrl-C,
//! and a flush of the last spans whatever happened. Its service then [`serve`]s: the
//! Prometheus listener (when `--metrics-listen` names one), its gRPC services with health,
//! reflection and authentication on the listener, and its background work (a worker loop, the
//! coordinator's lease reaper) beside them until shutdown.

use std::future::Future;
use std::net::SocketAddr;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use troupe_telemetry::metrics::{MetricsArgs, Refresh};

use crate::auth::ServerAuth;
use crate::{Error, ServeOptions, Services};

/// A service opened from its configuration, as its binary, its tests and `troupe up` run it.
pub trait Service: Send {
    /// The service's error.
    type Error: From<Error>;

    /// Adds the service's gRPC services to a server (`troupe up` mounts several on one).
    fn mount(&mut self, services: &mut Services);

    /// Background work until `shutdown`; ends the server when it fails.
    fn run_background(
        self,
        shutdown: CancellationToken,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Hooks that bring the service's gauges up to date before each `/metrics` answer.
    fn metrics_refresh(&self) -> Vec<Refresh> {
        Vec::new()
    }
}

/// Serves `service` on `listener` until `shutdown`: its gRPC services with health, reflection
/// and `auth` (loaded before the service opens, so a bad setting changes nothing),
/// `/metrics` when `metrics` names an address, and its background work.
pub async fn serve<S: Service>(
    mut service: S,
    auth: ServerAuth,
    metrics: &MetricsArgs,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), S::Error> {
    troupe_telemetry::metrics::spawn(
        metrics,
        service.metrics_refresh(),
        shutdown.clone().cancelled_owned(),
    )
    .await
    .map_err(|err| Error::Config(err.to_string()))?;
    let mut services = Services::new();
    service.mount(&mut services);
    crate::serve_with_background(
        listener,
        services,
        shutdown,
        ServeOptions::with_auth(auth),
        |stop| service.run_background(stop),
    )
    .await
}

/// Why a service binary stopped.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// Telemetry could not start.
    #[error("initialising telemetry")]
    Telemetry(#[from] troupe_telemetry::Error),
    /// The listen address could not be bound.
    #[error("binding {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The service failed.
    #[error("{name} failed")]
    Service {
        /// The service's binary name.
        name: &'static str,
        /// Its error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// The body of a service binary named `name`: telemetry, a listener bound at `listen`, then
/// `run` with it and a token cancelled by SIGTERM or Ctrl-C. A failure is logged (so it
/// reaches the collector too) and telemetry is flushed before this returns.
pub async fn run_binary<F, Fut, E>(
    name: &'static str,
    listen: SocketAddr,
    run: F,
) -> Result<(), BootError>
where
    F: FnOnce(TcpListener, CancellationToken) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: std::error::Error + Send + Sync + 'static,
{
    let telemetry = troupe_telemetry::init(name)?;
    let shutdown = crate::shutdown_token();
    let result = match TcpListener::bind(listen).await {
        Ok(listener) => run(listener, shutdown)
            .await
            .map_err(|err| BootError::Service {
                name,
                source: Box::new(err),
            }),
        Err(source) => Err(BootError::Bind {
            addr: listen,
            source,
        }),
    };
    if let Err(err) = &result {
        tracing::error!(error = %chain(err), "stopped");
    }
    telemetry.shutdown().await;
    result
}

/// `err` and its causes, `: `-separated.
fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

//! The one way troupe serves and calls gRPC.
//!
//! [`serve`] runs every service of a process on one listener with `grpc.health.v1` (a status
//! per service), server reflection v1 and v1alpha (grpcurl 1.8 only speaks v1alpha), a span
//! per request named and attributed by the RPC semantic conventions and parented on the
//! caller's W3C `traceparent`, a default request deadline, and a graceful shutdown: health
//! flips to NOT_SERVING first, then in-flight calls drain within a bound. [`channel`] and [`coordinator_client`] build outbound clients that carry a default
//! deadline and the current trace context; [`within`] bounds one call on the caller's side too,
//! and [`is_transient`] says which failures are worth repeating. [`worker`] is the claim →
//! heartbeat → report loop the executor, validator and test-runner share.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic_health::ServingStatus;

pub mod assets;
pub mod auth;
pub mod backoff;
pub mod boot;
mod connect;
mod rpc_span;
pub mod status;
pub mod worker;

pub use backoff::Backoff;
pub use connect::Connector;

/// The largest message servers and clients accept or send unless `--max-message-bytes` says
/// otherwise: 64 MiB (gRPC's default is 4 MiB).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// Fully qualified gRPC name of the health service, as health checks and grpcurl spell it.
pub const HEALTH_SERVICE: &str = "grpc.health.v1.Health";

/// Errors of serving or connecting.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The reflection service could not be built from the descriptor set.
    #[error("reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// The transport failed (bind, accept, connect).
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The listener's address could not be read.
    #[error("listener: {0}")]
    Listener(#[source] std::io::Error),
    /// An outbound URL is not a valid URI.
    #[error("invalid url {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// Why it was refused.
        reason: String,
    },
    /// A setting is out of range.
    #[error("{0}")]
    Config(String),
    /// A plan's assets could not be fetched or written.
    #[error("plan assets: {0}")]
    Assets(String),
    /// A call to the coordinator failed.
    #[error("coordinator call {rpc} failed: {status}")]
    Call {
        /// The RPC name.
        rpc: &'static str,
        /// The status returned.
        status: Box<tonic::Status>,
    },
}

/// The gRPC services one server exposes, with their names for health reporting.
#[derive(Debug, Default)]
pub struct Services {
    routes: tonic::service::RoutesBuilder,
    names: Vec<&'static str>,
    health: tonic_health::server::HealthReporter,
}

/// One service's entry in its server's `grpc.health.v1` answers, for a part that knows better
/// than the server whether the service can do its work (a worker cut off from its coordinator).
#[derive(Clone, Debug)]
pub struct ServiceHealth {
    reporter: tonic_health::server::HealthReporter,
    name: &'static str,
}

impl ServiceHealth {
    /// Reports the service SERVING or NOT_SERVING.
    pub async fn set(&self, serving: bool) {
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        self.reporter.set_service_status(self.name, status).await;
    }

    /// The service's fully qualified name.
    pub fn name(&self) -> &'static str {
        self.name
    }
}

impl Services {
    /// Returns an empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a generated tonic server, such as `CoordinatorServer::new(adapter)`.
    pub fn add<S>(&mut self, service: S) -> &mut Self
    where
        S: tower::Service<http::Request<tonic::body::Body>, Error = Infallible>
            + tonic::server::NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        self.names.push(S::NAME);
        self.routes.add_service(service);
        self
    }

    /// Returns the fully qualified names of the services added so far.
    pub fn names(&self) -> &[&'static str] {
        &self.names
    }

    /// The health entry of `name` (a service's `NamedService::NAME`), which [`serve`] reports
    /// SERVING when it starts.
    pub fn health_of(&self, name: &'static str) -> ServiceHealth {
        ServiceHealth {
            reporter: self.health.clone(),
            name,
        }
    }
}

/// How [`serve`] behaves.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// How long in-flight calls may run after shutdown begins before they are dropped.
    pub drain_timeout: Duration,
    /// Deadline for requests that carry no `grpc-timeout` of their own; a shorter client
    /// deadline always wins.
    pub default_deadline: Option<Duration>,
    /// Who may call what, and TLS; the default authenticates nobody and is refused beyond
    /// loopback.
    pub auth: auth::ServerAuth,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            drain_timeout: Duration::from_secs(10),
            // Long enough for an agent run or a test suite (CCW gives its executor an hour);
            // callers that want less send their own `grpc-timeout`.
            default_deadline: Some(Duration::from_secs(2 * 3600)),
            auth: auth::ServerAuth::default(),
        }
    }
}

impl ServeOptions {
    /// The defaults with `auth`.
    pub fn with_auth(auth: auth::ServerAuth) -> Self {
        Self {
            auth,
            ..Self::default()
        }
    }
}

/// Creates the data directory if needed and returns it absolute and canonical: children run
/// with other working directories, so relative paths would point elsewhere.
pub async fn prepare_data_dir(dir: &std::path::Path) -> std::io::Result<std::path::PathBuf> {
    tokio::fs::create_dir_all(dir).await?;
    tokio::fs::canonicalize(dir).await
}

/// A service's exclusive hold on its data directory, released when dropped (or when the
/// process dies: the kernel drops the lock with the file).
#[derive(Debug)]
pub struct DataDirLock {
    _file: std::fs::File,
}

/// Takes `<dir>/<service>.lock`, so two processes never run the same service on one data
/// directory: a service clears what its previous run left there at start, which is safe only
/// when no other process is using it.
pub fn lock_data_dir(dir: &std::path::Path, service: &str) -> std::io::Result<DataDirLock> {
    use std::io::Write;
    let path = dir.join(format!("{service}.lock"));
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .read(true)
        .open(&path)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            return Err(std::io::Error::other(format!(
                "{} is in use by another {service} (pid {}); give each process its own data dir",
                dir.display(),
                holder.trim()
            )));
        }
        Err(std::fs::TryLockError::Error(err)) => return Err(err),
    }
    file.set_len(0)?;
    write!(file, "{}", std::process::id())?;
    Ok(DataDirLock { _file: file })
}

/// Serves `services` on `listener` and runs `background` (a worker loop, a reaper) beside it
/// until `shutdown`. When either side ends, the other is stopped; the first error is returned.
pub async fn serve_with_background<E, F, B>(
    listener: TcpListener,
    services: Services,
    shutdown: CancellationToken,
    options: ServeOptions,
    background: F,
) -> Result<(), E>
where
    E: From<Error>,
    F: FnOnce(CancellationToken) -> B,
    B: std::future::Future<Output = Result<(), E>>,
{
    let stop = shutdown.child_token();
    let serve = async {
        let result = serve(listener, services, stop.clone(), options)
            .await
            .map_err(E::from);
        stop.cancel();
        result
    };
    let background = {
        let stop = stop.clone();
        let work = background(stop.clone());
        async move {
            let result = work.await;
            stop.cancel();
            result
        }
    };
    let (served, worked) = tokio::join!(serve, background);
    served.and(worked)
}

/// Serves `services` plus health and reflection on `listener` until `shutdown` is cancelled,
/// then drains in-flight calls for at most `options.drain_timeout`. Every request passes
/// `options.auth` first; a non-loopback listener without authentication is refused unless
/// the options say `insecure`.
pub async fn serve(
    listener: TcpListener,
    services: Services,
    shutdown: CancellationToken,
    options: ServeOptions,
) -> Result<(), Error> {
    let local_addr = listener.local_addr().map_err(Error::Listener)?;
    options.auth.check_listen(local_addr)?;
    let health_reporter = services.health.clone();
    let health_service = tonic_health::pb::health_server::HealthServer::new(
        tonic_health::server::HealthService::from_health_reporter(health_reporter.clone()),
    );
    for name in &services.names {
        health_reporter
            .set_service_status(*name, ServingStatus::Serving)
            .await;
    }
    // The empty name is the server's overall health, what `grpc_health_probe` asks by default.
    health_reporter
        .set_service_status("", ServingStatus::Serving)
        .await;

    // Each reflection version also registers the other's descriptors, so that a client
    // speaking either one lists both (grpcurl 1.8 lists through v1alpha).
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(troupe_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(
                tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
            )
    };
    let reflection_v1 = reflection().build_v1()?;
    let reflection_v1alpha = reflection().build_v1alpha()?;

    let mut routes = services.routes;
    routes.add_service(health_service.clone());
    if options.auth.reflection() != auth::Reflection::Off {
        routes
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha);
    }

    let mut builder = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .trace_fn(rpc_span::request_span);
    if let Some(deadline) = options.default_deadline {
        builder = builder.timeout(deadline);
    }
    if let Some(tls) = options.auth.tls_config() {
        builder = builder.tls_config(tls)?;
    }
    // The status recorder goes outermost, so it sees the auth layer's refusals too.
    let mut builder = builder
        .layer(rpc_span::RpcStatusLayer)
        .layer(auth::AuthLayer::new(&options.auth));
    tracing::info!(
        addr = %local_addr,
        services = ?services.names,
        tls = options.auth.is_tls(),
        authenticated = options.auth.is_enforced(),
        reflection = ?options.auth.reflection(),
        "grpc server listening"
    );

    let stop_accepting = CancellationToken::new();
    // Probes that cannot speak TLS get the health service alone, in plaintext.
    let health_only = match options.auth.health_listen {
        Some(addr) => {
            let listener = TcpListener::bind(addr).await.map_err(|err| {
                Error::Config(format!("cannot bind the health listener {addr}: {err}"))
            })?;
            tracing::info!(addr = %addr, "health-only listener");
            let incoming = tonic::transport::server::TcpIncoming::from(listener);
            Some(tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(health_service.clone())
                    .serve_with_incoming_shutdown(
                        incoming,
                        stop_accepting.clone().cancelled_owned(),
                    ),
            ))
        }
        None => None,
    };
    let _health_only = health_only.map(AbortOnDrop);
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let server = builder
        .add_routes(routes.routes())
        .serve_with_incoming_shutdown(incoming, stop_accepting.clone().cancelled_owned());
    tokio::pin!(server);

    tokio::select! {
        result = &mut server => return result.map_err(Error::from),
        () = shutdown.cancelled() => {}
    }
    // Health first, so load balancers and probes stop sending before we stop answering.
    for name in services.names.iter().copied().chain([""]) {
        health_reporter
            .set_service_status(name, ServingStatus::NotServing)
            .await;
    }
    tracing::info!(addr = %local_addr, drain_timeout = ?options.drain_timeout, "shutting down, draining in-flight calls");
    stop_accepting.cancel();
    match tokio::time::timeout(options.drain_timeout, &mut server).await {
        Ok(result) => result.map_err(Error::from),
        Err(_) => {
            tracing::warn!(addr = %local_addr, "drain timed out, dropping remaining calls");
            Ok(())
        }
    }
}

/// Aborts a spawned task when dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Returns `http://<addr>` for a bound address, the form outbound clients take.
pub fn url_for(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

/// Builds a lazy channel to `url` with a bounded connect time, without credentials (see
/// [`Connector::channel`]). Build once and clone it.
pub fn channel(url: &str) -> Result<Channel, Error> {
    Connector::default().channel(url)
}

/// Adds a default deadline, the current W3C trace context and this process's bearer token
/// to every outbound call.
#[derive(Clone, Debug)]
pub struct Outbound {
    pub(crate) deadline: Duration,
    pub(crate) token: Option<auth::TokenSource>,
}

impl Outbound {
    /// An interceptor whose calls time out after `deadline` unless the caller set one.
    pub fn new(deadline: Duration) -> Self {
        Self {
            deadline,
            token: None,
        }
    }
}

impl tonic::service::Interceptor for Outbound {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if !request.metadata().contains_key("grpc-timeout") {
            request.set_timeout(self.deadline);
        }
        troupe_telemetry::inject_context(request.metadata_mut());
        if let Some(token) = &self.token
            && let Some(header) = token.current().header()
        {
            request.metadata_mut().insert("authorization", header);
        }
        Ok(request)
    }
}

/// A coordinator client with troupe's outbound interceptor.
pub type CoordinatorClient =
    troupe_proto::v1::coordinator_client::CoordinatorClient<InterceptedService<Channel, Outbound>>;

/// How long a coordinator call may take by default: long enough for the longest
/// `ClaimTasks` long-poll.
const COORDINATOR_DEADLINE: Duration = Duration::from_secs(90);

/// Returns a coordinator client for `url`, without credentials (see
/// [`Connector::coordinator_client`]), whose calls default to a 90 s deadline.
pub fn coordinator_client(url: &str) -> Result<CoordinatorClient, Error> {
    Connector::default().coordinator_client(url)
}

/// Whether a failed call may succeed if repeated unchanged, with a backoff.
///
/// Transient: UNAVAILABLE (the server is down, restarting or draining, or refused the stream),
/// DEADLINE_EXCEEDED (no answer in time: a stopped or partitioned server, or our own
/// [`within`]), RESOURCE_EXHAUSTED (overload), ABORTED (a write conflict the coordinator
/// could not retry itself), and any status the client's transport made locally (it carries
/// the transport error as its source: a connection reset mid-call comes back as UNKNOWN or
/// CANCELLED). Everything else is the server's considered answer to this request (a stale
/// fencing token, an unknown task, an invalid argument, an internal error) and repeating the
/// request unchanged would get it again.
pub fn is_transient(status: &tonic::Status) -> bool {
    use std::error::Error as _;
    matches!(
        status.code(),
        tonic::Code::Unavailable
            | tonic::Code::DeadlineExceeded
            | tonic::Code::ResourceExhausted
            | tonic::Code::Aborted
    ) || status.source().is_some()
}

/// A request carrying `message` whose `grpc-timeout` is `timeout`, so the server stops
/// working on it once the caller stops waiting (see [`within`]).
pub fn timed<T>(message: T, timeout: Duration) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(timeout);
    request
}

/// Awaits a unary call for at most `timeout`, answer and trailers included. `grpc-timeout`
/// alone binds only a server that runs: a stopped (`SIGSTOP`) or partitioned one never
/// answers, and tonic's own client timeout covers the response headers only. A call still
/// unanswered at `timeout` is dropped and comes back as DEADLINE_EXCEEDED.
pub async fn within<T>(
    timeout: Duration,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, tonic::Status> {
    let elapsed = || tonic::Status::deadline_exceeded(format!("no answer within {timeout:?}"));
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(answer)) => Ok(answer.into_inner()),
        // tonic's own timer (from `grpc-timeout`) may fire first; it says CANCELLED.
        Ok(Err(status)) if timed_out_locally(&status) => Err(elapsed()),
        Ok(Err(status)) => Err(status),
        Err(_) => Err(elapsed()),
    }
}

/// Whether tonic's client gave up on the call at its `grpc-timeout`.
fn timed_out_locally(status: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(err) = source {
        if err.is::<tonic::TimeoutExpired>() {
            return true;
        }
        source = err.source();
    }
    false
}

/// Completes when the process receives SIGTERM or SIGINT (Kubernetes sends SIGTERM).
pub async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(err) => {
                tracing::warn!(error = %err, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = terminate => tracing::info!("received SIGTERM"),
        result = tokio::signal::ctrl_c() => {
            if result.is_ok() {
                tracing::info!("received SIGINT");
            }
        }
    }
}

/// Returns a token cancelled on the first SIGTERM/SIGINT; a second signal exits at once.
pub fn shutdown_token() -> CancellationToken {
    let token = CancellationToken::new();
    let signalled = token.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        signalled.cancel();
        shutdown_signal().await;
        tracing::warn!("second shutdown signal, exiting immediately");
        std::process::exit(130);
    });
    token
}

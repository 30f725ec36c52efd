//! Prometheus metrics for every troupe binary: one process-wide registry that each service
//! registers its families in (so `troupe up`, which runs them all in one process, serves them
//! on one endpoint), and that endpoint: `GET /metrics` in the Prometheus text format 0.0.4,
//! plain HTTP on a port of its own ([`MetricsArgs`]), off unless configured.
//!
//! Counters live in memory and start at 0 with the process (Prometheus handles resets). State
//! that must survive a restart (the coordinator's tasks by state) is read when scraped: a
//! [`Refresh`] hook runs before each encoding.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, prometheus_text};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Metric, Registry, Unit};

pub use prometheus_client::metrics::counter::Counter;
pub use prometheus_client::metrics::family::Family;
pub use prometheus_client::metrics::gauge::Gauge;
pub use prometheus_client::metrics::histogram::Histogram;

/// A series' labels: bounded names and values (roles, states, backends, error kinds; never
/// session or task ids).
pub type Labels = Vec<(&'static str, String)>;

/// A gauge of a fraction or percentage.
pub type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

/// A histogram family whose buckets are fixed by a plain function.
pub type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;

/// Reads state into gauges before a scrape; an error fails the scrape (HTTP 503) rather than
/// serving stale values.
pub type Refresh =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync>;

/// Where to serve metrics, from flags or the environment.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct MetricsArgs {
    /// Serve Prometheus metrics on this address (`GET /metrics`, plain HTTP, no auth); off
    /// when unset.
    #[arg(long = "metrics-listen", env = "TROUPE_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
}

/// Errors of the metrics endpoint.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The metrics address could not be bound.
    #[error("binding the metrics address {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

fn registry() -> &'static Mutex<Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY.get_or_init(|| Mutex::new(Registry::default()))
}

/// A registered metric whose `# HELP` and `# TYPE` lines are served even before its first
/// series (the registry skips empty families otherwise): a scrape shows every family the
/// process has, and dashboards can be checked against it.
#[derive(Debug)]
struct Declared<M>(M);

impl<M: EncodeMetric> EncodeMetric for Declared<M> {
    fn encode(&self, encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        self.0.metric_type()
    }
}

fn register<M: Metric + Clone>(name: &str, help: &str, unit: Option<Unit>, metric: M) -> M {
    // The encoder ends the help with a full stop of its own.
    let help = help.trim_end_matches('.');
    let mut registry = registry()
        .lock()
        .unwrap_or_else(|poison| poison.into_inner());
    let declared = Declared(metric.clone());
    match unit {
        Some(unit) => registry.register_with_unit(name, help, unit, declared),
        None => registry.register(name, help, declared),
    }
    metric
}

/// Registers a counter family; the exposition adds `_total` to `name`. Register each name
/// once per process (services keep their families in a `OnceLock`).
pub fn counter(name: &str, help: &str) -> Family<Labels, Counter> {
    register(name, help, None, Family::default())
}

/// Registers a counter family counted in `unit` (`troupe_cost_usd` and the like).
pub fn counter_in(name: &str, help: &str, unit: &str) -> Family<Labels, Counter<f64>> {
    register(
        name,
        help,
        Some(Unit::Other(unit.to_owned())),
        Family::default(),
    )
}

/// Registers an integer gauge family.
pub fn gauge(name: &str, help: &str) -> Family<Labels, Gauge> {
    register(name, help, None, Family::default())
}

/// Registers a floating-point gauge family.
pub fn float_gauge(name: &str, help: &str) -> Family<Labels, FloatGauge> {
    register(name, help, None, Family::default())
}

/// Registers a histogram family in seconds (the exposition adds `_seconds` to `name`) with
/// the buckets `buckets` makes ([`latency_buckets`] or [`duration_buckets`]).
pub fn seconds_histogram(name: &str, help: &str, buckets: fn() -> Histogram) -> HistogramFamily {
    register(
        name,
        help,
        Some(Unit::Seconds),
        Family::new_with_constructor(buckets),
    )
}

/// Registers a histogram family without a unit (ratios) with `buckets`.
pub fn histogram(name: &str, help: &str, buckets: fn() -> Histogram) -> HistogramFamily {
    register(name, help, None, Family::new_with_constructor(buckets))
}

/// `troupe_sandbox_denials_total`: children whose failure the sandbox caused, by `kind`
/// (`path`, `connect`). Counted where a denial is attributed (`troupe-process`); registered by
/// whichever comes first, that or a worker's start, so a scrape shows it before any denial.
pub fn sandbox_denials() -> &'static Family<Labels, Counter> {
    static DENIALS: OnceLock<Family<Labels, Counter>> = OnceLock::new();
    DENIALS.get_or_init(|| {
        counter(
            "troupe_sandbox_denials",
            "Children whose failure the sandbox caused (an access its ruleset does not grant), by kind (path, connect).",
        )
    })
}

/// Buckets for service latencies: 1 ms to about 65 s.
pub fn latency_buckets() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.001, 2.0, 17,
    ))
}

/// Buckets for agent work: 0.1 s to about 3.6 hours.
pub fn duration_buckets() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.1, 2.0, 18,
    ))
}

/// Buckets for a fraction in 0..=1: tenths.
pub fn ratio_buckets() -> Histogram {
    Histogram::new((1..=10).map(|tenth| f64::from(tenth) / 10.0))
}

/// Shorthand for one label.
pub fn labels<const N: usize>(pairs: [(&'static str, &str); N]) -> Labels {
    pairs
        .into_iter()
        .map(|(name, value)| (name, value.to_owned()))
        .collect()
}

/// Runs `refresh` then encodes every registered family in the Prometheus text format.
pub async fn render(refresh: &[Refresh]) -> Result<String, String> {
    for hook in refresh {
        hook().await?;
    }
    Ok(encode())
}

/// Encodes every registered family as it stands.
pub fn encode() -> String {
    let registry = registry()
        .lock()
        .unwrap_or_else(|poison| poison.into_inner());
    let mut text = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_text::encode(&mut text, &registry);
    text
}

/// Binds `args`' address when one is given, and serves `GET /metrics` there (after
/// `refresh`) until `shutdown` completes; when an OTLP endpoint is configured, also pushes the
/// same metrics there (see the `otlp_metrics` module). Returns the bound address, or `None`
/// when the endpoint is off.
pub async fn spawn(
    args: &MetricsArgs,
    refresh: Vec<Refresh>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Option<SocketAddr>, MetricsError> {
    // Both the endpoint and the OTLP push stop with `shutdown`.
    let (stopped, stop) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stopped.send(true);
    });
    let until_stopped = move || {
        let mut stop = stop.clone();
        async move {
            let _ = stop.wait_for(|stopped| *stopped).await;
        }
    };
    if let Some(config) = crate::otlp_metrics::Config::from_env() {
        tokio::spawn(crate::otlp_metrics::push_until(
            config,
            refresh.clone(),
            until_stopped(),
        ));
    }
    let Some(addr) = args.metrics_listen else {
        return Ok(None);
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| MetricsError::Bind { addr, source })?;
    tokio::spawn(serve(listener, refresh, until_stopped()));
    tracing::info!(addr = %bound, "serving metrics on /metrics");
    Ok(Some(bound))
}

/// Serves `GET /metrics` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    refresh: Vec<Refresh>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let app = axum::Router::new()
        .route("/metrics", axum::routing::get(scrape))
        .with_state(Arc::new(refresh));
    if let Err(err) = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
    {
        tracing::error!(error = %err, "metrics endpoint stopped");
    }
}

async fn scrape(State(refresh): State<Arc<Vec<Refresh>>>) -> Response {
    match render(&refresh).await {
        Ok(text) => (
            [(header::CONTENT_TYPE, prometheus_text::CONTENT_TYPE)],
            text,
        )
            .into_response(),
        Err(err) => {
            tracing::warn!(error = %err, "metrics scrape failed");
            (StatusCode::SERVICE_UNAVAILABLE, err).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use prometheus_parse::{Scrape, Value};

    use super::*;

    #[test]
    fn families_encode_as_prometheus_text_a_parser_reads() {
        let tasks = counter("troupe_test_encoded", "Tasks counted by the test.");
        tasks.get_or_create(&labels([("role", "executor")])).inc();
        tasks.get_or_create(&labels([("role", "executor")])).inc();
        let depth = gauge("troupe_test_depth", "Depth seen by the test.");
        depth
            .get_or_create(&labels([("role", "test-runner")]))
            .set(3);
        let took = seconds_histogram("troupe_test_took", "Time the test took.", latency_buckets);
        let series = took.get_or_create(&labels([("role", "executor")]));
        series.observe(0.003);
        series.observe(100.0);
        counter("troupe_test_unused", "A family with no series yet.");
        let text = encode();
        assert!(
            text.contains("# TYPE troupe_test_unused_total counter\n"),
            "an empty family is declared: {text}"
        );
        assert!(
            text.contains("# HELP troupe_test_encoded_total Tasks counted by the test.\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE troupe_test_took_seconds histogram\n"),
            "{text}"
        );

        let scrape = Scrape::parse(text.lines().map(|line| Ok(line.to_owned()))).expect("parses");
        let sample = |name: &str| {
            scrape
                .samples
                .iter()
                .find(|sample| sample.metric == name)
                .unwrap_or_else(|| panic!("no {name} in {text}"))
        };
        let encoded = sample("troupe_test_encoded_total");
        assert_eq!(encoded.value, Value::Counter(2.0));
        assert_eq!(encoded.labels.get("role"), Some("executor"));
        let depth = sample("troupe_test_depth");
        assert_eq!(depth.value, Value::Gauge(3.0));
        assert_eq!(depth.labels.get("role"), Some("test-runner"));
        let Value::Histogram(buckets) = &sample("troupe_test_took_seconds").value else {
            panic!("not a histogram: {text}");
        };
        let at = |le: f64| {
            buckets
                .iter()
                .find(|bucket| bucket.less_than == le)
                .map(|bucket| bucket.count)
        };
        assert_eq!(at(0.002), Some(0.0));
        assert_eq!(at(0.004), Some(1.0));
        assert_eq!(at(65.536), Some(1.0));
        assert_eq!(at(f64::INFINITY), Some(2.0));
        assert_eq!(
            sample("troupe_test_took_seconds_count").value,
            Value::Untyped(2.0)
        );
    }
}

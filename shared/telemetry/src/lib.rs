//! Tracing and OpenTelemetry for every troupe binary.
//!
//! [`init`] installs a `tracing` subscriber (readable logs on a terminal, JSON lines otherwise,
//! `RUST_LOG` filtering), a W3C trace-context propagator, and an OpenTelemetry tracer provider.
//! Spans are exported over OTLP/gRPC only when `OTEL_EXPORTER_OTLP_ENDPOINT` is set; without it
//! trace ids are still created and propagated, so logs and downstream calls stay correlated.
//! Await [`TelemetryGuard::shutdown`] before exiting, or the last spans are lost.
//!
//! [`inject_context`] and [`extract_context`] carry the current trace across gRPC metadata.
//!
//! Log lines and exported spans pass through [`redact`]: known secret values never leave the
//! process in them.

pub mod metrics;
pub mod spans;

use std::io::IsTerminal;

mod logs;
mod otlp_metrics;
mod redact;

pub use redact::{
    MIN_SECRET_LEN, REDACTED, redact, redact_bytes, register_secret, register_secrets_from_env,
};

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Errors while setting telemetry up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The OTLP exporter could not be built from the environment.
    #[error("otlp exporter: {0}")]
    Exporter(String),
    /// A global subscriber was already installed.
    #[error("tracing subscriber already installed: {0}")]
    AlreadyInstalled(String),
}

/// Keeps the tracer provider alive; flushes and shuts it down on [`TelemetryGuard::shutdown`].
#[derive(Debug)]
#[must_use = "call shutdown() before exit or the last spans are lost"]
pub struct TelemetryGuard {
    provider: SdkTracerProvider,
}

impl TelemetryGuard {
    /// Flushes pending spans and stops the exporter, waiting at most five seconds: a collector
    /// that never answers must not hang the process on exit. The batch processor's shutdown
    /// blocks, so it runs on a blocking thread.
    pub async fn shutdown(self) {
        let provider = self.provider;
        let flush = tokio::task::spawn_blocking(move || provider.shutdown());
        match tokio::time::timeout(std::time::Duration::from_secs(5), flush).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(err))) => eprintln!("telemetry shutdown failed: {err}"),
            Ok(Err(err)) => eprintln!("telemetry shutdown panicked: {err}"),
            Err(_) => eprintln!("telemetry shutdown timed out after 5s"),
        }
    }
}

/// Installs logging and tracing for `service_name` (overridden by `OTEL_SERVICE_NAME`) as the
/// process-global subscriber. Log lines inside a traced span carry its `trace_id` and
/// `span_id`.
///
/// Log format: human-readable when stderr is a terminal, JSON lines otherwise; override with
/// `TROUPE_LOG_FORMAT=json|text`. Filter with `RUST_LOG` (default `info`).
pub fn init(service_name: &str) -> Result<TelemetryGuard, Error> {
    init_with_filter(service_name, "info")
}

/// Like [`init`], with `default_filter` used when `RUST_LOG` is unset (commands that print
/// their own progress want `warn`).
pub fn init_with_filter(service_name: &str, default_filter: &str) -> Result<TelemetryGuard, Error> {
    register_secrets_from_env();
    let _ = SERVICE_NAME.set(service_name.to_owned());
    let provider = tracer_provider(service_name)?;
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    opentelemetry::global::set_tracer_provider(provider.clone());
    let tracer = provider.tracer(service_name.to_owned());
    let otel_layer = tracing_opentelemetry::layer().with_tracer(tracer);
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));

    let json = match std::env::var("TROUPE_LOG_FORMAT").as_deref() {
        Ok("json") => true,
        Ok("text") => false,
        _ => !std::io::stderr().is_terminal(),
    };
    let registry = tracing_subscriber::registry().with(filter).with(otel_layer);
    let result = if json {
        registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_current_span(true)
                    .with_span_list(false)
                    .map_event_format(|inner| logs::WithTraceIds { inner, json: true })
                    .with_writer(redact::RedactingStderr),
            )
            .try_init()
    } else {
        registry
            .with(
                tracing_subscriber::fmt::layer()
                    .compact()
                    .map_event_format(|inner| logs::WithTraceIds { inner, json: false })
                    .with_writer(redact::RedactingStderr),
            )
            .try_init()
    };
    result.map_err(|err| Error::AlreadyInstalled(err.to_string()))?;
    Ok(TelemetryGuard { provider })
}

/// The name [`init`] was given, for the resource of pushed metrics.
pub(crate) static SERVICE_NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The resource every span (and metric) names: `OTEL_SERVICE_NAME` when set, else
/// `service_name`; plus `OTEL_RESOURCE_ATTRIBUTES`.
pub(crate) fn resource(service_name: &str) -> opentelemetry_sdk::Resource {
    let builder = opentelemetry_sdk::Resource::builder();
    // The builder reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES itself; the binary's
    // own name is only the fallback.
    if std::env::var("OTEL_SERVICE_NAME").is_ok_and(|name| !name.trim().is_empty()) {
        builder.build()
    } else {
        builder.with_service_name(service_name.to_owned()).build()
    }
}

fn tracer_provider(service_name: &str) -> Result<SdkTracerProvider, Error> {
    let builder = SdkTracerProvider::builder()
        .with_resource(resource(service_name))
        .with_id_generator(spans::PinnedIds::default());
    let endpoint_set = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
        .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        .is_ok_and(|value| !value.trim().is_empty());
    if !endpoint_set {
        return Ok(builder.build());
    }
    // The exporter reads OTEL_EXPORTER_OTLP_* itself (endpoint, headers, timeout).
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
        .map_err(|err| Error::Exporter(err.to_string()))?;
    Ok(builder
        .with_batch_exporter(redact::RedactingExporter(exporter))
        .build())
}

/// Writes the current span's trace context (`traceparent`, `tracestate`) into gRPC metadata.
pub fn inject_context(metadata: &mut tonic::metadata::MetadataMap) {
    let context = tracing::Span::current().context();
    let propagator = TraceContextPropagator::new();
    propagator.inject_context(&context, &mut MetadataInjector(metadata));
}

/// Reads a W3C trace context from HTTP/2 headers (gRPC metadata), for a server span's parent.
pub fn extract_context(headers: &http::HeaderMap) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(&HeaderExtractor(headers))
}

/// Makes `span` a child of the trace context found in `headers`, if any.
pub fn set_parent_from(span: &tracing::Span, headers: &http::HeaderMap) {
    let parent = extract_context(headers);
    // An invalid or absent context leaves the span a root; nothing to report.
    let _ = span.set_parent(parent);
}

/// Returns the current span's trace id as 32 hex digits, or `None` outside a sampled trace.
pub fn current_trace_id() -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    let context = tracing::Span::current().context();
    let span_context = context.span().span_context().clone();
    span_context
        .is_valid()
        .then(|| span_context.trace_id().to_string())
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        let Ok(key) = tonic::metadata::MetadataKey::from_bytes(key.as_bytes()) else {
            return;
        };
        if let Ok(value) = tonic::metadata::MetadataValue::try_from(value.as_str()) {
            self.0.insert(key, value);
        }
    }
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extracts_a_w3c_traceparent() {
        use opentelemetry::trace::TraceContextExt;
        let mut headers = http::HeaderMap::new();
        headers.insert(
            "traceparent",
            http::HeaderValue::from_static(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            ),
        );
        let context = extract_context(&headers);
        let span = context.span();
        let span_context = span.span_context();
        assert!(span_context.is_valid());
        assert_eq!(
            span_context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
    }

    #[test]
    fn missing_traceparent_gives_an_invalid_context() {
        use opentelemetry::trace::TraceContextExt;
        let context = extract_context(&http::HeaderMap::new());
        assert!(!context.span().span_context().is_valid());
    }
}

//! Server spans by the OpenTelemetry semantic conventions for RPC: one span per call, named
//! `troupe.v1.Coordinator/ClaimTasks`, with `rpc.system`, `rpc.service`, `rpc.method`, and
//! `rpc.grpc.status_code` once the call ends; its status is ERROR for the codes the
//! conventions call a server error (UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL,
//! UNAVAILABLE, DATA_LOSS), unset otherwise (a refused argument is the caller's error).
//!
//! A call's code is in the response headers when it failed before any message, else in the
//! trailers at the end of its body (a unary answer, a stream), so the body is watched to its
//! end. A call dropped unanswered (the client went away, or its `grpc-timeout` passed) is
//! recorded as CANCELLED or DEADLINE_EXCEEDED.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http_body::{Frame, SizeHint};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The span tonic opens for each request (`Server::trace_fn`), parented on the caller's W3C
/// `traceparent`.
pub(crate) fn request_span(request: &http::Request<()>) -> tracing::Span {
    let path = request.uri().path().trim_start_matches('/');
    let (service, method) = path.split_once('/').unwrap_or((path, ""));
    let span = tracing::info_span!(
        "grpc",
        otel.name = %path,
        otel.kind = "server",
        rpc.system = "grpc",
        rpc.service = %service,
        rpc.method = %method,
    );
    troupe_telemetry::set_parent_from(&span, request.headers());
    span
}

/// Records each call's gRPC status on its span.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RpcStatusLayer;

impl<S> tower::Layer<S> for RpcStatusLayer {
    type Service = RpcStatus<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RpcStatus { inner }
    }
}

/// See [`RpcStatusLayer`].
#[derive(Clone, Debug)]
pub(crate) struct RpcStatus<S> {
    inner: S,
}

type Response = http::Response<tonic::body::Body>;

impl<S, B> tower::Service<http::Request<B>> for RpcStatus<S>
where
    S: tower::Service<http::Request<B>, Response = Response>,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let deadline = request
            .headers()
            .get("grpc-timeout")
            .and_then(|value| value.to_str().ok())
            .and_then(grpc_timeout)
            .map(|timeout| Instant::now() + timeout);
        let call = self.inner.call(request);
        Box::pin(async move {
            // Polled inside the request's span (tonic enters it around this future).
            let mut recorder = Recorder {
                span: Some(tracing::Span::current()),
                deadline,
            };
            let response = call.await?;
            let code = response
                .headers()
                .get("grpc-status")
                .and_then(|value| value.to_str().ok()?.parse::<i32>().ok());
            Ok(match code {
                Some(code) => {
                    recorder.finish(code);
                    response
                }
                None => response.map(|body| {
                    tonic::body::Body::new(Watched {
                        inner: body,
                        recorder,
                    })
                }),
            })
        })
    }
}

/// A call's span until its status is known.
struct Recorder {
    span: Option<tracing::Span>,
    deadline: Option<Instant>,
}

impl Recorder {
    fn finish(&mut self, code: i32) {
        if let Some(span) = self.span.take() {
            record(&span, code);
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        let timed_out = self.deadline.is_some_and(|at| Instant::now() >= at);
        let code = if timed_out {
            tonic::Code::DeadlineExceeded
        } else {
            tonic::Code::Cancelled
        };
        self.finish(code as i32);
    }
}

/// Sets `rpc.grpc.status_code` and, for a server error, the span's status.
fn record(span: &tracing::Span, code: i32) {
    span.set_attribute("rpc.grpc.status_code", i64::from(code));
    let code = tonic::Code::from_i32(code);
    if matches!(
        code,
        tonic::Code::Unknown
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Unimplemented
            | tonic::Code::Internal
            | tonic::Code::Unavailable
            | tonic::Code::DataLoss
    ) {
        span.set_status(opentelemetry::trace::Status::error(format!("{code:?}")));
    }
}

/// A response body whose trailers (or end) give the call's status.
struct Watched {
    inner: tonic::body::Body,
    recorder: Recorder,
}

impl http_body::Body for Watched {
    type Data = <tonic::body::Body as http_body::Body>::Data;
    type Error = <tonic::body::Body as http_body::Body>::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(code) = frame
                    .trailers_ref()
                    .and_then(|trailers| trailers.get("grpc-status"))
                    .and_then(|value| value.to_str().ok()?.parse::<i32>().ok())
                {
                    self.recorder.finish(code);
                }
            }
            Poll::Ready(Some(Err(status))) => self.recorder.finish(status.code() as i32),
            // Ended without a status in its trailers: an answer tonic completed normally.
            Poll::Ready(None) => self.recorder.finish(tonic::Code::Ok as i32),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Parses a `grpc-timeout` header value: digits and a unit (`H`, `M`, `S`, `m`, `u`, `n`).
fn grpc_timeout(value: &str) -> Option<Duration> {
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount.saturating_mul(3600)),
        "M" => Duration::from_secs(amount.saturating_mul(60)),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse_in_every_unit() {
        assert_eq!(grpc_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(grpc_timeout("90S"), Some(Duration::from_secs(90)));
        assert_eq!(grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(grpc_timeout("7n"), Some(Duration::from_nanos(7)));
        assert_eq!(grpc_timeout("S"), None);
        assert_eq!(grpc_timeout(""), None);
        assert_eq!(grpc_timeout("10x"), None);
    }
}

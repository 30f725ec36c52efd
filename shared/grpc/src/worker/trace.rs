//! How an attempt ended, on its `troupe.task.attempt` span (the current span of the attempt):
//! the outcome, the backend with its tokens, the error kind, and an ERROR status for a failed
//! or abandoned attempt.

use tracing_opentelemetry::OpenTelemetrySpanExt;
use troupe_proto::v1::task_result::Detail;
use troupe_telemetry::spans;

use super::metrics::{Outcome, kind_label};

/// Records `outcome` on the current span; `message` says why a failed attempt failed.
pub(crate) fn attempt(outcome: &Outcome<'_>, message: &str) {
    let span = tracing::Span::current();
    let (name, result) = match outcome {
        Outcome::Completed(result) => ("completed", Some(*result)),
        Outcome::Failed(kind, partial) => {
            span.set_attribute(spans::ERROR_KIND, kind_label(*kind));
            spans::set_error(&span, message);
            ("failed", *partial)
        }
        Outcome::Abandoned => {
            spans::set_error(&span, &format!("attempt abandoned: {message}"));
            ("abandoned", None)
        }
    };
    span.set_attribute(spans::OUTCOME, name);
    if let Some(Detail::Implementation(report)) = result.and_then(|result| result.detail.as_ref()) {
        if !report.backend.is_empty() {
            span.set_attribute(spans::BACKEND, report.backend.clone());
        }
        if !report.model.is_empty() {
            span.set_attribute(spans::MODEL, report.model.clone());
        }
        if let Some(usage) = &report.usage {
            span.set_attribute(
                spans::INPUT_TOKENS,
                i64::try_from(usage.input_tokens).unwrap_or(i64::MAX),
            );
            span.set_attribute(
                spans::OUTPUT_TOKENS,
                i64::try_from(usage.output_tokens).unwrap_or(i64::MAX),
            );
        }
    }
}

//! The spans troupe's traces are made of, named and attributed by the OpenTelemetry semantic
//! conventions where they have one (`rpc.*` for gRPC), and `troupe.*` otherwise.
//!
//! A session has one span, `troupe.session`, whose trace and span ids derive from the session
//! id ([`session_span_context`]): any coordinator (a restarted one, another replica) can link
//! to it without storing anything. Each task attempt is one trace: the coordinator opens it at
//! claim time with a `troupe.task.claim` span ([`claim_span`]) linked to the session span, and
//! sends its W3C `traceparent` in the claim; the worker's `troupe.task.attempt` span joins it
//! ([`attempt_span`]), and so does every call the worker makes meanwhile (the coordinator's
//! heartbeat and report spans, the validator of a self-validation).

use opentelemetry::Context;
pub use opentelemetry::KeyValue;
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState,
    Tracer as _,
};
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator};
use sha2::{Digest, Sha256};
use std::cell::Cell;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Attribute: the session id.
pub const SESSION: &str = "troupe.session.id";
/// Attribute: the task id.
pub const TASK: &str = "troupe.task.id";
/// Attribute: the attempt number (1-based).
pub const ATTEMPT: &str = "troupe.task.attempt";
/// Attribute: the task's role (`executor`, `validator`, `test-runner`).
pub const ROLE: &str = "troupe.role";
/// Attribute: how the attempt ended (`completed`, `failed`, `abandoned`).
pub const OUTCOME: &str = "troupe.outcome";
/// Attribute: the error kind of a failed attempt (`timeout`, `crash`, ...).
pub const ERROR_KIND: &str = "troupe.error.kind";
/// Attribute: the executor backend that produced the result (`command`, `codex`, ...).
pub const BACKEND: &str = "troupe.backend";
/// Attribute (GenAI semantic conventions): the model asked for.
pub const MODEL: &str = "gen_ai.request.model";
/// Attribute (GenAI semantic conventions): prompt tokens.
pub const INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
/// Attribute (GenAI semantic conventions): generated tokens.
pub const OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";

thread_local! {
    /// Ids the next span built on this thread takes instead of random ones (see [`PinnedIds`]).
    static PINNED: Cell<Option<(TraceId, SpanId)>> = const { Cell::new(None) };
}

/// The tracer provider's id generator: random ids, except for a span built while ids are
/// pinned on its thread (the session span, whose ids derive from the session id). The SDK
/// ignores ids given in a span builder, so this is the one way to choose them.
#[derive(Debug, Default)]
pub(crate) struct PinnedIds(RandomIdGenerator);

impl IdGenerator for PinnedIds {
    fn new_trace_id(&self) -> TraceId {
        match PINNED.with(Cell::take) {
            Some((trace_id, _)) => trace_id,
            None => self.0.new_trace_id(),
        }
    }

    fn new_span_id(&self) -> SpanId {
        // The SDK asks for the span id first, then (for a root) the trace id: keep the trace
        // id pinned for that second call.
        match PINNED.with(Cell::get) {
            Some((trace_id, span_id)) => {
                PINNED.with(|pinned| pinned.set(Some((trace_id, SpanId::INVALID))));
                if span_id == SpanId::INVALID {
                    PINNED.with(Cell::take);
                    self.0.new_span_id()
                } else {
                    span_id
                }
            }
            None => self.0.new_span_id(),
        }
    }
}

/// The span context of `session_id`'s session span: ids from SHA-256 of the id, sampled.
pub fn session_span_context(session_id: &str) -> SpanContext {
    let digest = Sha256::digest(format!("troupe.session:{session_id}").as_bytes());
    let mut trace = [0u8; 16];
    let mut span = [0u8; 8];
    trace.copy_from_slice(&digest[..16]);
    span.copy_from_slice(&digest[16..24]);
    SpanContext::new(
        TraceId::from_bytes(trace),
        SpanId::from_bytes(span),
        TraceFlags::SAMPLED,
        false,
        TraceState::default(),
    )
}

/// Records `session_id`'s session span (the creation of the session), with `attributes`,
/// linked to the current span (the `CreateSession` call). Its ids are
/// [`session_span_context`]'s, so attempts link to it from any coordinator.
pub fn record_session(session_id: &str, attributes: Vec<KeyValue>) {
    let ids = session_span_context(session_id);
    let caller = tracing::Span::current()
        .context()
        .span()
        .span_context()
        .clone();
    let tracer = opentelemetry::global::tracer("troupe");
    let mut builder = tracer
        .span_builder("troupe.session")
        .with_kind(SpanKind::Internal)
        .with_attributes(
            std::iter::once(KeyValue::new(SESSION, session_id.to_owned())).chain(attributes),
        );
    if caller.is_valid() {
        builder = builder.with_links(vec![opentelemetry::trace::Link::with_context(caller)]);
    }
    PINNED.with(|pinned| pinned.set(Some((ids.trace_id(), ids.span_id()))));
    let mut span = tracer.build_with_context(builder, &Context::new());
    // A provider other than ours (a test's, the no-op one) leaves the ids pinned.
    PINNED.with(Cell::take);
    span.end();
}

/// What a claim leased, for its attempt's trace.
#[derive(Clone, Copy, Debug)]
pub struct AttemptIds<'a> {
    /// The session.
    pub session_id: &'a str,
    /// The task.
    pub task_id: &'a str,
    /// The attempt number.
    pub attempt: u32,
    /// The task's role.
    pub role: &'a str,
}

impl AttemptIds<'_> {
    fn record(&self, span: &tracing::Span) {
        span.set_attribute(SESSION, self.session_id.to_owned());
        span.set_attribute(TASK, self.task_id.to_owned());
        span.set_attribute(ATTEMPT, i64::from(self.attempt));
        span.set_attribute(ROLE, self.role.to_owned());
    }
}

/// Opens and closes `troupe.task.claim`, the root of a new trace for one attempt, linked to
/// its session span and to the current span (the claim call); returns the `traceparent` the
/// claim carries to the worker (empty when tracing is off).
pub fn claim_span(ids: AttemptIds<'_>) -> String {
    let span = tracing::info_span!(parent: None, "troupe.task.claim", otel.kind = "internal");
    ids.record(&span);
    span.add_link(session_span_context(ids.session_id));
    let caller = tracing::Span::current()
        .context()
        .span()
        .span_context()
        .clone();
    if caller.is_valid() {
        span.add_link(caller);
    }
    traceparent(&span.context())
}

/// The worker's span for one attempt, `troupe.task.attempt`, a child of the claim's
/// `traceparent` (or a root linked to the session span, from a coordinator that sent none).
pub fn attempt_span(ids: AttemptIds<'_>, traceparent: &str) -> tracing::Span {
    let span = tracing::info_span!(
        "troupe.task.attempt",
        otel.kind = "internal",
        session_id = %ids.session_id,
        task_id = %ids.task_id,
        attempt = ids.attempt,
    );
    let parent = from_traceparent(traceparent);
    if parent.span().span_context().is_valid() {
        let _ = span.set_parent(parent);
    } else {
        span.add_link(session_span_context(ids.session_id));
    }
    ids.record(&span);
    span
}

/// Marks `span` failed: status ERROR with `message` (semantic conventions: the description
/// of an error status).
pub fn set_error(span: &tracing::Span, message: &str) {
    span.set_status(opentelemetry::trace::Status::error(message.to_owned()));
}

/// The W3C `traceparent` of `context`'s span, empty when it has none.
pub fn traceparent(context: &Context) -> String {
    let span = context.span();
    let span_context = span.span_context();
    if !span_context.is_valid() {
        return String::new();
    }
    format!(
        "00-{}-{}-{:02x}",
        span_context.trace_id(),
        span_context.span_id(),
        span_context.trace_flags().to_u8()
    )
}

/// The remote context a W3C `traceparent` names; an empty context when it is empty or
/// malformed.
pub fn from_traceparent(traceparent: &str) -> Context {
    use opentelemetry::propagation::TextMapPropagator;
    if traceparent.is_empty() {
        return Context::new();
    }
    let carrier =
        std::collections::HashMap::from([("traceparent".to_owned(), traceparent.to_owned())]);
    opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&carrier)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_span_context_is_the_same_everywhere_and_differs_by_session() {
        let a = session_span_context("s-1");
        assert_eq!(a, session_span_context("s-1"));
        assert!(a.is_valid() && a.is_sampled());
        assert_ne!(a.trace_id(), session_span_context("s-2").trace_id());
    }

    #[test]
    fn traceparent_round_trips() {
        let remote = SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").expect("hex"),
            SpanId::from_hex("00f067aa0ba902b7").expect("hex"),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        let context = Context::new().with_remote_span_context(remote.clone());
        let text = traceparent(&context);
        assert_eq!(
            text,
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        assert_eq!(*from_traceparent(&text).span().span_context(), remote);
        assert!(!from_traceparent("garbage").span().span_context().is_valid());
        assert_eq!(traceparent(&Context::new()), "");
    }

    #[test]
    fn pinned_ids_serve_one_span_then_random_ones() {
        let ids = session_span_context("s-1");
        let generator = PinnedIds::default();
        PINNED.with(|pinned| pinned.set(Some((ids.trace_id(), ids.span_id()))));
        assert_eq!(generator.new_span_id(), ids.span_id());
        assert_eq!(generator.new_trace_id(), ids.trace_id());
        assert_ne!(generator.new_span_id(), ids.span_id());
        assert_ne!(generator.new_trace_id(), ids.trace_id());
    }
}

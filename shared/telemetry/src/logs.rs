//! Log lines that name their trace: an event inside a traced span carries that span's
//! OpenTelemetry `trace_id` and `span_id` (JSON lines as two more keys; text lines as
//! `trace_id=… span_id=…` at the end), so a log line leads to its trace and back.

use std::fmt;

use opentelemetry::trace::TraceContextExt;
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// Wraps an event format, adding the ids of the event's span.
#[derive(Debug)]
pub(crate) struct WithTraceIds<E> {
    pub(crate) inner: E,
    pub(crate) json: bool,
}

/// The trace and span ids of the span an event is in, when that span is traced.
fn ids<S, N>(ctx: &FmtContext<'_, S, N>) -> Option<(String, String)>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    let span = ctx.parent_span()?;
    let context = tracing::dispatcher::get_default(|dispatch| {
        tracing_opentelemetry::get_otel_context(&span.id(), dispatch)
    })?;
    let otel_span = context.span();
    let span_context = otel_span.span_context();
    span_context.is_valid().then(|| {
        (
            span_context.trace_id().to_string(),
            span_context.span_id().to_string(),
        )
    })
}

impl<S, N, E> FormatEvent<S, N> for WithTraceIds<E>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    E: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let Some((trace_id, span_id)) = ids(ctx) else {
            return self.inner.format_event(ctx, writer, event);
        };
        // The inner format writes a whole line; the ids go inside it, before its end.
        let mut line = String::new();
        self.inner
            .format_event(ctx, Writer::new(&mut line), event)?;
        let body = line.trim_end_matches('\n');
        if self.json {
            let Some(open) = body.strip_suffix('}') else {
                return writeln!(writer, "{body}");
            };
            writeln!(
                writer,
                "{open},\"trace_id\":\"{trace_id}\",\"span_id\":\"{span_id}\"}}"
            )
        } else {
            writeln!(writer, "{body} trace_id={trace_id} span_id={span_id}")
        }
    }
}

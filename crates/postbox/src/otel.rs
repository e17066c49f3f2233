//! Tracing spans named after the OpenTelemetry messaging conventions, and
//! (with the cargo feature `otel`) the W3C trace context that links them
//! from the producer's request to the consumer's effect.
//!
//! Every span here is a plain `tracing` span at INFO: without a subscriber
//! that wants it, creating one costs a callsite check. With the feature `otel`
//! and a [`tracing-opentelemetry`](https://docs.rs/tracing-opentelemetry)
//! layer installed, the spans become OpenTelemetry spans and:
//!
//! - `enqueue`, `enqueue_batch` and `emit` fill the `traceparent` (and
//!   `tracestate`) of an event that carries none from their own span, so the
//!   relay's publish span continues the producer's trace;
//! - [`receive_span`] starts a consumer's span as a child of the context a
//!   delivery carries (the relay's publish span), and `record_inbox` runs in
//!   a child span of whatever span is current.
//!
//! Span attributes: `messaging.system` = `postbox`,
//! `messaging.operation.type` (`create`, `receive`, `process`),
//! `messaging.destination.name` (the outbox's schema), `messaging.message.id`
//! (the event id), `messaging.batch.message_count`,
//! `messaging.consumer.group.name` (the inbox consumer).

use crate::Schema;
use std::borrow::Cow;
use tracing::Span;
use uuid::Uuid;

/// The `messaging.system` of every postbox span.
pub const MESSAGING_SYSTEM: &str = "postbox";

/// The span of `enqueue`/`emit` (one event) or `enqueue_batch` (`count`
/// events): operation type `create`, a producer span.
pub(crate) fn create_span(
    operation: &'static str,
    schema: &Schema,
    event_id: Option<Uuid>,
    count: usize,
) -> Span {
    let span = tracing::info_span!(
        target: "postbox::otel",
        "create",
        otel.name = %format_args!("{operation} {schema}"),
        otel.kind = "producer",
        messaging.system = MESSAGING_SYSTEM,
        messaging.operation.type = "create",
        messaging.operation.name = operation,
        messaging.destination.name = %schema,
        messaging.message.id = tracing::field::Empty,
        messaging.batch.message_count = tracing::field::Empty,
    );
    match event_id {
        Some(id) => span.record("messaging.message.id", tracing::field::display(id)),
        None => span.record("messaging.batch.message_count", count),
    };
    span
}

/// The span of `record_inbox`: operation type `process`, a child of the
/// current span (start the delivery's span with [`receive_span`]).
pub(crate) fn record_inbox_span(consumer: &str, event_id: Uuid) -> Span {
    tracing::info_span!(
        target: "postbox::otel",
        "record_inbox",
        otel.name = %format_args!("record_inbox {consumer}"),
        messaging.system = MESSAGING_SYSTEM,
        messaging.operation.type = "process",
        messaging.operation.name = "record_inbox",
        messaging.consumer.group.name = consumer,
        messaging.message.id = %event_id,
    )
}

/// A consumer's span for one delivery of `event_id`: operation type
/// `receive`, a consumer span. With the feature `otel` and an OpenTelemetry
/// layer installed, its parent is the context the delivery carries (the
/// `traceparent`/`tracestate` headers or CloudEvents attributes: the relay's
/// publish span), so the consumer's work joins the producer's trace; without
/// a valid `traceparent` it is a child of the current span.
///
/// Run the handling inside it (`.instrument(span)` or `span.in_scope(..)`);
/// [`crate::sqlx::record_inbox`] then records its own span beneath it.
pub fn receive_span(
    consumer: &str,
    event_id: Uuid,
    traceparent: Option<&str>,
    tracestate: Option<&str>,
) -> Span {
    let span = tracing::info_span!(
        target: "postbox::otel",
        "receive",
        otel.name = %format_args!("receive {consumer}"),
        otel.kind = "consumer",
        messaging.system = MESSAGING_SYSTEM,
        messaging.operation.type = "receive",
        messaging.consumer.group.name = consumer,
        messaging.message.id = %event_id,
    );
    #[cfg(feature = "otel")]
    if let Some(cx) = traceparent.and_then(|tp| context::parent(tp, tracestate)) {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        // Fails only when no OpenTelemetry layer tracks the span: nothing to link.
        let _ = span.set_parent(cx);
    }
    #[cfg(not(feature = "otel"))]
    let _ = (traceparent, tracestate);
    span
}

/// The event headers (JSON text) to store: `headers` as they are, or, when
/// they carry no `traceparent` and `span` has an OpenTelemetry context, with
/// that context added. Parses the headers only in the latter case.
pub(crate) fn headers_with_context<'a>(headers: &'a str, span: &Span) -> Cow<'a, str> {
    #[cfg(feature = "otel")]
    if let Some((traceparent, tracestate)) = context::of_span(span) {
        return context::add_if_missing(headers, &traceparent, tracestate.as_deref())
            .map_or(Cow::Borrowed(headers), Cow::Owned);
    }
    #[cfg(not(feature = "otel"))]
    let _ = span;
    Cow::Borrowed(headers)
}

/// [`headers_with_context`] for the headers of a batch, in place.
pub(crate) fn fill_headers(headers: &mut [String], span: &Span) {
    #[cfg(feature = "otel")]
    if let Some((traceparent, tracestate)) = context::of_span(span) {
        for h in headers {
            if let Some(filled) = context::add_if_missing(h, &traceparent, tracestate.as_deref()) {
                *h = filled;
            }
        }
    }
    #[cfg(not(feature = "otel"))]
    let _ = (headers, span);
}

/// W3C trace context ⇄ OpenTelemetry context (feature `otel`), shared with
/// the relay.
#[cfg(feature = "otel")]
pub mod context {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    use opentelemetry::Context;
    use std::collections::BTreeMap;
    use std::str::FromStr;
    use tracing::Span;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    /// The span context a `traceparent` (version 00) names, remote, with
    /// its `tracestate` when that parses; `None` when it is not valid.
    pub fn span_context(traceparent: &str, tracestate: Option<&str>) -> Option<SpanContext> {
        let mut parts = traceparent.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version != "00" || parts.next().is_some() || trace.len() != 32 || span.len() != 16 {
            return None;
        }
        let trace_id = TraceId::from_hex(trace).ok()?;
        let span_id = SpanId::from_hex(span).ok()?;
        let flags = u8::from_str_radix(flags, 16).ok()?;
        let state = tracestate
            .and_then(|s| TraceState::from_str(s).ok())
            .unwrap_or_default();
        let cx = SpanContext::new(
            trace_id,
            span_id,
            TraceFlags::new(flags) & TraceFlags::SAMPLED,
            true,
            state,
        );
        cx.is_valid().then_some(cx)
    }

    /// A parent context from a `traceparent`/`tracestate` pair.
    pub fn parent(traceparent: &str, tracestate: Option<&str>) -> Option<Context> {
        span_context(traceparent, tracestate).map(|sc| Context::new().with_remote_span_context(sc))
    }

    /// `span`'s OpenTelemetry context as `traceparent` and `tracestate`
    /// (`None` when empty); `None` when no OpenTelemetry layer tracks it.
    pub fn of_span(span: &Span) -> Option<(String, Option<String>)> {
        if span.is_disabled() {
            return None;
        }
        let cx = span.context();
        let otel = cx.span();
        let sc = otel.span_context();
        sc.is_valid().then(|| format_context(sc))
    }

    /// A span context as `traceparent` and `tracestate` (`None` when empty).
    pub fn format_context(sc: &SpanContext) -> (String, Option<String>) {
        let traceparent = format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        );
        let state = sc.trace_state().header();
        (traceparent, (!state.is_empty()).then_some(state))
    }

    /// `headers` (a JSON object's text) with `traceparent`/`tracestate`
    /// added, or `None` when they already carry a `traceparent` (the
    /// application's own context wins) or are not an object.
    pub(crate) fn add_if_missing(
        headers: &str,
        traceparent: &str,
        tracestate: Option<&str>,
    ) -> Option<String> {
        let mut map: BTreeMap<String, serde_json::Value> = serde_json::from_str(headers).ok()?;
        if map.contains_key("traceparent") {
            return None;
        }
        map.insert("traceparent".to_owned(), traceparent.into());
        if let Some(state) = tracestate {
            map.insert("tracestate".to_owned(), state.into());
        }
        serde_json::to_string(&map).ok()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn a_traceparent_round_trips_and_a_malformed_one_is_refused() {
            let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
            let sc = span_context(tp, Some("congo=t61rcWkgMzE")).unwrap();
            assert!(sc.is_remote() && sc.is_sampled());
            assert_eq!(
                format_context(&sc),
                (tp.to_owned(), Some("congo=t61rcWkgMzE".to_owned()))
            );
            for bad in [
                "",
                "00-abc",
                "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
                "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            ] {
                assert!(span_context(bad, None).is_none(), "{bad:?}");
            }
        }

        #[test]
        fn the_applications_own_traceparent_wins() {
            let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
            assert_eq!(add_if_missing(r#"{"traceparent":"x"}"#, tp, None), None);
            let added = add_if_missing(r#"{"a":"b"}"#, tp, Some("k=v")).unwrap();
            assert_eq!(
                added,
                format!(r#"{{"a":"b","traceparent":"{tp}","tracestate":"k=v"}}"#)
            );
        }
    }
}

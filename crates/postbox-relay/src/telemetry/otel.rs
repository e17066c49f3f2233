//! The relay's spans, named after the OpenTelemetry messaging conventions
//! (see `postbox::otel` for the producer's and the consumer's).
//!
//! Per batch, always (plain `tracing` spans at INFO, a callsite check when no
//! subscriber wants them): `claim {schema}` (operation type `receive`; a
//! claim in claim mode, a page of the log in log mode, a batch read from the
//! slot in logical mode, made only for a read that returned events),
//! `publish {destination}` (`publish`, one per destination the batch goes
//! to, in every reading mode) and `settle {schema}` (`settle`: the claim's
//! acknowledgement, or the cursor's move in log mode; logical mode confirms
//! its slot per round, not per batch),
//! each with
//! `messaging.batch.message_count`.
//!
//! Per event, only with the cargo feature `otel` **and** an OpenTelemetry
//! layer tracking the batch's publish span (checked once per batch, so a
//! relay without one never builds them): a `publish {destination}` span whose
//! parent is the context the event carries (the producer's `enqueue` span)
//! and which links to the batch span; the message handed to the sink carries
//! that span's context as its `traceparent`, so the consumer's span is its
//! child and one trace runs from the producer's request to the consumer's
//! effect. The span ends when the destination answered; a retry or a
//! rejection marks it as an error. The batch spans link to the events'
//! contexts.

use crate::sink::{Message, Outcome};
use postbox::otel::MESSAGING_SYSTEM;
use std::collections::BTreeMap;
use tracing::Span;

/// The headers of the events of a batch, from which the batch spans link to
/// the contexts the events carry.
pub(crate) type Carried<'a> = &'a BTreeMap<String, String>;

/// Mark a claimed batch from `schema` (its events' `headers`) with a span
/// linked to the events' contexts: a claim in claim mode, a page of the log
/// in log mode, a batch read from the slot in logical mode. Made once the
/// read returned events, so an idle relay makes no spans; it marks the read
/// rather than timing it (one short statement).
pub(crate) fn claimed<'a>(
    schema: &impl std::fmt::Display,
    headers: impl ExactSizeIterator<Item = Carried<'a>>,
) {
    let span = tracing::info_span!(
        target: "postbox_relay::otel",
        "claim",
        otel.name = %format_args!("claim {schema}"),
        otel.kind = "consumer",
        messaging.system = MESSAGING_SYSTEM,
        messaging.operation.type = "receive",
        messaging.operation.name = "claim",
        messaging.destination.name = %schema,
        messaging.batch.message_count = headers.len(),
    );
    link_events(&span, headers);
}

/// The span of settling a batch in `schema` (its events' `headers`): the
/// claim's acknowledgement in claim mode, moving the cursor (and handing
/// failures to the outbox) in log mode.
pub(crate) fn settle_span<'a>(
    schema: &impl std::fmt::Display,
    headers: impl ExactSizeIterator<Item = Carried<'a>>,
) -> Span {
    let span = tracing::info_span!(
        target: "postbox_relay::otel",
        "settle",
        otel.name = %format_args!("settle {schema}"),
        messaging.system = MESSAGING_SYSTEM,
        messaging.operation.type = "settle",
        messaging.operation.name = "settle",
        messaging.destination.name = %schema,
        messaging.batch.message_count = headers.len(),
    );
    link_events(&span, headers);
    span
}

/// Link a batch span to the context each event carries (only when an
/// OpenTelemetry layer tracks the span).
fn link_events<'a>(span: &Span, headers: impl Iterator<Item = Carried<'a>>) {
    #[cfg(feature = "otel")]
    if tracked(span) {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        for h in headers {
            if let Some(sc) = carried(h) {
                span.add_link(sc);
            }
        }
    }
    #[cfg(not(feature = "otel"))]
    let _ = (span, headers);
}

/// One destination's publish of a batch: the batch span, and (feature
/// `otel`, layer installed) a span per event and the messages re-stamped with
/// those spans' contexts.
pub(crate) struct Publish {
    batch: Span,
    #[cfg(feature = "otel")]
    events: Vec<Span>,
    #[cfg(feature = "otel")]
    stamped: Vec<Message>,
}

impl Publish {
    pub(crate) fn start(destination: &str, messages: &[Message]) -> Self {
        let batch = tracing::info_span!(
            target: "postbox_relay::otel",
            "publish",
            otel.name = %format_args!("publish {destination}"),
            otel.kind = "producer",
            messaging.system = MESSAGING_SYSTEM,
            messaging.operation.type = "publish",
            messaging.destination.name = destination,
            messaging.batch.message_count = messages.len(),
        );
        #[cfg(feature = "otel")]
        {
            let (events, stamped) = if tracked(&batch) {
                per_event(&batch, destination, messages)
            } else {
                (Vec::new(), Vec::new())
            };
            Self {
                batch,
                events,
                stamped,
            }
        }
        #[cfg(not(feature = "otel"))]
        Self { batch }
    }

    /// The messages to hand the sink: re-stamped with the per-event spans'
    /// contexts when there are such spans, else `messages` as they are.
    pub(crate) fn messages<'a>(&'a self, messages: &'a [Message]) -> &'a [Message] {
        #[cfg(feature = "otel")]
        if !self.stamped.is_empty() {
            return &self.stamped;
        }
        messages
    }

    /// The batch span, to instrument the sink's call with.
    pub(crate) fn span(&self) -> Span {
        self.batch.clone()
    }

    /// End the spans, marking an event's span as an error when its
    /// destination did not take it.
    pub(crate) fn end(self, outcomes: &[Outcome]) {
        #[cfg(feature = "otel")]
        for (span, outcome) in self.events.iter().zip(outcomes) {
            if let Outcome::Retry { .. } | Outcome::Reject { .. } = outcome {
                span.record("otel.status_code", "ERROR");
            }
        }
        #[cfg(not(feature = "otel"))]
        let _ = outcomes;
    }
}

/// Whether an OpenTelemetry layer tracks `span`.
#[cfg(feature = "otel")]
fn tracked(span: &Span) -> bool {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    !span.is_disabled() && span.context().span().span_context().is_valid()
}

/// The span context an event carries (its `traceparent`), if valid.
#[cfg(feature = "otel")]
fn carried(headers: Carried<'_>) -> Option<opentelemetry::trace::SpanContext> {
    let traceparent = headers.get("traceparent")?;
    let tracestate = headers.get("tracestate").map(String::as_str);
    postbox::otel::context::span_context(traceparent, tracestate)
}

#[cfg(feature = "otel")]
fn per_event(batch: &Span, destination: &str, messages: &[Message]) -> (Vec<Span>, Vec<Message>) {
    use opentelemetry::trace::TraceContextExt;
    use opentelemetry::Context;
    use postbox::otel::context;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let batch_context = batch.context().span().span_context().clone();
    let mut spans = Vec::with_capacity(messages.len());
    let mut stamped = Vec::with_capacity(messages.len());
    for m in messages {
        let span = tracing::info_span!(
            target: "postbox_relay::otel",
            parent: batch,
            "publish",
            otel.name = %format_args!("publish {destination}"),
            otel.kind = "producer",
            otel.status_code = tracing::field::Empty,
            messaging.system = MESSAGING_SYSTEM,
            messaging.operation.type = "publish",
            messaging.destination.name = destination,
            messaging.message.id = %m.event_id,
        );
        if let Some(producer) = carried(&m.headers) {
            batch.add_link(producer.clone());
            // The producer's context is the parent; the batch is a link.
            let _ = span.set_parent(Context::new().with_remote_span_context(producer));
            span.add_link(batch_context.clone());
        }
        let mut message = m.clone();
        if let Some((traceparent, tracestate)) = context::of_span(&span) {
            message
                .headers
                .insert("traceparent".to_owned(), traceparent);
            match tracestate {
                Some(state) => message.headers.insert("tracestate".to_owned(), state),
                None => message.headers.remove("tracestate"),
            };
        }
        spans.push(span);
        stamped.push(message);
    }
    (spans, stamped)
}

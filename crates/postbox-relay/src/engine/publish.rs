//! The one place every reading mode publishes through: a batch of messages
//! to one destination, first through the filters and transforms on the way
//! there (`crate::shape`, on the evaluator's threads), then to the sink,
//! bounded by `publish_timeout`, each outcome cleaned of the sink's secrets,
//! counted, and watched for runs of failures.

use super::outages::{whole_seconds, Report};
use super::Shared;
use crate::config::ReadMode;
use crate::redact::sanitize_error;
use crate::shape::Shaped;
use crate::sink::{Message, Outcome};
use crate::telemetry::metrics as m;
use futures::FutureExt;
use std::panic::AssertUnwindSafe;
use std::time::Instant;
use tracing::Instrument;

/// Publish `messages` to destination `d`: what its filters keep from it is
/// answered delivered without being sent (and counted as filtered), what an
/// expression fails on is rejected (a dead letter of `d` only), the rest goes
/// to the sink as its transforms made it.
pub(crate) async fn publish_to(
    shared: &Shared,
    read: super::Read,
    d: usize,
    messages: &[Message],
) -> Vec<Outcome> {
    if !shared.router.shapes(d) || messages.is_empty() {
        return publish_sink(shared, read, d, messages).await;
    }
    let router = shared.router.clone();
    let steps = shared.config.expression_steps;
    let batch = messages.to_vec();
    let shaped = crate::shape::map_on_pool(batch, move |m| router.shape(d, m, steps)).await;
    let Some(shaped) = shaped.filter(|s| s.len() == messages.len()) else {
        tracing::error!(destination = %shared.router.destinations()[d].name, "the expression evaluator did not answer; retrying the batch");
        return vec![Outcome::retry("the expression evaluator did not answer"); messages.len()];
    };
    enum Slot {
        Sent(usize),
        Filtered,
        Failed(Outcome),
    }
    let name = &shared.router.destinations()[d].name;
    let mut send = Vec::with_capacity(messages.len());
    let mut slots = Vec::with_capacity(messages.len());
    let mut filtered = 0u64;
    for (m, s) in messages.iter().zip(shaped) {
        match s {
            Shaped::Send {
                payload, headers, ..
            } => {
                slots.push(Slot::Sent(send.len()));
                send.push(crate::shape::reshaped(m, payload, headers));
            }
            Shaped::Filtered { .. } => {
                filtered += 1;
                slots.push(Slot::Filtered);
            }
            failed @ Shaped::Failed { .. } => {
                let which = match &failed {
                    Shaped::Failed { expression, .. } => {
                        expression.split(' ').next().unwrap_or_default().to_owned()
                    }
                    _ => String::new(),
                };
                metrics::counter!(m::EXPRESSION_FAILURES, "destination" => name.clone(), "expression" => which)
                    .increment(1);
                let error = failed.error().unwrap_or_default();
                tracing::warn!(destination = %name, event_id = %m.event_id, event_type = %m.event_type, error = %sanitize_error(&error), "an expression failed on the event; it is a dead letter of this destination");
                slots.push(Slot::Failed(mask(shared, Outcome::reject(error), m)));
            }
        }
    }
    if filtered > 0 {
        metrics::counter!(m::FILTERED, "destination" => name.clone()).increment(filtered);
        shared.filtered[d][read as usize].fetch_add(filtered, std::sync::atomic::Ordering::Relaxed);
        shared
            .stats
            .filtered
            .fetch_add(filtered, std::sync::atomic::Ordering::Relaxed);
    }
    let mut sent = if send.is_empty() {
        Vec::new()
    } else {
        publish_sink(shared, read, d, &send).await
    }
    .into_iter()
    .map(Some)
    .collect::<Vec<_>>();
    // A transform may have moved a redacted value elsewhere in the body:
    // what the sink answered is masked for the event as it was, too.
    slots
        .into_iter()
        .zip(messages)
        .map(|(slot, m)| match slot {
            Slot::Sent(i) => mask(
                shared,
                sent[i]
                    .take()
                    .unwrap_or_else(|| Outcome::retry("not published")),
                m,
            ),
            Slot::Filtered => Outcome::Delivered,
            Slot::Failed(outcome) => outcome,
        })
        .collect()
}

/// `m` as a transform and a headers expression made it for one destination.
/// What the configuration redacts wherever an event is shown (payload
/// paths, headers) masked out of an outcome's error, in case it echoes them.
fn mask(shared: &Shared, outcome: Outcome, m: &Message) -> Outcome {
    match shared.router.redactor() {
        Some(redactor) if !matches!(outcome, Outcome::Delivered) => {
            let payload: serde_json::Value =
                serde_json::from_str(m.payload.get()).unwrap_or_default();
            outcome.masked(&redactor.secrets_of(&payload, &m.headers))
        }
        _ => outcome,
    }
}

/// Publish `messages` to destination `d`'s sink, bounded by
/// `publish_timeout`; a sink that panics, overruns or miscounts yields retries.
async fn publish_sink(
    shared: &Shared,
    read: super::Read,
    d: usize,
    messages: &[Message],
) -> Vec<Outcome> {
    let destination = &shared.router.destinations()[d];
    let sink = &destination.sink;
    let traced = crate::telemetry::otel::Publish::start(&destination.name, messages);
    let publish = AssertUnwindSafe(sink.publish(traced.messages(messages))).catch_unwind();
    let publish = tokio::time::timeout(shared.config.publish_timeout, publish);
    let outcomes = match publish.instrument(traced.span()).await {
        Ok(Ok(outcomes)) if outcomes.len() == messages.len() => outcomes,
        Ok(Ok(outcomes)) => {
            let error = format!(
                "sink returned {} outcomes for {} events",
                outcomes.len(),
                messages.len()
            );
            tracing::error!(destination = %destination.name, sink = %sink.describe(), "{error}; retrying the batch");
            vec![Outcome::retry(error); messages.len()]
        }
        Ok(Err(_panic)) => {
            tracing::error!(destination = %destination.name, sink = %sink.describe(), "sink panicked; retrying the batch");
            vec![Outcome::retry("sink panicked while publishing"); messages.len()]
        }
        Err(_elapsed) => {
            let error = format!(
                "publish timed out after {}",
                humantime::format_duration(shared.config.publish_timeout)
            );
            tracing::warn!(destination = %destination.name, sink = %sink.describe(), "{error}");
            vec![Outcome::retry(error); messages.len()]
        }
    };
    // Whatever the endpoint echoed, the sink's own secrets never go further.
    let secrets = sink.secrets();
    let outcomes: Vec<Outcome> = outcomes.into_iter().map(|o| o.masked(secrets)).collect();
    // …nor do the values the configuration redacts wherever an event is
    // shown (payload paths, headers) when an endpoint echoes the body.
    let outcomes: Vec<Outcome> = outcomes
        .into_iter()
        .zip(messages)
        .map(|(o, m)| mask(shared, o, m))
        .collect();
    traced.end(&outcomes);
    let mut by_outcome = [0u64; 4];
    for outcome in &outcomes {
        by_outcome[match outcome {
            Outcome::Delivered => 0,
            Outcome::Retry { .. } => 1,
            Outcome::Reject { .. } => 2,
            Outcome::Deferred { .. } => 3,
        }] += 1;
    }
    for (label, n) in m::OUTCOME_LABELS.into_iter().zip(by_outcome) {
        if n > 0 {
            metrics::counter!(m::PUBLISH_OUTCOMES, "outcome" => label, "destination" => destination.name.clone())
                .increment(n);
        }
    }
    shared.delivered[d][read as usize]
        .fetch_add(by_outcome[0], std::sync::atomic::Ordering::Relaxed);
    let report = shared.trouble[d].observe(
        Instant::now(),
        by_outcome[0] as usize,
        by_outcome[1] as usize,
    );
    speak_up(shared, d, report, &outcomes).await;
    outcomes
}

/// Say that destination `d` keeps failing (rate-limited by [`Trouble`]) or
/// that it delivers again.
///
/// [`Trouble`]: super::outages::Trouble
async fn speak_up(shared: &Shared, d: usize, report: Report, outcomes: &[Outcome]) {
    let destination = &shared.router.destinations()[d];
    match report {
        Report::Nothing => {}
        Report::Failing {
            since,
            lasting,
            failed,
        } => {
            let error = outcomes
                .iter()
                .find_map(|o| match o {
                    Outcome::Retry { error, .. } => Some(error.as_str()),
                    _ => None,
                })
                .unwrap_or_default();
            // What waits: the outbox's backlog (claim mode), or this
            // destination's unread log events (log mode).
            let waiting = match shared.config.mode {
                ReadMode::Claim => shared
                    .store
                    .gauges()
                    .await
                    .ok()
                    .map(|g| g.pending + g.processing),
                ReadMode::Log => shared.store.log().cursor_lag().await.ok().and_then(|lags| {
                    lags.into_iter()
                        .find(|l| l.destination == destination.name)
                        .map(|l| l.lag_events)
                }),
                // The slot's lag is in bytes, not events.
                ReadMode::Logical => None,
            };
            tracing::warn!(
                destination = %destination.name,
                since = %humantime::format_rfc3339_seconds(since),
                failing_for = %whole_seconds(lasting),
                failed_attempts = failed,
                events_waiting = %waiting.map_or_else(|| "unknown".to_owned(), |n| n.to_string()),
                error = %sanitize_error(error),
                "destination keeps failing; its events wait and are retried (said again every minute while it lasts)"
            );
        }
        Report::Recovered { lasted, failed } => {
            tracing::info!(
                destination = %destination.name,
                failing_for = %whole_seconds(lasted),
                failed_attempts = failed,
                "destination delivers again"
            );
        }
    }
}

//! Claim mode: the seeds' model, and the outbox half of every mode. Three
//! tasks joined by small bounded channels:
//!
//! - the **claimer** claims a batch under a fresh lease (one committed
//!   statement) and hands it on; while the publisher works it already claims
//!   the next batch. With a full batch it claims again at once; otherwise it
//!   waits for a notification, the next due retry, or the poll interval.
//! - the **publisher** gives each batch to its destinations' sinks (see
//!   [`crate::router`]), all at once, each through the engine's one publish
//!   path (`engine::publish::publish_to`);
//! - the **settler** records per-destination results of fan-out events, then
//!   acknowledges delivered events and schedules retries or dead letters in
//!   one statement each, only where the lease token still matches; rows no
//!   longer held are counted as lost acknowledgements.
//!
//! In log and logical mode the same pipeline runs alongside the stream
//! readers, retrying and dead-lettering what they handed to the outbox.
//! No transaction is ever open while a sink publishes.

use crate::backoff;
use crate::engine::permits::BatchPermit;
use crate::engine::publish::publish_to;
use crate::engine::{spawn, Read, RunMode, Shared, DB_RETRY_BASE, DB_RETRY_MAX};
use crate::failpoint;
use crate::redact::sanitize_error;
use crate::router::{RetryPolicy, Round};
use crate::sink::{Message, Outcome};
use crate::telemetry::metrics as m;
use postbox_store::{ClaimOrder, DeliveryUpdate, Failure};
use std::ops::Deref;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;

/// Claim mode's state for one `run`: the engine's, and its own.
struct ClaimMode {
    shared: Arc<Shared>,
    /// The ordered claim's patterns; `None`: the plain claim.
    order: Option<ClaimOrder>,
    /// Batches claimed and not yet settled by this process.
    in_flight: AtomicUsize,
}

impl Deref for ClaimMode {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.shared
    }
}

/// The publisher and the settler, running; the claimer starts with [`Pipeline::claim`].
pub(crate) struct Pipeline {
    state: Arc<ClaimMode>,
    to_publish: mpsc::Sender<Claim>,
    finishing: Finishing,
}

/// The publisher and the settler after the claimer stopped: they finish
/// what is in their channels, then end.
pub(crate) struct Finishing {
    publisher: AbortOnDropHandle<()>,
    settler: AbortOnDropHandle<()>,
}

impl Pipeline {
    pub(crate) fn start(shared: Arc<Shared>) -> Self {
        let state = Arc::new(ClaimMode {
            order: shared.router.claim_order(),
            shared,
            in_flight: AtomicUsize::new(0),
        });
        let (to_publish, publish_rx) = mpsc::channel::<Claim>(1);
        let (to_settle, settle_rx) = mpsc::channel(4);
        let publisher = spawn(publish_loop(state.clone(), publish_rx, to_settle));
        let settler = spawn(settle_loop(state.clone(), settle_rx));
        Self {
            state,
            to_publish,
            finishing: Finishing { publisher, settler },
        }
    }

    /// Whether claims are ordered (some route is).
    pub(crate) fn ordered(&self) -> bool {
        self.state.order.is_some()
    }

    /// Claim until shutdown (or, draining, until nothing is pending or in
    /// flight); then the publisher and settler finish.
    pub(crate) async fn claim(self, mode: RunMode) -> Finishing {
        claim_loop(&self.state, mode, self.to_publish).await;
        self.finishing
    }
}

impl Finishing {
    pub(crate) async fn done(self) {
        let _ = self.publisher.await;
        let _ = self.settler.await;
    }
}

/// Events claimed under one lease, as the sinks take them.
#[derive(Debug)]
pub struct Claim {
    pub token: uuid::Uuid,
    /// Outbox row ids, parallel to `messages`.
    pub ids: Vec<i64>,
    pub messages: Vec<Message>,
    /// Held until the batch is settled (see [`Relay::with_batch_permits`](crate::Relay::with_batch_permits)).
    permit: Option<BatchPermit>,
}

impl From<postbox_store::Claim> for Claim {
    fn from(claim: postbox_store::Claim) -> Self {
        Self {
            token: claim.token,
            ids: claim.ids,
            messages: claim
                .events
                .into_iter()
                .map(crate::engine::message)
                .collect(),
            permit: None,
        }
    }
}

async fn claim_loop(shared: &ClaimMode, mode: RunMode, to_publish: mpsc::Sender<Claim>) {
    let config = &shared.config;
    let mut db_failures = 0;
    // Ordered drain: consecutive idle looks at due events that no claim takes.
    let mut only_blocked = 0;
    while !shared.shutdown.is_cancelled() {
        let Ok(permit) = shared.batch_permit().await else {
            break;
        };
        let claimed = shared
            .store
            .claim(
                i64::from(config.batch_size),
                config.lease,
                shared.order.as_ref(),
            )
            .await;
        let claim = match claimed {
            Ok(c) => {
                db_failures = 0;
                let mut claim = Claim::from(c);
                claim.permit = permit;
                if let Some(source) = &shared.source {
                    for m in &mut claim.messages {
                        m.source = Some(source.clone());
                    }
                }
                claim
            }
            Err(e) => {
                drop(permit);
                db_failures += 1;
                metrics::counter!(m::DB_ERRORS, "operation" => "claim").increment(1);
                let delay = backoff::full_jitter(db_failures, DB_RETRY_BASE, DB_RETRY_MAX);
                tracing::warn!(error = %sanitize_error(&e.to_string()), retry_in = ?delay, "claim failed");
                wait(shared, delay).await;
                continue;
            }
        };
        let n = claim.ids.len();
        if n > 0 {
            crate::telemetry::otel::claimed(
                &shared.store.schema(),
                claim.messages.iter().map(|m| &m.headers),
            );
            failpoint::hit(failpoint::points::AFTER_CLAIM_COMMIT).await;
            only_blocked = 0;
            shared.stats.claimed.fetch_add(n as u64, Ordering::Relaxed);
            shared.in_flight.fetch_add(1, Ordering::SeqCst);
            if let Err(mpsc::error::SendError(claim)) = to_publish.send(claim).await {
                // The publisher is gone (it only ends after we do): give the batch back.
                release(shared, &claim).await;
                shared.in_flight.fetch_sub(1, Ordering::SeqCst);
                return;
            }
            if n == config.batch_size as usize {
                continue;
            }
        } else {
            // Nothing claimed: give the batch permit back before waiting.
            drop(claim);
        }
        // A partial or empty batch: nothing more is due right now.
        let mut delay = config.poll_interval;
        if n == 0 {
            match shared.store.next_due().await {
                Ok(next) => {
                    let idle = shared.in_flight.load(Ordering::SeqCst) == 0;
                    if mode == RunMode::Drain
                        && idle
                        && next.pending_in.is_none()
                        && !next.in_flight
                    {
                        tracing::info!("outbox drained: nothing pending or in flight");
                        return;
                    }
                    // No retry of ours is due later than backoff_max: events
                    // due beyond it were scheduled (by hand or by a producer
                    // with the rights to): report them rather than wait.
                    let horizon = config.backoff_max + Duration::from_secs(1);
                    if mode == RunMode::Drain
                        && idle
                        && !next.in_flight
                        && next.pending_in.is_some_and(|d| d > horizon)
                    {
                        if let Ok(later) = shared.store.scheduled_later(horizon).await {
                            tracing::warn!(
                                events = later.events,
                                first_due = %later.first_due.map_or_else(String::new, |t| t.to_rfc3339()),
                                "outbox drained, except events scheduled later than the longest retry delay (relay.backoff_max); not waiting for them"
                            );
                            return;
                        }
                    }
                    if mode == RunMode::Drain
                        && idle
                        && !next.in_flight
                        && shared.order.is_some()
                        && next.pending_in.is_some_and(|d| d.is_zero())
                    {
                        // Due events, nothing in flight anywhere, and the ordered
                        // claim takes none: they wait behind blocking dead letters
                        // or events of their aggregate scheduled for later.
                        // Look a few times to let other relays' claims settle.
                        only_blocked += 1;
                        if only_blocked >= 3 {
                            tracing::info!(
                                "outbox drained: only aggregates held back by dead letters or scheduled events remain"
                            );
                            return;
                        }
                    } else {
                        only_blocked = 0;
                    }
                    match next.pending_in {
                        // Ordered: due events the claim did not take are held
                        // back by their aggregate; poll for the rest.
                        Some(due) if due.is_zero() && shared.order.is_some() => {}
                        Some(due) => delay = delay.min(due.max(Duration::from_millis(1))),
                        None => {}
                    }
                    if mode == RunMode::Drain && next.in_flight && idle {
                        // Another relay's lease, or an expired one: check back at the rescue pace.
                        delay = delay.min(config.rescue_interval);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %sanitize_error(&e.to_string()), "checking for due events failed");
                }
            }
        }
        wait(shared, delay).await;
    }
}

/// Sleep for `delay`, or less if woken by a notification or shutdown.
async fn wait(shared: &ClaimMode, delay: Duration) {
    tokio::select! {
        _ = tokio::time::sleep(delay) => {}
        _ = shared.signals.outbox.notified() => {}
        _ = shared.shutdown.cancelled() => {}
    }
}

/// A published batch on its way to the settler.
struct Published {
    claim: Claim,
    /// One per event.
    outcomes: Vec<Outcome>,
    /// Per event: attempts after which a retry becomes a dead letter.
    budgets: Vec<i32>,
    /// Per-destination results of fan-out events, recorded before settling.
    updates: Vec<DeliveryUpdate>,
}

async fn publish_loop(
    shared: Arc<ClaimMode>,
    mut batches: mpsc::Receiver<Claim>,
    to_settle: mpsc::Sender<Published>,
) {
    while let Some(claim) = batches.recv().await {
        if shared.shutdown.is_cancelled() {
            release(&shared, &claim).await;
            shared.in_flight.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        #[cfg(feature = "failpoints")]
        if failpoint::hit(failpoint::points::ACK_BEFORE_PUBLISH).await {
            failpoint::ack_without_publishing(&shared.store, claim.token, &claim.ids).await;
            shared.in_flight.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        let started = Instant::now();
        let span = batch_span(&claim);
        let published = publish_round(&shared, claim).instrument(span).await;
        let elapsed = started.elapsed();
        metrics::histogram!(m::PUBLISH_LATENCY).record(elapsed.as_secs_f64());
        let attempts = metrics::histogram!(m::ATTEMPTS);
        for message in &published.claim.messages {
            attempts.record(f64::from(message.attempt));
        }
        tracing::debug!(
            events = published.claim.ids.len(),
            ?elapsed,
            "published batch"
        );
        if to_settle.send(published).await.is_err() {
            return;
        }
    }
}

/// A span per published batch naming the trace ids its events carry (from
/// the producers' `traceparent`), so a trace can be followed into the relay.
/// Built only when debug spans are on.
fn batch_span(claim: &Claim) -> tracing::Span {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return tracing::Span::none();
    }
    let mut trace_ids: Vec<&str> = claim
        .messages
        .iter()
        .filter_map(|m| m.headers.get("traceparent"))
        .filter_map(|tp| tp.get(3..35))
        .collect();
    trace_ids.sort_unstable();
    trace_ids.dedup();
    trace_ids.truncate(20);
    tracing::debug_span!(
        "publish_batch",
        events = claim.ids.len(),
        lease = %claim.token,
        trace_ids = %trace_ids.join(",")
    )
}

/// Publish one claimed batch to every destination its events route to (all
/// destinations at once), and combine the answers into one outcome per event.
async fn publish_round(shared: &ClaimMode, claim: Claim) -> Published {
    let router = &shared.router;
    let config = &shared.config;
    let types: Vec<&str> = claim
        .messages
        .iter()
        .map(|m| m.event_type.as_str())
        .collect();
    let need = Round::needs_state(router, &types);
    let states = if need.is_empty() {
        Vec::new()
    } else {
        let ids: Vec<i64> = need.iter().map(|&i| claim.ids[i]).collect();
        match shared.store.delivery_states(&ids).await {
            Ok(states) => states,
            Err(e) => {
                // Without the state we cannot tell which destinations are done:
                // publish nothing, try the batch again shortly.
                let error = format!(
                    "reading per-destination state failed: {}",
                    sanitize_error(&e.to_string())
                );
                tracing::warn!("{error}");
                let n = claim.ids.len();
                let outcomes = vec![
                    Outcome::Retry {
                        error,
                        after: Some(config.backoff_base),
                    };
                    n
                ];
                return Published {
                    claim,
                    outcomes,
                    budgets: vec![i32::MAX; n],
                    updates: Vec::new(),
                };
            }
        }
    };
    let round = Round::plan(router, &claim.ids, &types, states);
    let publishes = round.batches.iter().enumerate().map(|(d, batch)| {
        let messages: std::borrow::Cow<'_, [Message]> = if batch.len() == claim.messages.len() {
            // Every event goes here (the common case): no copies.
            std::borrow::Cow::Borrowed(&claim.messages)
        } else {
            batch.iter().map(|&i| claim.messages[i].clone()).collect()
        };
        async move {
            if messages.is_empty() {
                Vec::new()
            } else {
                publish_to(shared, Read::Outbox, d, &messages).await
            }
        }
    });
    let results = futures::future::join_all(publishes).await;
    let policy = RetryPolicy {
        max_attempts: config.max_attempts,
        backoff_base: config.backoff_base,
        backoff_max: config.backoff_max,
    };
    let (outcomes, budgets, updates) = round.combine(router, &claim.ids, &types, results, &policy);
    drop(types);
    Published {
        claim,
        outcomes,
        budgets,
        updates,
    }
}
async fn settle_loop(shared: Arc<ClaimMode>, mut settled: mpsc::Receiver<Published>) {
    while let Some(published) = settled.recv().await {
        let Published {
            claim,
            outcomes,
            budgets,
            updates,
        } = published;
        if !updates.is_empty() {
            // Destination facts first: even if the lease was lost meanwhile, a
            // destination that took the event is never published to again.
            retry_db(&shared, &claim, "recording per-destination results", || {
                shared.store.record_deliveries(&updates)
            })
            .await;
        }
        failpoint::hit(failpoint::points::AFTER_PUBLISH_BEFORE_ACK).await;
        let span = crate::telemetry::otel::settle_span(
            &shared.store.schema(),
            claim.messages.iter().map(|m| &m.headers),
        );
        settle(&shared, &claim, outcomes, &budgets)
            .instrument(span)
            .await;
        shared.in_flight.fetch_sub(1, Ordering::SeqCst);
        shared.signals.outbox.notify_one();
    }
}

async fn settle(shared: &ClaimMode, claim: &Claim, outcomes: Vec<Outcome>, budgets: &[i32]) {
    let config = &shared.config;
    let mut delivered = Vec::new();
    let mut failures = Vec::new();
    for (((id, message), outcome), &budget) in claim
        .ids
        .iter()
        .zip(&claim.messages)
        .zip(outcomes)
        .zip(budgets)
    {
        match outcome {
            Outcome::Delivered => delivered.push(*id),
            Outcome::Retry { error, after } => {
                let delay = after
                    .unwrap_or_else(|| {
                        backoff::full_jitter(
                            message.attempt,
                            config.backoff_base,
                            config.backoff_max,
                        )
                    })
                    .min(config.backoff_max);
                failures.push(Failure {
                    id: *id,
                    reject: false,
                    counted: true,
                    budget,
                    delay,
                    error: sanitize_error(&error),
                });
            }
            Outcome::Deferred { reason, after } => failures.push(Failure {
                id: *id,
                reject: false,
                counted: false,
                budget,
                delay: after.unwrap_or(config.backoff_base).min(config.backoff_max),
                error: sanitize_error(&reason),
            }),
            Outcome::Reject { error } => {
                let error = sanitize_error(&error);
                tracing::warn!(event_id = %message.event_id, event_type = %message.event_type, %error, "rejected by the sink; dead-lettered");
                failures.push(Failure {
                    id: *id,
                    reject: true,
                    counted: true,
                    budget,
                    delay: Duration::ZERO,
                    error,
                });
            }
        }
    }

    let (store, token, ids) = (&shared.store, claim.token, &delivered);
    let acked = retry_db(
        shared,
        claim,
        "acknowledging delivered events",
        move || async move {
            let acked = store.ack_delivered(token, ids).await?;
            if failpoint::hit(failpoint::points::DURING_ACK).await {
                return Err(sqlx::Error::Protocol("failpoint during_ack".into()));
            }
            Ok(acked)
        },
    )
    .await;
    if let Some(acked) = acked {
        shared
            .stats
            .delivered
            .fetch_add(acked.len() as u64, Ordering::Relaxed);
        record_delivery_latency(claim, &acked);
        lost(shared, claim, delivered.len() - acked.len(), "delivered");
    }

    if failures.is_empty() {
        return;
    }
    let settled = retry_db(shared, claim, "scheduling retries", || {
        shared.store.settle_failed(claim.token, &failures)
    })
    .await;
    if let Some(s) = settled {
        let rejected = failures.iter().filter(|f| f.reject).count();
        let retried = s.updated.saturating_sub(s.dead_lettered);
        shared
            .stats
            .retried
            .fetch_add(retried as u64, Ordering::Relaxed);
        shared
            .stats
            .dead_lettered
            .fetch_add(s.dead_lettered as u64, Ordering::Relaxed);
        metrics::counter!(m::DEAD_LETTERED).increment(s.dead_lettered as u64);
        if s.dead_lettered > rejected {
            tracing::warn!(
                count = s.dead_lettered - rejected,
                max_attempts = config.max_attempts,
                "events exhausted their retry budget and were dead-lettered"
            );
        }
        if retried > 0 {
            tracing::debug!(count = retried, error = %failures[0].error, "scheduled retries");
        }
        lost(shared, claim, failures.len() - s.updated, "failed");
    }
}

/// Commit-to-delivery latency of the acknowledged events: now − `created_at`.
fn record_delivery_latency(claim: &Claim, acked: &[i64]) {
    if acked.is_empty() {
        return;
    }
    // `acked` comes back in any order; both lists are short (one batch).
    let mut acked = acked.to_vec();
    acked.sort_unstable();
    m::record_commit_to_delivery(
        claim
            .ids
            .iter()
            .zip(&claim.messages)
            .filter(|(id, _)| acked.binary_search(id).is_ok())
            .map(|(_, message)| message.created_at),
    );
}

fn lost(shared: &ClaimMode, claim: &Claim, count: usize, what: &str) {
    if count > 0 {
        shared
            .stats
            .lost_acks
            .fetch_add(count as u64, Ordering::Relaxed);
        metrics::counter!(m::ACKS_LOST).increment(count as u64);
        tracing::warn!(
            count,
            lease = %claim.token,
            "{what} events were no longer held by this relay's lease (it expired and another claim took them); their state was left to the newer claim"
        );
    }
}

/// Run a settling statement until it succeeds. Gives up when the lease has
/// surely expired: the rows are then another claim's business (and the events
/// will be delivered again, which consumers tolerate).
async fn retry_db<T, F, Fut>(shared: &ClaimMode, claim: &Claim, what: &str, op: F) -> Option<T>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let give_up = Instant::now() + shared.config.lease;
    let mut failures = 0;
    loop {
        match op().await {
            Ok(v) => return Some(v),
            Err(e) => {
                failures += 1;
                let error = sanitize_error(&e.to_string());
                if Instant::now() >= give_up {
                    tracing::error!(%error, lease = %claim.token, "{what} failed until the lease expired; these events will be delivered again");
                    return None;
                }
                let delay = backoff::full_jitter(failures, DB_RETRY_BASE, DB_RETRY_MAX);
                tracing::warn!(%error, retry_in = ?delay, "{what} failed");
                tokio::time::sleep(delay).await;
            }
        }
    }
}

async fn release(shared: &ClaimMode, claim: &Claim) {
    match shared.store.release(claim.token, &claim.ids).await {
        Ok(n) => tracing::info!(
            released = n,
            "released a claimed batch that was not published"
        ),
        Err(e) => tracing::warn!(
            error = %sanitize_error(&e.to_string()),
            "could not release a claimed batch; its lease will expire and it will be redelivered"
        ),
    }
}

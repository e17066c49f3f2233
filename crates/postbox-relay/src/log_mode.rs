//! Log mode's reader: one task per destination and partition, reading that
//! partition of the destination's cursor over the append-only log (see
//! `postbox_store::Log`). A destination's cursor is split by a hash of the
//! aggregate into `relay.log_partitions` partitions, each under its own
//! lease; relays sharing a log take about an equal share of them each (see
//! `Log::acquire`), so one aggregate is read by one reader, in order.
//!
//! Each round reads one page of the cursor's window, publishes the events
//! that route to the destination, and then — in one transaction — moves the
//! cursor past the page and hands the events the destination did not take to
//! the outbox, where the claim loop (running alongside) retries them with
//! backoff or keeps them as dead letters. So a poison event never stops the
//! cursor, a slow destination never holds a fast one back, and a crash
//! between publishing and moving redelivers at most one page. Within a
//! window the reader keeps the window it moved (opening it once) and reads
//! the next page while the current one publishes: the page read is the same
//! whatever publishing does, since a window's events are fixed by its two
//! snapshots. An event scheduled for later (`deliver_at` still ahead) is not
//! published: it is handed to the outbox, due at its time, so the cursor
//! never waits for it.
//!
//! Under a relay serving many outboxes, each round takes one of the shared
//! batch permits (see `crate::tenants::permits`) before it reads and gives it
//! back once its page is settled, so log-mode outboxes keep the same global
//! cap on batches in flight and the same fairness as claim-mode ones.

use crate::backoff;
use crate::metrics as m;
use crate::redact::sanitize_error;
use crate::relay::{publish_to, RunMode, Shared};
use crate::router::PoisonPolicy;
use crate::sink::{Message, Outcome};
use postbox_store::{Handoff, Log, LogEvent, LogWindow};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;
use uuid::Uuid;

const DB_RETRY_BASE: Duration = Duration::from_millis(100);
const DB_RETRY_MAX: Duration = Duration::from_secs(10);

/// How often a reader renews its lease (and heartbeat) at most: also how
/// soon a relay gives back partitions beyond its share when another joins.
const RENEW_MAX: Duration = Duration::from_secs(1);

/// Read partition `part` of destination `d`'s cursor until shutdown (or,
/// draining, until a window comes back empty).
pub(crate) async fn read_loop(
    shared: Arc<Shared>,
    d: usize,
    part: i32,
    owner: Uuid,
    mode: RunMode,
) {
    let log = shared.store.log();
    let name = shared.router.destinations()[d].name.clone();
    let config = &shared.config;
    let mut reader = Reader {
        held_until: None,
        window: None,
        ahead: None,
        ordered: shared.router.claim_order().is_some(),
    };
    let mut failures = 0;
    let mut wake = shared.log_wake.subscribe();
    while !shared.shutdown.is_cancelled() {
        // Serving many outboxes, a round is a batch like a claim: it holds a
        // shared batch permit from before it reads until its page is settled.
        let Ok(permit) = shared.batch_permit().await else {
            break;
        };
        let round = reader.round(&shared, &log, d, part, owner).await;
        drop(permit);
        match round {
            Ok(Round::More) => failures = 0,
            // A window that ended short holds everything committed when it
            // opened; anything committed since sent a notification (or the
            // poll finds it): wait for that instead of opening an empty window
            // right away, which would cost two more cursor writes per wake-up.
            // A drain goes on until a window comes back empty.
            Ok(Round::WindowDone) if mode == RunMode::Forever => {
                failures = 0;
                wait(&shared, &mut wake, config.poll_interval).await;
            }
            Ok(Round::WindowDone) => failures = 0,
            Ok(Round::Idle) => {
                failures = 0;
                if mode == RunMode::Drain {
                    break;
                }
                wait(&shared, &mut wake, config.poll_interval).await;
            }
            Ok(Round::NotHeld) => {
                // Another relay holds this cursor: try again after a while.
                wait(&shared, &mut wake, config.poll_interval).await;
            }
            Err(e) => {
                // Start again from what the database says.
                reader.forget();
                failures += 1;
                let delay = backoff::full_jitter(failures, DB_RETRY_BASE, DB_RETRY_MAX);
                tracing::warn!(destination = %name, part, error = %sanitize_error(&e.to_string()), retry_in = ?delay, "reading the log failed");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shared.shutdown.cancelled() => {}
                }
            }
        }
    }
    if let Err(e) = log.release(owner, &name, part).await {
        tracing::debug!(error = %sanitize_error(&e.to_string()), "could not release the log cursor's lease; it expires by itself");
    }
}

/// One destination's reader between rounds.
struct Reader {
    /// The lease is renewed when this passes.
    held_until: Option<Instant>,
    /// The cursor's open window as this reader last moved it (while it holds
    /// the lease nobody else moves it), so a window read page by page opens
    /// once rather than once per page.
    window: Option<LogWindow>,
    /// The window's next page, read while the previous one was published.
    ahead: Option<Vec<LogEvent>>,
    /// The router has ordered routes.
    ordered: bool,
}

impl Reader {
    fn forget(&mut self) {
        self.held_until = None;
        self.window = None;
        self.ahead = None;
    }

    /// Read a page, publish it (reading the next page of the window
    /// meanwhile), then settle it: move the cursor and hand off what the
    /// destination did not take.
    async fn round(
        &mut self,
        shared: &Shared,
        log: &Log,
        d: usize,
        part: i32,
        owner: Uuid,
    ) -> Result<Round, sqlx::Error> {
        let config = &shared.config;
        let name = &shared.router.destinations()[d].name;
        let batch = i64::from(config.batch_size);
        if self.held_until.is_none_or(|t| Instant::now() >= t) {
            // Between pages: nothing of this cursor is in flight, so a
            // partition beyond this relay's share may be given back here.
            if !log.acquire(owner, name, part, config.lease).await? {
                self.forget();
                return Ok(Round::NotHeld);
            }
            self.held_until = Some(Instant::now() + (config.lease / 3).min(RENEW_MAX));
        }
        let (window, page) = match self.window.take() {
            Some(w) => {
                let page = match self.ahead.take() {
                    Some(page) => page,
                    None => log.page(&w, batch).await?,
                };
                (w, page)
            }
            None => {
                self.ahead = None;
                let Some(w) = log.window(name, part, owner).await? else {
                    self.forget();
                    return Ok(Round::NotHeld);
                };
                // A window read from its start begins at its first event;
                // an empty one needs no read at all.
                match log.from_floor(w.clone()).await? {
                    Some(from) => {
                        let page = log.page(&from, batch).await?;
                        (from, page)
                    }
                    None => (w, Vec::new()),
                }
            }
        };
        if !page.is_empty() {
            crate::otel::claimed(
                &shared.store.schema(),
                page.iter().map(|e| &e.event.headers),
            );
        }
        let done = (page.len() as i64) < batch;
        let last = page.last().map_or(window.after_id, |e| e.id);
        let next = LogWindow {
            after_id: last,
            ..window.clone()
        };
        // The next page of the window does not depend on how this one is
        // published: read it meanwhile. A failed read-ahead is read again.
        let (published, ahead) = if done {
            (
                publish_page(shared, log, d, &page, self.ordered).await,
                None,
            )
        } else {
            let (published, ahead) = tokio::join!(
                publish_page(shared, log, d, &page, self.ordered),
                log.page(&next, batch)
            );
            (published, ahead.ok())
        };
        let Published {
            delivered,
            handoffs,
            held,
        } = published?;
        let delivered_at: Vec<_> = delivered
            .iter()
            .map(|&i| page[i].event.created_at)
            .collect();
        let delivered = delivered.len();
        let handoffs: Vec<Handoff<'_>> = handoffs
            .into_iter()
            .map(|(i, h)| h.into_handoff(&page[i]))
            .collect();
        let settled = crate::otel::settle_span(
            &shared.store.schema(),
            page.iter().map(|e| &e.event.headers),
        );
        let kept = log
            .settle_page(&window, owner, last, delivered as i64, done, &handoffs)
            .instrument(settled)
            .await?;
        if !kept {
            tracing::warn!(destination = %name, part, "lost the log cursor's lease; another relay reads it now");
            self.forget();
            return Ok(Round::NotHeld);
        }
        count(shared, delivered, &handoffs, held);
        m::record_commit_to_delivery(delivered_at.into_iter());
        if !done {
            self.window = Some(next);
            self.ahead = ahead;
        }
        Ok(if !done {
            Round::More
        } else if page.is_empty() {
            Round::Idle
        } else {
            Round::WindowDone
        })
    }
}

enum Round {
    /// The window has more events.
    More,
    /// The window is done; the next one may hold more.
    WindowDone,
    /// Nothing new was committed.
    Idle,
    /// Another relay holds the cursor.
    NotHeld,
}

async fn wait(shared: &Shared, wake: &mut tokio::sync::watch::Receiver<u64>, delay: Duration) {
    tokio::select! {
        _ = tokio::time::sleep(delay) => {}
        _ = wake.changed() => {}
        _ = shared.shutdown.cancelled() => {}
    }
}

/// What to do with an event the destination did not take.
struct Pending {
    dead: bool,
    delay: Duration,
    attempts: i32,
    error: String,
    others: Vec<String>,
}

impl Pending {
    /// Not published now, not tried: due in the outbox at once (an event held
    /// behind an earlier one of its aggregate) or at its time (a scheduled
    /// event, whose hand-off makes it due then).
    fn untried(others: Vec<String>) -> Self {
        Pending {
            dead: false,
            delay: Duration::ZERO,
            attempts: 0,
            error: String::new(),
            others,
        }
    }

    fn into_handoff(self, event: &LogEvent) -> Handoff<'_> {
        Handoff {
            event,
            dead: self.dead,
            delay: self.delay,
            attempts: self.attempts,
            error: self.error,
            others: self.others,
        }
    }
}

/// What publishing a page did at one destination.
#[derive(Default)]
struct Published {
    /// Page indices of the events delivered.
    delivered: Vec<usize>,
    /// By page index, the events to hand to the outbox.
    handoffs: Vec<(usize, Pending)>,
    /// How many of the hand-offs are held behind an earlier event of their
    /// aggregate (not tried).
    held: usize,
}

/// An aggregate, as ordered routes key it.
type Aggregate<'a> = (&'a str, &'a str);

fn aggregate(e: &LogEvent) -> Aggregate<'_> {
    (&e.event.aggregate_type, &e.event.aggregate_id)
}

/// Publish the page's events that route to `d`.
///
/// Unordered events go out in one call. On ordered routes an aggregate's
/// events go out one at a time, in id order (which is its sequence order,
/// see ARCHITECTURE.md "The log"): the page is published in layers — every
/// aggregate's first event, then every aggregate's second one, … — and once
/// one of an aggregate's events is not delivered (a retry, or a dead letter
/// its poison policy blocks on), is scheduled for later, or follows an
/// earlier event the outbox still holds for `d`, its later events are handed
/// to the outbox too, where the ordered claim delivers them behind it. Other
/// aggregates keep flowing from the log; an aggregate whose events in the
/// outbox are all delivered flows from the log again. `ordered`: the router
/// has ordered routes.
async fn publish_page(
    shared: &Shared,
    log: &Log,
    d: usize,
    page: &[LogEvent],
    ordered: bool,
) -> Result<Published, sqlx::Error> {
    let router = &shared.router;
    let name = &router.destinations()[d].name;
    let others = |targets: &[usize]| -> Vec<String> {
        targets
            .iter()
            .filter(|&&t| t != d)
            .map(|&t| router.destinations()[t].name.clone())
            .collect()
    };
    let mut out = Published::default();
    // Per page index: its destinations (empty when `d` is not one of them)
    // and, on an ordered route, its poison policy.
    let mut targets = vec![Vec::new(); page.len()];
    let mut policies: Vec<Option<PoisonPolicy>> = vec![None; page.len()];
    for (i, e) in page.iter().enumerate() {
        let t = router.targets(&e.event.event_type);
        if t.contains(&d) {
            if ordered && e.event.sequence.is_some() {
                policies[i] = router.ordering(&e.event.event_type);
            }
            targets[i] = t;
        }
    }
    // The lowest sequence the outbox still holds for `d`, per aggregate of
    // the page's ordered events.
    let mut held: HashMap<(String, String), i64> = HashMap::new();
    if policies.iter().any(Option::is_some) {
        let aggregates: Vec<Aggregate<'_>> = page
            .iter()
            .zip(&policies)
            .filter(|(_, p)| p.is_some())
            .map(|(e, _)| aggregate(e))
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        for h in log.held(name, &aggregates).await? {
            // Only an ordered event that goes to `d` holds `d` back, and a
            // dead letter only when its poison policy blocks.
            let holds = match router.ordering(&h.event_type) {
                None => false,
                Some(policy) => {
                    router.targets(&h.event_type).contains(&d)
                        && !(h.dead && policy == PoisonPolicy::Skip)
                }
            };
            if holds {
                let lowest = held
                    .entry((h.aggregate_type, h.aggregate_id))
                    .or_insert(h.sequence);
                *lowest = (*lowest).min(h.sequence);
            }
        }
    }
    // Aggregates whose later events wait in the outbox.
    let mut blocked: HashSet<Aggregate<'_>> = HashSet::new();
    let mut depth: HashMap<Aggregate<'_>, usize> = HashMap::new();
    let mut layers: Vec<Vec<usize>> = vec![Vec::new()];
    for (i, e) in page.iter().enumerate() {
        if targets[i].is_empty() {
            continue;
        }
        let Some(seq) = policies[i].and(e.event.sequence) else {
            if e.scheduled {
                out.handoffs
                    .push((i, Pending::untried(others(&targets[i]))));
            } else {
                layers[0].push(i);
            }
            continue;
        };
        let key = aggregate(e);
        let behind = blocked.contains(&key)
            || held
                .get(&(key.0.to_owned(), key.1.to_owned()))
                .is_some_and(|&lowest| lowest < seq);
        if behind || e.scheduled {
            // Not due yet, or behind an earlier event: the outbox keeps it
            // (making it due at its time), and the aggregate's later events
            // go behind it.
            out.held += usize::from(behind);
            out.handoffs
                .push((i, Pending::untried(others(&targets[i]))));
            blocked.insert(key);
            continue;
        }
        let k = depth.entry(key).or_default();
        if layers.len() <= *k {
            layers.push(Vec::new());
        }
        layers[*k].push(i);
        *k += 1;
    }
    for layer in layers {
        let mut now = Vec::with_capacity(layer.len());
        for i in layer {
            if policies[i].is_some() && blocked.contains(&aggregate(&page[i])) {
                out.held += 1;
                out.handoffs
                    .push((i, Pending::untried(others(&targets[i]))));
            } else {
                now.push(i);
            }
        }
        if now.is_empty() {
            continue;
        }
        let messages: Vec<Message> = now.iter().map(|&i| Message::from(&page[i].event)).collect();
        let outcomes = publish_to(shared, d, &messages).await;
        for (&i, outcome) in now.iter().zip(outcomes) {
            let Some(pending) = settle(shared, &page[i], outcome, others(&targets[i])) else {
                out.delivered.push(i);
                continue;
            };
            if let Some(policy) = policies[i] {
                if !(pending.dead && policy == PoisonPolicy::Skip) {
                    blocked.insert(aggregate(&page[i]));
                }
            }
            out.handoffs.push((i, pending));
        }
    }
    out.handoffs.sort_by_key(|(i, _)| *i);
    Ok(out)
}

/// What to hand off for an event the sink answered `outcome` to; `None`
/// when it was delivered.
fn settle(
    shared: &Shared,
    event: &LogEvent,
    outcome: Outcome,
    others: Vec<String>,
) -> Option<Pending> {
    let config = &shared.config;
    Some(match outcome {
        Outcome::Delivered => return None,
        Outcome::Retry { error, after } => Pending {
            dead: config.max_attempts <= 1,
            delay: after
                .unwrap_or_else(|| backoff::full_jitter(1, config.backoff_base, config.backoff_max))
                .min(config.backoff_max),
            attempts: 1,
            error: sanitize_error(&error),
            others,
        },
        Outcome::Deferred { reason, after } => Pending {
            dead: false,
            delay: after.unwrap_or(config.backoff_base).min(config.backoff_max),
            attempts: 0,
            error: sanitize_error(&reason),
            others,
        },
        Outcome::Reject { error } => {
            let error = sanitize_error(&error);
            tracing::warn!(event_id = %event.event.event_id, event_type = %event.event.event_type, %error, "rejected by the sink; dead-lettered");
            Pending {
                dead: true,
                delay: Duration::ZERO,
                attempts: 1,
                error,
                others,
            }
        }
    })
}

/// Count a settled page; `held` of the hand-offs were not tried (behind an
/// earlier event of their aggregate).
fn count(shared: &Shared, delivered: usize, handoffs: &[Handoff<'_>], held: usize) {
    let dead = handoffs.iter().filter(|h| h.dead).count();
    let scheduled = handoffs.iter().filter(|h| h.event.scheduled).count() + held;
    let stats = &shared.stats;
    stats
        .delivered
        .fetch_add(delivered as u64, Ordering::Relaxed);
    stats.retried.fetch_add(
        (handoffs.len() - dead - scheduled) as u64,
        Ordering::Relaxed,
    );
    stats
        .dead_lettered
        .fetch_add(dead as u64, Ordering::Relaxed);
    if dead > 0 {
        metrics::counter!(m::DEAD_LETTERED).increment(dead as u64);
    }
}

/// Retention without vacuum: rotate the ring of segments and empty the ones
/// every cursor has read past, until shutdown.
pub(crate) async fn maintain_loop(shared: Arc<Shared>, archive: bool) {
    let log = shared.store.log();
    let age = shared.config.log_segment_age;
    let every = (age / 4).max(Duration::from_millis(50));
    while !shared.shutdown.is_cancelled() {
        match log.maintain(age, archive).await {
            Ok((rotated, removed)) => {
                if removed > 0 {
                    metrics::counter!(m::RETENTION_PURGED, "table" => "log").increment(removed);
                }
                if rotated || removed > 0 {
                    tracing::debug!(rotated, removed, "log segments maintained");
                }
            }
            Err(e) => {
                tracing::warn!(error = %sanitize_error(&e.to_string()), "log maintenance failed; trying again later");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shared.shutdown.cancelled() => {}
        }
    }
}

//! Publishing a page of events to one destination: the core log mode and
//! logical mode share. A page is what a reader read in one go (a page of a
//! log cursor's window, a batch of the replication slot); the events the
//! destination does not take now are returned as hand-offs, which each mode
//! writes to the outbox its own way (log mode in the transaction that moves
//! its cursor, logical mode before it confirms the slot).
//!
//! Unordered events go out in one call. On ordered routes an aggregate's
//! events go out one at a time, in the order they were read (which is their
//! sequence order in both modes: ARCHITECTURE.md, "The log" and "Logical
//! mode"): the page is published in layers — every aggregate's first event,
//! then every aggregate's second one, … — and once one of an aggregate's
//! events is not delivered (a retry, or a dead letter its poison policy
//! blocks on), is scheduled for later, or follows an earlier event the
//! outbox still holds for the destination, its later events are handed to
//! the outbox too, where the ordered claim delivers them behind it. Other
//! aggregates keep flowing; an aggregate whose events in the outbox are all
//! delivered flows from the reader again.

use super::publish::publish_to;
use super::Shared;
use crate::backoff;
use crate::redact::sanitize_error;
use crate::router::PoisonPolicy;
use crate::sink::{Message, Outcome};
use postbox_store::{ClaimedEvent, HeldEvents, Log};
use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// One event of a page.
pub(crate) struct Item<'a> {
    pub(crate) event: &'a ClaimedEvent,
    /// Scheduled for later: handed to the outbox untried, never published.
    pub(crate) scheduled: bool,
}

/// What a mode tells the core about the outbox its hand-offs go to.
pub(crate) trait Outbox {
    /// For ordered routes: of `aggregates` (type, id), what the outbox has
    /// not delivered to `destination` yet, each group with its lowest
    /// sequence (see `Log::held`).
    async fn held(
        &self,
        destination: &str,
        aggregates: &[(&str, &str)],
    ) -> Result<Vec<HeldEvents>, sqlx::Error>;

    /// Whether a page may hold events the outbox already has: read again
    /// after a crash between handing them off and moving past them. Then an
    /// event whose own sequence the outbox holds is left to the outbox, not
    /// published a second time.
    const READ_AGAIN: bool;
}

/// Log mode: nothing it handed off is read again (the hand-off and the
/// cursor's move are one transaction).
impl Outbox for Log {
    async fn held(
        &self,
        destination: &str,
        aggregates: &[(&str, &str)],
    ) -> Result<Vec<HeldEvents>, sqlx::Error> {
        Log::held(self, destination, aggregates).await
    }

    const READ_AGAIN: bool = false;
}

/// What to do with an event the destination did not take.
pub(crate) struct Pending {
    /// The sink was asked (false: handed off untried — scheduled, or
    /// behind an earlier event of its aggregate).
    pub(crate) tried: bool,
    pub(crate) dead: bool,
    pub(crate) delay: Duration,
    pub(crate) attempts: i32,
    pub(crate) error: String,
    pub(crate) others: Vec<String>,
}

impl Pending {
    /// Not published now, not tried: due in the outbox at once (an event held
    /// behind an earlier one of its aggregate) or at its time (a scheduled
    /// event, whose hand-off makes it due then).
    fn untried(others: Vec<String>) -> Self {
        Pending {
            tried: false,
            dead: false,
            delay: Duration::ZERO,
            attempts: 0,
            error: String::new(),
            others,
        }
    }
}

/// What publishing a page did at one destination.
#[derive(Default)]
pub(crate) struct Published {
    /// Page indices of the events delivered.
    pub(crate) delivered: Vec<usize>,
    /// By page index, the events to hand to the outbox.
    pub(crate) handoffs: Vec<(usize, Pending)>,
}

/// An aggregate, as ordered routes key it.
type Aggregate<'a> = (&'a str, &'a str);

fn aggregate<'a>(e: &Item<'a>) -> Aggregate<'a> {
    (&e.event.aggregate_type, &e.event.aggregate_id)
}

/// Publish the page's events that route to `d` (see the module's doc).
/// `ordered`: the router has ordered routes.
pub(crate) async fn publish<O: Outbox>(
    shared: &Shared,
    outbox: &O,
    d: usize,
    page: &[Item<'_>],
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
        for h in outbox.held(name, &aggregates).await? {
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
                .is_some_and(|&lowest| lowest < seq || (O::READ_AGAIN && lowest == seq));
        if behind || e.scheduled {
            // Not due yet, or behind an earlier event: the outbox keeps it
            // (making it due at its time), and the aggregate's later events
            // go behind it.
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
                out.handoffs
                    .push((i, Pending::untried(others(&targets[i]))));
            } else {
                now.push(i);
            }
        }
        if now.is_empty() {
            continue;
        }
        let messages: Vec<Message> = now
            .iter()
            .map(|&i| super::message_of(page[i].event))
            .collect();
        let outcomes = publish_to(shared, super::Read::Stream, d, &messages).await;
        for (&i, outcome) in now.iter().zip(outcomes) {
            let Some(pending) = settle(shared, page[i].event, outcome, others(&targets[i])) else {
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
    event: &ClaimedEvent,
    outcome: Outcome,
    others: Vec<String>,
) -> Option<Pending> {
    let config = &shared.config;
    Some(match outcome {
        Outcome::Delivered => return None,
        Outcome::Retry { error, after } => Pending {
            tried: true,
            dead: config.max_attempts <= 1,
            delay: after
                .unwrap_or_else(|| backoff::full_jitter(1, config.backoff_base, config.backoff_max))
                .min(config.backoff_max),
            attempts: 1,
            error: sanitize_error(&error),
            others,
        },
        Outcome::Deferred { reason, after } => Pending {
            tried: true,
            dead: false,
            delay: after.unwrap_or(config.backoff_base).min(config.backoff_max),
            attempts: 0,
            error: sanitize_error(&reason),
            others,
        },
        Outcome::Reject { error } => {
            let error = sanitize_error(&error);
            tracing::warn!(event_id = %event.event_id, event_type = %event.event_type, %error, "rejected by the sink; dead-lettered");
            Pending {
                tried: true,
                dead: true,
                delay: Duration::ZERO,
                attempts: 1,
                error,
                others,
            }
        }
    })
}

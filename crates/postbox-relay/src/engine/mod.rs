//! What every reading mode shares: the state of one `run` ([`Shared`]), the
//! publish path every event takes to its destination ([`publish::publish_to`],
//! with per-destination failure tracking in [`outages`]), the page publisher
//! the stream readers share ([`page_publisher`]), the wake-up signals ([`Signals`]),
//! the batch permits of a multi-outbox relay ([`permits`]), and the counters
//! ([`Stats`]).
//!
//! **Boundary:** nothing here imports a reading mode (`crate::modes`), a
//! background task (`crate::tasks`) or the multi-outbox layer
//! (`crate::tenants`); they import this. `.ci/layers` checks it.

pub(crate) mod outages;
pub(crate) mod page_publisher;
pub mod permits;
pub(crate) mod publish;
mod signals;
mod stats;

pub(crate) use signals::Signals;
pub use stats::{RunMode, Stats, StatsSnapshot};

use crate::config::RelayConfig;
use crate::router::Router;
use crate::sink::Message;
use permits::{BatchPermit, OutboxPermits};
use postbox_store::Store;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;

/// The first and the longest pause between retries of a failed database call.
pub(crate) const DB_RETRY_BASE: Duration = Duration::from_millis(100);
pub(crate) const DB_RETRY_MAX: Duration = Duration::from_secs(10);

/// Shared between the relay's tasks for one `run`, whatever the reading mode.
pub(crate) struct Shared {
    pub(crate) store: Store,
    pub(crate) router: Arc<Router>,
    pub(crate) config: RelayConfig,
    pub(crate) stats: Arc<Stats>,
    /// Who to wake when a notification comes.
    pub(crate) signals: Signals,
    /// Cancelled on SIGTERM: stop reading, release what was not published.
    pub(crate) shutdown: CancellationToken,
    /// Per destination (by index): its current run of failures, if any.
    pub(crate) trouble: Vec<outages::Trouble>,
    /// A permit per batch (claimed, read from the log or the slot), shared
    /// by many relays (see `Relay::with_batch_permits`).
    pub(crate) permits: Option<OutboxPermits>,
    /// The CloudEvents `source` given to every message, if any.
    pub(crate) source: Option<Arc<str>>,
    /// Per destination (by index) and [`Read`]: deliveries not yet flushed
    /// to the deliveries-by-minute table (`tasks::tally`).
    pub(crate) delivered: Vec<[std::sync::atomic::AtomicU64; 2]>,
    /// The same for the events a destination's filters kept from it.
    pub(crate) filtered: Vec<[std::sync::atomic::AtomicU64; 2]>,
}

impl Shared {
    /// Before a batch (a claim, or a round of a stream reader): the shared
    /// batch permit to hold until it is settled, if permits are shared
    /// (`Ok(None)` when they are not); `Err(Stopped)` when shutdown came first.
    pub(crate) async fn batch_permit(&self) -> Result<Option<BatchPermit>, Stopped> {
        let Some(permits) = &self.permits else {
            return Ok(None);
        };
        tokio::select! {
            p = permits.acquire() => Ok(p),
            _ = self.shutdown.cancelled() => Err(Stopped),
        }
    }
}

/// A store row as the sinks take it: the engine turns what a mode read
/// (claimed, from the log, from the slot) into a [`Message`] — the sink
/// contract knows nothing of the store.
pub fn message(e: postbox_store::ClaimedEvent) -> Message {
    Message {
        event_id: e.event_id,
        event_type: e.event_type,
        aggregate_type: e.aggregate_type,
        aggregate_id: e.aggregate_id,
        schema_version: e.schema_version,
        payload: e.payload,
        headers: e.headers,
        created_at: e.created_at,
        attempt: e.attempt,
        sequence: e.sequence,
        source: None,
    }
}

/// [`message`] of a borrowed row.
pub fn message_of(e: &postbox_store::ClaimedEvent) -> Message {
    Message {
        event_id: e.event_id,
        event_type: e.event_type.clone(),
        aggregate_type: e.aggregate_type.clone(),
        aggregate_id: e.aggregate_id.clone(),
        schema_version: e.schema_version,
        payload: e.payload.clone(),
        headers: e.headers.clone(),
        created_at: e.created_at,
        attempt: e.attempt,
        sequence: e.sequence,
        source: None,
    }
}

/// Where the events a publish carries were read: the outbox (claim mode,
/// and in every mode what the readers handed off) or a stream reader (the
/// log, the slot). The tally counts them apart, so the console adds stream
/// deliveries to the outbox's `sent` rows without counting any twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Read {
    Outbox = 0,
    Stream = 1,
}

/// Shutdown came while waiting.
#[derive(Debug)]
pub(crate) struct Stopped;

/// Spawn one of the relay's tasks, aborted when its handle is dropped. A
/// task keeps its parent's span and outbox label (see
/// [`crate::telemetry::label`]).
pub(crate) fn spawn<F>(task: F) -> AbortOnDropHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    AbortOnDropHandle::new(tokio::spawn(crate::telemetry::label::inherit(
        task.in_current_span(),
    )))
}

//! Logical mode's reader: events emitted into the WAL (`emit`), read from a
//! replication slot (see `postbox_store::Logical`).
//!
//! One relay reads a slot at a time: the reader holds a session advisory
//! lock on its own connection; a second relay on the same slot waits as a
//! standby, trying the lock every `standby_retry`, and takes over once the
//! holder's session ends (its process died or stopped).
//!
//! The slot is read over the streaming replication protocol by default
//! (`logical_stream.rs`); with `relay.logical_transport = "sql"`, by the
//! rounds below. Both publish through `publish_batch` and confirm only
//! past what was published or handed off.
//!
//! Over SQL, each round peeks the slot's changes up to the WAL's flush position,
//! decoding them row by row as they arrive: every `batch_size` events are
//! published at once to every destination they route to, and those a
//! destination did not take are handed to the outbox (the claim loop, running
//! alongside, retries them or keeps them as dead letters), so one poison event
//! never holds the slot. Only then is the slot confirmed past the round's
//! transactions. A crash before that redelivers what was read since the last
//! confirmation, never less; a transaction of any size is never held in
//! memory (its events pass through in batches, and it is confirmed at its
//! commit). An event scheduled for later (`deliver_at` still ahead when it
//! is read) is not published: it is handed to the outbox, due at its time,
//! so the slot never waits for it.

use crate::backoff;
use crate::config::{LogicalTransport, ReadMode};
use crate::metrics as m;
use crate::page::{Item, Outbox};
use crate::redact::sanitize_error;
use crate::relay::{RunMode, Shared};
use futures::future::join_all;
use futures::TryStreamExt;
use postbox_store::{
    Change, HeldEvents, Log, Logical, LogicalEvent, LogicalHandoff, Lsn, SlotStatus,
};
use sqlx::PgConnection;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

const DB_RETRY_BASE: Duration = Duration::from_millis(100);
const DB_RETRY_MAX: Duration = Duration::from_secs(10);
/// How often a standby tries to take the slot over.
const STANDBY_RETRY: Duration = Duration::from_millis(500);
/// How often the slot's lag gauges are refreshed while reading.
pub(crate) const SLOT_CHECK: Duration = Duration::from_secs(1);
/// The longest wait between two reads of an idle slot.
const IDLE_POLL_MAX: Duration = Duration::from_millis(250);
/// Warn when less than this share of `max_slot_wal_keep_size` is left.
const SAFE_WAL_WARN_SHARE: f64 = 0.2;
/// How often the reader notes in the schema that it reads the slot (what
/// `status` and the health watch measure a slot's time unread by).
pub(crate) const READ_NOTE: Duration = Duration::from_secs(5);
/// A round reads at most this many batches' worth of changes before it
/// confirms them. Every read (and every confirmation) decodes the WAL again
/// from the slot's restart position, which moves only every ~15 s: rounds
/// of one batch made draining a backlog quadratic. A crash redelivers at
/// most one round.
const ROUND_BATCHES: usize = 20;

/// Why a reading session ended.
pub(crate) enum Ended {
    Shutdown,
    Drained,
    Standby,
}

/// Read the slot until shutdown (or, draining, until a read finds nothing).
pub(crate) async fn read_loop(shared: Arc<Shared>, mode: RunMode) {
    let logical = shared.store.logical();
    let slot = shared.config.slot_name(shared.store.schema());
    let batches = Batches::new(&shared);
    let mut failures = 0;
    let mut standby_said = false;
    while !shared.shutdown.is_cancelled() {
        let read = match shared.config.logical_transport {
            LogicalTransport::Stream => {
                crate::logical_stream::session(
                    &shared,
                    &logical,
                    &batches,
                    &slot,
                    mode,
                    &mut failures,
                )
                .await
            }
            LogicalTransport::Sql => {
                session(&shared, &logical, &batches, &slot, mode, &mut failures).await
            }
        };
        match read {
            Ok(Ended::Shutdown | Ended::Drained) => break,
            Ok(Ended::Standby) => {
                if !standby_said {
                    tracing::info!(%slot, "another relay reads the replication slot; waiting as a standby");
                    standby_said = true;
                }
                if mode == RunMode::Drain {
                    break;
                }
                tokio::select! {
                    _ = tokio::time::sleep(STANDBY_RETRY) => {}
                    _ = shared.shutdown.cancelled() => {}
                }
            }
            Err(e) => {
                failures += 1;
                standby_said = false;
                let delay = backoff::full_jitter(failures, DB_RETRY_BASE, DB_RETRY_MAX);
                let error = sanitize_error(&e.to_string());
                if let ReadError::Lost { .. } = e {
                    metrics::gauge!(m::SLOT_INVALIDATED, "slot" => slot.clone()).set(1.0);
                    tracing::error!(%slot, %error, retry_in = ?delay, "the replication slot is invalidated: the relay does not read on until it is dropped and re-created");
                } else if let ReadError::Unnumbered(_) = e {
                    tracing::error!(%slot, %error, retry_in = ?delay, "logical mode does not read with ordered routes while emits are not numbered");
                } else if let ReadError::Refused { .. } = e {
                    tracing::error!(%slot, %error, retry_in = ?delay, "logical mode cannot open a replication connection: the server refused it");
                } else if error.contains("wal_level") {
                    tracing::error!(%slot, %error, retry_in = ?delay, "logical mode cannot read: the server is not configured for it");
                } else {
                    tracing::warn!(%slot, %error, retry_in = ?delay, "reading the replication slot failed");
                }
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shared.shutdown.cancelled() => {}
                }
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    /// The replication stream failed (connection lost, server error).
    #[error("the replication stream failed: {0}")]
    Stream(String),
    /// Ordered routes, and the schema's emits are not numbered.
    #[error(transparent)]
    Unnumbered(#[from] crate::relay::StartError),
    /// The server refused the replication connection; `what` says what to
    /// set.
    #[error("the server refused the replication connection ({error}): {what}")]
    Refused { error: String, what: String },
    #[error(
        "replication slot {slot} was invalidated (wal_status = lost): the server removed WAL it \
         still needed (max_slot_wal_keep_size), so {range}; see the README's operations section \
         to recover (postbox slot drop {slot}, restart the relay, reconcile that range from the \
         application's own records)"
    )]
    Lost { slot: String, range: String },
}

/// A reading session's start, whatever the transport: the slot held on
/// `conn` (the session advisory lock; `None` when another relay holds it),
/// created if missing, its confirmed position, and its watch checked once
/// (an invalidated slot is an error here).
pub(crate) struct Opened {
    pub(crate) conn: PgConnection,
    pub(crate) confirmed: Lsn,
    pub(crate) watch: SlotWatch,
}

pub(crate) async fn open(
    shared: &Shared,
    logical: &Logical,
    slot: &str,
) -> Result<Option<Opened>, ReadError> {
    // Ordered routes order an aggregate's events by their sequence: read
    // nothing while the schema's emits carry none.
    crate::relay::check_numbered_emits(&shared.store, &shared.router, ReadMode::Logical).await?;
    let mut conn = shared.store.pool().acquire().await?.detach();
    if !logical.lock(&mut conn, slot).await? {
        return Ok(None);
    }
    if logical.ensure_slot(&mut conn, slot).await? {
        tracing::info!(%slot, "created the replication slot; events emitted from now on are delivered");
    }
    let confirmed = logical
        .confirmed(&mut conn, slot)
        .await?
        .unwrap_or_default();
    let mut watch = SlotWatch::default();
    watch.check(logical, slot).await?;
    metrics::gauge!(m::SLOT_INVALIDATED, "slot" => slot.to_owned()).set(0.0);
    Ok(Some(Opened {
        conn,
        confirmed,
        watch,
    }))
}

/// Hold the slot on one connection and read it round after round.
async fn session(
    shared: &Shared,
    logical: &Logical,
    batches: &Batches,
    slot: &str,
    mode: RunMode,
    failures: &mut i32,
) -> Result<Ended, ReadError> {
    let Some(Opened {
        mut conn,
        mut confirmed,
        mut watch,
    }) = open(shared, logical, slot).await?
    else {
        return Ok(Ended::Standby);
    };
    logical.read_now(&mut conn, slot).await?;
    let mut noted = Instant::now();
    tracing::info!(%slot, transport = "sql", "reading the replication slot");
    let mut idle: u32 = 0;
    loop {
        if shared.shutdown.is_cancelled() {
            return Ok(Ended::Shutdown);
        }
        let Some(read) = round(shared, logical, batches, &mut conn, slot, &mut confirmed).await?
        else {
            return Ok(Ended::Shutdown);
        };
        *failures = 0;
        if read.caught_up {
            watch.caught_up = Instant::now();
        }
        if watch.last.elapsed() >= SLOT_CHECK {
            watch.check(logical, slot).await?;
        }
        if noted.elapsed() >= READ_NOTE {
            logical.read_now(&mut conn, slot).await?;
            noted = Instant::now();
        }
        if read.events == 0 && read.caught_up {
            if mode == RunMode::Drain {
                return Ok(Ended::Drained);
            }
            // Every read decodes the WAL from the slot's restart position
            // (all of the database's writes, not only postbox's): an idle
            // reader backs off, up to IDLE_POLL_MAX, and is back at
            // logical_poll_interval as soon as a read finds events.
            idle = (idle + 1).min(16);
            let base = shared.config.logical_poll_interval;
            let wait = base
                .saturating_mul(1 << (idle - 1).min(10))
                .min(IDLE_POLL_MAX.max(base));
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shared.shutdown.cancelled() => return Ok(Ended::Shutdown),
            }
        } else {
            idle = 0;
        }
    }
}

/// The slot's gauges and warnings.
pub(crate) struct SlotWatch {
    pub(crate) last: Instant,
    /// When a read last reached the WAL's flush position.
    pub(crate) caught_up: Instant,
    warned: Option<Instant>,
}

impl Default for SlotWatch {
    fn default() -> Self {
        Self {
            last: Instant::now(),
            caught_up: Instant::now(),
            warned: None,
        }
    }
}

impl SlotWatch {
    pub(crate) async fn check(&mut self, logical: &Logical, slot: &str) -> Result<(), ReadError> {
        self.last = Instant::now();
        let Some(status) = logical.status(Some(slot)).await?.into_iter().next() else {
            return Ok(());
        };
        if status.is_lost() {
            return Err(ReadError::Lost {
                slot: slot.to_owned(),
                range: status.lost_range(),
            });
        }
        record_slot(&status, self.caught_up.elapsed());
        if let Some(reason) = at_risk(&status) {
            if self
                .warned
                .is_none_or(|t| t.elapsed() >= Duration::from_secs(60))
            {
                self.warned = Some(Instant::now());
                tracing::warn!(%slot, %reason, "the replication slot is close to being invalidated; its WAL is kept only up to max_slot_wal_keep_size");
            }
        }
        Ok(())
    }
}

/// Set the slot's gauges.
pub(crate) fn record_slot(status: &SlotStatus, behind: Duration) {
    let slot = status.slot_name.clone();
    metrics::gauge!(m::SLOT_LAG_BYTES, "slot" => slot.clone()).set(status.lag_bytes.unwrap_or(0.0));
    metrics::gauge!(m::SLOT_RETAINED_BYTES, "slot" => slot.clone())
        .set(status.retained_bytes.unwrap_or(0.0));
    metrics::gauge!(m::SLOT_LAG_SECONDS, "slot" => slot).set(behind.as_secs_f64());
}

/// Why `status` is close to invalidation, if it is.
pub fn at_risk(status: &SlotStatus) -> Option<String> {
    let (Some(safe), Some(max)) = (status.safe_wal_bytes, status.max_slot_wal_keep_bytes) else {
        return None;
    };
    (max > 0.0 && safe < max * SAFE_WAL_WARN_SHARE).then(|| {
        format!(
            "{:.0} MB of WAL may still be written before the slot is invalidated (max_slot_wal_keep_size = {:.0} MB)",
            safe / 1048576.0,
            max / 1048576.0
        )
    })
}

struct Read {
    events: usize,
    /// Everything up to the flush position was read.
    caught_up: bool,
}

/// Peek, publish in batches, hand off, confirm. `None`: shutdown came while
/// a batch waited for a shared batch permit (nothing confirmed past it).
async fn round(
    shared: &Shared,
    logical: &Logical,
    batches: &Batches,
    conn: &mut PgConnection,
    slot: &str,
    confirmed: &mut Lsn,
) -> Result<Option<Read>, ReadError> {
    let batch = shared.config.batch_size as usize;
    let round_rows = batch.saturating_mul(ROUND_BATCHES);
    let limit = i32::try_from(round_rows).unwrap_or(i32::MAX);
    let upto = logical.flush_lsn(conn).await?;
    let mut last_commit: Option<Lsn> = None;
    let mut rows = 0usize;
    let mut events = 0usize;
    let mut pending: Vec<LogicalEvent> = Vec::with_capacity(batch);
    {
        let mut changes = logical.peek(conn, slot, upto, limit);
        while let Some(change) = changes.try_next().await? {
            rows += 1;
            match change {
                Change::Event(e) => {
                    pending.push(*e);
                    if pending.len() >= batch {
                        events += pending.len();
                        if let Settled::Stopped = publish_batch(shared, batches, &pending).await? {
                            return Ok(None);
                        }
                        pending.clear();
                    }
                }
                Change::Commit { end } => last_commit = Some(end),
                Change::Begin | Change::Other => {}
            }
        }
    }
    if !pending.is_empty() {
        events += pending.len();
        if let Settled::Stopped = publish_batch(shared, batches, &pending).await? {
            return Ok(None);
        }
    }
    // Fewer rows than asked: the read stopped at `upto`, not at the limit,
    // so nothing before `upto` is left to read.
    let caught_up = rows < round_rows;
    let confirm = if caught_up {
        Some(last_commit.map_or(upto, |c| c.max(upto)))
    } else {
        last_commit
    };
    if let Some(lsn) = confirm.filter(|&lsn| lsn > *confirmed) {
        logical.advance(conn, slot, lsn).await?;
        *confirmed = lsn;
    }
    Ok(Some(Read { events, caught_up }))
}

/// The outbox as logical mode sees it: asked the same `held` question as
/// in log mode (`Log::held`, `log.sql`: a question about the outbox, not
/// the log). A batch read again after a crash between its hand-off and the
/// slot's confirmation holds events the outbox already has.
pub(crate) struct SlotOutbox(Log);

impl Outbox for SlotOutbox {
    async fn held(
        &self,
        destination: &str,
        aggregates: &[(&str, &str)],
    ) -> Result<Vec<HeldEvents>, sqlx::Error> {
        self.0.held(destination, aggregates).await
    }

    const READ_AGAIN: bool = true;
}

/// What publishing a batch needs, made once per reader.
pub(crate) struct Batches {
    logical: Logical,
    outbox: SlotOutbox,
    /// The router has ordered routes.
    ordered: bool,
}

impl Batches {
    pub(crate) fn new(shared: &Shared) -> Self {
        Self {
            logical: shared.store.logical(),
            outbox: SlotOutbox(shared.store.log()),
            ordered: shared.router.claim_order().is_some(),
        }
    }
}

/// How a batch ended.
#[must_use]
pub(crate) enum Settled {
    /// Published or handed off: the slot may be confirmed past it.
    Done,
    /// Shutdown came while it waited for a shared batch permit: nothing was
    /// published, and the slot must not be confirmed past it.
    Stopped,
}

/// Publish `events` to every destination they route to, at once — on
/// ordered routes in layers per aggregate (see `crate::page`) — and hand
/// what a destination did not take to the outbox. Serving many outboxes,
/// the batch holds one of the shared batch permits until then.
pub(crate) async fn publish_batch(
    shared: &Shared,
    batches: &Batches,
    events: &[LogicalEvent],
) -> Result<Settled, sqlx::Error> {
    let Ok(_permit) = shared.batch_permit().await else {
        return Ok(Settled::Stopped);
    };
    let router = &shared.router;
    crate::otel::claimed(
        &shared.store.schema(),
        events.iter().map(|e| &e.event.headers),
    );
    // An event scheduled for later is not published: it is handed to the
    // outbox, due at its time, and the slot moves on past it.
    let now = chrono::Utc::now();
    let items: Vec<Item<'_>> = events
        .iter()
        .map(|e| Item {
            event: &e.event,
            scheduled: e.scheduled_after(now),
        })
        .collect();
    let rounds = (0..router.destinations().len())
        .map(|d| crate::page::publish(shared, &batches.outbox, d, &items, batches.ordered));
    let results = join_all(rounds).await;
    // Per event: whether some destination did not take it (now).
    let mut handed_off = vec![false; events.len()];
    let (mut retried, mut dead) = (0u64, 0u64);
    for (d, published) in results.into_iter().enumerate() {
        let published = published?;
        let handoffs: Vec<LogicalHandoff<'_>> = published
            .handoffs
            .into_iter()
            .map(|(i, p)| {
                handed_off[i] = true;
                if p.dead {
                    dead += 1;
                } else if p.tried {
                    retried += 1;
                }
                LogicalHandoff {
                    event: &events[i],
                    dead: p.dead,
                    delay: p.delay,
                    attempts: p.attempts,
                    error: p.error,
                    others: p.others,
                }
            })
            .collect();
        batches
            .logical
            .handoff(&router.destinations()[d].name, &handoffs)
            .await?;
    }
    let created: Vec<_> = events
        .iter()
        .zip(handed_off)
        .filter(|(e, off)| !off && !router.targets(&e.event.event_type).is_empty())
        .map(|(e, _)| e.event.created_at)
        .collect();
    let stats = &shared.stats;
    stats
        .delivered
        .fetch_add(created.len() as u64, Ordering::Relaxed);
    stats.retried.fetch_add(retried, Ordering::Relaxed);
    stats.dead_lettered.fetch_add(dead, Ordering::Relaxed);
    if dead > 0 {
        metrics::counter!(m::DEAD_LETTERED).increment(dead);
    }
    m::record_commit_to_delivery(created.into_iter());
    Ok(Settled::Done)
}

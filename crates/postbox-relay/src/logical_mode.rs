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
use crate::config::LogicalTransport;
use crate::metrics as m;
use crate::redact::sanitize_error;
use crate::relay::{publish_to, RunMode, Shared};
use crate::sink::{Message, Outcome};
use futures::future::join_all;
use futures::TryStreamExt;
use postbox_store::{Change, Logical, LogicalEvent, LogicalHandoff, Lsn, SlotStatus};
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
    let mut failures = 0;
    let mut standby_said = false;
    while !shared.shutdown.is_cancelled() {
        let read = match shared.config.logical_transport {
            LogicalTransport::Stream => {
                crate::logical_stream::session(&shared, &logical, &slot, mode, &mut failures).await
            }
            LogicalTransport::Sql => session(&shared, &logical, &slot, mode, &mut failures).await,
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
        let read = round(shared, logical, &mut conn, slot, &mut confirmed).await?;
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

/// Peek, publish in batches, hand off, confirm.
async fn round(
    shared: &Shared,
    logical: &Logical,
    conn: &mut PgConnection,
    slot: &str,
    confirmed: &mut Lsn,
) -> Result<Read, ReadError> {
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
                        publish_batch(shared, logical, &pending).await?;
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
        publish_batch(shared, logical, &pending).await?;
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
    Ok(Read { events, caught_up })
}

/// Publish `events` to every destination they route to, at once; hand what
/// a destination did not take to the outbox.
pub(crate) async fn publish_batch(
    shared: &Shared,
    logical: &Logical,
    events: &[LogicalEvent],
) -> Result<(), sqlx::Error> {
    let router = &shared.router;
    crate::otel::claimed(
        &shared.store.schema(),
        events.iter().map(|e| &e.event.headers),
    );
    let targets: Vec<Vec<usize>> = events
        .iter()
        .map(|e| router.targets(&e.event.event_type))
        .collect();
    // An event scheduled for later is not published: it is handed to the
    // outbox, due at its time, and the slot moves on past it.
    let now = chrono::Utc::now();
    let scheduled: Vec<bool> = events.iter().map(|e| e.scheduled_after(now)).collect();
    let destinations = router.destinations().len();
    let rounds = (0..destinations).map(|d| {
        let mine: Vec<usize> = (0..events.len())
            .filter(|&i| targets[i].contains(&d) && !scheduled[i])
            .collect();
        async move {
            if mine.is_empty() {
                return (d, mine, Vec::new());
            }
            let messages: Vec<Message> = mine
                .iter()
                .map(|&i| Message::from(&events[i].event))
                .collect();
            let outcomes = publish_to(shared, d, &messages).await;
            (d, mine, outcomes)
        }
    });
    let results = join_all(rounds).await;
    let mut delivered_everywhere: Vec<bool> = scheduled.iter().map(|s| !s).collect();
    let (mut delivered, mut retried, mut dead) = (0u64, 0u64, 0u64);
    for (d, mine, outcomes) in results {
        let others = |i: usize| -> Vec<String> {
            targets[i]
                .iter()
                .filter(|&&t| t != d)
                .map(|&t| router.destinations()[t].name.clone())
                .collect()
        };
        let mut handoffs: Vec<LogicalHandoff<'_>> = (0..events.len())
            .filter(|&i| scheduled[i] && targets[i].contains(&d))
            .map(|i| LogicalHandoff {
                event: &events[i],
                dead: false,
                delay: Duration::ZERO,
                attempts: 0,
                error: String::new(),
                others: others(i),
            })
            .collect();
        for (&i, outcome) in mine.iter().zip(outcomes) {
            let Some(h) = handoff_of(shared, &events[i], outcome, others(i)) else {
                continue;
            };
            delivered_everywhere[i] = false;
            if h.dead {
                dead += 1;
            } else {
                retried += 1;
            }
            handoffs.push(h);
        }
        logical
            .handoff(&router.destinations()[d].name, &handoffs)
            .await?;
    }
    let mut created = Vec::new();
    for (i, ok) in delivered_everywhere.into_iter().enumerate() {
        if ok && !targets[i].is_empty() {
            delivered += 1;
            created.push(events[i].event.created_at);
        }
    }
    let stats = &shared.stats;
    stats.delivered.fetch_add(delivered, Ordering::Relaxed);
    stats.retried.fetch_add(retried, Ordering::Relaxed);
    stats.dead_lettered.fetch_add(dead, Ordering::Relaxed);
    if dead > 0 {
        metrics::counter!(m::DEAD_LETTERED).increment(dead);
    }
    m::record_commit_to_delivery(created.into_iter());
    Ok(())
}

/// How an event a destination did not take leaves the stream; `None` when
/// it was delivered.
fn handoff_of<'a>(
    shared: &Shared,
    event: &'a LogicalEvent,
    outcome: Outcome,
    others: Vec<String>,
) -> Option<LogicalHandoff<'a>> {
    let config = &shared.config;
    let (dead, delay, attempts, error) = match outcome {
        Outcome::Delivered => return None,
        Outcome::Retry { error, after } => (
            config.max_attempts <= 1,
            after
                .unwrap_or_else(|| backoff::full_jitter(1, config.backoff_base, config.backoff_max))
                .min(config.backoff_max),
            1,
            sanitize_error(&error),
        ),
        Outcome::Deferred { reason, after } => (
            false,
            after.unwrap_or(config.backoff_base).min(config.backoff_max),
            0,
            sanitize_error(&reason),
        ),
        Outcome::Reject { error } => {
            let error = sanitize_error(&error);
            tracing::warn!(event_id = %event.event.event_id, event_type = %event.event.event_type, %error, "rejected by the sink; dead-lettered");
            (true, Duration::ZERO, 1, error)
        }
    };
    Some(LogicalHandoff {
        event,
        dead,
        delay,
        attempts,
        error,
        others,
    })
}

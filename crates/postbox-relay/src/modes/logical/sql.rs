//! Logical mode over SQL (`relay.logical_transport = "sql"`): rounds that
//! peek the slot's changes up to the WAL's flush position, decoding them row
//! by row as they arrive, publish them in batches, hand off what a
//! destination did not take, and only then advance the slot past the
//! round's transactions (`pg_logical_slot_peek_binary_changes` +
//! `pg_replication_slot_advance`).

use super::{
    open, publish_batch, Batches, Ended, Failures, Note, Opened, ReadError, Settled, SLOT_CHECK,
};
use crate::engine::{RunMode, Shared};
use crate::redact::sanitize_error;
use futures::TryStreamExt;
use postbox_store::{Change, Logical, LogicalEvent, Lsn};
use sqlx::PgConnection;
use std::time::{Duration, Instant};

/// The longest wait between two reads of an idle slot.
const IDLE_POLL_MAX: Duration = Duration::from_millis(250);
/// A round reads at most this many batches' worth of changes before it
/// confirms them. Every read (and every confirmation) decodes the WAL again
/// from the slot's restart position, which moves only every ~15 s: rounds
/// of one batch made draining a backlog quadratic. A crash redelivers at
/// most one round.
const ROUND_BATCHES: usize = 20;

/// Hold the slot on one connection and read it round after round.
pub(super) async fn session(
    shared: &Shared,
    logical: &Logical,
    batches: &Batches,
    slot: &str,
    mode: RunMode,
    failures: &mut Failures,
) -> Result<Ended, ReadError> {
    let Some(Opened {
        mut conn,
        mut confirmed,
        mut watch,
    }) = open(shared, logical, slot).await?
    else {
        return Ok(Ended::Standby);
    };
    failures.opened(slot, confirmed)?;
    // A reader still failing notes its read once it has recovered
    // (`Failures`): noting it now would wipe the failures the schema shows.
    if !failures.failing() {
        logical.read_now(&mut conn, slot, confirmed).await?;
    }
    let mut note = Note::new(confirmed);
    tracing::info!(%slot, transport = "sql", "reading the replication slot");
    let mut idle: u32 = 0;
    let ended = loop {
        if shared.shutdown.is_cancelled() {
            break Ended::Shutdown;
        }
        let Some(read) = round(shared, logical, batches, &mut conn, slot, &mut confirmed).await?
        else {
            break Ended::Shutdown;
        };
        if read.events > 0 {
            note.published();
        }
        // A round read up to the flush position and confirmed the slot
        // past it: the reader has recovered.
        if failures.failing() {
            failures
                .recovered(shared, logical, &mut conn, slot, confirmed)
                .await?;
            note.noted(confirmed);
        }
        if read.caught_up {
            watch.caught_up = Instant::now();
        }
        if watch.last.elapsed() >= SLOT_CHECK {
            watch.check(logical, slot).await?;
        }
        if note.due(confirmed) {
            logical.read_now(&mut conn, slot, confirmed).await?;
            note.noted(confirmed);
        }
        if read.events == 0 && read.caught_up {
            if mode == RunMode::Drain {
                break Ended::Drained;
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
                _ = shared.shutdown.cancelled() => break Ended::Shutdown,
            }
        } else {
            idle = 0;
        }
    };
    // A session that ends well notes where it got to: a server restart
    // before the slot's position is saved then delivers nothing again.
    if !failures.failing() {
        if let Err(e) = logical.read_now(&mut conn, slot, confirmed).await {
            tracing::debug!(error = %sanitize_error(&e.to_string()), "could not note the last position read");
        }
    }
    Ok(ended)
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
                Change::Refused { at, refusal } => batches.refuse(at, &refusal).await,
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

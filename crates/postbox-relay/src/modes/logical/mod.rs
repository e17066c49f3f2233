//! Logical mode's reader: events emitted into the WAL (`emit`), read from a
//! replication slot (see `postbox_store::Logical`).
//!
//! One relay reads a slot at a time: the reader holds a session advisory
//! lock on its own connection; a second relay on the same slot waits as a
//! standby, trying the lock every `standby_retry`, and takes over once the
//! holder's session ends (its process died or stopped).
//!
//! The slot is read over the streaming replication protocol by default
//! (`stream.rs`); with `relay.logical_transport = "sql"`, by the
//! rounds of `sql.rs`. Both publish through `publish_batch` and confirm only
//! past what was published or handed off.
//!
//! Over SQL, each round peeks the slot's changes up to the WAL's flush position,
//! decoding them row by row as they arrive: every `batch_size` events are
//! published at once to every destination they route to, and those a
//! destination did not take are handed to the outbox (the claim loop, running
//! alongside, retries them or keeps them as dead letters), so one poison event
//! never holds the slot. Only then is the slot confirmed past the round's
//! transactions. A crash before that redelivers what was read since the last
//! confirmation, never less (after a server crash, which can bring the slot
//! back to an older position, at most what was confirmed since the reader's
//! last read note: `open` moves the slot up to the note); a transaction of
//! any size is never held in
//! memory (its events pass through in batches, and it is confirmed at its
//! commit). An event scheduled for later (`deliver_at` still ahead when it
//! is read) is not published: it is handed to the outbox, due at its time,
//! so the slot never waits for it.

mod sql;
mod stream;

use crate::backoff;
use crate::config::{LogicalTransport, ReadMode};
use crate::engine::page_publisher::{Item, Outbox};
use crate::engine::{RunMode, Shared, DB_RETRY_BASE, DB_RETRY_MAX};
use crate::redact::sanitize_error;
use crate::router::Router;
use crate::telemetry::metrics as m;
use futures::future::join_all;
use postbox_store::Store;
use postbox_store::{
    HeldEvents, Log, Logical, LogicalEvent, LogicalHandoff, Lsn, Refusal, SlotStatus,
};
use sqlx::PgConnection;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a standby tries to take the slot over.
const STANDBY_RETRY: Duration = Duration::from_millis(500);
/// How often the slot's lag gauges are refreshed while reading.
pub(crate) const SLOT_CHECK: Duration = Duration::from_secs(1);
/// Warn when less than this share of `max_slot_wal_keep_size` is left.
const SAFE_WAL_WARN_SHARE: f64 = 0.2;
/// How often the reader notes in the schema that it reads the slot (what
/// `status` and the health watch measure a slot's time unread by).
pub(crate) const READ_NOTE: Duration = Duration::from_secs(5);
/// How often, while events are published and confirmed, the reader notes
/// its position (a server crash redelivers at most what was confirmed since
/// the last note).
const POSITION_NOTE: Duration = Duration::from_secs(1);

/// When the reader last noted its read in the schema (`logical_readers`),
/// and the position it confirmed the slot up to then. A note is due every
/// `READ_NOTE`, and every `POSITION_NOTE` while events are published and
/// confirmed: one row update a second at most, whatever the rate of
/// events. (A position raised by keepalives alone waits for `READ_NOTE`:
/// each note writes WAL, which the next keepalive confirms, so noting every
/// such move would write a row a second on an idle slot forever.)
pub(crate) struct Note {
    at: Instant,
    position: Lsn,
    /// Events were published (or handed off) since the last note.
    published: bool,
}

impl Note {
    /// Noted at `position` just now.
    pub(crate) fn new(position: Lsn) -> Self {
        Self {
            at: Instant::now(),
            position,
            published: false,
        }
    }

    /// Events were published or handed off, to be confirmed.
    pub(crate) fn published(&mut self) {
        self.published = true;
    }

    /// How long since the last note.
    pub(crate) fn age(&self) -> Duration {
        self.at.elapsed()
    }

    /// Whether a note is due, the slot confirmed up to `confirmed`.
    pub(crate) fn due(&self, confirmed: Lsn) -> bool {
        let age = self.age();
        age >= READ_NOTE || (self.published && confirmed > self.position && age >= POSITION_NOTE)
    }

    /// The reader noted `confirmed` now.
    pub(crate) fn noted(&mut self, confirmed: Lsn) {
        *self = Self::new(confirmed);
    }
}

/// Why a relay refuses to start (see [`Relay::check_start`](crate::Relay::check_start)).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Ordered routes in logical mode, and the schema's emits carry no
    /// sequence to order by.
    #[error(
        "schema {schema}: ordered routes in logical mode need numbered emits: run `postbox \
         migrate --emit-sequence on` (each emit then updates its aggregate's counter row)"
    )]
    UnnumberedEmits { schema: String },
    /// The database could not be asked.
    #[error("schema {schema}: cannot read logical mode's settings (is the schema migrated?)")]
    Settings {
        schema: String,
        #[source]
        source: sqlx::Error,
    },
}

/// Ordered routes in logical mode need the schema's emits numbered
/// (migration 17): `Ok` when they are, or when the relay has no ordered
/// routes or does not read in logical mode.
pub(crate) async fn check_numbered_emits(
    store: &Store,
    router: &Router,
    mode: ReadMode,
) -> Result<(), StartError> {
    if mode != ReadMode::Logical || router.claim_order().is_none() {
        return Ok(());
    }
    let schema = || store.schema().name().to_owned();
    let numbered =
        store
            .logical()
            .numbered_emits()
            .await
            .map_err(|source| StartError::Settings {
                schema: schema(),
                source,
            })?;
    if numbered {
        Ok(())
    } else {
        Err(StartError::UnnumberedEmits { schema: schema() })
    }
}

/// How often the reader says that it set messages aside, at most.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(60);
/// How many set-aside messages a second are kept in `logical_refused`, at
/// most (every one is counted; a flood costs the database bounded writes).
const REFUSALS_KEPT_PER_SECOND: u32 = 10;

/// Messages under the schema's prefix that are not an event: counted
/// (`postbox_logical_refused_total`), said with bounded volume, kept for an
/// operator (bounded), never delivered — and the slot is confirmed past
/// them like past anything else, so none of them can stop the reader.
pub(crate) struct Refusals {
    slot: String,
    /// When the last WARN was said, and what was refused since.
    said: Option<Instant>,
    unsaid: u64,
    /// This second's window of kept refusals.
    window: Instant,
    kept: u32,
}

impl Refusals {
    pub(crate) fn new(slot: &str) -> Self {
        Self {
            slot: slot.to_owned(),
            said: None,
            unsaid: 0,
            window: Instant::now(),
            kept: 0,
        }
    }

    /// Set aside one message read at `at`.
    pub(crate) async fn refuse(&mut self, logical: &Logical, at: Lsn, refusal: &Refusal) {
        metrics::counter!(m::LOGICAL_REFUSED, "slot" => self.slot.clone()).increment(1);
        self.unsaid += 1;
        if self.said.is_none_or(|t| t.elapsed() >= REFUSAL_LOG_EVERY) {
            tracing::warn!(
                slot = %self.slot,
                lsn = %at,
                refused = self.unsaid,
                reason = %sanitize_error(&refusal.reason),
                "set aside messages under the schema's prefix that are not events postbox can decode (never delivered; kept in the schema's logical_refused table; said again at most once a minute)"
            );
            self.said = Some(Instant::now());
            self.unsaid = 0;
        }
        if self.window.elapsed() >= Duration::from_secs(1) {
            self.window = Instant::now();
            self.kept = 0;
        }
        if self.kept < REFUSALS_KEPT_PER_SECOND {
            self.kept += 1;
            if let Err(e) = logical.refuse(at, refusal).await {
                // Counted and said; keeping it is best effort.
                tracing::debug!(error = %sanitize_error(&e.to_string()), "could not keep a refused message");
            }
        }
    }
}

/// The reader's reading sessions that failed in a row, and where the slot
/// stood when they opened.
///
/// A session that reads and then fails before the slot has moved is no
/// recovery: the next one reads the same WAL again, and would fail the same
/// way. So the count starts over only once the slot has moved past where
/// the last failed session opened (or a session that opened further on
/// reads), or a session has read on for `READ_NOTE` without failing (an
/// idle slot does not move), or a round over SQL completed — never merely
/// because a message was read; the wait between sessions grows meanwhile,
/// and the failures noted in the schema (`slot status`, `status`, the
/// console) are not wiped by each new session.
#[derive(Default)]
pub(crate) struct Failures {
    count: i32,
    /// The slot's confirmed position when the current session opened.
    opened_at: Option<Lsn>,
    /// … when the last failed session opened.
    failed_from: Option<Lsn>,
    /// A slot that cannot be decoded past its confirmed position: that
    /// position, and the server's error.
    stuck: Option<(Lsn, String)>,
}

impl Failures {
    /// A session is about to open: until it says where, its failure is
    /// tied to no position.
    fn opening(&mut self) {
        self.opened_at = None;
    }

    /// Whether the last session failed and none has recovered since.
    pub(crate) fn failing(&self) -> bool {
        self.count > 0
    }

    /// A session opened at the slot's `confirmed` position. A slot known not
    /// to decode past that very position is not read again (that would
    /// deliver what it read before the failing change again, every time):
    /// the error stands until the slot moves or is re-created.
    pub(crate) fn opened(&mut self, slot: &str, confirmed: Lsn) -> Result<(), ReadError> {
        self.opened_at = Some(confirmed);
        match &self.stuck {
            Some((at, error)) if *at == confirmed => Err(ReadError::Undecodable {
                slot: slot.to_owned(),
                at: at.to_string(),
                error: error.clone(),
            }),
            _ => {
                self.stuck = None;
                Ok(())
            }
        }
    }

    /// Whether the session reading something means the reader has
    /// recovered: it was failing, and the last failed session did not open
    /// where this one did (then it read too, and failed before the slot
    /// moved).
    pub(crate) fn recovers_on_read(&self) -> bool {
        self.count > 0
            && match (self.failed_from, self.opened_at) {
                (Some(failed), Some(opened)) => opened > failed,
                _ => true,
            }
    }

    /// Whether the slot's confirmed `position`, seen during a session
    /// (`None`: not known), means the reader has recovered: it was failing,
    /// and the slot moved past where the session opened.
    pub(crate) fn recovers_at(&self, position: Option<Lsn>) -> bool {
        self.count > 0
            && matches!((position, self.opened_at), (Some(now), Some(opened)) if now > opened)
    }

    /// The reader reads again: ready. `confirmed`: where it has confirmed
    /// the slot up to.
    pub(crate) async fn recovered(
        &mut self,
        shared: &Shared,
        logical: &Logical,
        conn: &mut PgConnection,
        slot: &str,
        confirmed: Lsn,
    ) -> Result<(), sqlx::Error> {
        self.count = 0;
        self.failed_from = None;
        shared.stats.reader_failures.store(0, Ordering::Relaxed);
        metrics::gauge!(m::READER_FAILURES, "slot" => slot.to_owned()).set(0.0);
        tracing::info!(%slot, "reading the replication slot again");
        logical.read_now(conn, slot, confirmed).await
    }

    /// A session failed with `e`: how many have in a row. A slot found
    /// undecodable is not read again where it stands.
    fn failed(&mut self, e: &ReadError) -> i32 {
        self.count += 1;
        self.failed_from = self.opened_at;
        if let ReadError::Undecodable { error, .. } = e {
            if let Some(at) = self.opened_at {
                self.stuck = Some((at, error.clone()));
            }
        }
        self.count
    }
}

/// Whether the server's error says the slot's publication does not exist
/// (pgoutput looks it up as of each change it decodes, SQLSTATE 42704).
fn publication_missing(error: &str) -> bool {
    error.contains("publication \"") && error.contains("does not exist")
}

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
    let batches = Batches::new(&shared, &slot);
    let mut failures = Failures::default();
    let mut standby_said = false;
    while !shared.shutdown.is_cancelled() {
        failures.opening();
        let read = match shared.config.logical_transport {
            LogicalTransport::Stream => {
                stream::session(&shared, &logical, &batches, &slot, mode, &mut failures).await
            }
            LogicalTransport::Sql => {
                sql::session(&shared, &logical, &batches, &slot, mode, &mut failures).await
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
                let server = sanitize_error(&e.to_string());
                // A missing publication fails every session at the same
                // change: said as such, with what to do.
                let e = match (e, failures.opened_at) {
                    (ReadError::Stream(_) | ReadError::Db(_), Some(at))
                        if publication_missing(&server) =>
                    {
                        ReadError::Undecodable {
                            slot: slot.clone(),
                            at: at.to_string(),
                            error: server,
                        }
                    }
                    (e, _) => e,
                };
                let error = sanitize_error(&e.to_string());
                let count = failures.failed(&e);
                shared
                    .stats
                    .reader_failures
                    .store(count as u64, Ordering::Relaxed);
                metrics::gauge!(m::READER_FAILURES, "slot" => slot.clone()).set(f64::from(count));
                standby_said = false;
                let delay = backoff::full_jitter(count, DB_RETRY_BASE, DB_RETRY_MAX);
                // Noted in the schema (best effort: the database may be what
                // fails), so `slot status`, `status` and the console say so.
                if let Err(note) = logical.read_failed(&slot, &error).await {
                    tracing::debug!(error = %sanitize_error(&note.to_string()), "could not note the failed read");
                }
                if let ReadError::Undecodable { .. } = e {
                    tracing::error!(%slot, %error, retry_in = ?delay, "the replication slot cannot be decoded past its confirmed position: the relay does not read it again until it moves or is re-created");
                } else if let ReadError::Lost { .. } = e {
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
    Unnumbered(#[from] StartError),
    /// The server refused the replication connection; `what` says what to
    /// set.
    #[error("the server refused the replication connection ({error}): {what}")]
    Refused { error: String, what: String },
    /// The server cannot decode the slot past `at`: its publication did
    /// not exist as of a change there.
    #[error(
        "replication slot {slot} cannot be read past {at}: drop it and start the relay again \
         (postbox slot drop {slot}; the relay then creates the publication and the slot), and \
         reconcile the events emitted before that and not yet delivered from the application's \
         own records. Its publication did not exist when a change after {at} was written \
         (dropped, or the slot was created without it), and pgoutput looks it up as of each \
         change it decodes, so creating it again does not help ({error})"
    )]
    Undecodable {
        slot: String,
        at: String,
        error: String,
    },
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
    check_numbered_emits(&shared.store, &shared.router, ReadMode::Logical).await?;
    let mut conn = shared.store.pool().acquire().await?.detach();
    if !logical.lock(&mut conn, slot).await? {
        return Ok(None);
    }
    let created = logical.ensure_slot(&mut conn, slot).await?;
    if created {
        tracing::info!(%slot, "created the replication slot; events emitted from now on are delivered");
    }
    let confirmed = logical
        .confirmed(&mut conn, slot)
        .await?
        .unwrap_or_default();
    // An invalidated slot is said as such (`ReadError::Lost`) before
    // anything else is asked of it.
    let mut watch = SlotWatch::default();
    watch.check(logical, slot).await?;
    metrics::gauge!(m::SLOT_INVALIDATED, "slot" => slot.to_owned()).set(0.0);
    // A slot just created owes nothing to a note.
    let confirmed = if created {
        confirmed
    } else {
        move_up_to_note(logical, &mut conn, slot, confirmed).await?
    };
    Ok(Some(Opened {
        conn,
        confirmed,
        watch,
    }))
}

/// PostgreSQL up to 16 saves a logical slot's confirmed position only now
/// and then (when its restart position moves, at the next checkpoint): a
/// server crash, or on PostgreSQL up to 16 any restart, can bring the slot
/// back to before what this relay noted it confirmed, all of it delivered.
/// Move the slot up to the note rather than deliver all that again; the
/// slot's confirmed position after that.
async fn move_up_to_note(
    logical: &Logical,
    conn: &mut PgConnection,
    slot: &str,
    confirmed: Lsn,
) -> Result<Lsn, ReadError> {
    let Some(noted) = logical.noted(conn, slot).await? else {
        return Ok(confirmed);
    };
    if noted <= confirmed {
        return Ok(confirmed);
    }
    logical.advance(conn, slot, noted).await?;
    let now = logical.confirmed(conn, slot).await?.unwrap_or_default();
    metrics::counter!(m::SLOT_MOVED_UP, "slot" => slot.to_owned()).increment(1);
    tracing::info!(%slot, from = %confirmed, to = %now, "moved the replication slot up to where this relay had confirmed it (the server restarted without saving that position): the events before it were delivered and are not read again");
    Ok(now)
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
    /// Refresh the gauges; the slot's confirmed position, when known.
    pub(crate) async fn check(
        &mut self,
        logical: &Logical,
        slot: &str,
    ) -> Result<Option<Lsn>, ReadError> {
        self.last = Instant::now();
        let Some(status) = logical.status(Some(slot)).await?.into_iter().next() else {
            return Ok(None);
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
        Ok(status.confirmed_lsn.and_then(|l| l.parse().ok()))
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
    /// What was set aside instead of delivered.
    refusals: tokio::sync::Mutex<Refusals>,
}

impl Batches {
    pub(crate) fn new(shared: &Shared, slot: &str) -> Self {
        Self {
            logical: shared.store.logical(),
            outbox: SlotOutbox(shared.store.log()),
            ordered: shared.router.claim_order().is_some(),
            refusals: tokio::sync::Mutex::new(Refusals::new(slot)),
        }
    }

    /// Set aside one message read at `at` (see [`Refusals`]).
    pub(crate) async fn refuse(&self, at: Lsn, refusal: &Refusal) {
        self.refusals
            .lock()
            .await
            .refuse(&self.logical, at, refusal)
            .await;
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
/// ordered routes in layers per aggregate (see `crate::engine::page`) — and hand
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
    // Only what the schema's emit signed is delivered: whatever else was
    // written under the prefix is set aside (and the slot moves past it).
    let all: Vec<&LogicalEvent> = events.iter().collect();
    let signed = batches.logical.verify(&all).await?;
    let mut events = Vec::with_capacity(all.len());
    for (e, ok) in all.into_iter().zip(signed) {
        if ok {
            events.push(e);
        } else {
            let why = if e.tag.is_some() {
                "its tag does not match its content (not written by the schema's emit)"
            } else {
                "it carries no tag (not written by the schema's emit, or emitted before migration 19)"
            };
            batches
                .refuse(e.at, &Refusal::new(why, e.content.as_bytes()))
                .await;
        }
    }
    let router = &shared.router;
    crate::telemetry::otel::claimed(
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
    let rounds = (0..router.destinations().len()).map(|d| {
        crate::engine::page_publisher::publish(shared, &batches.outbox, d, &items, batches.ordered)
    });
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
                    event: events[i],
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

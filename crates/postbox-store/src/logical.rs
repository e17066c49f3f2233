//! Logical mode's slot (see migration 11 and `sql/logical.sql`).
//!
//! Producers write events into the WAL only (`emit`: a transactional logical
//! message with the prefix `postbox.<schema>`). The relay reads them from a
//! replication slot, by default over the streaming replication protocol
//! (the relay's `logical_stream.rs`: this module gives it the slot's lock,
//! creation, status and hand-off, and [`decode_event`]); over the SQL
//! interface (`relay.logical_transport = "sql"`) it *peeks* the slot's
//! changes (nothing is confirmed by reading), publishes them, hands what a
//! destination did not take to the outbox, and only then *advances* the
//! slot past them. A crash before the confirmation redelivers what was read.
//!
//! The changes are pgoutput's binary messages (protocol version 1); this
//! module decodes the three a message-only publication yields — Begin,
//! Message and Commit — into [`Change`]s, and an event's content into a
//! [`ClaimedEvent`].

use crate::catalog;
use crate::rows::{decode_error, header_map, ClaimedEvent};
use chrono::{DateTime, Utc};
use futures::stream::{BoxStream, StreamExt};
use postbox::statements::trusted;
use postbox::Schema;
use serde::Deserialize;
use serde_json::value::RawValue;
use sqlx::{PgConnection, PgPool, Row};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

/// A WAL position.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(pub u64);

impl std::str::FromStr for Lsn {
    type Err = String;
    /// PostgreSQL's text form, `16/B374D848`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (hi, lo) = s
            .split_once('/')
            .ok_or_else(|| format!("not an LSN: {s:?}"))?;
        let hi = u64::from_str_radix(hi, 16).map_err(|_| format!("not an LSN: {s:?}"))?;
        let lo = u64::from_str_radix(lo, 16).map_err(|_| format!("not an LSN: {s:?}"))?;
        if hi > u64::from(u32::MAX) || lo > u64::from(u32::MAX) {
            return Err(format!("not an LSN: {s:?}"));
        }
        Ok(Lsn(hi << 32 | lo))
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// One event read from the slot.
#[derive(Debug)]
pub struct LogicalEvent {
    pub event: ClaimedEvent,
    /// The headers as emitted (JSON object text), for a hand-off.
    pub headers_json: String,
    /// When it was scheduled for (`emit(..., deliver_at => …)`); `None`: at
    /// once.
    pub deliver_at: Option<DateTime<Utc>>,
    /// The event's JSON exactly as emitted (what the tag signs; what a
    /// hand-off passes).
    pub content: String,
    /// The tag `emit_one` put before the JSON (migration 19), if any.
    pub tag: Option<[u8; 32]>,
    /// Where the message was read (0 when decoded without one).
    pub at: Lsn,
}

impl LogicalEvent {
    /// Scheduled for a time still ahead of `now`: not to be published yet.
    pub fn scheduled_after(&self, now: DateTime<Utc>) -> bool {
        self.deliver_at.is_some_and(|t| t > now)
    }
}

/// One decoded change of the slot.
#[derive(Debug)]
pub enum Change {
    /// A transaction starts.
    Begin,
    /// One of this schema's events.
    Event(Box<LogicalEvent>),
    /// A transaction committed; confirming the slot up to `end` is
    /// confirming it.
    Commit { end: Lsn },
    /// A message under the schema's prefix that is not an event this
    /// reader can decode: set aside, never delivered, and never in the way
    /// of what follows it.
    Refused { at: Lsn, refusal: Refusal },
    /// Anything else (another schema's messages, a non-transactional one).
    Other,
}

/// A message the reader set aside instead of delivering.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Why (a fixed phrase and the decoder's word, without the content).
    pub reason: String,
    /// The message's first bytes (at most [`Refusal::EXCERPT_BYTES`]), as
    /// text (NUL bytes and invalid UTF-8 replaced).
    pub excerpt: String,
}

impl Refusal {
    /// How much of a refused message is kept.
    pub const EXCERPT_BYTES: usize = 512;

    /// `content` refused for `reason`.
    pub fn new(reason: impl Into<String>, content: &[u8]) -> Self {
        let head = &content[..content.len().min(Self::EXCERPT_BYTES)];
        Self {
            // PostgreSQL's text holds no NUL, and a decoder's word may quote one.
            reason: reason.into().replace('\0', "\u{fffd}"),
            excerpt: String::from_utf8_lossy(head).replace('\0', "\u{fffd}"),
        }
    }
}

/// A refused message as an operator reads it back.
#[derive(Clone, Debug, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct RefusedMessage {
    pub refused_at: DateTime<Utc>,
    pub lsn: String,
    pub reason: String,
    pub excerpt: String,
}

/// Decode an event's content, or say why it is refused.
pub fn decode_or_refuse(content: &[u8]) -> Result<LogicalEvent, Refusal> {
    decode_event(content).map_err(|e| {
        let reason = match e {
            sqlx::Error::Protocol(why) => why,
            other => other.to_string(),
        };
        Refusal::new(
            format!("not an event postbox can decode: {reason}"),
            content,
        )
    })
}

/// A slot as `postbox slot status` and the metrics show it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct SlotStatus {
    pub slot_name: String,
    pub plugin: Option<String>,
    pub active: bool,
    pub active_pid: Option<i32>,
    /// `reserved`, `extended`, `unreserved` or `lost` (invalidated).
    pub wal_status: Option<String>,
    pub confirmed_lsn: Option<String>,
    /// WAL written since the slot's confirmed position.
    pub lag_bytes: Option<f64>,
    /// WAL the slot keeps from being removed.
    pub retained_bytes: Option<f64>,
    /// How much more WAL can be written before the slot is invalidated
    /// (`None` without `max_slot_wal_keep_size`).
    pub safe_wal_bytes: Option<f64>,
    pub max_slot_wal_keep_bytes: Option<f64>,
    /// The WAL's current position (where the events an invalidated slot
    /// can no longer deliver end, for now).
    pub current_lsn: Option<String>,
    /// The backend of the relay that holds the slot (reads it now).
    pub reader_pid: Option<i32>,
    /// Since a relay last noted a read of the slot (`None`: never, or the
    /// schema's relays never read it).
    pub last_read_seconds_ago: Option<f64>,
    /// Reading sessions that failed in a row since the last good read
    /// (migration 22; 0 when none).
    pub reader_failures: i32,
    /// Since the first of those failures.
    pub failing_seconds: Option<f64>,
    /// The last failure's error, secrets masked.
    pub reader_error: Option<String>,
    /// The position a relay last noted it confirmed the slot up to on this
    /// server (migration 32; `None`: none noted, or noted on another server).
    pub noted_lsn: Option<String>,
    /// How far the slot stands behind that note (`None` unless it does):
    /// WAL whose events were delivered, which a server crash or restart
    /// brought back. The next relay to read the slot moves it up.
    pub behind_note_bytes: Option<f64>,
}

/// Reading sessions failed in a row after which a reader counts as failing
/// (`/readyz` answers 503 from the same count).
pub const READER_FAILING_AFTER: i32 = 3;

impl SlotStatus {
    /// The server removed WAL the slot needed: events since its confirmed
    /// position can no longer be read.
    pub fn is_lost(&self) -> bool {
        self.wal_status.as_deref() == Some("lost")
    }

    /// A relay holds the slot (or a read is running now).
    pub fn read_now(&self) -> bool {
        self.reader_pid.is_some() || self.active
    }

    /// How long no relay has held the slot: `None` while one does; the time
    /// since the last read a relay noted, or `unknown` when none was noted.
    pub fn unread_for(&self) -> Option<Unread> {
        if self.read_now() {
            return None;
        }
        Some(match self.last_read_seconds_ago {
            Some(s) if s.is_finite() => Unread::For(Duration::from_secs_f64(s.max(0.0))),
            _ => Unread::Unknown,
        })
    }

    /// No relay has held the slot for longer than `bound`. A slot no relay
    /// of this schema ever noted a read of (one a relay is about to take
    /// for the first time) does not count: its lag says more.
    pub fn unread_longer_than(&self, bound: Duration) -> bool {
        match self.unread_for() {
            Some(Unread::For(d)) => d > bound,
            None | Some(Unread::Unknown) => false,
        }
    }

    /// Whether this schema's relays read the slot: its default name, or a
    /// relay of the schema noted a read or a failure of it.
    pub fn belongs_to(&self, schema: &Schema) -> bool {
        self.slot_name == default_slot_name(schema)
            || self.last_read_seconds_ago.is_some()
            || self.reader_failures > 0
    }

    /// `Some(what to say)` when the slot's reader has failed
    /// [`READER_FAILING_AFTER`] reading sessions or more in a row.
    pub fn failing(&self) -> Option<String> {
        if self.reader_failures < READER_FAILING_AFTER {
            return None;
        }
        let since = self
            .failing_seconds
            .filter(|s| s.is_finite())
            .map(|s| {
                format!(
                    " over {}",
                    rough_duration(Duration::from_secs_f64(s.max(0.0)))
                )
            })
            .unwrap_or_default();
        Some(format!(
            "the relay's reader failed {} times in a row{since}; last error: {}",
            self.reader_failures,
            self.reader_error.as_deref().unwrap_or("(not recorded)")
        ))
    }

    /// `Some(what to say)` when no relay reads the slot and it stands behind
    /// its reader's note: that much of its lag was delivered already (the
    /// console shows it under the slot; `summary` after its lag).
    pub fn behind_note(&self) -> Option<String> {
        let bytes = self.behind_note_bytes.filter(|b| *b > 0.0)?;
        if self.read_now() || self.is_lost() {
            // A relay moves it up when it opens the slot; while it reads, the
            // slot's own position leads. An invalidated slot is never moved
            // up: what it lost is the news (`lost_range`).
            return None;
        }
        let amount = match bytes {
            b if b < 1024.0 => format!("{b} bytes"),
            b if b < 1048576.0 => format!("{:.1} kB", b / 1024.0),
            b => format!("{:.1} MB", b / 1048576.0),
        };
        Some(format!(
            "{amount} of WAL were delivered already: its reader noted {}, a server crash or restart brought the slot back, and the next relay to read it moves it up",
            self.noted_lsn.as_deref().unwrap_or("a later position"),
        ))
    }

    /// What an invalidated slot lost: the events emitted from its last
    /// confirmed position on, up to where the WAL is now (and on, until the
    /// slot is re-created).
    pub fn lost_range(&self) -> String {
        format!(
            "events emitted after {} (the slot's last confirmed position) up to {} (the WAL's position now) and until the slot is re-created were not delivered and can no longer be read from the WAL",
            self.confirmed_lsn.as_deref().unwrap_or("its last confirmed position"),
            self.current_lsn.as_deref().unwrap_or("now"),
        )
    }

    /// One line for operators: whether a relay reads it, its lag, the WAL it
    /// retains, its WAL status and how much more WAL may be written before
    /// the server invalidates it.
    pub fn summary(&self) -> String {
        let mb = |b: Option<f64>| {
            b.map_or_else(|| "-".to_owned(), |b| format!("{:.1} MB", b / 1048576.0))
        };
        let reader = match self.unread_for() {
            None => "read now".to_owned(),
            Some(Unread::For(d)) => {
                format!("NOT READ for {} (no relay holds it)", rough_duration(d))
            }
            Some(Unread::Unknown) => "NOT READ (no relay holds it; no read noted)".to_owned(),
        };
        let delivered = self
            .behind_note()
            .map(|b| format!(" ({b})"))
            .unwrap_or_default();
        format!(
            "{}: {}, lag {}{delivered}, retains {}, wal_status {}, safe {}",
            self.slot_name,
            reader,
            mb(self.lag_bytes),
            mb(self.retained_bytes),
            self.wal_status.as_deref().unwrap_or("-"),
            mb(self.safe_wal_bytes),
        )
    }
}

/// The replication slot a schema's relays read unless configured otherwise
/// (`relay.logical_slot`): `postbox_<schema>`.
pub fn default_slot_name(schema: &Schema) -> String {
    format!("postbox_{}", schema.name())
}

/// `d` to the second below two minutes, to the minute below two hours.
pub fn rough_duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..120 => format!("{s} s"),
        120..7200 => format!("{} min", s / 60),
        _ => format!("{} h {} min", s / 3600, s % 3600 / 60),
    }
}

/// How long a slot has gone unread.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Unread {
    /// Since a relay last read it.
    For(Duration),
    /// No relay of this schema noted a read of it.
    Unknown,
}

/// An event a destination did not take, leaving the stream for the outbox's
/// retry and dead-letter machinery.
#[derive(Debug)]
pub struct LogicalHandoff<'a> {
    pub event: &'a LogicalEvent,
    /// Rejected or out of attempts: a dead letter now.
    pub dead: bool,
    /// Until the retry (ignored for a dead letter).
    pub delay: Duration,
    /// Attempts so far: 1, or 0 for an event the sink deferred without trying.
    pub attempts: i32,
    /// Already sanitized.
    pub error: String,
    /// The other destinations a fan-out event routes to (empty otherwise).
    pub others: Vec<String>,
}

/// The position `query` answers for `slot` (one row of one text column, or
/// none; NULL is `None`).
async fn slot_lsn(
    query: &str,
    conn: &mut PgConnection,
    slot: &str,
) -> Result<Option<Lsn>, sqlx::Error> {
    let text: Option<Option<String>> = sqlx::query_scalar(trusted(query))
        .bind(slot)
        .fetch_optional(conn)
        .await?;
    text.flatten()
        .map(|t| t.parse().map_err(sqlx::Error::Protocol))
        .transpose()
}

struct Queries {
    prefix: Vec<u8>,
    lock: String,
    create_slot: String,
    ensure_slot: String,
    ensure_publication: String,
    flush_lsn: String,
    peek: String,
    advance: String,
    confirmed: String,
    status: String,
    drop_slot: String,
    handoff: String,
    read_now: String,
    noted: String,
    read_failed: String,
    numbered_emits: String,
    set_numbered_emits: String,
    refuse: String,
    refused: String,
    verify: String,
}

impl Queries {
    fn new(schema: &Schema) -> Self {
        let mut file = catalog("logical.sql", include_str!("../sql/logical.sql"));
        let queries = Self {
            prefix: format!("postbox.{}", schema.name()).into_bytes(),
            lock: file.render("lock", schema),
            create_slot: file.render("create_slot", schema),
            ensure_slot: file.render("ensure_slot", schema),
            ensure_publication: file.render("ensure_publication", schema),
            flush_lsn: file.render("flush_lsn", schema),
            peek: file.render("peek", schema),
            advance: file.render("advance", schema),
            confirmed: file.render("confirmed", schema),
            status: file.render("status", schema),
            drop_slot: file.render("drop_slot", schema),
            handoff: file.render("handoff", schema),
            read_now: file.render("read_now", schema),
            noted: file.render("noted", schema),
            read_failed: file.render("read_failed", schema),
            numbered_emits: file.render("numbered_emits", schema),
            set_numbered_emits: file.render("set_numbered_emits", schema),
            refuse: file.render("refuse", schema),
            refused: file.render("refused", schema),
            verify: file.render("verify", schema),
        };
        file.finish();
        queries
    }
}

/// Logical mode's operations on one schema. Get one with
/// [`crate::Store::logical`]. The reader's own statements (lock, slot,
/// peek, advance) run on a connection the caller holds for as long as it
/// reads: the lock belongs to that session.
#[derive(Clone)]
pub struct Logical {
    pool: PgPool,
    sql: Arc<Queries>,
}

impl Logical {
    pub fn new(pool: PgPool, schema: &Schema) -> Self {
        Self {
            pool,
            sql: Arc::new(Queries::new(schema)),
        }
    }

    /// The logical message prefix of this schema's events.
    pub fn prefix(&self) -> &str {
        std::str::from_utf8(&self.sql.prefix).unwrap_or_default()
    }

    /// Try to become `slot`'s one reader for `conn`'s lifetime.
    pub async fn lock(&self, conn: &mut PgConnection, slot: &str) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar(trusted(&self.sql.lock))
            .bind(slot)
            .fetch_one(conn)
            .await
    }

    /// Create `slot` and its publication when missing (the publication
    /// first); true when the slot was created now.
    pub async fn ensure_slot(
        &self,
        conn: &mut PgConnection,
        slot: &str,
    ) -> Result<bool, sqlx::Error> {
        // The publication first: pgoutput looks it up in the catalog as of
        // each change it decodes, so a slot older than its publication
        // fails on the first table change written in between.
        sqlx::query(trusted(&self.sql.ensure_publication))
            .bind(slot)
            .execute(&mut *conn)
            .await?;
        let created: Option<bool> = sqlx::query_scalar(trusted(&self.sql.create_slot))
            .bind(slot)
            .fetch_optional(&mut *conn)
            .await?;
        match created {
            Some(created) => Ok(created),
            None => {
                sqlx::query_scalar(trusted(&self.sql.ensure_slot))
                    .bind(slot)
                    .fetch_one(conn)
                    .await
            }
        }
    }

    /// The WAL position decoding may read up to now.
    pub async fn flush_lsn(&self, conn: &mut PgConnection) -> Result<Lsn, sqlx::Error> {
        let text: String = sqlx::query_scalar(trusted(&self.sql.flush_lsn))
            .fetch_one(conn)
            .await?;
        text.parse().map_err(sqlx::Error::Protocol)
    }

    /// The slot's changes of transactions committed before `upto`, as a
    /// stream read row by row (a large transaction is never held in
    /// memory), stopping after the transaction that takes the rows past
    /// `limit`. Nothing is confirmed.
    pub fn peek<'c>(
        &'c self,
        conn: &'c mut PgConnection,
        slot: &'c str,
        upto: Lsn,
        limit: i32,
    ) -> BoxStream<'c, Result<Change, sqlx::Error>> {
        let prefix = &self.sql.prefix;
        sqlx::query(trusted(&self.sql.peek))
            .bind(slot)
            .bind(upto.to_string())
            .bind(limit)
            .fetch(conn)
            .map(move |row| {
                let row = row?;
                let lsn: String = row.try_get("lsn")?;
                let data: Vec<u8> = row.try_get("data")?;
                let lsn = lsn.parse().map_err(sqlx::Error::Protocol)?;
                decode_change(lsn, &data, prefix)
            })
            .boxed()
    }

    /// The slot's confirmed position; `None` when the slot does not exist
    /// (or is still being created).
    pub async fn confirmed(
        &self,
        conn: &mut PgConnection,
        slot: &str,
    ) -> Result<Option<Lsn>, sqlx::Error> {
        slot_lsn(&self.sql.confirmed, conn, slot).await
    }

    /// Confirm `slot` up to `lsn`, which must be past its confirmed position.
    pub async fn advance(
        &self,
        conn: &mut PgConnection,
        slot: &str,
        lsn: Lsn,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.sql.advance))
            .bind(slot)
            .bind(lsn.to_string())
            .execute(conn)
            .await?;
        Ok(())
    }

    /// Keep a message the reader set aside (read at `lsn`); the table keeps
    /// the newest 1,000.
    pub async fn refuse(&self, lsn: Lsn, refusal: &Refusal) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.sql.refuse))
            .bind(lsn.to_string())
            .bind(&refusal.reason)
            .bind(&refusal.excerpt)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The newest `limit` messages set aside.
    pub async fn refused(&self, limit: i64) -> Result<Vec<RefusedMessage>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.refused))
            .bind(limit)
            .fetch_all(&self.pool)
            .await
    }

    /// Note a failed reading session of `slot` with its (masked) error.
    pub async fn read_failed(&self, slot: &str, error: &str) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.sql.read_failed))
            .bind(slot)
            .bind(error)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Note that the reader read `slot` now, and that it confirmed the slot
    /// up to `confirmed` (every event before it delivered or handed off).
    pub async fn read_now(
        &self,
        conn: &mut PgConnection,
        slot: &str,
        confirmed: Lsn,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.sql.read_now))
            .bind(slot)
            .bind(confirmed.to_string())
            .execute(conn)
            .await?;
        Ok(())
    }

    /// The position a reader last noted it confirmed `slot` up to (see
    /// [`Logical::read_now`]), when one did. PostgreSQL saves a slot's
    /// confirmed position only now and then, so after a server crash (or,
    /// up to PostgreSQL 16, any restart) the slot can stand before it.
    pub async fn noted(
        &self,
        conn: &mut PgConnection,
        slot: &str,
    ) -> Result<Option<Lsn>, sqlx::Error> {
        slot_lsn(&self.sql.noted, conn, slot).await
    }

    /// The database's logical slots, or only `slot`.
    pub async fn status(&self, slot: Option<&str>) -> Result<Vec<SlotStatus>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.status))
            .bind(slot)
            .fetch_all(&self.pool)
            .await
    }

    /// Whether `emit` numbers each event within its aggregate (migration
    /// 17; off by default). Ordered routes in logical mode need it.
    pub async fn numbered_emits(&self) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar(trusted(&self.sql.numbered_emits))
            .fetch_one(&self.pool)
            .await
    }

    /// Turn numbered emits on or off. On, every emit bumps its aggregate's
    /// counter row (a row update per event); off, emit writes no row.
    pub async fn set_numbered_emits(&self, on: bool) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.sql.set_numbered_emits))
            .bind(on)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Drop `slot` and its publication; true when the slot existed.
    pub async fn drop_slot(&self, slot: &str) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar(trusted(&self.sql.drop_slot))
            .bind(slot)
            .fetch_one(&self.pool)
            .await
    }

    /// Hand `handoffs` (events `destination` did not take) to the outbox.
    pub async fn handoff(
        &self,
        destination: &str,
        handoffs: &[LogicalHandoff<'_>],
    ) -> Result<(), sqlx::Error> {
        if handoffs.is_empty() {
            return Ok(());
        }
        let (mut other_ids, mut other_names) = (Vec::new(), Vec::new());
        for h in handoffs {
            for name in &h.others {
                other_ids.push(h.event.event.event_id);
                other_names.push(name.as_str());
            }
        }
        let found: i32 = sqlx::query_scalar(trusted(&self.sql.handoff))
            .bind(destination)
            .bind(
                handoffs
                    .iter()
                    .map(|h| h.event.content.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                handoffs
                    .iter()
                    .map(|h| h.event.tag.map(|t| t.to_vec()))
                    .collect::<Vec<_>>(),
            )
            .bind(handoffs.iter().map(|h| h.dead).collect::<Vec<_>>())
            .bind(
                handoffs
                    .iter()
                    .map(|h| h.delay.as_secs_f64())
                    .collect::<Vec<_>>(),
            )
            .bind(
                handoffs
                    .iter()
                    .map(|h| h.error.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                handoffs
                    .iter()
                    .map(|h| !h.others.is_empty())
                    .collect::<Vec<_>>(),
            )
            .bind(handoffs.iter().map(|h| h.attempts).collect::<Vec<_>>())
            .bind(&other_ids)
            .bind(&other_names)
            .fetch_one(&self.pool)
            .await?;
        if found as usize != handoffs.len() {
            return Err(sqlx::Error::Protocol(format!(
                "logical_handoff_verified took {found} of {} events",
                handoffs.len()
            )));
        }
        Ok(())
    }
}

impl Logical {
    /// Which of `events` carry a valid tag (`emit_one`'s, migration 19), in
    /// order; an event without a tag does not. One statement, whatever the
    /// number of events; the key stays in the database.
    pub async fn verify(&self, events: &[&LogicalEvent]) -> Result<Vec<bool>, sqlx::Error> {
        use sha2::{Digest, Sha256};
        let tagged: Vec<(usize, Vec<u8>, Vec<u8>)> = events
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                e.tag.map(|t| {
                    let digest = Sha256::digest(e.content.as_bytes()).to_vec();
                    (i, digest, t.to_vec())
                })
            })
            .collect();
        let mut valid = vec![false; events.len()];
        if tagged.is_empty() {
            return Ok(valid);
        }
        let digests: Vec<&[u8]> = tagged.iter().map(|(_, d, _)| d.as_slice()).collect();
        let tags: Vec<&[u8]> = tagged.iter().map(|(_, _, t)| t.as_slice()).collect();
        let answers: Vec<bool> = sqlx::query_scalar(trusted(&self.sql.verify))
            .bind(&digests)
            .bind(&tags)
            .fetch_one(&self.pool)
            .await?;
        if answers.len() != tagged.len() {
            return Err(sqlx::Error::Protocol(format!(
                "logical_verify answered {} of {} tags",
                answers.len(),
                tagged.len()
            )));
        }
        for ((i, _, _), ok) in tagged.iter().zip(answers) {
            valid[*i] = ok;
        }
        Ok(valid)
    }
}

/// The content `emit_one` writes.
#[derive(Deserialize)]
struct Content<'a> {
    event_id: Uuid,
    event_type: String,
    aggregate_type: String,
    aggregate_id: String,
    schema_version: i32,
    #[serde(borrow)]
    payload: &'a RawValue,
    #[serde(borrow)]
    headers: &'a RawValue,
    created_at_us: i64,
    #[serde(default)]
    deliver_at_us: Option<i64>,
    /// The event's number within its aggregate (migration 16; absent in
    /// events emitted before it).
    #[serde(default)]
    sequence: Option<i64>,
}

/// Decode one pgoutput message (protocol 1) read at `lsn`; only messages
/// with `prefix` become events.
pub fn decode_change(lsn: Lsn, data: &[u8], prefix: &[u8]) -> Result<Change, sqlx::Error> {
    let bad = |what: &str| sqlx::Error::Protocol(format!("pgoutput message at {lsn}: {what}"));
    match data.first() {
        Some(b'B') => Ok(Change::Begin),
        Some(b'C') => {
            // flags (1), commit lsn (8), end lsn (8), commit time (8)
            let end = data
                .get(10..18)
                .ok_or_else(|| bad("commit message too short"))?;
            let end = u64::from_be_bytes(end.try_into().map_err(|_| bad("commit lsn"))?);
            Ok(Change::Commit {
                end: Lsn(end.max(lsn.0)),
            })
        }
        Some(b'M') => {
            // flags (1: transactional), lsn (8), prefix NUL-terminated,
            // length (4), content
            let transactional = data.get(1).ok_or_else(|| bad("message too short"))? & 1 == 1;
            let rest = data.get(10..).ok_or_else(|| bad("message too short"))?;
            let nul = rest
                .iter()
                .position(|&b| b == 0)
                .ok_or_else(|| bad("prefix not terminated"))?;
            if &rest[..nul] != prefix || !transactional {
                return Ok(Change::Other);
            }
            let rest = &rest[nul + 1..];
            let len = rest.get(..4).ok_or_else(|| bad("message too short"))?;
            let len = u32::from_be_bytes(len.try_into().map_err(|_| bad("length"))?) as usize;
            let content = rest
                .get(4..4 + len)
                .ok_or_else(|| bad("content shorter than its length"))?;
            Ok(match decode_or_refuse(content) {
                Ok(mut e) => {
                    e.at = lsn;
                    Change::Event(Box::new(e))
                }
                Err(refusal) => Change::Refused { at: lsn, refusal },
            })
        }
        _ => Ok(Change::Other),
    }
}

/// The hex digits of a tag before the event's JSON (migration 19).
const TAG_HEX: usize = 64;

/// Split a message's content into its tag, if it has one, and the JSON.
fn split_tag(content: &[u8]) -> Result<(Option<[u8; 32]>, &[u8]), sqlx::Error> {
    if content.first() == Some(&b'{') || content.len() < TAG_HEX {
        return Ok((None, content));
    }
    let (hex, json) = content.split_at(TAG_HEX);
    let mut tag = [0u8; 32];
    for (i, pair) in hex.chunks(2).enumerate() {
        let digit = |b: u8| match b {
            b'0'..=b'9' => Some(b - b'0'),
            b'a'..=b'f' => Some(b - b'a' + 10),
            _ => None,
        };
        match (digit(pair[0]), digit(pair[1])) {
            (Some(h), Some(l)) => tag[i] = h << 4 | l,
            _ => return Err(sqlx::Error::Protocol("a malformed tag".to_owned())),
        }
    }
    Ok((Some(tag), json))
}

/// An event's content as `emit_one` wrote it: the tag's hex digits (from
/// migration 19 on), then the event's JSON.
pub fn decode_event(content: &[u8]) -> Result<LogicalEvent, sqlx::Error> {
    let (tag, content) = split_tag(content)?;
    let json = std::str::from_utf8(content)
        .map_err(|_| sqlx::Error::Protocol("content is not UTF-8".to_owned()))?;
    let c: Content<'_> = serde_json::from_str(json).map_err(|e| decode_error("content", e))?;
    let created_at = DateTime::<Utc>::from_timestamp_micros(c.created_at_us)
        .ok_or_else(|| sqlx::Error::Protocol("created_at_us out of range".to_owned()))?;
    let deliver_at = c
        .deliver_at_us
        .map(|us| {
            DateTime::<Utc>::from_timestamp_micros(us)
                .ok_or_else(|| sqlx::Error::Protocol("deliver_at_us out of range".to_owned()))
        })
        .transpose()?;
    let headers_json = c.headers.get().to_owned();
    Ok(LogicalEvent {
        event: ClaimedEvent {
            event_id: c.event_id,
            event_type: c.event_type,
            aggregate_type: c.aggregate_type,
            aggregate_id: c.aggregate_id,
            schema_version: c.schema_version,
            payload: c.payload.to_owned(),
            headers: header_map(&headers_json).map_err(|e| decode_error("headers", e))?,
            created_at,
            attempt: 1,
            sequence: c.sequence,
        },
        headers_json,
        deliver_at,
        content: json.to_owned(),
        tag,
        at: Lsn(0),
    })
}

#[cfg(test)]
mod tests {

    fn slot_behind_its_note(bytes: f64) -> SlotStatus {
        SlotStatus {
            slot_name: "s".into(),
            plugin: Some("pgoutput".into()),
            active: false,
            active_pid: None,
            wal_status: Some("reserved".into()),
            confirmed_lsn: Some("0/100".into()),
            lag_bytes: Some(bytes + 10.0),
            retained_bytes: Some(bytes + 10.0),
            safe_wal_bytes: None,
            max_slot_wal_keep_bytes: None,
            current_lsn: Some("0/9000000".into()),
            reader_pid: None,
            last_read_seconds_ago: Some(30.0),
            reader_failures: 0,
            failing_seconds: None,
            reader_error: None,
            noted_lsn: Some("0/8000000".into()),
            behind_note_bytes: Some(bytes),
        }
    }

    #[test]
    fn a_slot_behind_its_note_says_so_only_while_no_relay_reads_it_and_it_is_not_lost() {
        for (bytes, amount) in [
            (512.0, "512 bytes of WAL"),
            (3072.0, "3.0 kB of WAL"),
            (5.5 * 1048576.0, "5.5 MB of WAL"),
        ] {
            let s = slot_behind_its_note(bytes);
            let said = s.behind_note().expect("behind its note");
            assert!(said.starts_with(amount), "{said}");
            assert!(said.contains("0/8000000"), "{said}");
            assert!(s.summary().contains(&said), "{}", s.summary());
        }
        let read = SlotStatus {
            reader_pid: Some(7),
            ..slot_behind_its_note(4096.0)
        };
        assert_eq!(read.behind_note(), None, "a relay reads it");
        let lost = SlotStatus {
            wal_status: Some("lost".into()),
            ..slot_behind_its_note(4096.0)
        };
        assert_eq!(
            lost.behind_note(),
            None,
            "an invalidated slot is not moved up"
        );
        for none in [None, Some(0.0)] {
            let level = SlotStatus {
                behind_note_bytes: none,
                ..slot_behind_its_note(0.0)
            };
            assert_eq!(level.behind_note(), None);
        }
    }
    use super::*;

    #[test]
    fn lsn_round_trips_through_text() {
        let lsn: Lsn = "16/B374D848".parse().unwrap();
        assert_eq!(lsn.0, 0x16_B374_D848);
        assert_eq!(lsn.to_string(), "16/B374D848");
        assert!("16B374D848".parse::<Lsn>().is_err());
        assert!("x/1".parse::<Lsn>().is_err());
    }

    #[test]
    fn messages_decode_and_garbage_is_an_error_not_a_panic() {
        let content = br#"{"event_id":"01a23142-d1d0-7a07-85ba-b8914fce081b","event_type":"t","aggregate_type":"a","aggregate_id":"1","schema_version":1,"payload":{"x":1},"headers":{"h":"v","n":2},"created_at_us":1796122792399425}"#;
        let mut m = vec![b'M', 1];
        m.extend_from_slice(&[0; 8]);
        m.extend_from_slice(b"postbox.s\0");
        m.extend_from_slice(&(content.len() as u32).to_be_bytes());
        m.extend_from_slice(content);
        let Change::Event(e) = decode_change(Lsn(1), &m, b"postbox.s").unwrap() else {
            panic!("an event")
        };
        assert_eq!(e.event.payload.get(), r#"{"x":1}"#);
        assert_eq!(e.event.headers["n"], "2");
        assert_eq!(e.event.sequence, None, "emitted before migration 16");
        assert!(matches!(
            decode_change(Lsn(1), &m, b"postbox.other").unwrap(),
            Change::Other
        ));
        for cut in 0..m.len() {
            let _ = decode_change(Lsn(1), &m[..cut], b"postbox.s");
        }
        let mut c = vec![b'C', 0];
        c.extend_from_slice(&5u64.to_be_bytes());
        c.extend_from_slice(&9u64.to_be_bytes());
        c.extend_from_slice(&0u64.to_be_bytes());
        assert!(matches!(
            decode_change(Lsn(1), &c, b"x").unwrap(),
            Change::Commit { end: Lsn(9) }
        ));
        assert!(decode_change(Lsn(1), &c[..12], b"x").is_err());
    }

    #[test]
    fn an_emitted_sequence_is_decoded() {
        let content = br#"{"event_id":"01a23142-d1d0-7a07-85ba-b8914fce081b","event_type":"t","aggregate_type":"a","aggregate_id":"1","schema_version":1,"payload":{},"headers":{},"sequence":7,"created_at_us":1796122792399425}"#;
        assert_eq!(decode_event(content).unwrap().event.sequence, Some(7));
    }

    #[test]
    fn rough_durations_read_well() {
        assert_eq!(rough_duration(Duration::from_secs(59)), "59 s");
        assert_eq!(rough_duration(Duration::from_secs(600)), "10 min");
        assert_eq!(rough_duration(Duration::from_secs(7260)), "2 h 1 min");
    }
}

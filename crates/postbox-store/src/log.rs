//! Log mode's reads and cursor moves (see migration 7 and `sql/log.sql`).
//!
//! A cursor per destination records how far that destination has read: every
//! event visible in its `lo` snapshot is done; the open window is the events
//! visible in `hi` and not in `lo`, read in id order up to `after_id`. The
//! relay reads a page, publishes it, then advances the cursor: a crash
//! between the two redelivers what was published since the cursor last
//! moved. Reading writes nothing: a window's `hi` is stored only when the
//! cursor moves past a page of it.

use crate::catalog;
use crate::commit::RelayCommit;
use crate::rows::{ClaimedEvent, ClaimedRow};
use postbox::statements::trusted;
use postbox::Schema;
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

/// Which table producers write to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProducerTarget {
    /// The outbox table, read by claims (claim mode).
    Outbox,
    /// The append-only log, read by snapshot cursors (log mode).
    Log,
}

impl ProducerTarget {
    pub fn as_str(self) -> &'static str {
        match self {
            ProducerTarget::Outbox => "outbox",
            ProducerTarget::Log => "log",
        }
    }
}

/// Where a destination's new cursor starts (`start` of its configuration).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CursorStart {
    /// None configured: at the beginning of what the log retains when the
    /// schema has no cursor yet (the outbox's first destinations), else
    /// after every event committed so far (one added to a running outbox).
    Default,
    /// After every event committed so far.
    Now,
    /// Before the first event the log still retains.
    Beginning,
}

impl CursorStart {
    fn as_sql(self) -> &'static str {
        match self {
            CursorStart::Default => "",
            CursorStart::Now => "now",
            CursorStart::Beginning => "beginning",
        }
    }
}

/// The window a cursor reads now.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct LogWindow {
    pub destination: String,
    /// The cursor's partition (0 ≤ part < parts): it reads the events whose
    /// aggregate hashes to it (migration 14's `log_part`).
    pub part: i32,
    /// Into how many partitions the destination's cursor is split.
    pub parts: i32,
    /// Everything visible in this snapshot is done.
    pub lo: String,
    /// The window's upper snapshot.
    pub hi: String,
    /// Read (and published) up to this id.
    pub after_id: i64,
}

/// A reader's lease on one partition after [`Log::renew`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct Lease {
    /// The reader holds the partition.
    pub held: bool,
    /// It holds it beyond its fair share: another relay is waiting for it.
    #[sqlx(rename = "beyond")]
    pub beyond_share: bool,
}

/// How far one cursor is behind (for `postbox status` and the metrics).
#[derive(Clone, Debug, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct CursorLag {
    pub destination: String,
    /// Events delivered (or handed to the outbox) through this cursor.
    pub delivered: i64,
    /// A relay holds the cursor's lease now.
    pub held: bool,
    /// Committed events the cursor has not read.
    pub lag_events: i64,
    /// Age of the oldest of them; `None` when it is caught up.
    pub lag_seconds: Option<f64>,
    /// How long no relay has held any of its partitions (0 while one does).
    pub unread_seconds: f64,
}

/// What [`Log::drop_cursor`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CursorDropped {
    /// Dropped: its partitions, and the events delivered through it.
    Dropped { parts: i32, delivered: i64 },
    /// A relay holds one of its partitions now: nothing dropped.
    Held,
    /// No cursor of that name.
    Missing,
}

/// The audit log's name for dropping a log cursor.
pub const ACTION_DROP_CURSOR: &str = "log.drop_cursor";

/// One event read from the log.
#[derive(Debug)]
pub struct LogEvent {
    /// The log row id (the page cursor).
    pub id: i64,
    pub event: ClaimedEvent,
    /// Scheduled for later (its `deliver_at` was still ahead when the page
    /// was read): not to be published now, but handed to the outbox, which
    /// keeps it until it is due.
    pub scheduled: bool,
}

/// A row of the page statement, decoded by position (its SELECT lists the
/// columns in this order): a page is most of what a drain's relay decodes,
/// and looking each column up by name was about 5 % of its samples.
///
/// The columns' types are not compared with the Rust types row by row
/// (`try_get_unchecked`; another 2–3 % of a drain's relay): `log_page`
/// declares them, and a value that does not decode as its Rust type is
/// still an error, as with the checked read.
fn page_event(row: &sqlx::postgres::PgRow) -> Result<LogEvent, sqlx::Error> {
    use sqlx::Row;
    let claimed = ClaimedRow {
        id: row.try_get_unchecked(0)?,
        event_id: row.try_get_unchecked(1)?,
        event_type: row.try_get_unchecked(2)?,
        aggregate_type: row.try_get_unchecked(3)?,
        aggregate_id: row.try_get_unchecked(4)?,
        schema_version: row.try_get_unchecked(5)?,
        payload: row.try_get_unchecked(6)?,
        headers: row.try_get_unchecked(7)?,
        created_at: row.try_get_unchecked(8)?,
        sequence: row.try_get_unchecked(9)?,
        attempts: row.try_get_unchecked(10)?,
    };
    let scheduled = row.try_get_unchecked(11)?;
    let (id, event) = claimed.decode()?;
    Ok(LogEvent {
        id,
        event,
        scheduled,
    })
}

/// A row of `open`: the window (first row), or one of its events.
#[derive(sqlx::FromRow)]
struct OpenRow {
    destination: Option<String>,
    part: Option<i32>,
    parts: Option<i32>,
    lo: Option<String>,
    hi: Option<String>,
    after_id: Option<i64>,
    id: Option<i64>,
    event_id: Option<Uuid>,
    event_type: Option<String>,
    aggregate_type: Option<String>,
    aggregate_id: Option<String>,
    schema_version: Option<i32>,
    payload: Option<String>,
    headers: Option<String>,
    created_at: Option<chrono::DateTime<chrono::Utc>>,
    sequence: Option<i64>,
    attempts: Option<i32>,
    scheduled: Option<bool>,
}

impl OpenRow {
    fn window(self) -> Option<LogWindow> {
        Some(LogWindow {
            destination: self.destination?,
            part: self.part?,
            parts: self.parts?,
            lo: self.lo?,
            hi: self.hi?,
            after_id: self.after_id?,
        })
    }

    fn event(self) -> Result<LogEvent, sqlx::Error> {
        let missing = |column: &str| sqlx::Error::ColumnNotFound(format!("open: {column} is NULL"));
        let row = ClaimedRow {
            id: self.id.ok_or_else(|| missing("id"))?,
            event_id: self.event_id.ok_or_else(|| missing("event_id"))?,
            event_type: self.event_type.ok_or_else(|| missing("event_type"))?,
            aggregate_type: self
                .aggregate_type
                .ok_or_else(|| missing("aggregate_type"))?,
            aggregate_id: self.aggregate_id.ok_or_else(|| missing("aggregate_id"))?,
            schema_version: self
                .schema_version
                .ok_or_else(|| missing("schema_version"))?,
            payload: self.payload.ok_or_else(|| missing("payload"))?,
            headers: self.headers.ok_or_else(|| missing("headers"))?,
            created_at: self.created_at.ok_or_else(|| missing("created_at"))?,
            attempts: self.attempts.ok_or_else(|| missing("attempts"))?,
            sequence: self.sequence,
        };
        let scheduled = self.scheduled.unwrap_or(false);
        row.decode().map(|(id, event)| LogEvent {
            id,
            event,
            scheduled,
        })
    }
}

struct Queries {
    cursors_ensure: String,
    cursors_split: String,
    cursors_lock: String,
    cursors_drop: String,
    cursors_split_at: String,
    cursors_acquire: String,
    cursors_release: String,
    open: String,
    page: String,
    held: String,
    advance: String,
    producer_target: String,
    set_producer_target: String,
    handoff: String,
    rotate: String,
    truncate: String,
    cursor_lag: String,
    unread: String,
    log_bytes: String,
    drop_cursor: String,
    audit_insert: String,
}

impl Queries {
    fn new(schema: &Schema, commit: RelayCommit) -> Self {
        let mut file = catalog("log.sql", include_str!("../sql/log.sql"));
        let condition = commit.condition_alone();
        let commit = [("relay_commit", condition.as_str())];
        let queries = Self {
            cursors_ensure: file.render("cursors_ensure", schema),
            cursors_split: file.render("cursors_split", schema),
            cursors_lock: file.render("cursors_lock", schema),
            cursors_drop: file.render("cursors_drop", schema),
            cursors_split_at: file.render("cursors_split_at", schema),
            cursors_acquire: file.render("cursors_acquire", schema),
            cursors_release: file.render("cursors_release", schema),
            open: file.render("open", schema),
            page: file.render("page", schema),
            held: file.render("held", schema),
            advance: file.render_with("advance", schema, &commit),
            producer_target: file.render("producer_target", schema),
            set_producer_target: file.render("set_producer_target", schema),
            handoff: file.render("handoff", schema),
            rotate: file.render("rotate", schema),
            truncate: file.render("truncate", schema),
            cursor_lag: file.render("cursor_lag", schema),
            unread: file.render("unread", schema),
            log_bytes: file.render("log_bytes", schema),
            drop_cursor: file.render("drop_cursor", schema),
            audit_insert: crate::dead_letters::AuditQueries::new(schema).insert,
        };
        file.finish();
        queries
    }
}

/// Events of one aggregate the outbox still holds for a destination (see
/// [`Log::held`]).
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct HeldEvents {
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    /// Unresolved dead letters (for the destination); otherwise pending or
    /// in flight.
    pub dead: bool,
    /// The lowest sequence among them.
    pub sequence: i64,
}

/// An event a destination did not take, leaving the log for the outbox's
/// retry and dead-letter machinery.
#[derive(Debug)]
pub struct Handoff<'a> {
    /// The log event (its log id and content).
    pub event: &'a LogEvent,
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

/// The log and its cursors on one schema. Get one with [`crate::Store::log`].
#[derive(Clone)]
pub struct Log {
    pool: PgPool,
    sql: Arc<Queries>,
}

impl Log {
    pub fn new(pool: PgPool, schema: &Schema) -> Self {
        Self::committing(pool, schema, RelayCommit::default())
    }

    /// The log, its cursor moves committing as `commit` says (see
    /// [`RelayCommit`]: asynchronously, a PostgreSQL crash can move a cursor
    /// back, so the events past it are delivered again — never skipped, as a
    /// cursor never persists ahead of the publishing it records).
    pub fn committing(pool: PgPool, schema: &Schema, commit: RelayCommit) -> Self {
        Self {
            pool,
            sql: Arc::new(Queries::new(schema, commit)),
        }
    }

    /// Make sure each destination has a cursor (in one partition when it
    /// has none yet), starting as [`CursorStart::Default`] says.
    pub async fn ensure_cursors(&self, destinations: &[String]) -> Result<(), sqlx::Error> {
        let starts = vec![CursorStart::Default; destinations.len()];
        self.make_cursors(destinations, &starts, 1).await
    }

    async fn make_cursors(
        &self,
        destinations: &[String],
        starts: &[CursorStart],
        parts: i32,
    ) -> Result<(), sqlx::Error> {
        let starts: Vec<&str> = starts.iter().map(|s| s.as_sql()).collect();
        sqlx::query(trusted(&self.sql.cursors_ensure))
            .bind(destinations)
            .bind(parts)
            .bind(starts)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// [`Log::ensure_split_from`] with every new cursor starting as
    /// [`CursorStart::Default`] says.
    pub async fn ensure_split(
        &self,
        destinations: &[String],
        parts: i32,
    ) -> Result<Vec<(String, i32)>, sqlx::Error> {
        let starts = vec![CursorStart::Default; destinations.len()];
        self.ensure_split_from(destinations, &starts, parts).await
    }

    /// Make sure each destination has a cursor split into `parts`
    /// partitions: new cursors are made so, starting where the destination's
    /// entry of `starts` says; a destination split otherwise is
    /// re-split when no relay holds any of its cursors (every partition then
    /// starts again at the earliest of the old cursors' positions, so events
    /// the others had read past that are delivered again). Returns, per
    /// destination, how many partitions it has now — the old count where a
    /// relay holds one of its cursors.
    pub async fn ensure_split_from(
        &self,
        destinations: &[String],
        starts: &[CursorStart],
        parts: i32,
    ) -> Result<Vec<(String, i32)>, sqlx::Error> {
        self.make_cursors(destinations, starts, parts).await?;
        let mut split: Vec<(String, i32)> = sqlx::query_as(trusted(&self.sql.cursors_split))
            .bind(destinations)
            .fetch_all(&self.pool)
            .await?;
        for (destination, now) in &mut split {
            if *now != parts && self.resplit(destination, parts).await? {
                *now = parts;
            }
        }
        Ok(split)
    }

    /// Re-split `destination`'s cursors into `parts` partitions if no relay
    /// holds any of them; whether it did.
    async fn resplit(&self, destination: &str, parts: i32) -> Result<bool, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let (held, start, delivered): (i64, Option<String>, Option<i64>) =
            sqlx::query_as(trusted(&self.sql.cursors_lock))
                .bind(destination)
                .fetch_one(&mut *tx)
                .await?;
        let Some(start) = start.filter(|_| held == 0) else {
            tx.rollback().await?;
            return Ok(false);
        };
        sqlx::query(trusted(&self.sql.cursors_drop))
            .bind(destination)
            .execute(&mut *tx)
            .await?;
        sqlx::query(trusted(&self.sql.cursors_split_at))
            .bind(destination)
            .bind(parts)
            .bind(start)
            .bind(delivered.unwrap_or(0))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Take, renew or give back `owner`'s lease on partition `part` of
    /// `destination`'s cursor (and renew its heartbeat as a reader of
    /// `destination`): an owner holds at most its fair share of the
    /// destination's partitions, ceil(parts / live readers), taking free
    /// ones below it and giving back the ones beyond it. Call it between
    /// pages, with no cursor move of the partition in flight. Returns whether
    /// `owner` holds the partition now.
    pub async fn acquire(
        &self,
        owner: Uuid,
        destination: &str,
        part: i32,
        lease: Duration,
    ) -> Result<bool, sqlx::Error> {
        Ok(self
            .lease(owner, destination, part, lease, false)
            .await?
            .held)
    }

    /// Renew `owner`'s lease (and heartbeat) as [`Log::acquire`] does, but
    /// never give the partition back, so it may be called while moves of
    /// the partition are in flight: the answer says whether `owner` holds it
    /// beyond its share, to give it back with `acquire` once they are in.
    pub async fn renew(
        &self,
        owner: Uuid,
        destination: &str,
        part: i32,
        lease: Duration,
    ) -> Result<Lease, sqlx::Error> {
        self.lease(owner, destination, part, lease, true).await
    }

    async fn lease(
        &self,
        owner: Uuid,
        destination: &str,
        part: i32,
        lease: Duration,
        keep: bool,
    ) -> Result<Lease, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.cursors_acquire))
            .bind(owner)
            .bind(destination)
            .bind(part)
            .bind(lease.as_secs_f64())
            .bind(keep)
            .fetch_one(&self.pool)
            .await
    }

    /// Give up `owner`'s lease on partition `part` of `destination`'s
    /// cursor and, unless it holds another of its partitions, its heartbeat
    /// as the destination's reader.
    pub async fn release(
        &self,
        owner: Uuid,
        destination: &str,
        part: i32,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.sql.cursors_release))
            .bind(owner)
            .bind(destination)
            .bind(part)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The window partition `part` of `destination`'s cursor reads now
    /// (opening one if needed: a read, nothing is stored until
    /// [`Log::advance`] moves past a page of it) and its first [`Log::page`]
    /// of up to `limit` events, in one statement: the window positioned where
    /// its first page starts (`after_id` 0 when it holds no event), and that
    /// page; `None` when `owner` does not hold the cursor. With `from` (a snapshot, as text) a new window starts
    /// there, whatever the cursor's row says: the reader's last move, closing
    /// the window before, may not be committed yet.
    pub async fn open(
        &self,
        destination: &str,
        part: i32,
        owner: Uuid,
        from: Option<&str>,
        limit: i64,
    ) -> Result<Option<(LogWindow, Vec<LogEvent>)>, sqlx::Error> {
        let rows: Vec<OpenRow> = sqlx::query_as(trusted(&self.sql.open))
            .bind(destination)
            .bind(owner)
            .bind(part)
            .bind(limit)
            .bind(from)
            .fetch_all(&self.pool)
            .await?;
        let mut rows = rows.into_iter();
        let Some(first) = rows.next() else {
            return Ok(None);
        };
        let window = first.window().ok_or_else(|| {
            sqlx::Error::Protocol("open: its first row is not the window".to_owned())
        })?;
        let page = rows.map(OpenRow::event).collect::<Result<Vec<_>, _>>()?;
        Ok(Some((window, page)))
    }

    /// How many connections the pool has idle now or room to open: reads
    /// that are only worth making when no other work waits for them take
    /// no more than these.
    pub fn spare_connections(&self) -> usize {
        let room = self
            .pool
            .options()
            .get_max_connections()
            .saturating_sub(self.pool.size());
        self.pool.num_idle() + room as usize
    }

    /// Up to `limit` events of `window` after its position, in id order.
    pub async fn page(&self, window: &LogWindow, limit: i64) -> Result<Vec<LogEvent>, sqlx::Error> {
        sqlx::query(trusted(&self.sql.page))
            .bind(&window.lo)
            .bind(&window.hi)
            .bind(window.after_id)
            .bind(limit)
            .bind(window.parts)
            .bind(window.part)
            .try_map(|row: sqlx::postgres::PgRow| page_event(&row))
            .fetch_all(&self.pool)
            .await
    }

    /// For ordered routes: of the aggregates `aggregates` (type, id), the
    /// events the outbox has not delivered to `destination` yet — pending,
    /// in flight, or unresolved dead letters — grouped by aggregate, event
    /// type and whether they are dead letters, each group with its lowest
    /// sequence.
    pub async fn held(
        &self,
        destination: &str,
        aggregates: &[(&str, &str)],
    ) -> Result<Vec<HeldEvents>, sqlx::Error> {
        if aggregates.is_empty() {
            return Ok(Vec::new());
        }
        let (types, ids): (Vec<&str>, Vec<&str>) = aggregates.iter().copied().unzip();
        sqlx::query_as(trusted(&self.sql.held))
            .bind(destination)
            .bind(&types)
            .bind(&ids)
            .fetch_all(&self.pool)
            .await
    }

    /// Record that `window` was published up to `last_id` (`count` events);
    /// `done` closes the window (its `hi` becomes the cursor's `lo`),
    /// otherwise the window is stored as open. False when `owner` lost the
    /// cursor, or the cursor is no longer where `window` was read from.
    pub async fn advance(
        &self,
        window: &LogWindow,
        owner: Uuid,
        last_id: i64,
        count: i64,
        done: bool,
    ) -> Result<bool, sqlx::Error> {
        let advanced = self
            .advance_statement(window, owner, last_id, count, done)
            .fetch_optional(&self.pool)
            .await?;
        Ok(advanced == Some(true))
    }

    fn advance_statement<'q>(
        &'q self,
        window: &'q LogWindow,
        owner: Uuid,
        last_id: i64,
        count: i64,
        done: bool,
    ) -> sqlx::query::QueryScalar<'q, sqlx::Postgres, bool, sqlx::postgres::PgArguments> {
        sqlx::query_scalar(trusted(&self.sql.advance))
            .bind(&window.destination)
            .bind(owner)
            .bind(last_id)
            .bind(count)
            .bind(done)
            .bind(window.part)
            .bind(&window.lo)
            .bind(&window.hi)
    }

    /// Move the cursor past a published page as [`Log::advance`] does, and
    /// hand `handoffs` (the events `window.destination` did not take) to the
    /// outbox in the same transaction. False when `owner` lost the cursor:
    /// nothing was written.
    pub async fn settle_page(
        &self,
        window: &LogWindow,
        owner: Uuid,
        last_id: i64,
        count: i64,
        done: bool,
        handoffs: &[Handoff<'_>],
    ) -> Result<bool, sqlx::Error> {
        if handoffs.is_empty() {
            return self.advance(window, owner, last_id, count, done).await;
        }
        let mut tx = self.pool.begin().await?;
        let advanced = self
            .advance_statement(window, owner, last_id, count, done)
            .fetch_optional(&mut *tx)
            .await?;
        if advanced != Some(true) {
            tx.rollback().await?;
            return Ok(false);
        }
        let (mut other_ids, mut other_names) = (Vec::new(), Vec::new());
        for h in handoffs {
            for name in &h.others {
                other_ids.push(h.event.event.event_id);
                other_names.push(name.as_str());
            }
        }
        let each = |f: fn(&Handoff<'_>) -> i64| handoffs.iter().map(f).collect::<Vec<_>>();
        let found: i32 = sqlx::query_scalar(trusted(&self.sql.handoff))
            .bind(&window.destination)
            .bind(each(|h| h.event.id))
            .bind(
                handoffs
                    .iter()
                    .map(|h| h.event.event.event_id)
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
            .fetch_one(&mut *tx)
            .await?;
        if found as usize != handoffs.len() {
            // An event to hand off is not in the log under its id: moving the
            // cursor would skip it. Undo the move; the page is read again.
            tx.rollback().await?;
            return Err(sqlx::Error::Protocol(format!(
                "log_handoff found {found} of {} events in the log",
                handoffs.len()
            )));
        }
        tx.commit().await?;
        Ok(true)
    }

    /// Retention without vacuum: move producers to the next segment of the
    /// ring once the current one is older than `segment_age`, and empty
    /// every other segment all cursors have read past (into the archive
    /// first with `archive`). Returns whether it rotated and how many events
    /// it removed.
    pub async fn maintain(
        &self,
        segment_age: Duration,
        archive: bool,
    ) -> Result<(bool, u64), sqlx::Error> {
        let mut removed = 0;
        for segment in 0..4_i32 {
            let n: Option<i64> = sqlx::query_scalar(trusted(&self.sql.truncate))
                .bind(segment)
                .bind(archive)
                .fetch_one(&self.pool)
                .await?;
            removed += n.unwrap_or(0).max(0) as u64;
        }
        let rotated: bool = sqlx::query_scalar(trusted(&self.sql.rotate))
            .bind(segment_age.as_secs_f64())
            .fetch_one(&self.pool)
            .await?;
        Ok((rotated, removed))
    }

    /// Every cursor's lag.
    /// The log's size on disk (every segment, with indexes): what a cursor
    /// no relay reads keeps from being truncated.
    pub async fn log_bytes(&self) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(trusted(&self.sql.log_bytes))
            .fetch_one(&self.pool)
            .await
    }

    /// Drop `destination`'s cursor (every partition), unless a relay holds
    /// one of them (`force`: anyway), and record it in the audit log, in one
    /// transaction. What the cursor had not read is no longer delivered to
    /// that destination; the log's segments can be truncated again.
    pub async fn drop_cursor(
        &self,
        destination: &str,
        force: bool,
        actor: &str,
        reason: Option<&str>,
    ) -> Result<CursorDropped, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query(trusted(&self.sql.drop_cursor))
            .bind(destination)
            .bind(force)
            .fetch_one(&mut *tx)
            .await?;
        let parts: i32 = sqlx::Row::try_get(&row, "parts")?;
        let delivered: i64 = sqlx::Row::try_get(&row, "delivered")?;
        if parts == 0 {
            tx.rollback().await?;
            let exists = self
                .cursor_lag()
                .await?
                .iter()
                .any(|c| c.destination == destination);
            return Ok(if exists {
                CursorDropped::Held
            } else {
                CursorDropped::Missing
            });
        }
        let selection = serde_json::json!({ "destination": destination, "force": force });
        let details = serde_json::json!([{ "destination": destination, "partitions": parts, "delivered": delivered }]);
        sqlx::query(trusted(&self.sql.audit_insert))
            .bind(actor)
            .bind(ACTION_DROP_CURSOR)
            .bind(selection.to_string())
            .bind(i64::from(parts))
            .bind(reason)
            .bind(details.to_string())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(CursorDropped::Dropped { parts, delivered })
    }

    pub async fn cursor_lag(&self) -> Result<Vec<CursorLag>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.cursor_lag))
            .fetch_all(&self.pool)
            .await
    }

    /// Events in the log some cursor has not read (all of them when no
    /// cursor exists yet).
    pub async fn unread(&self) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(trusted(&self.sql.unread))
            .fetch_one(&self.pool)
            .await
    }

    /// Which table producers write to.
    pub async fn producer_target(&self) -> Result<ProducerTarget, sqlx::Error> {
        let target: String = sqlx::query_scalar(trusted(&self.sql.producer_target))
            .fetch_one(&self.pool)
            .await?;
        Ok(if target == "log" {
            ProducerTarget::Log
        } else {
            ProducerTarget::Outbox
        })
    }

    /// Send producers to `target`.
    pub async fn set_producer_target(&self, target: ProducerTarget) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.sql.set_producer_target))
            .bind(target.as_str())
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_moves_commit_as_the_relay_does() {
        let schema = Schema::new("shop").unwrap();
        let flag = "set_config('synchronous_commit', 'off', true)";
        let sync = Queries::new(&schema, RelayCommit::Synchronous);
        let not_flushed = Queries::new(&schema, RelayCommit::Asynchronous);
        assert!(
            !sync.advance.contains("{relay_commit}") && !sync.advance.contains(flag),
            "{}",
            sync.advance
        );
        assert!(
            not_flushed.advance.contains(flag),
            "{}",
            not_flushed.advance
        );
        // Opening a window writes nothing; leases never wait for a flush.
        for q in [&sync, &not_flushed] {
            assert!(!q.open.contains("UPDATE"), "{}", q.open);
            assert!(q.cursors_acquire.contains(flag), "{}", q.cursors_acquire);
        }
    }
}

//! The relay's statements: claim under a lease, settle, release, rescue
//! expired leases, per-destination state of fan-out events; and the reads
//! and maintenance around them (status, gauges, health, retention, roles).

use crate::catalog;
use crate::console::ConsoleStore;
use crate::dead_letters::DeadLetters;
use crate::events::{Events, Status};
use crate::log::Log;
use crate::roles::{CreateRolesError, Roles};
use chrono::{DateTime, Utc};
use postbox::statements::trusted;
use postbox::statements::Catalog;
use postbox::Schema;
use serde_json::value::RawValue;
use sqlx::PgPool;
use std::collections::BTreeMap;
use std::time::Duration;
use uuid::Uuid;

struct Queries {
    claim: String,
    claim_ordered: String,
    delivery_states: String,
    record_deliveries: String,
    destination_counts: String,
    db_health: String,
    notify_probe: String,
    vacuum_outbox: String,
    ack_delivered: String,
    settle_failed: String,
    release: String,
    rescue_expired: String,
    next_due: String,
    scheduled_later: String,
    status_counts: String,
    gauges: String,
    pending_attempts: String,
    ping: String,
    purge_sent: String,
    archive_sent: String,
    purge_inbox: String,
}

/// How the relay's own writes commit (the `{relay_commit}` condition in the
/// hot-path statements: claim, acknowledge, settle, release, rescue, record
/// deliveries, and log mode's window and cursor moves).
///
/// By default they commit like any other transaction. Asynchronously
/// (`relay.synchronous_commit = false`), each statement sets
/// `synchronous_commit = off` for its own implicit transaction, so it does not
/// wait for the WAL flush. That is safe for the delivery contract: a crash of
/// PostgreSQL can only lose a suffix of the WAL, so it rolls the relay's marks
/// back to an earlier consistent state — a claim or an acknowledgement is
/// forgotten and the event is delivered again (at least once, never lost).
/// The producers' commits, which hold the events themselves, keep the
/// application's own setting, and flushing them flushes every earlier relay
/// commit too. It takes the relay's flushes off a busy disk; measured on the
/// project's machine it did not lower the relay's own latency (README,
/// Performance), so it is not the default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RelayCommit {
    #[default]
    Synchronous,
    /// Do not wait for the WAL flush (`relay.synchronous_commit = false`).
    Asynchronous,
}

impl RelayCommit {
    /// The `{relay_commit}` condition, from `relay.sql` (`relay`).
    pub(crate) fn condition(self, relay: &mut Catalog) -> String {
        let without_flush = relay.take("commit_without_flush");
        match self {
            RelayCommit::Synchronous => "true".to_owned(),
            RelayCommit::Asynchronous => without_flush.to_owned(),
        }
    }

    /// The condition alone, for statements of other files.
    pub(crate) fn condition_alone(self) -> String {
        self.condition(&mut catalog("relay.sql", include_str!("../sql/relay.sql")))
    }
}

impl Queries {
    fn new(schema: &Schema, commit: RelayCommit) -> Self {
        let mut relay = catalog("relay.sql", include_str!("../sql/relay.sql"));
        let mut status = catalog("status.sql", include_str!("../sql/status.sql"));
        let mut retention = catalog("retention.sql", include_str!("../sql/retention.sql"));
        let condition = commit.condition(&mut relay);
        let commit = [("relay_commit", condition.as_str())];
        let queries = Self {
            claim: relay.render_with("claim", schema, &commit),
            claim_ordered: relay.render_with("claim_ordered", schema, &commit),
            ack_delivered: relay.render_with("ack_delivered", schema, &commit),
            settle_failed: relay.render_with("settle_failed", schema, &commit),
            release: relay.render_with("release", schema, &commit),
            rescue_expired: relay.render_with("rescue_expired", schema, &commit),
            next_due: relay.render("next_due", schema),
            scheduled_later: relay.render("scheduled_later", schema),
            delivery_states: relay.render("delivery_states", schema),
            record_deliveries: relay.render_with("record_deliveries", schema, &commit),
            notify_probe: relay.render("notify_probe", schema),
            status_counts: status.render("status_counts", schema),
            gauges: status.render("gauges", schema),
            pending_attempts: status.render("pending_attempts", schema),
            destination_counts: status.render("destination_counts", schema),
            db_health: status.render("db_health", schema),
            ping: status.render("ping", schema),
            purge_sent: retention.render("purge_sent", schema),
            archive_sent: retention.render("archive_sent", schema),
            purge_inbox: retention.render("purge_inbox", schema),
            vacuum_outbox: retention.render("vacuum_outbox", schema),
        };
        relay.finish();
        status.finish();
        retention.finish();
        queries
    }
}

/// The relay's view of the outbox tables.
#[derive(Clone)]
pub struct Store {
    pool: PgPool,
    schema: Schema,
    sql: std::sync::Arc<Queries>,
    commit: RelayCommit,
}

/// Events claimed under one lease.
#[derive(Debug)]
pub struct Claim {
    pub token: Uuid,
    /// Outbox row ids, parallel to `events`.
    pub ids: Vec<i64>,
    pub events: Vec<ClaimedEvent>,
}

/// One claimed event, decoded for publishing.
#[derive(Debug)]
pub struct ClaimedEvent {
    pub event_id: Uuid,
    pub event_type: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub schema_version: i32,
    /// The payload, as the JSON text that was committed.
    pub payload: Box<RawValue>,
    /// Producer-supplied headers; values that are not strings as their JSON text.
    pub headers: BTreeMap<String, String>,
    pub created_at: DateTime<Utc>,
    /// 1 on the first delivery attempt.
    pub attempt: i32,
    pub sequence: Option<i64>,
}

/// A claimed row as the claim statements return it.
#[derive(sqlx::FromRow)]
pub(crate) struct ClaimedRow {
    pub id: i64,
    pub event_id: Uuid,
    pub event_type: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub schema_version: i32,
    pub payload: String,
    pub headers: String,
    pub created_at: DateTime<Utc>,
    pub attempts: i32,
    pub sequence: Option<i64>,
}

impl ClaimedRow {
    pub(crate) fn decode(self) -> Result<(i64, ClaimedEvent), sqlx::Error> {
        let event = ClaimedEvent {
            event_id: self.event_id,
            event_type: self.event_type,
            aggregate_type: self.aggregate_type,
            aggregate_id: self.aggregate_id,
            schema_version: self.schema_version,
            payload: RawValue::from_string(self.payload).map_err(|e| decode_error("payload", e))?,
            headers: header_map(&self.headers).map_err(|e| decode_error("headers", e))?,
            created_at: self.created_at,
            attempt: self.attempts,
            sequence: self.sequence,
        };
        Ok((self.id, event))
    }
}

/// How one event that was not delivered is to be settled.
#[derive(Clone, Debug)]
pub struct Failure {
    pub id: i64,
    pub reject: bool,
    /// False for an event the sink deferred without trying: the claim's
    /// attempt is given back and it cannot become a dead letter.
    pub counted: bool,
    /// Attempts after which a retry becomes a dead letter instead.
    pub budget: i32,
    pub delay: Duration,
    /// Already sanitized.
    pub error: String,
}

/// What a settle statement changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Settled {
    /// Rows updated: the lease still held them.
    pub updated: usize,
    /// Of those, how many became dead letters.
    pub dead_lettered: usize,
}

/// Rows reclaimed from expired leases.
#[derive(Debug, Default)]
pub struct Rescued {
    pub requeued: Vec<Uuid>,
    pub dead_lettered: Vec<Uuid>,
}

/// Counts by status.
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct StatusCounts {
    /// Pending and due (or waiting for a retry); not the scheduled ones.
    pub pending: i64,
    /// Pending and scheduled for later: not due before their `deliver_at`.
    pub scheduled: i64,
    pub processing: i64,
    pub sent: i64,
    pub failed: i64,
    /// The oldest pending event's age (scheduled events left out).
    pub oldest_pending_age_seconds: Option<f64>,
    /// Until the first scheduled event is due.
    pub next_scheduled_in_seconds: Option<f64>,
}

/// The backlog as the metrics task sees it (cheap to read).
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct Gauges {
    pub pending: i64,
    pub processing: i64,
    pub dead_letters: i64,
    /// The pending event inserted first, if any.
    pub oldest_pending_event_id: Option<Uuid>,
    pub oldest_pending_age_seconds: Option<f64>,
}

/// How many pending events have been attempted `attempts` times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct AttemptsCount {
    pub attempts: i32,
    pub count: i64,
}

/// When the next work is due.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NextDue {
    /// Time until the earliest pending event is due (zero if due now); `None` if nothing is pending.
    pub pending_in: Option<Duration>,
    /// Some event is claimed by a relay (this one or another).
    pub in_flight: bool,
}

/// Pending events scheduled beyond a horizon (see [`Store::scheduled_later`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct ScheduledLater {
    pub events: i64,
    pub first_due: Option<DateTime<Utc>>,
}

impl Store {
    pub fn new(pool: PgPool, schema: Schema) -> Self {
        let commit = RelayCommit::default();
        let sql = std::sync::Arc::new(Queries::new(&schema, commit));
        Self {
            pool,
            schema,
            sql,
            commit,
        }
    }

    /// The same store, committing the relay's writes as `commit` says.
    pub fn with_relay_commit(self, commit: RelayCommit) -> Self {
        let sql = std::sync::Arc::new(Queries::new(&self.schema, commit));
        Self {
            sql,
            commit,
            ..self
        }
    }

    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The dead-letter operations for this store's schema.
    pub fn dead_letters(&self) -> DeadLetters {
        DeadLetters::new(self.pool.clone(), &self.schema)
    }

    /// Event look-ups for this store's schema.
    pub fn events(&self) -> Events {
        Events::new(self.pool.clone(), &self.schema)
    }

    /// The log and its cursors (log mode) for this store's schema.
    pub fn log(&self) -> Log {
        Log::committing(self.pool.clone(), &self.schema, self.commit)
    }

    /// Logical mode's slot operations for this store's schema.
    pub fn logical(&self) -> crate::Logical {
        crate::Logical::new(self.pool.clone(), &self.schema)
    }

    /// Deliveries counted by minute for this store's schema.
    pub fn tally(&self) -> crate::Tally {
        crate::Tally::new(self.pool.clone(), &self.schema)
    }

    /// The console's operations for this store's schema.
    pub fn console(&self) -> ConsoleStore {
        ConsoleStore::new(self.pool.clone(), &self.schema)
    }

    /// Claim up to `limit` due events under a fresh lease of `lease` length;
    /// with `order`, the event types it names are claimed one per aggregate, in
    /// sequence (see `claim_ordered.sql`).
    pub async fn claim(
        &self,
        limit: i64,
        lease: Duration,
        order: Option<&ClaimOrder>,
    ) -> Result<Claim, sqlx::Error> {
        let token = Uuid::new_v4();
        let query = match order {
            None => sqlx::query_as(trusted(&self.sql.claim)),
            Some(_) => sqlx::query_as(trusted(&self.sql.claim_ordered)),
        };
        let query = query.bind(token).bind(lease.as_secs_f64()).bind(limit);
        let query = match order {
            None => query,
            Some(order) => query.bind(&order.ordered).bind(&order.blocking),
        };
        let rows: Vec<ClaimedRow> = query.fetch_all(&self.pool).await?;
        let mut decoded = rows
            .into_iter()
            .map(ClaimedRow::decode)
            .collect::<Result<Vec<_>, _>>()?;
        decoded.sort_by_key(|(id, _)| *id);
        let (ids, events) = decoded.into_iter().unzip();
        Ok(Claim { token, ids, events })
    }

    /// Mark `ids` sent where lease `token` still holds them; returns the ids updated.
    pub async fn ack_delivered(&self, token: Uuid, ids: &[i64]) -> Result<Vec<i64>, sqlx::Error> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        sqlx::query_scalar(trusted(&self.sql.ack_delivered))
            .bind(ids)
            .bind(token)
            .fetch_all(&self.pool)
            .await
    }

    /// Schedule retries and dead-letter rejections where lease `token` still holds them.
    pub async fn settle_failed(
        &self,
        token: Uuid,
        failures: &[Failure],
    ) -> Result<Settled, sqlx::Error> {
        if failures.is_empty() {
            return Ok(Settled::default());
        }
        let ids: Vec<i64> = failures.iter().map(|f| f.id).collect();
        let budgets: Vec<i32> = failures.iter().map(|f| f.budget).collect();
        let counted: Vec<bool> = failures.iter().map(|f| f.counted).collect();
        let rejects: Vec<bool> = failures.iter().map(|f| f.reject).collect();
        let delays: Vec<f64> = failures.iter().map(|f| f.delay.as_secs_f64()).collect();
        let errors: Vec<&str> = failures.iter().map(|f| f.error.as_str()).collect();
        let rows: Vec<SettledRow> = sqlx::query_as(trusted(&self.sql.settle_failed))
            .bind(&ids)
            .bind(token)
            .bind(&budgets)
            .bind(&rejects)
            .bind(&delays)
            .bind(&errors)
            .bind(&counted)
            .fetch_all(&self.pool)
            .await?;
        Ok(Settled {
            updated: rows.len(),
            dead_lettered: rows.iter().filter(|r| r.dead_lettered).count(),
        })
    }

    /// Return unpublished events to `pending` without counting the attempt.
    pub async fn release(&self, token: Uuid, ids: &[i64]) -> Result<u64, sqlx::Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(trusted(&self.sql.release))
            .bind(ids)
            .bind(token)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    /// Reclaim up to `limit` events whose lease expired.
    pub async fn rescue_expired(
        &self,
        max_attempts: i32,
        limit: i64,
    ) -> Result<Rescued, sqlx::Error> {
        let rows: Vec<RescuedRow> = sqlx::query_as(trusted(&self.sql.rescue_expired))
            .bind(max_attempts)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        let mut rescued = Rescued::default();
        for row in rows {
            if row.dead_lettered {
                rescued.dead_lettered.push(row.event_id);
            } else {
                rescued.requeued.push(row.event_id);
            }
        }
        Ok(rescued)
    }

    /// When the next pending event is due, and whether anything is in flight.
    pub async fn next_due(&self) -> Result<NextDue, sqlx::Error> {
        let row: NextDueRow = sqlx::query_as(trusted(&self.sql.next_due))
            .fetch_one(&self.pool)
            .await?;
        Ok(NextDue {
            pending_in: row
                .pending_in_secs
                .map(|s| Duration::from_secs_f64(s.max(0.0))),
            in_flight: row.in_flight,
        })
    }

    /// Pending events due more than `horizon` from now: how many, and when
    /// the first of them is due.
    pub async fn scheduled_later(&self, horizon: Duration) -> Result<ScheduledLater, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.scheduled_later))
            .bind(horizon.as_secs_f64())
            .fetch_one(&self.pool)
            .await
    }

    /// Counts by status and the oldest pending age.
    pub async fn status_counts(&self) -> Result<StatusCounts, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.status_counts))
            .fetch_one(&self.pool)
            .await
    }
}

impl Store {
    /// The backlog gauges: counts of pending, processing and failed events
    /// (each from its partial index) and the oldest pending event.
    pub async fn gauges(&self) -> Result<Gauges, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.gauges))
            .fetch_one(&self.pool)
            .await
    }

    /// Pending events grouped by how often they were attempted.
    pub async fn pending_attempts(&self) -> Result<Vec<AttemptsCount>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.pending_attempts))
            .fetch_all(&self.pool)
            .await
    }

    /// Succeeds when the database answers and the outbox table is readable.
    pub async fn ping(&self) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.sql.ping))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Remove up to `limit` sent events acknowledged before `older_than` ago,
    /// deleting them or moving them to `outbox_archive`. Returns how many.
    pub async fn purge_sent(
        &self,
        older_than: Duration,
        limit: i64,
        archive: bool,
    ) -> Result<u64, sqlx::Error> {
        let sql = if archive {
            &self.sql.archive_sent
        } else {
            &self.sql.purge_sent
        };
        let done: i64 = sqlx::query_scalar(trusted(sql))
            .bind(older_than.as_secs_f64())
            .bind(limit)
            .fetch_one(&self.pool)
            .await?;
        Ok(done.max(0) as u64)
    }

    /// Delete up to `limit` inbox records processed before `older_than` ago.
    pub async fn purge_inbox(&self, older_than: Duration, limit: i64) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(trusted(&self.sql.purge_inbox))
            .bind(older_than.as_secs_f64())
            .bind(limit)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    /// Create the least-privilege roles (idempotent). Needs a user allowed to
    /// create roles and to grant on postbox's schema.
    pub async fn create_roles(&self) -> Result<Roles, CreateRolesError> {
        let roles = Roles::for_schema(&self.schema)?;
        sqlx::raw_sql(trusted(&roles.sql(&self.schema)))
            .execute(&self.pool)
            .await?;
        Ok(roles)
    }
}

/// Which event types the ordered claim keeps in per-aggregate order, as SQL
/// LIKE patterns (the relay's router turns its globs into them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimOrder {
    /// Ordered event types: one event per aggregate in flight, in sequence.
    pub ordered: Vec<String>,
    /// Of those, the types whose dead letters hold back their aggregate
    /// (poison policy `block`) until an operator replays or discards them.
    pub blocking: Vec<String>,
}

/// One destination's state for one fan-out event.
#[derive(Clone, Debug, PartialEq)]
pub struct DeliveryState {
    pub outbox_id: i64,
    pub destination: String,
    /// `Pending`, `Sent` or `Failed`.
    pub status: Status,
    pub attempts: i32,
    /// Until the destination is due again (zero when due).
    pub due_in: Duration,
}

/// What one round of publishing did at one destination of a fan-out event.
#[derive(Clone, Debug)]
pub struct DeliveryUpdate {
    pub outbox_id: i64,
    pub destination: String,
    pub delivered: bool,
    /// Rejected, or out of attempts: a dead letter at this destination.
    pub dead: bool,
    pub attempts: i32,
    /// Until the next attempt (when neither delivered nor dead).
    pub delay: Duration,
    /// Already sanitized; `None` when delivered.
    pub error: Option<String>,
}

/// Fan-out state of one destination, for `postbox status`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct DestinationCounts {
    pub destination: String,
    /// Fan-out events waiting for a retry at this destination.
    pub retrying: i64,
    /// Dead letters at this destination that no operator resolved yet.
    pub dead_letters: i64,
    /// Delivered here after at least one failed round somewhere.
    pub delivered_after_retry: i64,
    /// The most attempts an open (not delivered) one has taken.
    pub max_attempts: i32,
}

impl Store {
    /// Per-destination rows of the fan-out events among `ids`.
    pub async fn delivery_states(&self, ids: &[i64]) -> Result<Vec<DeliveryState>, sqlx::Error> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<DeliveryStateRow> = sqlx::query_as(trusted(&self.sql.delivery_states))
            .bind(ids)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows
            .into_iter()
            .map(|r| DeliveryState {
                outbox_id: r.outbox_id,
                destination: r.destination,
                status: r.status,
                attempts: r.attempts,
                due_in: Duration::from_secs_f64(r.due_in_secs.clamp(0.0, 1e9)),
            })
            .collect())
    }

    /// Upsert per-destination results; a delivered destination is never reverted.
    pub async fn record_deliveries(&self, updates: &[DeliveryUpdate]) -> Result<u64, sqlx::Error> {
        if updates.is_empty() {
            return Ok(0);
        }
        let ids: Vec<i64> = updates.iter().map(|u| u.outbox_id).collect();
        let names: Vec<&str> = updates.iter().map(|u| u.destination.as_str()).collect();
        let delivered: Vec<bool> = updates.iter().map(|u| u.delivered).collect();
        let dead: Vec<bool> = updates.iter().map(|u| u.dead).collect();
        let attempts: Vec<i32> = updates.iter().map(|u| u.attempts).collect();
        let delays: Vec<f64> = updates.iter().map(|u| u.delay.as_secs_f64()).collect();
        let errors: Vec<Option<&str>> = updates.iter().map(|u| u.error.as_deref()).collect();
        let done = sqlx::query(trusted(&self.sql.record_deliveries))
            .bind(&ids)
            .bind(&names)
            .bind(&delivered)
            .bind(&dead)
            .bind(&attempts)
            .bind(&delays)
            .bind(&errors)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    /// Retries and dead letters per destination (fan-out events only).
    pub async fn destination_counts(&self) -> Result<Vec<DestinationCounts>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.destination_counts))
            .fetch_all(&self.pool)
            .await
    }
}

/// The database's health as it matters to an outbox (see `db_health.sql`).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct DbHealth {
    /// The session whose transaction is the oldest holding back xmin, if visible.
    pub oldest_xact_pid: Option<i32>,
    pub oldest_xact_application: Option<String>,
    pub oldest_xact_state: Option<String>,
    pub oldest_xact_age_seconds: Option<f64>,
    /// The replication slot holding xmin back the most, and by how many transactions.
    pub slot_name: Option<String>,
    pub slot_active: Option<bool>,
    pub slot_xmin_age: Option<i64>,
    pub live_tuples: Option<i64>,
    pub dead_tuples: Option<i64>,
    /// The server's `autovacuum` setting.
    pub autovacuum: bool,
}

impl DbHealth {
    /// Dead / (live + dead) tuples of the outbox table; `None` before statistics exist.
    pub fn dead_tuple_ratio(&self) -> Option<f64> {
        let (live, dead) = (self.live_tuples?, self.dead_tuples?);
        let total = live + dead;
        (total > 0).then(|| dead as f64 / total as f64)
    }
}

impl Store {
    /// Read [`DbHealth`].
    pub async fn db_health(&self) -> Result<DbHealth, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.db_health))
            .bind(self.schema.name())
            .fetch_one(&self.pool)
            .await
    }

    /// `VACUUM (ANALYZE)` the outbox table (needs its owner).
    pub async fn vacuum_outbox(&self) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(trusted(&self.sql.vacuum_outbox))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Send a notification with `payload` on the relays' channel.
    pub async fn notify_probe(&self, payload: &str) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.sql.notify_probe))
            .bind(self.schema.notify_channel())
            .bind(payload)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

#[derive(sqlx::FromRow)]
struct SettledRow {
    dead_lettered: bool,
}

#[derive(sqlx::FromRow)]
struct RescuedRow {
    event_id: Uuid,
    dead_lettered: bool,
}

#[derive(sqlx::FromRow)]
struct NextDueRow {
    pending_in_secs: Option<f64>,
    in_flight: bool,
}

#[derive(sqlx::FromRow)]
struct DeliveryStateRow {
    outbox_id: i64,
    destination: String,
    status: Status,
    attempts: i32,
    due_in_secs: f64,
}

pub(crate) fn decode_error(column: &str, e: serde_json::Error) -> sqlx::Error {
    sqlx::Error::ColumnDecode {
        index: column.to_owned(),
        source: Box::new(e),
    }
}

/// Headers are a JSON object; values that are not strings travel as their JSON text.
///
/// Values are read raw first: serde_json reads a raw value of any depth, while
/// a `Value` stops at 128 levels, and a row that fails to decode fails the
/// claim of its whole batch. A value too deep for `Value` travels verbatim.
pub(crate) fn header_map(json: &str) -> Result<BTreeMap<String, String>, serde_json::Error> {
    let map: BTreeMap<String, Box<RawValue>> = serde_json::from_str(json)?;
    map.into_iter()
        .map(|(k, raw)| {
            let text = raw.get();
            let value = if text.starts_with('"') {
                serde_json::from_str::<String>(text)?
            } else {
                serde_json::from_str::<serde_json::Value>(text)
                    .map_or_else(|_| text.to_owned(), |v| v.to_string())
            };
            Ok((k, value))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_statement_renders_for_both_commit_modes() {
        let schema = Schema::new("shop").unwrap();
        let sync = Queries::new(&schema, RelayCommit::Synchronous);
        assert!(!sync.claim.contains("{relay_commit}"));
        assert!(!sync.claim.contains("set_config"));
        assert!(sync.claim.contains("\"shop\".outbox"));
        let not_flushed = Queries::new(&schema, RelayCommit::Asynchronous);
        for sql in [
            &not_flushed.claim,
            &not_flushed.ack_delivered,
            &not_flushed.settle_failed,
            &not_flushed.release,
            &not_flushed.rescue_expired,
            &not_flushed.record_deliveries,
        ] {
            assert!(
                sql.contains("set_config('synchronous_commit', 'off', true)"),
                "{sql}"
            );
        }
        let roles = Roles::for_schema(&schema).unwrap().sql(&schema);
        assert!(roles.contains("CREATE ROLE shop_relay NOLOGIN"), "{roles}");
    }
}

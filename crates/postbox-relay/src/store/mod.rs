//! Every SQL statement the relay runs, and the named operations built on them.
//!
//! The statements are the `.sql` files beside this module, rendered once for
//! the configured schema. Relay logic calls these operations; it never builds
//! SQL of its own.

pub mod console;
pub mod dlq;

use crate::sink::Message;
use postbox::Schema;
use serde_json::value::RawValue;
use sqlx::{PgPool, Row};
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
/// deliveries).
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
    fn condition(self) -> &'static str {
        match self {
            // An uncorrelated subquery: evaluated once per statement, before
            // the implicit transaction commits; `true` is local to it.
            Self::Asynchronous => {
                "(SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL"
            }
            Self::Synchronous => "true",
        }
    }
}

impl Queries {
    fn new(schema: &Schema, commit: RelayCommit) -> Self {
        let relay = |template: &str| {
            schema
                .render(template)
                .replace("{relay_commit}", commit.condition())
        };
        Self {
            claim: relay(include_str!("sql/claim.sql")),
            claim_ordered: relay(include_str!("sql/claim_ordered.sql")),
            delivery_states: schema.render(include_str!("sql/delivery_states.sql")),
            record_deliveries: relay(include_str!("sql/record_deliveries.sql")),
            destination_counts: schema.render(include_str!("sql/destination_counts.sql")),
            db_health: include_str!("sql/db_health.sql").to_owned(),
            notify_probe: include_str!("sql/notify_probe.sql").to_owned(),
            vacuum_outbox: schema.render(include_str!("sql/vacuum_outbox.sql")),
            ack_delivered: relay(include_str!("sql/ack_delivered.sql")),
            settle_failed: relay(include_str!("sql/settle_failed.sql")),
            release: relay(include_str!("sql/release.sql")),
            rescue_expired: relay(include_str!("sql/rescue_expired.sql")),
            next_due: schema.render(include_str!("sql/next_due.sql")),
            status_counts: schema.render(include_str!("sql/status_counts.sql")),
            gauges: schema.render(include_str!("sql/gauges.sql")),
            pending_attempts: schema.render(include_str!("sql/pending_attempts.sql")),
            ping: schema.render(include_str!("sql/ping.sql")),
            purge_sent: schema.render(include_str!("sql/purge_sent.sql")),
            archive_sent: schema.render(include_str!("sql/archive_sent.sql")),
            purge_inbox: schema.render(include_str!("sql/purge_inbox.sql")),
        }
    }
}

/// The relay's view of the outbox tables.
#[derive(Clone)]
pub struct Store {
    pool: PgPool,
    schema: Schema,
    sql: std::sync::Arc<Queries>,
}

/// Events claimed under one lease.
#[derive(Debug)]
pub struct Claim {
    pub token: Uuid,
    /// Outbox row ids, parallel to `messages`.
    pub ids: Vec<i64>,
    pub messages: Vec<Message>,
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
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize)]
pub struct StatusCounts {
    pub pending: i64,
    pub processing: i64,
    pub sent: i64,
    pub failed: i64,
    pub oldest_pending_age_seconds: Option<f64>,
}

/// The backlog as the metrics task sees it (cheap to read).
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize)]
pub struct Gauges {
    pub pending: i64,
    pub processing: i64,
    pub dead_letters: i64,
    /// The pending event inserted first, if any.
    pub oldest_pending_event_id: Option<Uuid>,
    pub oldest_pending_age_seconds: Option<f64>,
}

/// How many pending events have been attempted `attempts` times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct AttemptsCount {
    pub attempts: i32,
    pub count: i64,
}

/// The roles `create_roles` makes for one schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roles {
    /// Can only enqueue.
    pub producer: String,
    /// What the relay needs on postbox's tables.
    pub relay: String,
    /// Read-only.
    pub monitor: String,
}

/// The schema name is too long to derive role names from it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("schema name {schema:?} is too long for role names: `{schema}_producer` must fit in 63 bytes (use a schema name of at most 54 bytes)")]
pub struct RoleNameError {
    pub schema: String,
}

impl Roles {
    /// `<schema>_producer`, `<schema>_relay`, `<schema>_monitor`.
    pub fn for_schema(schema: &Schema) -> Result<Self, RoleNameError> {
        let name = schema.name();
        if name.len() + "_producer".len() > 63 {
            return Err(RoleNameError {
                schema: name.to_owned(),
            });
        }
        Ok(Self {
            producer: format!("{name}_producer"),
            relay: format!("{name}_relay"),
            monitor: format!("{name}_monitor"),
        })
    }

    /// The idempotent script creating the roles and their grants, for
    /// `postbox migrate --create-roles` (and `--print-sql`). Schema names are
    /// restricted to `[a-z0-9_]`, so the role names need no quoting.
    pub fn sql(&self, schema: &Schema) -> String {
        schema
            .render(include_str!("sql/create_roles.sql"))
            .replace("{producer}", &self.producer)
            .replace("{relay}", &self.relay)
            .replace("{monitor}", &self.monitor)
    }
}

/// When the next work is due.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NextDue {
    /// Time until the earliest pending event is due (zero if due now); `None` if nothing is pending.
    pub pending_in: Option<Duration>,
    /// Some event is claimed by a relay (this one or another).
    pub in_flight: bool,
}

impl Store {
    pub fn new(pool: PgPool, schema: Schema) -> Self {
        let sql = std::sync::Arc::new(Queries::new(&schema, RelayCommit::default()));
        Self { pool, schema, sql }
    }

    /// The same store, committing the relay's writes as `commit` says.
    pub fn with_relay_commit(self, commit: RelayCommit) -> Self {
        let sql = std::sync::Arc::new(Queries::new(&self.schema, commit));
        Self { sql, ..self }
    }

    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
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
            None => sqlx::query(&self.sql.claim),
            Some(_) => sqlx::query(&self.sql.claim_ordered),
        };
        let query = query.bind(token).bind(lease.as_secs_f64()).bind(limit);
        let query = match order {
            None => query,
            Some(order) => query.bind(&order.ordered).bind(&order.blocking),
        };
        let mut rows = query.fetch_all(&self.pool).await?;
        rows.sort_by_key(|r| r.try_get::<i64, _>(0).unwrap_or_default());
        let mut ids = Vec::with_capacity(rows.len());
        let mut messages = Vec::with_capacity(rows.len());
        for row in rows {
            ids.push(row.try_get(0)?);
            let payload: String = row.try_get(6)?;
            let headers: String = row.try_get(7)?;
            messages.push(Message {
                event_id: row.try_get(1)?,
                event_type: row.try_get(2)?,
                aggregate_type: row.try_get(3)?,
                aggregate_id: row.try_get(4)?,
                schema_version: row.try_get(5)?,
                payload: RawValue::from_string(payload).map_err(|e| decode_error("payload", e))?,
                headers: header_map(&headers).map_err(|e| decode_error("headers", e))?,
                created_at: row.try_get(8)?,
                attempt: row.try_get(9)?,
                sequence: row.try_get(10)?,
            });
        }
        Ok(Claim {
            token,
            ids,
            messages,
        })
    }

    /// Mark `ids` sent where lease `token` still holds them; returns the ids updated.
    pub async fn ack_delivered(&self, token: Uuid, ids: &[i64]) -> Result<Vec<i64>, sqlx::Error> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        sqlx::query_scalar(&self.sql.ack_delivered)
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
        let rows = sqlx::query(&self.sql.settle_failed)
            .bind(&ids)
            .bind(token)
            .bind(&budgets)
            .bind(&rejects)
            .bind(&delays)
            .bind(&errors)
            .bind(&counted)
            .fetch_all(&self.pool)
            .await?;
        let mut settled = Settled {
            updated: rows.len(),
            dead_lettered: 0,
        };
        for row in rows {
            if row.try_get::<bool, _>(1)? {
                settled.dead_lettered += 1;
            }
        }
        Ok(settled)
    }

    /// Return unpublished events to `pending` without counting the attempt.
    pub async fn release(&self, token: Uuid, ids: &[i64]) -> Result<u64, sqlx::Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(&self.sql.release)
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
        let rows = sqlx::query(&self.sql.rescue_expired)
            .bind(max_attempts)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        let mut rescued = Rescued::default();
        for row in rows {
            let id: Uuid = row.try_get(0)?;
            if row.try_get::<bool, _>(1)? {
                rescued.dead_lettered.push(id);
            } else {
                rescued.requeued.push(id);
            }
        }
        Ok(rescued)
    }

    /// When the next pending event is due, and whether anything is in flight.
    pub async fn next_due(&self) -> Result<NextDue, sqlx::Error> {
        let row = sqlx::query(&self.sql.next_due)
            .fetch_one(&self.pool)
            .await?;
        let secs: Option<f64> = row.try_get(0)?;
        Ok(NextDue {
            pending_in: secs.map(|s| Duration::from_secs_f64(s.max(0.0))),
            in_flight: row.try_get(1)?,
        })
    }

    /// Counts by status and the oldest pending age.
    pub async fn status_counts(&self) -> Result<StatusCounts, sqlx::Error> {
        let row = sqlx::query(&self.sql.status_counts)
            .fetch_one(&self.pool)
            .await?;
        Ok(StatusCounts {
            pending: row.try_get(0)?,
            processing: row.try_get(1)?,
            sent: row.try_get(2)?,
            failed: row.try_get(3)?,
            oldest_pending_age_seconds: row.try_get(4)?,
        })
    }
}

impl Store {
    /// The backlog gauges: counts of pending, processing and failed events
    /// (each from its partial index) and the oldest pending event.
    pub async fn gauges(&self) -> Result<Gauges, sqlx::Error> {
        let row = sqlx::query(&self.sql.gauges).fetch_one(&self.pool).await?;
        Ok(Gauges {
            pending: row.try_get(0)?,
            processing: row.try_get(1)?,
            dead_letters: row.try_get(2)?,
            oldest_pending_event_id: row.try_get(3)?,
            oldest_pending_age_seconds: row.try_get(4)?,
        })
    }

    /// Pending events grouped by how often they were attempted.
    pub async fn pending_attempts(&self) -> Result<Vec<AttemptsCount>, sqlx::Error> {
        let rows = sqlx::query(&self.sql.pending_attempts)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(AttemptsCount {
                    attempts: r.try_get(0)?,
                    count: r.try_get(1)?,
                })
            })
            .collect()
    }

    /// Succeeds when the database answers and the outbox table is readable.
    pub async fn ping(&self) -> Result<(), sqlx::Error> {
        sqlx::query(&self.sql.ping).execute(&self.pool).await?;
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
        let done: i64 = sqlx::query_scalar(sql)
            .bind(older_than.as_secs_f64())
            .bind(limit)
            .fetch_one(&self.pool)
            .await?;
        Ok(done.max(0) as u64)
    }

    /// Delete up to `limit` inbox records processed before `older_than` ago.
    pub async fn purge_inbox(&self, older_than: Duration, limit: i64) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(&self.sql.purge_inbox)
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
        sqlx::raw_sql(&roles.sql(&self.schema))
            .execute(&self.pool)
            .await?;
        Ok(roles)
    }
}

/// Which event types the ordered claim keeps in per-aggregate order, as SQL
/// LIKE patterns (see [`crate::router::Pattern::like`]).
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
    /// `pending`, `sent` or `failed`.
    pub status: String,
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
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
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
        let rows = sqlx::query(&self.sql.delivery_states)
            .bind(ids)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(DeliveryState {
                    outbox_id: r.try_get(0)?,
                    destination: r.try_get(1)?,
                    status: r.try_get(2)?,
                    attempts: r.try_get(3)?,
                    due_in: Duration::from_secs_f64(r.try_get::<f64, _>(4)?.clamp(0.0, 1e9)),
                })
            })
            .collect()
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
        let done = sqlx::query(&self.sql.record_deliveries)
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
        let rows = sqlx::query(&self.sql.destination_counts)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(DestinationCounts {
                    destination: r.try_get(0)?,
                    retrying: r.try_get(1)?,
                    dead_letters: r.try_get(2)?,
                    delivered_after_retry: r.try_get(3)?,
                    max_attempts: r.try_get(4)?,
                })
            })
            .collect()
    }
}

/// The database's health as it matters to an outbox (see `db_health.sql`).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
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
        let r = sqlx::query(&self.sql.db_health)
            .bind(self.schema.name())
            .fetch_one(&self.pool)
            .await?;
        Ok(DbHealth {
            oldest_xact_pid: r.try_get(0)?,
            oldest_xact_application: r.try_get(1)?,
            oldest_xact_state: r.try_get(2)?,
            oldest_xact_age_seconds: r.try_get(3)?,
            slot_name: r.try_get(4)?,
            slot_active: r.try_get(5)?,
            slot_xmin_age: r.try_get(6)?,
            live_tuples: r.try_get(7)?,
            dead_tuples: r.try_get(8)?,
            autovacuum: r.try_get(9)?,
        })
    }

    /// `VACUUM (ANALYZE)` the outbox table (needs its owner).
    pub async fn vacuum_outbox(&self) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(&self.sql.vacuum_outbox)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Send a notification with `payload` on the relays' channel.
    pub async fn notify_probe(&self, payload: &str) -> Result<(), sqlx::Error> {
        sqlx::query(&self.sql.notify_probe)
            .bind(self.schema.notify_channel())
            .bind(payload)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

/// `create_roles` failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CreateRolesError {
    #[error(transparent)]
    Name(#[from] RoleNameError),
    #[error(
        "cannot create the roles (the user needs CREATEROLE and the right to grant on the schema)"
    )]
    Database(#[from] sqlx::Error),
}

fn decode_error(column: &str, e: serde_json::Error) -> sqlx::Error {
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
fn header_map(json: &str) -> Result<BTreeMap<String, String>, serde_json::Error> {
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

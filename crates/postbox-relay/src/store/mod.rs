//! Every SQL statement the relay runs, and the named operations built on them.
//!
//! The statements are the `.sql` files beside this module, rendered once for
//! the configured schema. Relay logic calls these operations; it never builds
//! SQL of its own.

pub mod bench;
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

impl Queries {
    fn new(schema: &Schema) -> Self {
        Self {
            claim: schema.render(include_str!("sql/claim.sql")),
            ack_delivered: schema.render(include_str!("sql/ack_delivered.sql")),
            settle_failed: schema.render(include_str!("sql/settle_failed.sql")),
            release: schema.render(include_str!("sql/release.sql")),
            rescue_expired: schema.render(include_str!("sql/rescue_expired.sql")),
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
        let sql = std::sync::Arc::new(Queries::new(&schema));
        Self { pool, schema, sql }
    }

    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Claim up to `limit` due events under a fresh lease of `lease` length.
    pub async fn claim(&self, limit: i64, lease: Duration) -> Result<Claim, sqlx::Error> {
        let token = Uuid::new_v4();
        let mut rows = sqlx::query(&self.sql.claim)
            .bind(token)
            .bind(lease.as_secs_f64())
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
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
        max_attempts: i32,
        failures: &[Failure],
    ) -> Result<Settled, sqlx::Error> {
        if failures.is_empty() {
            return Ok(Settled::default());
        }
        let ids: Vec<i64> = failures.iter().map(|f| f.id).collect();
        let rejects: Vec<bool> = failures.iter().map(|f| f.reject).collect();
        let delays: Vec<f64> = failures.iter().map(|f| f.delay.as_secs_f64()).collect();
        let errors: Vec<&str> = failures.iter().map(|f| f.error.as_str()).collect();
        let rows = sqlx::query(&self.sql.settle_failed)
            .bind(&ids)
            .bind(token)
            .bind(max_attempts)
            .bind(&rejects)
            .bind(&delays)
            .bind(&errors)
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
        let done = sqlx::query(sql)
            .bind(older_than.as_secs_f64())
            .bind(limit)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
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
fn header_map(json: &str) -> Result<BTreeMap<String, String>, serde_json::Error> {
    let map: BTreeMap<String, serde_json::Value> = serde_json::from_str(json)?;
    Ok(map
        .into_iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => (k, s),
            other => (k, other.to_string()),
        })
        .collect())
}

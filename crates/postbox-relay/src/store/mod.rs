//! Every SQL statement the relay runs, and the named operations built on them.
//!
//! The statements are the `.sql` files beside this module, rendered once for
//! the configured schema. Relay logic calls these operations; it never builds
//! SQL of its own.

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

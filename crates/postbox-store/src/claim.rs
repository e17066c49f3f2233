//! The hot path: claim under a lease, acknowledge, settle failures, release,
//! rescue expired leases, what is due next, and per-destination state of
//! fan-out events.

use crate::events::Status;
use crate::rows::{ClaimedEvent, ClaimedRow};
use crate::store::Store;
use chrono::{DateTime, Utc};
use postbox::statements::trusted;
use std::time::Duration;
use uuid::Uuid;

/// Events claimed under one lease.
#[derive(Debug)]
pub struct Claim {
    pub token: Uuid,
    /// Outbox row ids, parallel to `events`.
    pub ids: Vec<i64>,
    pub events: Vec<ClaimedEvent>,
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

impl Store {
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
}

//! Counts and health reads: status by state, the backlog gauges, attempts,
//! per-destination counts, the database's health, the open replay jobs, the
//! LISTEN probe.

use crate::replay::ReplayJob;
use crate::store::Store;
use postbox::statements::trusted;
use uuid::Uuid;

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
    /// Counts by status and the oldest pending age.
    pub async fn status_counts(&self) -> Result<StatusCounts, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.status_counts))
            .fetch_one(&self.pool)
            .await
    }

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

    /// Retries and dead letters per destination (fan-out events only).
    pub async fn destination_counts(&self) -> Result<Vec<DestinationCounts>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.destination_counts))
            .fetch_all(&self.pool)
            .await
    }

    /// Read [`DbHealth`].
    pub async fn db_health(&self) -> Result<DbHealth, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.db_health))
            .bind(self.schema.name())
            .fetch_one(&self.pool)
            .await
    }

    /// The replay jobs not yet done or cancelled (running, paused or
    /// failed), oldest first: each holds retention back until it ends.
    pub async fn open_replays(&self) -> Result<Vec<ReplayJob>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.open_replays))
            .fetch_all(&self.pool)
            .await
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

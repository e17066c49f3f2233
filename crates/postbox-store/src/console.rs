//! What the operator console (`postbox console`) reads and writes beyond the
//! dead-letter operations of [`crate::DeadLetters`] and the event look-ups of
//! [`crate::Events`]: its users and sessions (migration 6), the delivery
//! rate, the relays connected now, and audit log pages.
//!
//! Password hashing, tokens and access rules live in the console crate; this
//! module only stores what it is given.

use crate::catalog;
use crate::dead_letters::{AuditEntry, AuditQueries};
use crate::events::{DeliveryRecord, EventQuery, EventRecord, EventRow, Events};
use chrono::{DateTime, Utc};
use postbox::statements::trusted;
use postbox::Schema;
use serde_json::Value;
use sqlx::PgPool;
use std::sync::Arc;
use uuid::Uuid;

/// The `application_name` a relay's connections carry.
pub const RELAY_APPLICATION_NAME: &str = "postbox-relay";

struct Queries {
    user_upsert: String,
    user_get: String,
    user_delete: String,
    sessions_end_user: String,
    session_insert: String,
    session_get: String,
    session_delete: String,
    delivery_rate: String,
    relays: String,
    backlog: String,
    error_groups: String,
    error_group_ids: String,
    audit: AuditQueries,
}

impl Queries {
    fn new(schema: &Schema) -> Self {
        let mut file = catalog("console.sql", include_str!("../sql/console.sql"));
        let queries = Self {
            user_upsert: file.render("user_upsert", schema),
            user_get: file.render("user_get", schema),
            user_delete: file.render("user_delete", schema),
            sessions_end_user: file.render("sessions_end_user", schema),
            session_insert: file.render("session_insert", schema),
            session_get: file.render("session_get", schema),
            session_delete: file.render("session_delete", schema),
            delivery_rate: file.render("delivery_rate", schema),
            relays: file.render("relays", schema),
            backlog: file.render("backlog", schema),
            error_groups: file.render("error_groups", schema),
            error_group_ids: file.render("error_group_ids", schema),
            audit: AuditQueries::new(schema),
        };
        file.finish();
        queries
    }
}

/// A stored console user.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct StoredUser {
    /// `viewer` or `operator`.
    pub role: String,
    /// The argon2 PHC string.
    pub password_hash: String,
    /// The outboxes the user's role applies to, as patterns (migration 23;
    /// empty: every outbox). The console parses and checks them.
    pub outboxes: Vec<String>,
}

/// A live session.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct StoredSession {
    #[sqlx(rename = "user_name")]
    pub user: String,
    /// The user's role now (a changed role applies to open sessions).
    pub role: String,
    /// The user's outbox patterns now (empty: every outbox).
    pub outboxes: Vec<String>,
    pub csrf_token: String,
}

/// Relays connected from one client address.
#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
pub struct RelaySeen {
    /// The client's address, or `local` (a Unix socket, or hidden without pg_monitor).
    pub client: String,
    pub connections: i64,
    pub connected_since: Option<DateTime<Utc>>,
    pub last_active: Option<DateTime<Utc>>,
}

/// The backlog at one moment (see [`ConsoleStore::backlog`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, sqlx::FromRow)]
pub struct Backlog {
    /// Pending, never attempted.
    pub pending: i64,
    /// Pending after at least one failed attempt: waiting for the next one.
    pub retrying: i64,
    /// Claimed by a relay.
    pub processing: i64,
    /// Unresolved dead letters.
    pub dead_letters: i64,
    pub oldest_pending_age_seconds: Option<f64>,
}

/// Which events [`ConsoleStore::error_groups`] groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupOf {
    /// Unresolved dead letters.
    DeadLetters,
    /// Pending events that failed at least once (waiting for a retry).
    Retrying,
}

/// Events that failed the same way: the same last error, at the same
/// destinations (fan-out).
#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
pub struct ErrorGroup {
    /// Names the group for [`ConsoleStore::error_group_ids`] (a hash of the
    /// error and the destinations).
    pub key: String,
    pub last_error: Option<String>,
    /// The destinations not yet delivered to, comma-separated (fan-out only).
    pub destinations: Option<String>,
    pub events: i64,
    pub oldest: DateTime<Utc>,
    pub newest: DateTime<Utc>,
    /// The group's oldest event.
    pub example: Uuid,
    /// The event types in the group, comma-separated.
    pub event_types: Option<String>,
}

/// Events acknowledged in one minute.
#[derive(sqlx::FromRow)]
struct RatePoint {
    minute: DateTime<Utc>,
    events: i64,
}

/// Console operations on one schema. Get one with [`Store::console`].
#[derive(Clone)]
pub struct ConsoleStore {
    pool: PgPool,
    sql: Arc<Queries>,
    events: Events,
}

impl ConsoleStore {
    pub fn new(pool: PgPool, schema: &Schema) -> Self {
        Self {
            events: Events::new(pool.clone(), schema),
            pool,
            sql: Arc::new(Queries::new(schema)),
        }
    }

    /// Create a user or replace an existing one's role and hash, and its
    /// outbox patterns when `outboxes` is given (`None`: an existing user
    /// keeps its own, a new one gets none, which is every outbox); ends the
    /// user's open sessions either way. Returns whether the user is new, and
    /// the patterns stored.
    pub async fn upsert_user(
        &self,
        name: &str,
        role: &str,
        password_hash: &str,
        outboxes: Option<&[String]>,
    ) -> Result<(bool, Vec<String>), sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let stored: (bool, Vec<String>) = sqlx::query_as(trusted(&self.sql.user_upsert))
            .bind(name)
            .bind(role)
            .bind(password_hash)
            .bind(outboxes)
            .fetch_one(&mut *tx)
            .await?;
        sqlx::query(trusted(&self.sql.sessions_end_user))
            .bind(name)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(stored)
    }

    /// Remove a user and their sessions; false when there was no such user.
    pub async fn delete_user(&self, name: &str) -> Result<bool, sqlx::Error> {
        let gone: Option<String> = sqlx::query_scalar(trusted(&self.sql.user_delete))
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        Ok(gone.is_some())
    }

    pub async fn user(&self, name: &str) -> Result<Option<StoredUser>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.user_get))
            .bind(name)
            .fetch_optional(&self.pool)
            .await
    }

    /// Store a session (expired ones are swept at the same time).
    pub async fn create_session(
        &self,
        token_hash: &[u8],
        user: &str,
        csrf_token: &str,
        lifetime_seconds: f64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.sql.session_insert))
            .bind(token_hash)
            .bind(user)
            .bind(csrf_token)
            .bind(lifetime_seconds)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn session(&self, token_hash: &[u8]) -> Result<Option<StoredSession>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.session_get))
            .bind(token_hash)
            .fetch_optional(&self.pool)
            .await
    }

    pub async fn delete_session(&self, token_hash: &[u8]) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.sql.session_delete))
            .bind(token_hash)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Write one audit entry in its own transaction (sign-in attempts, sign-outs).
    pub async fn audit(
        &self,
        actor: &str,
        action: &str,
        selection: &Value,
        count: i64,
        reason: Option<&str>,
        details: &Value,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(trusted(&self.sql.audit.insert))
            .bind(actor)
            .bind(action)
            .bind(selection.to_string())
            .bind(count)
            .bind(reason)
            .bind(details.to_string())
            .fetch_one(&self.pool)
            .await
    }

    /// Events acknowledged per minute over the last `minutes` minutes, among
    /// the newest `window` outbox rows and the archive; minutes with none are absent.
    pub async fn delivery_rate(
        &self,
        minutes: i32,
        window: i64,
    ) -> Result<Vec<(DateTime<Utc>, i64)>, sqlx::Error> {
        let points: Vec<RatePoint> = sqlx::query_as(trusted(&self.sql.delivery_rate))
            .bind(minutes)
            .bind(window)
            .fetch_all(&self.pool)
            .await?;
        Ok(points.into_iter().map(|p| (p.minute, p.events)).collect())
    }

    /// The backlog now: pending, retrying, processing, dead letters, the
    /// oldest pending event's age (reads partial indexes only).
    pub async fn backlog(&self) -> Result<Backlog, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.backlog))
            .fetch_one(&self.pool)
            .await
    }

    /// Events grouped by last error and failed destinations, largest group
    /// first, at most `limit` groups.
    pub async fn error_groups(
        &self,
        of: GroupOf,
        limit: i64,
    ) -> Result<Vec<ErrorGroup>, sqlx::Error> {
        let of = match of {
            GroupOf::DeadLetters => "dead",
            GroupOf::Retrying => "retrying",
        };
        sqlx::query_as(trusted(&self.sql.error_groups))
            .bind(of)
            .bind(limit.max(0))
            .fetch_all(&self.pool)
            .await
    }

    /// The unresolved dead letters of the group `key` names, oldest first,
    /// at most `limit`, with their last error.
    pub async fn error_group_ids(
        &self,
        key: &str,
        limit: i64,
    ) -> Result<Vec<(Uuid, Option<String>)>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.error_group_ids))
            .bind(key)
            .bind(limit.max(0))
            .fetch_all(&self.pool)
            .await
    }

    /// Relays connected to this database now (sessions named `postbox-relay`).
    pub async fn relays(&self) -> Result<Vec<RelaySeen>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.relays))
            .bind(RELAY_APPLICATION_NAME)
            .fetch_all(&self.pool)
            .await
    }

    /// Search events, newest first (see [`Events::search`]).
    pub async fn events(&self, q: &EventQuery) -> Result<Vec<EventRow>, sqlx::Error> {
        self.events.search(q).await
    }

    /// One event by id, whatever its status (see [`Events::show`]).
    pub async fn event(&self, event_id: Uuid) -> Result<Option<EventRecord>, sqlx::Error> {
        self.events.show(event_id).await
    }

    /// The per-destination rows of a fan-out event (see [`Events::deliveries`]).
    pub async fn deliveries(&self, row: i64) -> Result<Vec<DeliveryRecord>, sqlx::Error> {
        self.events.deliveries(row).await
    }

    /// Audit entries, newest first: below entry id `before`, of `action` and
    /// `actor` when given. Entries of action `actor_hidden` (when given) never
    /// match the `actor` filter: for readers who may not see those actors.
    /// With `action_prefix`, only the actions starting with it.
    pub async fn audit_page(
        &self,
        before: Option<i64>,
        action: Option<&str>,
        actor: Option<&str>,
        actor_hidden: Option<&str>,
        action_prefix: Option<&str>,
        limit: i64,
    ) -> Result<Vec<AuditEntry>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.audit.page))
            .bind(before)
            .bind(action)
            .bind(actor)
            .bind(limit.max(0))
            .bind(actor_hidden)
            .bind(action_prefix)
            .fetch_all(&self.pool)
            .await
    }
}

//! What the operator console (`postbox console`) reads and writes beyond the
//! dead-letter operations of [`super::dlq`]: its users and sessions
//! (migration 6), event search, one event with its per-destination state,
//! the delivery rate, the relays connected now, and audit log pages.
//!
//! Password hashing, tokens and access rules live in the console crate; this
//! module only stores what it is given.

use super::dlq::{audit_entry, json, AuditEntry, DlqError};
use super::Store;
use chrono::{DateTime, Utc};
use postbox::Schema;
use serde_json::Value;
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row};
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
    events: String,
    event: String,
    event_deliveries: String,
    audit_page: String,
    audit_insert: String,
}

impl Queries {
    fn new(schema: &Schema) -> Self {
        Self {
            user_upsert: schema.render(include_str!("sql/console_user_upsert.sql")),
            user_get: schema.render(include_str!("sql/console_user_get.sql")),
            user_delete: schema.render(include_str!("sql/console_user_delete.sql")),
            sessions_end_user: schema.render(include_str!("sql/console_sessions_end_user.sql")),
            session_insert: schema.render(include_str!("sql/console_session_insert.sql")),
            session_get: schema.render(include_str!("sql/console_session_get.sql")),
            session_delete: schema.render(include_str!("sql/console_session_delete.sql")),
            delivery_rate: schema.render(include_str!("sql/console_delivery_rate.sql")),
            relays: include_str!("sql/console_relays.sql").to_owned(),
            events: schema.render(include_str!("sql/console_events.sql")),
            event: schema.render(include_str!("sql/console_event.sql")),
            event_deliveries: schema.render(include_str!("sql/console_event_deliveries.sql")),
            audit_page: schema.render(include_str!("sql/console_audit_page.sql")),
            audit_insert: schema.render(include_str!("sql/dlq_audit_insert.sql")),
        }
    }
}

/// A stored console user.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredUser {
    /// `viewer` or `operator`.
    pub role: String,
    /// The argon2 PHC string.
    pub password_hash: String,
}

/// A live session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredSession {
    pub user: String,
    /// The user's role now (a changed role applies to open sessions).
    pub role: String,
    pub csrf_token: String,
}

/// What the console's event search asks for; `None` matches anything.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EventQuery {
    pub event_id: Option<Uuid>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub event_type: Option<String>,
    /// An event status, or `dead`, `discarded`, `replaced`.
    pub status: Option<String>,
    pub created_from: Option<DateTime<Utc>>,
    pub created_before: Option<DateTime<Utc>>,
    /// Only rows with an id below this (the next page).
    pub before_row: Option<i64>,
    pub limit: i64,
}

/// One search result.
#[derive(Clone, Debug, PartialEq)]
pub struct EventRow {
    /// The outbox row id (the page cursor).
    pub row: i64,
    pub event_id: Uuid,
    pub event_type: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub status: String,
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    pub sent_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub resolution: Option<String>,
}

/// One event in full, for its console page.
#[derive(Clone, Debug, PartialEq)]
pub struct EventRecord {
    pub row: i64,
    pub event_id: Uuid,
    pub event_type: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub schema_version: i32,
    pub sequence: Option<i64>,
    pub status: String,
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    pub available_at: DateTime<Utc>,
    pub sent_at: Option<DateTime<Utc>>,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub payload: Value,
    pub headers: Value,
    pub resolved_at: Option<DateTime<Utc>>,
    pub resolution: Option<String>,
    pub resolution_note: Option<String>,
    pub replaced_by: Option<Uuid>,
    pub replay_of: Option<Uuid>,
}

impl EventRecord {
    /// A dead letter nobody has resolved yet.
    pub fn is_dead_letter(&self) -> bool {
        self.status == "failed" && self.resolved_at.is_none()
    }
}

/// One destination's state of a fan-out event.
#[derive(Clone, Debug, PartialEq)]
pub struct DeliveryRecord {
    pub destination: String,
    pub status: String,
    pub attempts: i32,
    pub available_at: DateTime<Utc>,
    pub last_error: Option<String>,
    pub updated_at: DateTime<Utc>,
    pub sent_at: Option<DateTime<Utc>>,
}

/// Relays connected from one client address.
#[derive(Clone, Debug, PartialEq)]
pub struct RelaySeen {
    /// The client's address, or `local` (a Unix socket, or hidden without pg_monitor).
    pub client: String,
    pub connections: i64,
    pub connected_since: Option<DateTime<Utc>>,
    pub last_active: Option<DateTime<Utc>>,
}

/// Console operations on one schema. Get one with [`Store::console`].
#[derive(Clone)]
pub struct ConsoleStore {
    pool: PgPool,
    sql: Arc<Queries>,
}

impl Store {
    /// The console's operations for this store's schema.
    pub fn console(&self) -> ConsoleStore {
        ConsoleStore::new(self.pool.clone(), &self.schema)
    }
}

impl ConsoleStore {
    pub fn new(pool: PgPool, schema: &Schema) -> Self {
        Self {
            pool,
            sql: Arc::new(Queries::new(schema)),
        }
    }

    /// Create a user or replace an existing one's role and hash; ends the
    /// user's open sessions either way. Returns true when the user is new.
    pub async fn upsert_user(
        &self,
        name: &str,
        role: &str,
        password_hash: &str,
    ) -> Result<bool, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let created: bool = sqlx::query_scalar(&self.sql.user_upsert)
            .bind(name)
            .bind(role)
            .bind(password_hash)
            .fetch_one(&mut *tx)
            .await?;
        sqlx::query(&self.sql.sessions_end_user)
            .bind(name)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(created)
    }

    /// Remove a user and their sessions; false when there was no such user.
    pub async fn delete_user(&self, name: &str) -> Result<bool, sqlx::Error> {
        let gone: Option<String> = sqlx::query_scalar(&self.sql.user_delete)
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        Ok(gone.is_some())
    }

    pub async fn user(&self, name: &str) -> Result<Option<StoredUser>, sqlx::Error> {
        let row = sqlx::query(&self.sql.user_get)
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| {
            Ok(StoredUser {
                role: r.try_get(0)?,
                password_hash: r.try_get(1)?,
            })
        })
        .transpose()
    }

    /// Store a session (expired ones are swept at the same time).
    pub async fn create_session(
        &self,
        token_hash: &[u8],
        user: &str,
        csrf_token: &str,
        lifetime_seconds: f64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(&self.sql.session_insert)
            .bind(token_hash)
            .bind(user)
            .bind(csrf_token)
            .bind(lifetime_seconds)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn session(&self, token_hash: &[u8]) -> Result<Option<StoredSession>, sqlx::Error> {
        let row = sqlx::query(&self.sql.session_get)
            .bind(token_hash)
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| {
            Ok(StoredSession {
                user: r.try_get(0)?,
                role: r.try_get(1)?,
                csrf_token: r.try_get(2)?,
            })
        })
        .transpose()
    }

    pub async fn delete_session(&self, token_hash: &[u8]) -> Result<(), sqlx::Error> {
        sqlx::query(&self.sql.session_delete)
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
        sqlx::query_scalar(&self.sql.audit_insert)
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
        let rows = sqlx::query(&self.sql.delivery_rate)
            .bind(minutes)
            .bind(window)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect()
    }

    /// Relays connected to this database now (sessions named `postbox-relay`).
    pub async fn relays(&self) -> Result<Vec<RelaySeen>, sqlx::Error> {
        let rows = sqlx::query(&self.sql.relays)
            .bind(RELAY_APPLICATION_NAME)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(RelaySeen {
                    client: r.try_get(0)?,
                    connections: r.try_get(1)?,
                    connected_since: r.try_get(2)?,
                    last_active: r.try_get(3)?,
                })
            })
            .collect()
    }

    /// Search events, newest first.
    pub async fn events(&self, q: &EventQuery) -> Result<Vec<EventRow>, sqlx::Error> {
        let rows = sqlx::query(&self.sql.events)
            .bind(q.event_id)
            .bind(q.aggregate_type.as_deref())
            .bind(q.aggregate_id.as_deref())
            .bind(q.event_type.as_deref())
            .bind(q.status.as_deref())
            .bind(q.created_from)
            .bind(q.created_before)
            .bind(q.before_row)
            .bind(q.limit.max(0))
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(EventRow {
                    row: r.try_get(0)?,
                    event_id: r.try_get(1)?,
                    event_type: r.try_get(2)?,
                    aggregate_type: r.try_get(3)?,
                    aggregate_id: r.try_get(4)?,
                    status: r.try_get(5)?,
                    attempts: r.try_get(6)?,
                    created_at: r.try_get(7)?,
                    sent_at: r.try_get(8)?,
                    last_error: r.try_get(9)?,
                    resolution: r.try_get(10)?,
                })
            })
            .collect()
    }

    /// One event by id, whatever its status.
    pub async fn event(&self, event_id: Uuid) -> Result<Option<EventRecord>, DlqError> {
        let Some(r) = sqlx::query(&self.sql.event)
            .bind(event_id)
            .fetch_optional(&self.pool)
            .await?
        else {
            return Ok(None);
        };
        Ok(Some(event_record(&r)?))
    }

    /// The per-destination rows of a fan-out event (empty for most events).
    pub async fn deliveries(&self, row: i64) -> Result<Vec<DeliveryRecord>, sqlx::Error> {
        let rows = sqlx::query(&self.sql.event_deliveries)
            .bind(row)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(DeliveryRecord {
                    destination: r.try_get(0)?,
                    status: r.try_get(1)?,
                    attempts: r.try_get(2)?,
                    available_at: r.try_get(3)?,
                    last_error: r.try_get(4)?,
                    updated_at: r.try_get(5)?,
                    sent_at: r.try_get(6)?,
                })
            })
            .collect()
    }

    /// Audit entries, newest first: below entry id `before`, of `action` and `actor` when given.
    pub async fn audit_page(
        &self,
        before: Option<i64>,
        action: Option<&str>,
        actor: Option<&str>,
        limit: i64,
    ) -> Result<Vec<AuditEntry>, DlqError> {
        let rows = sqlx::query(&self.sql.audit_page)
            .bind(before)
            .bind(action)
            .bind(actor)
            .bind(limit.max(0))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(audit_entry).collect()
    }
}

fn event_record(r: &PgRow) -> Result<EventRecord, DlqError> {
    let payload: String = r.try_get(14)?;
    let headers: String = r.try_get(15)?;
    Ok(EventRecord {
        row: r.try_get(0)?,
        event_id: r.try_get(1)?,
        event_type: r.try_get(2)?,
        aggregate_type: r.try_get(3)?,
        aggregate_id: r.try_get(4)?,
        schema_version: r.try_get(5)?,
        sequence: r.try_get(6)?,
        status: r.try_get(7)?,
        attempts: r.try_get(8)?,
        created_at: r.try_get(9)?,
        available_at: r.try_get(10)?,
        sent_at: r.try_get(11)?,
        lease_expires_at: r.try_get(12)?,
        last_error: r.try_get(13)?,
        payload: json("payload", &payload)?,
        headers: json("headers", &headers)?,
        resolved_at: r.try_get(16)?,
        resolution: r.try_get(17)?,
        resolution_note: r.try_get(18)?,
        replaced_by: r.try_get(19)?,
        replay_of: r.try_get(20)?,
    })
}

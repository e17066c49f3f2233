//! Events as operators look them up: one event in full ([`EventRecord`], the
//! one read model of an outbox row, shown by `postbox dlq show` and the
//! console), a search page ([`EventRow`]) and a fan-out event's destinations.

use crate::catalog;
use chrono::{DateTime, Utc};
use postbox::statements::trusted;
use postbox::Schema;
use serde::Serialize;
use serde_json::Value;
use sqlx::postgres::{PgTypeInfo, PgValueRef};
use sqlx::{PgPool, Postgres};
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use uuid::Uuid;

/// Where an event (or one destination of a fan-out event) stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Waiting to be claimed (due now, or after a retry delay).
    Pending,
    /// Claimed under a lease by a relay.
    Processing,
    /// Delivered (a broker acknowledged it).
    Sent,
    /// A dead letter (resolved or not: see the resolution columns).
    Failed,
}

impl Status {
    /// The name stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Processing => "processing",
            Status::Sent => "sent",
            Status::Failed => "failed",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A status name that is not one of postbox's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown event status {0:?}: expected pending, processing, sent or failed")]
pub struct UnknownStatus(pub String);

impl FromStr for Status {
    type Err = UnknownStatus;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "pending" => Ok(Status::Pending),
            "processing" => Ok(Status::Processing),
            "sent" => Ok(Status::Sent),
            "failed" => Ok(Status::Failed),
            other => Err(UnknownStatus(other.chars().take(40).collect())),
        }
    }
}

// Read from `status::text` columns (the enum type itself is per schema).
impl sqlx::Type<Postgres> for Status {
    fn type_info() -> PgTypeInfo {
        <&str as sqlx::Type<Postgres>>::type_info()
    }
    fn compatible(ty: &PgTypeInfo) -> bool {
        <&str as sqlx::Type<Postgres>>::compatible(ty)
    }
}

impl<'r> sqlx::Decode<'r, Postgres> for Status {
    fn decode(value: PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        let text = <&str as sqlx::Decode<Postgres>>::decode(value)?;
        Ok(text.parse()?)
    }
}

/// What the event search filters on by status: a stored status, or one of
/// the dead-letter views.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusFilter {
    Is(Status),
    /// Unresolved dead letters.
    Dead,
    /// Dead letters an operator discarded.
    Discarded,
    /// Dead letters an operator replayed under a new id.
    Replaced,
}

impl StatusFilter {
    /// The name the search statement takes (and the console's query string uses).
    pub fn as_str(self) -> &'static str {
        match self {
            StatusFilter::Is(status) => status.as_str(),
            StatusFilter::Dead => "dead",
            StatusFilter::Discarded => "discarded",
            StatusFilter::Replaced => "replaced",
        }
    }
}

impl FromStr for StatusFilter {
    type Err = UnknownStatus;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "dead" => Ok(StatusFilter::Dead),
            "discarded" => Ok(StatusFilter::Discarded),
            "replaced" => Ok(StatusFilter::Replaced),
            other => other.parse().map(StatusFilter::Is),
        }
    }
}

/// One event in full, whatever its status, with its dead-letter resolution.
#[derive(Clone, Debug, PartialEq, Serialize, sqlx::FromRow)]
pub struct EventRecord {
    /// The outbox row id.
    #[serde(skip)]
    #[sqlx(rename = "id")]
    pub row: i64,
    pub event_id: Uuid,
    pub event_type: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub schema_version: i32,
    pub sequence: Option<i64>,
    pub status: Status,
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    pub available_at: DateTime<Utc>,
    pub sent_at: Option<DateTime<Utc>>,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    #[sqlx(json)]
    pub payload: Value,
    #[sqlx(json)]
    pub headers: Value,
    pub resolved_at: Option<DateTime<Utc>>,
    pub resolution: Option<String>,
    pub resolution_note: Option<String>,
    pub replaced_by: Option<Uuid>,
    pub replay_of: Option<Uuid>,
    /// When it was scheduled for (`deliver_at`); `None`: at once.
    pub deliver_at: Option<DateTime<Utc>>,
}

impl EventRecord {
    /// A dead letter nobody has resolved yet.
    pub fn is_dead_letter(&self) -> bool {
        self.status == Status::Failed && self.resolved_at.is_none()
    }
}

/// What the event search asks for; `None` matches anything.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EventQuery {
    pub event_id: Option<Uuid>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub event_type: Option<String>,
    pub status: Option<StatusFilter>,
    pub created_from: Option<DateTime<Utc>>,
    pub created_before: Option<DateTime<Utc>>,
    /// Only rows with an id below this (the next page).
    pub before_row: Option<i64>,
    pub limit: i64,
}

/// One search result.
#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
pub struct EventRow {
    /// The outbox row id (the page cursor).
    #[sqlx(rename = "id")]
    pub row: i64,
    pub event_id: Uuid,
    pub event_type: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub status: Status,
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    /// When a pending event is due (its next attempt, after a failure).
    pub available_at: DateTime<Utc>,
    /// Until when a relay holds a claimed (`processing`) event.
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub sent_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub resolution: Option<String>,
}

fn as_raw_json<S: serde::Serializer>(text: &str, s: S) -> Result<S::Ok, S::Error> {
    use serde::Serialize;
    match serde_json::value::RawValue::from_string(text.to_owned()) {
        Ok(raw) => raw.serialize(s),
        Err(_) => s.serialize_str(text),
    }
}

/// An event's own fields, wherever the outbox keeps it ([`Events::find`]),
/// or as a file gives them (`postbox route test`).
#[derive(Clone, Debug, PartialEq, Serialize, sqlx::FromRow)]
pub struct StoredEvent {
    pub event_id: Uuid,
    pub event_type: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub schema_version: i32,
    pub sequence: Option<i64>,
    pub created_at: DateTime<Utc>,
    /// The payload's JSON text, as the relay reads it (serialized as that
    /// JSON, not as a string).
    #[serde(serialize_with = "as_raw_json")]
    pub payload: String,
    #[sqlx(json)]
    pub headers: Value,
    /// Where it was found: `outbox`, `log` or `archive` (`file`, `console`
    /// where it came from elsewhere).
    pub place: String,
}

/// One destination's state of a fan-out event.
#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
pub struct DeliveryRecord {
    pub destination: String,
    pub status: Status,
    pub attempts: i32,
    pub available_at: DateTime<Utc>,
    pub last_error: Option<String>,
    pub updated_at: DateTime<Utc>,
    pub sent_at: Option<DateTime<Utc>>,
}

#[derive(Debug)]
struct Queries {
    show: String,
    search: String,
    deliveries: String,
    find: String,
}

impl Queries {
    fn new(schema: &Schema) -> Self {
        let mut file = catalog("events.sql", include_str!("../sql/events.sql"));
        let queries = Self {
            show: file.render("show", schema),
            search: file.render("search", schema),
            deliveries: file.render("deliveries", schema),
            find: file.render("find", schema),
        };
        file.finish();
        queries
    }
}

/// Event look-ups on one schema. Get one with [`crate::Store::events`].
#[derive(Clone)]
pub struct Events {
    pool: PgPool,
    sql: Arc<Queries>,
}

impl Events {
    pub fn new(pool: PgPool, schema: &Schema) -> Self {
        Self {
            pool,
            sql: Arc::new(Queries::new(schema)),
        }
    }

    /// One event by id, whatever its status; `None` when there is no such event.
    pub async fn show(&self, event_id: Uuid) -> Result<Option<EventRecord>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.show))
            .bind(event_id)
            .fetch_optional(&self.pool)
            .await
    }

    /// One event by id in the outbox table, the log or the archive (the
    /// first that has it); `None` when none does. Reads the log whole.
    pub async fn find(&self, event_id: Uuid) -> Result<Option<StoredEvent>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.find))
            .bind(event_id)
            .fetch_optional(&self.pool)
            .await
    }

    /// Search events, newest first.
    pub async fn search(&self, q: &EventQuery) -> Result<Vec<EventRow>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.search))
            .bind(q.event_id)
            .bind(q.aggregate_type.as_deref())
            .bind(q.aggregate_id.as_deref())
            .bind(q.event_type.as_deref())
            .bind(q.status.map(StatusFilter::as_str))
            .bind(q.created_from)
            .bind(q.created_before)
            .bind(q.before_row)
            .bind(q.limit.max(0))
            .fetch_all(&self.pool)
            .await
    }

    /// The per-destination rows of a fan-out event (empty for most events).
    pub async fn deliveries(&self, row: i64) -> Result<Vec<DeliveryRecord>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.deliveries))
            .bind(row)
            .fetch_all(&self.pool)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_round_trip_and_filters_parse() {
        for s in [
            Status::Pending,
            Status::Processing,
            Status::Sent,
            Status::Failed,
        ] {
            assert_eq!(s.as_str().parse::<Status>(), Ok(s));
            assert_eq!(s.as_str().parse::<StatusFilter>(), Ok(StatusFilter::Is(s)));
        }
        assert_eq!("dead".parse::<StatusFilter>(), Ok(StatusFilter::Dead));
        assert!("lost".parse::<Status>().is_err());
    }
}

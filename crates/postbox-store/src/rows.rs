//! An outbox event as the relay reads it (`ClaimedEvent`): decoded from a
//! claimed row, a log row or an emitted message, and the helpers that decode
//! its parts. Shared by claim mode, the log and logical mode; imports
//! nothing else of the crate.

use chrono::{DateTime, Utc};
use serde_json::value::RawValue;
use std::collections::BTreeMap;
use uuid::Uuid;

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
    // Most events carry none (the columns' default, as jsonb prints it).
    if json == "{}" {
        return Ok(BTreeMap::new());
    }
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

//! CloudEvents 1.0, JSON structured mode: the body every sink sends.
//!
//! Attributes: `specversion`, `id` (the event id), `source` (configurable),
//! `type` (the event type), `subject` (the aggregate id), `time` (the commit's
//! insert time, RFC 3339), `datacontenttype` (`application/json`), `data` (the
//! payload, verbatim), and the extensions `aggregatetype` (string),
//! `schemaversion` (integer) and `sequence` (integer, the event's number within
//! its aggregate; absent for events committed before schema version 5).

use crate::sink::Message;
use chrono::SecondsFormat;
use serde::Serialize;
use serde_json::value::RawValue;

/// The CloudEvents `source` attribute used when none is configured.
pub const DEFAULT_SOURCE: &str = "postbox";

#[derive(Serialize)]
struct Structured<'a> {
    specversion: &'static str,
    id: uuid::fmt::Hyphenated,
    source: &'a str,
    #[serde(rename = "type")]
    event_type: &'a str,
    subject: &'a str,
    time: String,
    datacontenttype: &'static str,
    aggregatetype: &'a str,
    schemaversion: i32,
    #[serde(skip_serializing_if = "Option::is_none")]
    sequence: Option<i64>,
    data: &'a RawValue,
}

/// Encode `message` as a CloudEvents JSON document.
pub fn to_json(message: &Message, source: &str) -> String {
    let doc = Structured {
        specversion: "1.0",
        id: message.event_id.hyphenated(),
        source,
        event_type: &message.event_type,
        subject: &message.aggregate_id,
        time: message
            .created_at
            .to_rfc3339_opts(SecondsFormat::Micros, true),
        datacontenttype: "application/json",
        aggregatetype: &message.aggregate_type,
        schemaversion: message.schema_version,
        sequence: message.sequence,
        data: &message.payload,
    };
    // Serializing strings, integers and already-valid raw JSON cannot fail.
    serde_json::to_string(&doc).unwrap_or_else(|_| String::from("{}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn encodes_a_structured_event() {
        let m = Message {
            event_id: uuid::Uuid::parse_str("018f0000-0000-7000-8000-000000000001").unwrap(),
            event_type: "order.created".into(),
            aggregate_type: "order".into(),
            aggregate_id: "o-1".into(),
            schema_version: 2,
            payload: RawValue::from_string(r#"{"total": 10}"#.into()).unwrap(),
            headers: Default::default(),
            created_at: chrono::Utc.with_ymd_and_hms(2026, 1, 2, 3, 4, 5).unwrap(),
            attempt: 1,
            sequence: Some(1),
        };
        let v: serde_json::Value = serde_json::from_str(&to_json(&m, "shop")).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "specversion": "1.0",
                "id": "018f0000-0000-7000-8000-000000000001",
                "source": "shop",
                "type": "order.created",
                "subject": "o-1",
                "time": "2026-01-02T03:04:05.000000Z",
                "datacontenttype": "application/json",
                "aggregatetype": "order",
                "schemaversion": 2,
                "sequence": 1,
                "data": {"total": 10}
            })
        );
    }
}

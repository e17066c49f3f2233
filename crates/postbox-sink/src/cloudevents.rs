//! CloudEvents 1.0, JSON structured mode: the body every sink sends.
//!
//! Attributes: `specversion`, `id` (the event id), `source` (configurable),
//! `type` (the event type), `subject` (the aggregate id), `time` (the commit's
//! insert time, RFC 3339), `datacontenttype` (`application/json`), `data` (the
//! payload, verbatim), and the extensions `aggregatetype` (string),
//! `schemaversion` (integer) and `sequence` (integer, the event's number within
//! its aggregate; absent for events committed before schema version 5), and
//! `traceparent` / `tracestate` (the distributed-tracing extension) when the
//! producer attached a trace context.

use crate::Message;
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
    #[serde(skip_serializing_if = "Option::is_none")]
    traceparent: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tracestate: Option<&'a str>,
    data: &'a RawValue,
}

/// The event's own source ([`Message::source`]) if it has one, else `default`.
pub fn source_of<'a>(message: &'a Message, default: &'a str) -> &'a str {
    message.source.as_deref().unwrap_or(default)
}

/// Encode `message` as a CloudEvents JSON document (`source` unless the
/// message names its own, see [`source_of`]).
pub fn to_json(message: &Message, source: &str) -> String {
    let source = source_of(message, source);
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
        traceparent: message.headers.get("traceparent").map(String::as_str),
        tracestate: message.headers.get("tracestate").map(String::as_str),
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
            source: None,
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

// ---------------------------------------------------------------------------
// HTTP binding: structured and binary content modes.

/// The `Content-Type` of a structured-mode CloudEvents JSON body ([`to_json`]).
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";

/// The `Content-Type` of a binary-mode body: the payload itself.
pub const BINARY_CONTENT_TYPE: &str = "application/json";

/// Characters the CloudEvents HTTP binding requires to be percent-encoded in a
/// `ce-*` header value: controls, space, `"` and `%` (every byte outside
/// printable ASCII is encoded as well, as part of the UTF-8 encoding).
const CE_HEADER_VALUE: &percent_encoding::AsciiSet =
    &percent_encoding::CONTROLS.add(b' ').add(b'"').add(b'%');

/// Percent-encode one `ce-*` header value the way the CloudEvents HTTP binding
/// requires: the value's UTF-8 bytes, with space, `"`, `%` and every byte
/// outside printable ASCII (U+0021–U+007E) written as `%XX`.
pub fn encode_header_value(value: &str) -> String {
    percent_encoding::utf8_percent_encode(value, CE_HEADER_VALUE).to_string()
}

/// The `ce-*` headers of `message` in CloudEvents HTTP **binary** mode, with
/// their values already percent-encoded (see [`encode_header_value`]), so every
/// value is printable ASCII and valid in an HTTP header.
///
/// Headers, in order: `ce-specversion`, `ce-id`, `ce-source`, `ce-type`,
/// `ce-subject` (aggregate id), `ce-time`, and the extensions
/// `ce-aggregatetype`, `ce-schemaversion` and `ce-sequence` (only when the
/// event has a sequence number). In binary mode the body is the payload
/// ([`Message::payload`], verbatim) and `datacontenttype` travels as the
/// request's `Content-Type` ([`BINARY_CONTENT_TYPE`]).
pub fn binary_headers(message: &Message, source: &str) -> Vec<(&'static str, String)> {
    let source = source_of(message, source);
    let mut headers = vec![
        ("ce-specversion", "1.0".to_owned()),
        ("ce-id", message.event_id.hyphenated().to_string()),
        ("ce-source", encode_header_value(source)),
        ("ce-type", encode_header_value(&message.event_type)),
        ("ce-subject", encode_header_value(&message.aggregate_id)),
        (
            "ce-time",
            encode_header_value(
                &message
                    .created_at
                    .to_rfc3339_opts(SecondsFormat::Micros, true),
            ),
        ),
        (
            "ce-aggregatetype",
            encode_header_value(&message.aggregate_type),
        ),
        ("ce-schemaversion", message.schema_version.to_string()),
    ];
    if let Some(sequence) = message.sequence {
        headers.push(("ce-sequence", sequence.to_string()));
    }
    headers
}

#[cfg(test)]
mod binary_tests {
    use super::*;
    use chrono::TimeZone;

    fn message() -> Message {
        Message {
            event_id: uuid::Uuid::parse_str("018f0000-0000-7000-8000-000000000001").unwrap(),
            event_type: "order.created".into(),
            aggregate_type: "order line".into(),
            aggregate_id: "o-1 \"ä\" 100%".into(),
            schema_version: 2,
            payload: RawValue::from_string(r#"{"total": 10}"#.into()).unwrap(),
            headers: Default::default(),
            created_at: chrono::Utc.with_ymd_and_hms(2026, 1, 2, 3, 4, 5).unwrap(),
            attempt: 1,
            sequence: Some(7),
            source: None,
        }
    }

    #[test]
    fn binary_headers_are_percent_encoded() {
        let h = binary_headers(&message(), "shop/eu");
        let get = |name: &str| {
            h.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.as_str())
                .unwrap()
        };
        assert_eq!(get("ce-specversion"), "1.0");
        assert_eq!(get("ce-id"), "018f0000-0000-7000-8000-000000000001");
        assert_eq!(get("ce-source"), "shop/eu");
        assert_eq!(get("ce-type"), "order.created");
        assert_eq!(get("ce-subject"), "o-1%20%22%C3%A4%22%20100%25");
        assert_eq!(get("ce-time"), "2026-01-02T03:04:05.000000Z");
        assert_eq!(get("ce-aggregatetype"), "order%20line");
        assert_eq!(get("ce-schemaversion"), "2");
        assert_eq!(get("ce-sequence"), "7");
        for (_, v) in &h {
            assert!(v.bytes().all(|b| (0x21..0x7f).contains(&b)), "{v}");
        }
    }

    #[test]
    fn sequence_header_only_when_known() {
        let mut m = message();
        m.sequence = None;
        assert!(binary_headers(&m, "s")
            .iter()
            .all(|(n, _)| *n != "ce-sequence"));
        assert_eq!(encode_header_value("a\nb\u{7f}"), "a%0Ab%7F");
    }
}

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
use chrono::{DateTime, Datelike, SecondsFormat, Timelike, Utc};
#[cfg(test)]
use serde_json::value::RawValue;

/// The CloudEvents `source` attribute used when none is configured.
pub const DEFAULT_SOURCE: &str = "postbox";

/// The event's own source ([`Message::source`]) if it has one, else `default`.
pub fn source_of<'a>(message: &'a Message, default: &'a str) -> &'a str {
    message.source.as_deref().unwrap_or(default)
}

/// Encode `message` as a CloudEvents JSON document (`source` unless the
/// message names its own, see [`source_of`]).
///
/// Written straight into one buffer sized for the document: this runs once
/// per event on every sink's hot path, and a serializer walking a struct
/// escaped each of the dozen attribute names and formatted the time into a
/// string of its own first. The bytes are the same as `serde_json`'s compact
/// form of the attributes in this order (a test holds the two together).
pub fn to_json(message: &Message, source: &str) -> String {
    let mut out = String::with_capacity(json_capacity(message, source));
    encode(message, source, &mut out);
    out
}

/// How many bytes [`to_json`] writes for `message`, or a few more: sized by
/// this, the document's buffer never grows while it is written, unless an
/// attribute needs escapes.
pub fn json_capacity(message: &Message, source: &str) -> usize {
    // The attribute names, quotes and separators, the id (36), the time (27,
    // or 30 with a signed six-digit year) and the two numbers at their
    // longest (11 and 20 characters).
    const FIXED: usize = 265;
    let trace = ["traceparent", "tracestate"]
        .iter()
        .filter_map(|name| message.headers.get(*name).map(|v| name.len() + v.len() + 6))
        .sum::<usize>();
    FIXED
        + trace
        + message.payload.get().len()
        + source_of(message, source).len()
        + message.event_type.len()
        + message.aggregate_id.len()
        + message.aggregate_type.len()
}

/// [`to_json`]'s document appended to `out`: a sink that packs a batch into
/// one buffer reuses one string for every document of the batch.
pub fn push_json(message: &Message, source: &str, out: &mut String) {
    out.reserve(json_capacity(message, source));
    encode(message, source, out);
}

fn encode(message: &Message, source: &str, out: &mut String) {
    let source = source_of(message, source);
    out.push_str(r#"{"specversion":"1.0","id":""#);
    out.push_str(
        message
            .event_id
            .hyphenated()
            .encode_lower(&mut uuid::Uuid::encode_buffer()),
    );
    out.push_str(r#"","source":"#);
    put_json_str(out, source);
    out.push_str(r#","type":"#);
    put_json_str(out, &message.event_type);
    out.push_str(r#","subject":"#);
    put_json_str(out, &message.aggregate_id);
    out.push_str(r#","time":""#);
    put_time(out, &message.created_at);
    out.push_str(r#"","datacontenttype":"application/json","aggregatetype":"#);
    put_json_str(out, &message.aggregate_type);
    out.push_str(r#","schemaversion":"#);
    out.push_str(itoa::Buffer::new().format(message.schema_version));
    if let Some(sequence) = message.sequence {
        out.push_str(r#","sequence":"#);
        out.push_str(itoa::Buffer::new().format(sequence));
    }
    for name in ["traceparent", "tracestate"] {
        if let Some(value) = message.headers.get(name) {
            out.push_str(",\"");
            out.push_str(name);
            out.push_str("\":");
            put_json_str(out, value);
        }
    }
    out.push_str(r#","data":"#);
    out.push_str(message.payload.get());
    out.push('}');
}

/// `text` as a JSON string. Most attribute values need no escape and are
/// copied as they are; the rest are escaped as `serde_json` escapes them.
fn put_json_str(out: &mut String, text: &str) {
    if text.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\') {
        // A `&str` always serializes.
        out.push_str(&serde_json::to_string(text).unwrap_or_default());
    } else {
        out.push('"');
        out.push_str(text);
        out.push('"');
    }
}

/// `time` in RFC 3339 with microseconds and `Z`, exactly as chrono's
/// `to_rfc3339_opts(SecondsFormat::Micros, true)` writes it (a test holds
/// the two together), without a string of its own.
fn put_time(out: &mut String, time: &DateTime<Utc>) {
    // "YYYY-MM-DDTHH:MM:SS.ffffff" is 26 bytes: written into one small
    // buffer, then put at once.
    let mut text = [0u8; 26];
    let year = time.year();
    let (mut second, mut nano) = (time.second(), time.nanosecond());
    if nano >= 1_000_000_000 {
        // A leap second: chrono writes it as second 60.
        second += 1;
        nano -= 1_000_000_000;
    }
    if (0..=9999).contains(&year) {
        put_digits(&mut text[0..4], year as u32);
    } else {
        // Outside four digits, ISO 8601 wants the sign (chrono does the same).
        out.push_str(&format!("{year:+05}"));
    }
    text[4] = b'-';
    put_digits(&mut text[5..7], time.month());
    text[7] = b'-';
    put_digits(&mut text[8..10], time.day());
    text[10] = b'T';
    put_digits(&mut text[11..13], time.hour());
    text[13] = b':';
    put_digits(&mut text[14..16], time.minute());
    text[16] = b':';
    put_digits(&mut text[17..19], second);
    text[19] = b'.';
    put_digits(&mut text[20..26], nano / 1_000);
    let from = if (0..=9999).contains(&year) { 0 } else { 4 };
    // Only ASCII digits and separators were written.
    out.push_str(std::str::from_utf8(&text[from..]).unwrap_or_default());
    out.push('Z');
}

/// The last `digits.len()` decimal digits of `value`, zero-padded.
fn put_digits(digits: &mut [u8], mut value: u32) {
    for d in digits.iter_mut().rev() {
        *d = b'0' + (value % 10) as u8;
        value /= 10;
    }
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

    /// The attributes as a serializer writes them, in `to_json`'s order.
    #[derive(serde::Serialize)]
    struct Reference<'a> {
        specversion: &'static str,
        id: String,
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

    fn reference(m: &Message, source: &str) -> String {
        serde_json::to_string(&Reference {
            specversion: "1.0",
            id: m.event_id.hyphenated().to_string(),
            source: source_of(m, source),
            event_type: &m.event_type,
            subject: &m.aggregate_id,
            time: m.created_at.to_rfc3339_opts(SecondsFormat::Micros, true),
            datacontenttype: "application/json",
            aggregatetype: &m.aggregate_type,
            schemaversion: m.schema_version,
            sequence: m.sequence,
            traceparent: m.headers.get("traceparent").map(String::as_str),
            tracestate: m.headers.get("tracestate").map(String::as_str),
            data: &m.payload,
        })
        .unwrap()
    }

    #[test]
    fn writes_the_bytes_a_serializer_writes() {
        let hostile = [
            "plain",
            "",
            "quote \" and backslash \\",
            "a backslash \\ alone",
            "a quote \" alone",
            "a newline \n alone",
            "controls \u{0}\u{1}\u{8}\t\n\u{b}\u{c}\r\u{1f} end",
            "del \u{7f}, non-ascii ä € 😀, separators \u{2028}\u{2029}",
            "</script><!-- -->",
        ];
        let times = [
            chrono::Utc.with_ymd_and_hms(2026, 1, 2, 3, 4, 5).unwrap(),
            chrono::Utc
                .timestamp_opt(1_700_000_000, 123_456_789)
                .unwrap(),
            chrono::Utc.timestamp_opt(0, 999_999_999).unwrap(),
            chrono::Utc
                .with_ymd_and_hms(9999, 12, 31, 23, 59, 59)
                .unwrap(),
            chrono::Utc.with_ymd_and_hms(10000, 1, 1, 0, 0, 0).unwrap(),
            chrono::Utc
                .with_ymd_and_hms(262142, 12, 31, 23, 59, 59)
                .unwrap(),
            chrono::Utc.with_ymd_and_hms(0, 1, 1, 0, 0, 0).unwrap(),
            chrono::Utc
                .with_ymd_and_hms(-4713, 11, 24, 0, 0, 0)
                .unwrap(),
            chrono::Utc.with_ymd_and_hms(-1, 6, 30, 12, 0, 0).unwrap(),
            // A leap second (chrono writes second 60).
            chrono::Utc
                .timestamp_opt(1_483_228_799, 1_500_000_000)
                .unwrap(),
        ];
        let mut checked = 0;
        for (k, text) in hostile.iter().enumerate() {
            for (j, time) in times.iter().enumerate() {
                let mut m = Message {
                    event_id: uuid::Uuid::from_u128(
                        0x018f_0000_0000_7000_8000_0000_0000_00ab + k as u128,
                    ),
                    event_type: format!("t.{text}"),
                    aggregate_type: text.to_string(),
                    aggregate_id: format!("{text}-{j}"),
                    schema_version: [1, 0, -7, i32::MAX, i32::MIN][j % 5],
                    payload: RawValue::from_string(format!(r#"{{"k": {k}, "s": "x\u0001y"}}"#))
                        .unwrap(),
                    headers: Default::default(),
                    created_at: *time,
                    attempt: 1,
                    sequence: [None, Some(1), Some(i64::MAX), Some(i64::MIN)][j % 4],
                    source: (k % 2 == 1).then(|| format!("own/{text}").into()),
                };
                if j % 3 == 1 {
                    m.headers.insert("traceparent".into(), text.to_string());
                }
                if j % 3 == 2 {
                    m.headers.insert("tracestate".into(), format!("a={text}"));
                    m.headers.insert("traceparent".into(), "00-x-y-01".into());
                    m.headers.insert("other".into(), "not an attribute".into());
                }
                for source in ["shop", "src \"quoted\""] {
                    let ours = to_json(&m, source);
                    assert_eq!(ours, reference(&m, source));
                    if !text.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\')
                        && !source.contains('"')
                    {
                        assert!(
                            json_capacity(&m, source) >= ours.len(),
                            "a document without escapes fits its capacity: {ours}"
                        );
                    }
                    let mut pushed = "before ".to_owned();
                    push_json(&m, source, &mut pushed);
                    assert_eq!(pushed, format!("before {ours}"), "push_json appends");
                    serde_json::from_str::<serde_json::Value>(&ours).unwrap();
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, hostile.len() * times.len() * 2);
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

use crate::Error;
use chrono::{DateTime, Datelike, Utc};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;
use uuid::Uuid;

/// Longest accepted event type, aggregate type, aggregate id: 255 bytes.
pub const MAX_NAME_BYTES: usize = 255;

/// An event to enqueue, validated on construction.
///
/// Its `event_id` (UUIDv7) is generated here, once: the relay delivers it with
/// that id on every attempt and every replay, so consumers can deduplicate.
#[derive(Clone, Debug, PartialEq)]
pub struct NewEvent {
    pub(crate) event_id: Uuid,
    pub(crate) event_type: String,
    pub(crate) aggregate_type: String,
    pub(crate) aggregate_id: String,
    pub(crate) schema_version: i32,
    pub(crate) payload: String,
    pub(crate) headers: String,
    pub(crate) deliver: Option<Deliver>,
}

/// When a scheduled event becomes deliverable.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Deliver {
    /// At this time (by the producer's clock).
    At(DateTime<Utc>),
    /// This long after it is enqueued (by the database's clock).
    After(Duration),
}

/// The longest [`NewEvent::deliver_after`] delay: about 100 years.
pub const MAX_DELIVER_AFTER: Duration = Duration::from_secs(100 * 366 * 24 * 3600);

impl NewEvent {
    /// An event of `event_type` about the aggregate (`aggregate_type`, `aggregate_id`),
    /// carrying `payload` serialized as JSON.
    pub fn new(
        event_type: impl Into<String>,
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        payload: &impl Serialize,
    ) -> Result<Self, Error> {
        let payload = serde_json::to_string(payload).map_err(Error::Payload)?;
        Self::from_json(event_type, aggregate_type, aggregate_id, payload)
    }

    /// Like [`NewEvent::new`] with a payload that is already JSON text (it is
    /// checked to be valid JSON).
    pub fn from_json(
        event_type: impl Into<String>,
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        payload: impl Into<String>,
    ) -> Result<Self, Error> {
        let event = Self {
            event_id: Uuid::now_v7(),
            event_type: name("event_type", event_type.into())?,
            aggregate_type: name("aggregate_type", aggregate_type.into())?,
            aggregate_id: name("aggregate_id", aggregate_id.into())?,
            schema_version: 1,
            payload: payload.into(),
            headers: "{}".to_owned(),
            deliver: None,
        };
        serde_json::from_str::<serde::de::IgnoredAny>(&event.payload).map_err(Error::Payload)?;
        check_json_text("payload", &event.payload)?;
        Ok(event)
    }

    /// Set the payload's schema version (default 1).
    pub fn schema_version(mut self, version: i32) -> Result<Self, Error> {
        if version < 1 {
            return Err(Error::InvalidEvent {
                field: "schema_version",
                reason: format!("must be at least 1, got {version}"),
            });
        }
        self.schema_version = version;
        Ok(self)
    }

    /// Attach string headers, forwarded by transports that carry headers.
    pub fn headers<K, V>(mut self, headers: impl IntoIterator<Item = (K, V)>) -> Result<Self, Error>
    where
        K: Into<String>,
        V: Into<String>,
    {
        let map: BTreeMap<String, String> = headers
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        for key in map.keys() {
            if key.is_empty() {
                return Err(Error::InvalidEvent {
                    field: "headers",
                    reason: "contain an empty name".to_owned(),
                });
            }
        }
        self.headers = serde_json::to_string(&map).map_err(Error::Payload)?;
        check_json_text("headers", &self.headers)?;
        Ok(self)
    }

    /// Attach a W3C trace context (`traceparent`, as in the request that
    /// produced the event; `tracestate` optional). Stored with the event's
    /// headers and forwarded by every sink: the CloudEvents distributed-tracing
    /// attributes in the JSON body, and the `traceparent` header of transports
    /// with headers. Call after [`NewEvent::headers`], which replaces headers.
    pub fn trace_context(
        mut self,
        traceparent: &str,
        tracestate: Option<&str>,
    ) -> Result<Self, Error> {
        check_traceparent(traceparent)?;
        if let Some(state) = tracestate {
            if state.len() > 512 || !state.bytes().all(|b| (0x20..0x7f).contains(&b)) {
                return Err(Error::InvalidEvent {
                    field: "tracestate",
                    reason: "must be printable ASCII, at most 512 bytes".to_owned(),
                });
            }
        }
        let mut map: BTreeMap<String, serde_json::Value> =
            serde_json::from_str(&self.headers).map_err(Error::Payload)?;
        map.insert("traceparent".to_owned(), traceparent.into());
        match tracestate {
            Some(state) => map.insert("tracestate".to_owned(), state.into()),
            None => map.remove("tracestate"),
        };
        self.headers = serde_json::to_string(&map).map_err(Error::Payload)?;
        Ok(self)
    }

    /// Schedule the event: no relay delivers it before `time` (a time in the
    /// past means at once). The event is committed with the caller's
    /// transaction as usual and stays invisible to relays until then; in
    /// ordered routes it also holds back the later events of its aggregate
    /// (see the README's delivery contract). Replaces an earlier
    /// [`NewEvent::deliver_after`].
    ///
    /// Years outside 1..=9999 are refused.
    pub fn deliver_at(mut self, time: DateTime<Utc>) -> Result<Self, Error> {
        if !(1..=9999).contains(&time.year()) {
            return Err(Error::InvalidEvent {
                field: "deliver_at",
                reason: format!("must be a time in the years 1 to 9999, got {time}"),
            });
        }
        self.deliver = Some(Deliver::At(time));
        Ok(self)
    }

    /// Schedule the event `delay` after it is enqueued, measured by the
    /// database's clock when the enqueue statement runs (so the producer's
    /// clock does not matter). At most [`MAX_DELIVER_AFTER`]. Replaces an
    /// earlier [`NewEvent::deliver_at`].
    pub fn deliver_after(mut self, delay: Duration) -> Result<Self, Error> {
        if delay > MAX_DELIVER_AFTER {
            return Err(Error::InvalidEvent {
                field: "deliver_after",
                reason: format!(
                    "must be at most {} seconds (about 100 years), got {} seconds",
                    MAX_DELIVER_AFTER.as_secs(),
                    delay.as_secs()
                ),
            });
        }
        self.deliver = Some(Deliver::After(delay));
        Ok(self)
    }

    /// The time asked for with [`NewEvent::deliver_at`], if any.
    pub fn scheduled_at(&self) -> Option<DateTime<Utc>> {
        match self.deliver {
            Some(Deliver::At(t)) => Some(t),
            _ => None,
        }
    }

    /// The delay asked for with [`NewEvent::deliver_after`], if any.
    pub fn scheduled_after(&self) -> Option<Duration> {
        match self.deliver {
            Some(Deliver::After(d)) => Some(d),
            _ => None,
        }
    }

    /// Use a given event id instead of a fresh UUIDv7 (for example to re-enqueue
    /// the same logical event from another system).
    pub fn with_event_id(mut self, event_id: Uuid) -> Self {
        self.event_id = event_id;
        self
    }

    /// The event id consumers will see.
    pub fn event_id(&self) -> Uuid {
        self.event_id
    }

    /// The event type.
    pub fn event_type(&self) -> &str {
        &self.event_type
    }

    /// The payload as JSON text.
    pub fn payload_json(&self) -> &str {
        &self.payload
    }

    /// [`NewEvent::deliver_after`] in seconds, as the enqueue statements take it.
    pub(crate) fn deliver_after_secs(&self) -> Option<f64> {
        self.scheduled_after().map(|d| d.as_secs_f64())
    }

    pub(crate) fn check_payload_size(&self, max: usize) -> Result<(), Error> {
        if self.payload.len() > max {
            return Err(Error::InvalidEvent {
                field: "payload",
                reason: format!(
                    "is {} bytes once serialized, over the limit of {max} bytes",
                    self.payload.len()
                ),
            });
        }
        Ok(())
    }
}

fn name(field: &'static str, value: String) -> Result<String, Error> {
    let reason = if value.is_empty() {
        "must not be empty".to_owned()
    } else if value.len() > MAX_NAME_BYTES {
        format!(
            "must be at most {MAX_NAME_BYTES} bytes, got {}",
            value.len()
        )
    } else if value.contains('\0') {
        "must not contain NUL characters".to_owned()
    } else {
        return Ok(value);
    };
    Err(Error::InvalidEvent { field, reason })
}

/// Postgres' jsonb cannot store the NUL character; say so before the database does.
///
/// `json` is valid JSON, where a backslash always starts an escape: each escape
/// is skipped whole, so an escaped backslash followed by `u0000` (six ordinary
/// characters, which jsonb stores) is not mistaken for the escape `\u0000`.
fn check_json_text(field: &'static str, json: &str) -> Result<(), Error> {
    let bytes = json.as_bytes();
    let mut i = 0;
    while let Some(at) = bytes[i..].iter().position(|&b| b == b'\\') {
        let escape = i + at;
        if bytes[escape + 1..].starts_with(b"u0000") {
            return Err(Error::InvalidEvent {
                field,
                reason: "must not contain the NUL character (\\u0000), which jsonb cannot store"
                    .to_owned(),
            });
        }
        i = (escape + 2).min(bytes.len());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn builds_a_valid_event() {
        let e = NewEvent::new("order.created", "order", "42", &json!({"a": 1}))
            .unwrap()
            .schema_version(2)
            .unwrap()
            .headers([("traceparent", "00-abc")])
            .unwrap();
        assert_eq!(e.event_id.get_version_num(), 7);
        assert_eq!(e.payload, r#"{"a":1}"#);
        assert_eq!(e.headers, r#"{"traceparent":"00-abc"}"#);
        assert_eq!(e.schema_version, 2);
    }

    #[test]
    fn rejects_empty_long_and_nul_names() {
        let long = "x".repeat(256);
        let cases = [
            ("", "order", "1", "event_type must not be empty"),
            ("t", "", "1", "aggregate_type must not be empty"),
            ("t", "order", "", "aggregate_id must not be empty"),
            (
                long.as_str(),
                "order",
                "1",
                "event_type must be at most 255 bytes",
            ),
            ("t", "order", "a\0b", "aggregate_id must not contain NUL"),
        ];
        for (t, a, id, want) in cases {
            let err = NewEvent::new(t, a, id, &json!({})).unwrap_err().to_string();
            assert!(err.contains(want), "{err} !~ {want}");
        }
        assert!(NewEvent::new("x".repeat(255), "a", "1", &json!(1)).is_ok());
    }

    #[test]
    fn rejects_bad_payloads() {
        let err = NewEvent::from_json("t", "a", "1", "{not json").unwrap_err();
        assert!(matches!(err, Error::Payload(_)));
        let err = NewEvent::new("t", "a", "1", &json!({"s": "a\u{0}b"})).unwrap_err();
        assert!(err.to_string().contains("NUL"), "{err}");
        let e = NewEvent::new("t", "a", "1", &json!({"s": "x".repeat(100)})).unwrap();
        assert!(e
            .check_payload_size(50)
            .unwrap_err()
            .to_string()
            .contains("over the limit"));
        assert!(NewEvent::new("t", "a", "1", &json!(1))
            .unwrap()
            .schema_version(0)
            .is_err());
    }
}

/// W3C Trace Context `traceparent`: `version-traceid-parentid-flags`, lowercase
/// hex; version `ff`, an all-zero trace id or parent id are invalid. Versions
/// after `00` may append fields after a `-`.
fn check_traceparent(value: &str) -> Result<(), Error> {
    let bad = |reason: &str| Error::InvalidEvent {
        field: "traceparent",
        reason: reason.to_owned(),
    };
    let b = value.as_bytes();
    let hex = |r: std::ops::Range<usize>| {
        b[r].iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    };
    if b.len() < 55 || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
        return Err(bad(
            "expected VERSION-TRACEID-PARENTID-FLAGS (2-32-16-2 lowercase hex digits)",
        ));
    }
    if !(hex(0..2) && hex(3..35) && hex(36..52) && hex(53..55)) {
        return Err(bad("must be lowercase hexadecimal digits and dashes"));
    }
    let version = &value[..2];
    if version == "ff" || (version == "00" && b.len() != 55) || (b.len() > 55 && b[55] != b'-') {
        return Err(bad("has an invalid version or length"));
    }
    if b[3..35].iter().all(|&c| c == b'0') || b[36..52].iter().all(|&c| c == b'0') {
        return Err(bad("trace id and parent id must not be all zeros"));
    }
    Ok(())
}

#[cfg(test)]
mod trace_tests {
    use super::*;

    #[test]
    fn trace_context_is_validated_and_stored_in_the_headers() {
        let e = NewEvent::new("a.b", "a", "1", &1).unwrap();
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let e = e
            .headers([("x", "y")])
            .unwrap()
            .trace_context(tp, Some("congo=t61rcWkgMzE"))
            .unwrap();
        let h: serde_json::Value = serde_json::from_str(&e.headers).unwrap();
        assert_eq!(h["traceparent"], tp);
        assert_eq!(h["tracestate"], "congo=t61rcWkgMzE");
        assert_eq!(h["x"], "y");
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0\u{e9}",
        ] {
            let err = NewEvent::new("a.b", "a", "1", &1)
                .unwrap()
                .trace_context(bad, None);
            assert!(err.is_err(), "{bad:?} accepted");
        }
        // A later version may carry more fields.
        assert!(NewEvent::new("a.b", "a", "1", &1)
            .unwrap()
            .trace_context(
                "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-abc",
                None
            )
            .is_ok());
    }
}

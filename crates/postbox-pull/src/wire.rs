//! The JSON of the three calls: requests (checked here, with messages that
//! name the field) and the receive answer (each event the CloudEvents
//! document the push sinks send).

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use postbox_sink::{cloudevents, Message};
use postbox_store::Received;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use std::collections::BTreeMap;
use std::time::Duration;

/// The most receipts one ack takes (the SQL `ack`'s bound).
pub const MAX_RECEIPTS: usize = 10_000;

/// Longest visibility and nack delay (the SQL functions' bound).
const TWELVE_HOURS: f64 = 12.0 * 3600.0;

/// A receipt is `<uuid>:<id>`: far shorter than this.
const MAX_RECEIPT_LEN: usize = 100;

/// `POST /groups/{group}/receive`; every field optional.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiveRequest {
    /// 1 to 1,000 (default 10).
    pub max_events: Option<i32>,
    /// How long the events are hidden from the group's other readers:
    /// 1 second to 12 hours (default 30).
    pub visibility_seconds: Option<f64>,
    /// With nothing to hand out, wait this long for events (default 0, at
    /// most the server's `--max-wait`, 20 s).
    pub wait_seconds: Option<f64>,
}

/// A receive request, checked.
#[derive(Debug, PartialEq)]
pub(crate) struct Ask {
    pub max_events: i32,
    pub visibility: Duration,
    pub wait: Duration,
}

impl ReceiveRequest {
    pub(crate) fn check(&self, max_wait: Duration) -> Result<Ask, String> {
        let max_events = self.max_events.unwrap_or(10);
        if !(1..=1000).contains(&max_events) {
            return Err("max_events: must be 1 to 1000".to_owned());
        }
        let visibility = self.visibility_seconds.unwrap_or(30.0);
        if !(1.0..=TWELVE_HOURS).contains(&visibility) {
            return Err("visibility_seconds: must be 1 to 43200 (12 hours)".to_owned());
        }
        let wait = self.wait_seconds.unwrap_or(0.0);
        let most = max_wait.as_secs_f64();
        if !(0.0..=most).contains(&wait) {
            return Err(format!("wait_seconds: must be 0 to {most} on this server"));
        }
        Ok(Ask {
            max_events,
            visibility: Duration::from_secs_f64(visibility),
            wait: Duration::from_secs_f64(wait),
        })
    }
}

/// `POST /groups/{group}/ack`.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AckRequest {
    /// The receipts of the events done with (1 to 10,000).
    pub receipts: Vec<String>,
}

impl AckRequest {
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.receipts.is_empty() || self.receipts.len() > MAX_RECEIPTS {
            return Err(format!("receipts: give 1 to {MAX_RECEIPTS}"));
        }
        if self
            .receipts
            .iter()
            .any(|r| r.len() > MAX_RECEIPT_LEN || r.contains('\0'))
        {
            return Err("receipts: a receipt is the text receive returned".to_owned());
        }
        Ok(())
    }
}

/// `POST /groups/{group}/nack`.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NackRequest {
    /// The receipt of the event to give back.
    pub receipt: String,
    /// Hand it out again after this long: 0 (the default) to 12 hours.
    pub delay_seconds: Option<f64>,
    /// Why, kept as the event's last error (500 characters are kept; a
    /// dead letter shows it, masked).
    pub error: Option<String>,
}

/// What of a nack's `error` is kept (the SQL `nack` keeps as much).
const MAX_ERROR_CHARS: usize = 500;

impl NackRequest {
    /// The delay, and the error as it is kept: its first 500 characters,
    /// NUL (which PostgreSQL does not store) as a space.
    pub(crate) fn check(&self) -> Result<(Duration, Option<String>), String> {
        if self.receipt.is_empty()
            || self.receipt.len() > MAX_RECEIPT_LEN
            || self.receipt.contains('\0')
        {
            return Err("receipt: the text receive returned is required".to_owned());
        }
        let delay = self.delay_seconds.unwrap_or(0.0);
        if !(0.0..=TWELVE_HOURS).contains(&delay) {
            return Err("delay_seconds: must be 0 to 43200 (12 hours)".to_owned());
        }
        let error = self.error.as_ref().map(|e| {
            e.chars()
                .take(MAX_ERROR_CHARS)
                .map(|c| if c == '\0' { ' ' } else { c })
                .collect()
        });
        Ok((Duration::from_secs_f64(delay), error))
    }
}

#[derive(Serialize)]
struct Handed<'a> {
    receipt: &'a str,
    attempts: i32,
    event: Box<RawValue>,
}

#[derive(Serialize)]
struct Answer<'a> {
    events: Vec<Handed<'a>>,
}

/// The receive answer: `{"events": [{"receipt", "attempts", "event"}]}`.
pub(crate) fn received_body(events: &[Received], source: &str) -> Response {
    let handed = events
        .iter()
        .map(|e| Handed {
            receipt: &e.receipt,
            attempts: e.attempts,
            event: event_json(e, source),
        })
        .collect();
    // Strings, integers and valid raw JSON: serializing cannot fail.
    let body = serde_json::to_string(&Answer { events: handed })
        .unwrap_or_else(|_| r#"{"events":[]}"#.to_owned());
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response()
}

/// One handed-out event as the CloudEvents JSON document a push sink sends.
fn event_json(e: &Received, source: &str) -> Box<RawValue> {
    let payload = serde_json::value::to_raw_value(&e.payload)
        .unwrap_or_else(|_| RawValue::from_string("null".to_owned()).expect("null is JSON"));
    let headers: BTreeMap<String, String> = match &e.headers {
        serde_json::Value::Object(map) => map
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                (k.clone(), v)
            })
            .collect(),
        _ => BTreeMap::new(),
    };
    let message = Message {
        event_id: e.event_id,
        event_type: e.event_type.clone(),
        aggregate_type: e.aggregate_type.clone(),
        aggregate_id: e.aggregate_id.clone(),
        schema_version: e.schema_version,
        payload,
        headers,
        created_at: e.created_at,
        attempt: e.attempts,
        sequence: e.sequence,
        source: None,
    };
    let doc = cloudevents::to_json(&message, source);
    RawValue::from_string(doc)
        .unwrap_or_else(|_| RawValue::from_string("{}".to_owned()).expect("{} is JSON"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receive_requests_are_checked_field_by_field() {
        let max = Duration::from_secs(20);
        assert_eq!(
            ReceiveRequest::default().check(max),
            Ok(Ask {
                max_events: 10,
                visibility: Duration::from_secs(30),
                wait: Duration::ZERO
            })
        );
        let bad = |r: ReceiveRequest| r.check(max).unwrap_err();
        assert!(bad(ReceiveRequest {
            max_events: Some(0),
            ..Default::default()
        })
        .starts_with("max_events"));
        assert!(bad(ReceiveRequest {
            max_events: Some(1001),
            ..Default::default()
        })
        .starts_with("max_events"));
        assert!(bad(ReceiveRequest {
            visibility_seconds: Some(0.5),
            ..Default::default()
        })
        .starts_with("visibility_seconds"));
        assert!(bad(ReceiveRequest {
            visibility_seconds: Some(f64::NAN),
            ..Default::default()
        })
        .starts_with("visibility_seconds"));
        assert!(bad(ReceiveRequest {
            wait_seconds: Some(21.0),
            ..Default::default()
        })
        .starts_with("wait_seconds"));
        assert!(bad(ReceiveRequest {
            wait_seconds: Some(-1.0),
            ..Default::default()
        })
        .starts_with("wait_seconds"));
        assert!(ReceiveRequest {
            wait_seconds: Some(5.0),
            ..Default::default()
        }
        .check(Duration::from_secs(4))
        .is_err());
    }

    #[test]
    fn ack_and_nack_requests_are_checked() {
        assert!(AckRequest::default().check().is_err());
        assert!(AckRequest {
            receipts: vec!["a".into(); MAX_RECEIPTS + 1]
        }
        .check()
        .is_err());
        assert!(AckRequest {
            receipts: vec!["x".repeat(101)]
        }
        .check()
        .is_err());
        assert!(AckRequest {
            receipts: vec!["b:1".into()]
        }
        .check()
        .is_ok());
        assert!(NackRequest::default().check().is_err());
        let nack = |d: f64| NackRequest {
            receipt: "b:1".into(),
            delay_seconds: Some(d),
            error: None,
        };
        assert_eq!(nack(2.5).check(), Ok((Duration::from_millis(2500), None)));
        let long = NackRequest {
            receipt: "b:1".into(),
            delay_seconds: None,
            error: Some(format!("a\0b{}", "é".repeat(600))),
        };
        let (_, kept) = long.check().unwrap();
        let kept = kept.unwrap();
        assert_eq!(kept.chars().count(), 500);
        assert!(kept.starts_with("a b"));
        assert!(AckRequest {
            receipts: vec!["b:\u{0}1".into()]
        }
        .check()
        .is_err());
        assert!(NackRequest {
            receipt: "\0".into(),
            ..Default::default()
        }
        .check()
        .is_err());
        assert!(nack(-1.0).check().is_err());
        assert!(nack(f64::INFINITY).check().is_err());
    }

    #[test]
    fn unknown_fields_are_refused() {
        assert!(serde_json::from_str::<ReceiveRequest>(r#"{"max": 5}"#).is_err());
        assert!(serde_json::from_str::<AckRequest>(r#"{"receipts": [], "all": true}"#).is_err());
    }
}

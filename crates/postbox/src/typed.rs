//! Typed, versioned events: declare an event type's name and schema version once,
//! enqueue serde values, and decode them by (type, version) on the consumer side.
//!
//! ```
//! use postbox::typed::{Decoder, Event};
//! use postbox::NewEvent;
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize)]
//! struct OrderPlaced { order_id: u64, total_cents: i64 }
//!
//! impl Event for OrderPlaced {
//!     const TYPE: &'static str = "order.placed";
//!     const VERSION: i32 = 1;
//!     fn aggregate(&self) -> (&str, String) { ("order", self.order_id.to_string()) }
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let event = NewEvent::typed(&OrderPlaced { order_id: 7, total_cents: 990 })?;
//! assert_eq!(event.event_type(), "order.placed");
//!
//! // Consumer: one enum of everything it handles, one decoder built at start-up.
//! enum Incoming { Placed(OrderPlaced) }
//! let decoder = Decoder::new().register(Incoming::Placed);
//! let Incoming::Placed(p) = decoder.decode("order.placed", 1, r#"{"order_id":7,"total_cents":990,"new_field":true}"#)?;
//! assert_eq!(p.order_id, 7);
//! # Ok(()) }
//! ```
//!
//! Evolving a payload: adding an optional field (`#[serde(default)]`) keeps the
//! version, and old consumers ignore fields they do not know (serde's default;
//! do not use `deny_unknown_fields` on event types). Any other change is a new
//! `VERSION`; keep decoding the old one by registering its struct with a
//! conversion: `.register(|v1: OrderPlacedV1| Incoming::Placed(v1.into()))`.
//!
//! A payload that no longer decodes is a poison event, not a reason to stop:
//! answer it with a rejection carrying [`DecodeError::reason`] (the relay's
//! `Outcome::reject`, or your consumer's dead-letter path) and carry on.

use crate::{Error, NewEvent};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::HashMap;
use std::fmt;

/// An event type with a fixed name and payload schema version.
pub trait Event: Serialize + DeserializeOwned {
    /// The event type, e.g. `order.placed` (1 to 255 bytes).
    const TYPE: &'static str;
    /// The payload's schema version, at least 1. Bump it for any change that is
    /// not an added optional field.
    const VERSION: i32;
    /// The aggregate this event is about: (aggregate type, aggregate id).
    fn aggregate(&self) -> (&str, String);
}

impl NewEvent {
    /// An event built from a typed value: its type, version and aggregate come
    /// from the [`Event`] implementation, its payload is the value as JSON.
    pub fn typed<E: Event>(event: &E) -> Result<Self, Error> {
        let (aggregate_type, aggregate_id) = event.aggregate();
        NewEvent::new(E::TYPE, aggregate_type, aggregate_id, event)?.schema_version(E::VERSION)
    }
}

/// Why an event could not be decoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// No decoder is registered for this event type.
    #[error("unknown event type {event_type:?}")]
    UnknownType { event_type: String },
    /// The type is known, but not this schema version.
    #[error("event type {event_type:?} has no decoder for schema version {version} (known versions: {known:?})")]
    UnknownVersion {
        event_type: String,
        version: i32,
        known: Vec<i32>,
    },
    /// The payload does not match the registered type for (type, version).
    #[error("payload of {event_type:?} version {version} does not decode")]
    Payload {
        event_type: String,
        version: i32,
        #[source]
        source: serde_json::Error,
    },
}

impl DecodeError {
    /// A one-line reason for a dead letter's `last_error`: what failed, and for
    /// a payload, serde's description of where (e.g. `missing field `total` at
    /// line 1 column 12`). The relay sanitizes and bounds it again before storing.
    pub fn reason(&self) -> String {
        let text = match self {
            DecodeError::Payload { source, .. } => format!("{self}: {source}"),
            _ => self.to_string(),
        };
        let text = text.replace(['\n', '\r'], " ");
        const MAX: usize = 500;
        if text.len() <= MAX {
            return text;
        }
        let mut cut = MAX;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        format!("{}…", &text[..cut])
    }
}

/// Decode one payload as `E`, checking that `event_type` and `version` are `E`'s.
pub fn decode<E: Event>(event_type: &str, version: i32, payload: &str) -> Result<E, DecodeError> {
    if event_type != E::TYPE {
        return Err(DecodeError::UnknownType {
            event_type: event_type.to_owned(),
        });
    }
    if version != E::VERSION {
        return Err(DecodeError::UnknownVersion {
            event_type: event_type.to_owned(),
            version,
            known: vec![E::VERSION],
        });
    }
    serde_json::from_str(payload).map_err(|source| DecodeError::Payload {
        event_type: event_type.to_owned(),
        version,
        source,
    })
}

type DecodeFn<T> = Box<dyn Fn(&str) -> Result<T, serde_json::Error> + Send + Sync>;

/// Decodes payloads by (event type, schema version) into the consumer's own type `T`
/// (usually an enum of every event it handles). Build it once at start-up.
pub struct Decoder<T> {
    entries: HashMap<(&'static str, i32), DecodeFn<T>>,
}

impl<T> Default for Decoder<T> {
    fn default() -> Self {
        Self {
            entries: HashMap::new(),
        }
    }
}

impl<T> fmt::Debug for Decoder<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut keys: Vec<_> = self.entries.keys().collect();
        keys.sort();
        f.debug_struct("Decoder").field("events", &keys).finish()
    }
}

impl<T> Decoder<T> {
    /// A decoder that knows no event yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Decode (`E::TYPE`, `E::VERSION`) as `E`, then turn it into `T` with `into`
    /// (an enum variant, or a conversion from an older version). Registering the
    /// same (type, version) twice keeps the last.
    pub fn register<E: Event + 'static>(
        mut self,
        into: impl Fn(E) -> T + Send + Sync + 'static,
    ) -> Self {
        self.entries.insert(
            (E::TYPE, E::VERSION),
            Box::new(move |payload| serde_json::from_str::<E>(payload).map(&into)),
        );
        self
    }

    /// Decode a payload (JSON text) of `event_type` at schema `version`.
    pub fn decode(&self, event_type: &str, version: i32, payload: &str) -> Result<T, DecodeError> {
        match self.entries.get(&(event_type, version)) {
            Some(decode) => decode(payload).map_err(|source| DecodeError::Payload {
                event_type: event_type.to_owned(),
                version,
                source,
            }),
            None => {
                let mut known: Vec<i32> = self
                    .entries
                    .keys()
                    .filter(|(t, _)| *t == event_type)
                    .map(|(_, v)| *v)
                    .collect();
                known.sort_unstable();
                if known.is_empty() {
                    Err(DecodeError::UnknownType {
                        event_type: event_type.to_owned(),
                    })
                } else {
                    Err(DecodeError::UnknownVersion {
                        event_type: event_type.to_owned(),
                        version,
                        known,
                    })
                }
            }
        }
    }

    /// Whether (type, version) has a decoder.
    pub fn knows(&self, event_type: &str, version: i32) -> bool {
        self.entries.contains_key(&(event_type, version))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct PlacedV1 {
        order_id: u64,
    }
    impl Event for PlacedV1 {
        const TYPE: &'static str = "order.placed";
        const VERSION: i32 = 1;
        fn aggregate(&self) -> (&str, String) {
            ("order", self.order_id.to_string())
        }
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct PlacedV2 {
        order_id: u64,
        total_cents: i64,
        #[serde(default)]
        coupon: Option<String>,
    }
    impl Event for PlacedV2 {
        const TYPE: &'static str = "order.placed";
        const VERSION: i32 = 2;
        fn aggregate(&self) -> (&str, String) {
            ("order", self.order_id.to_string())
        }
    }

    #[derive(Debug, PartialEq)]
    enum Incoming {
        Placed(PlacedV2),
    }

    fn decoder() -> Decoder<Incoming> {
        Decoder::new()
            .register(Incoming::Placed)
            .register(|v1: PlacedV1| {
                Incoming::Placed(PlacedV2 {
                    order_id: v1.order_id,
                    total_cents: 0,
                    coupon: None,
                })
            })
    }

    #[test]
    fn typed_events_carry_type_version_and_aggregate() {
        let e = NewEvent::typed(&PlacedV2 {
            order_id: 9,
            total_cents: 100,
            coupon: None,
        })
        .unwrap();
        assert_eq!(e.event_type, "order.placed");
        assert_eq!(e.schema_version, 2);
        assert_eq!(
            (e.aggregate_type.as_str(), e.aggregate_id.as_str()),
            ("order", "9")
        );
        assert_eq!(
            decode::<PlacedV2>("order.placed", 2, &e.payload)
                .unwrap()
                .order_id,
            9
        );
    }

    #[test]
    fn unknown_additive_fields_are_ignored_and_old_versions_upcast() {
        let d = decoder();
        let newer = r#"{"order_id": 1, "total_cents": 5, "gift_wrap": true, "coupon": "X"}"#;
        assert_eq!(
            d.decode("order.placed", 2, newer).unwrap(),
            Incoming::Placed(PlacedV2 {
                order_id: 1,
                total_cents: 5,
                coupon: Some("X".into())
            })
        );
        let old = r#"{"order_id": 2}"#;
        let Incoming::Placed(p) = d.decode("order.placed", 1, old).unwrap();
        assert_eq!((p.order_id, p.total_cents), (2, 0));
        assert!(d.knows("order.placed", 1) && !d.knows("order.placed", 3));
    }

    #[test]
    fn undecodable_events_have_a_clear_reason() {
        let d = decoder();
        let e = d.decode("order.shipped", 1, "{}").unwrap_err();
        assert!(matches!(e, DecodeError::UnknownType { .. }));
        assert_eq!(e.reason(), r#"unknown event type "order.shipped""#);
        let e = d.decode("order.placed", 3, "{}").unwrap_err();
        assert_eq!(
            e.reason(),
            r#"event type "order.placed" has no decoder for schema version 3 (known versions: [1, 2])"#
        );
        let e = d
            .decode("order.placed", 2, r#"{"order_id": 1}"#)
            .unwrap_err();
        assert!(std::error::Error::source(&e).is_some());
        let reason = e.reason();
        assert!(
            reason.starts_with(r#"payload of "order.placed" version 2 does not decode: missing field `total_cents`"#),
            "{reason}"
        );
        let e = decode::<PlacedV1>("order.placed", 2, "{}").unwrap_err();
        assert!(matches!(e, DecodeError::UnknownVersion { version: 2, .. }));
        let long = d
            .decode(
                "order.placed",
                2,
                &format!(r#"{{"order_id": "{}"}}"#, "x".repeat(2000)),
            )
            .unwrap_err()
            .reason();
        assert!(long.len() <= 504, "bounded: {}", long.len());
    }
}

//! Destination names with placeholders (`postbox:{event_type}`): Redis keys,
//! NATS subjects, AMQP routing keys, Kafka topics.

use postbox_sink::{Message, SinkError};

/// A destination name with placeholders, parsed once at start-up:
/// `{event_type}`, `{aggregate_type}`, `{aggregate_id}`.
#[derive(Clone, Debug, PartialEq)]
pub struct KeyTemplate {
    parts: Vec<Part>,
    source: String,
}

#[derive(Clone, Debug, PartialEq)]
enum Part {
    Text(String),
    EventType,
    AggregateType,
    AggregateId,
}

impl KeyTemplate {
    /// Parse `template`; unknown or unclosed placeholders are errors naming `field`.
    pub fn parse(field: &str, template: &str) -> Result<Self, SinkError> {
        if template.is_empty() {
            return Err(SinkError::Config(format!("{field}: must not be empty")));
        }
        let mut parts = Vec::new();
        let mut rest = template;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(Part::Text(rest[..open].to_owned()));
            }
            let close = rest[open..].find('}').ok_or_else(|| {
                SinkError::Config(format!("{field}: unclosed '{{' in {template:?}"))
            })?;
            let name = &rest[open + 1..open + close];
            parts.push(match name {
                "event_type" => Part::EventType,
                "aggregate_type" => Part::AggregateType,
                "aggregate_id" => Part::AggregateId,
                other => {
                    return Err(SinkError::Config(format!(
                        "{field}: unknown placeholder {{{other}}} in {template:?}; \
                         use {{event_type}}, {{aggregate_type}} or {{aggregate_id}}"
                    )))
                }
            });
            rest = &rest[open + close + 1..];
        }
        if !rest.is_empty() {
            parts.push(Part::Text(rest.to_owned()));
        }
        Ok(Self {
            parts,
            source: template.to_owned(),
        })
    }

    /// The name for one message.
    pub fn render(&self, m: &Message) -> String {
        let mut out = String::new();
        for p in &self.parts {
            match p {
                Part::Text(t) => out.push_str(t),
                Part::EventType => out.push_str(&m.event_type),
                Part::AggregateType => out.push_str(&m.aggregate_type),
                Part::AggregateId => out.push_str(&m.aggregate_id),
            }
        }
        out
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }
}

/// `template` with every placeholder replaced by one token (`x`), so its
/// literal text can be checked as a rendered name would be (an unclosed
/// placeholder drops the rest).
#[cfg(any(feature = "nats", feature = "kafka"))]
pub(crate) fn with_placeholders_filled(template: &str) -> String {
    let mut out = String::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        out.push('x');
        rest = rest[open..]
            .find('}')
            .map_or("", |close| &rest[open + close + 1..]);
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        let t = KeyTemplate::parse("key", "postbox:{event_type}:{aggregate_id}").unwrap();
        assert_eq!(t.parts.len(), 4);
        let err = KeyTemplate::parse("key", "x:{nope}")
            .unwrap_err()
            .to_string();
        assert!(err.contains("key: unknown placeholder {nope}"), "{err}");
        assert!(KeyTemplate::parse("key", "x:{event_type").is_err());
        assert!(KeyTemplate::parse("key", "").is_err());
    }

    #[cfg(any(feature = "nats", feature = "kafka"))]
    #[test]
    fn fills_placeholders_for_checking() {
        assert_eq!(with_placeholders_filled("a.{event_type}.b"), "a.x.b");
        assert_eq!(with_placeholders_filled("{event_type}{aggregate_id}"), "xx");
        assert_eq!(with_placeholders_filled("a.{event_type"), "a.x");
        assert_eq!(with_placeholders_filled("plain"), "plain");
    }
}

//! The parts of a sink URL more than one sink reads the same way: query
//! parameters (`?timeout=5s&tls=true`) and percent-encoded user-info.
//!
//! Each helper is built only with the sinks that use it.

#[cfg(any(
    feature = "redis",
    feature = "nats",
    feature = "amqp",
    feature = "kafka",
    feature = "aws"
))]
use postbox_sink::SinkError;

/// The error for a query parameter the sink does not take, listing those it
/// does: `sink URL parameter "colour" is unknown; expected mode, key or maxlen`.
#[cfg(any(
    feature = "redis",
    feature = "nats",
    feature = "amqp",
    feature = "kafka",
    feature = "aws"
))]
pub(crate) fn unknown(name: &str, expected: &[&str]) -> SinkError {
    let list = match expected {
        [] => String::new(),
        [only] => (*only).to_owned(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    };
    SinkError::Config(format!(
        "sink URL parameter {:?} is unknown; expected {list}",
        postbox::redact::sanitize_error(name)
    ))
}

/// The `timeout` URL parameter the broker sinks take: a positive duration
/// such as `5s` or `500ms`.
#[cfg(any(feature = "nats", feature = "amqp", feature = "kafka", feature = "aws"))]
pub(crate) fn timeout(value: &str) -> Result<std::time::Duration, SinkError> {
    humantime::parse_duration(value)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            SinkError::Config(format!(
                "sink URL parameter timeout: expected a duration like 5s or 500ms, got {value:?}"
            ))
        })
}

/// A yes/no URL parameter: `true`, `1`, `yes` or `false`, `0`, `no`.
#[cfg(feature = "nats")]
pub(crate) fn boolean(name: &str, value: &str) -> Result<bool, SinkError> {
    match value {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        other => Err(SinkError::Config(format!(
            "sink URL parameter {name}: expected true or false, got {other:?}"
        ))),
    }
}

/// Percent-decoded user-info (a user name, a password, a vhost), or `None`
/// when it is not valid UTF-8 once decoded; the caller words the error,
/// which must not repeat the value.
#[cfg(any(feature = "nats", feature = "amqp", feature = "http"))]
pub(crate) fn percent_decode(s: &str) -> Option<String> {
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .ok()
        .map(|c| c.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(any(
        feature = "redis",
        feature = "nats",
        feature = "amqp",
        feature = "kafka"
    ))]
    #[test]
    fn unknown_parameters_list_the_known_ones() {
        let e = unknown("colour", &["mode", "key", "maxlen"]).to_string();
        assert!(
            e.ends_with("sink URL parameter \"colour\" is unknown; expected mode, key or maxlen"),
            "{e}"
        );
        let e = unknown("x", &["topic"]).to_string();
        assert!(e.ends_with("expected topic"), "{e}");
    }

    #[cfg(any(feature = "nats", feature = "amqp", feature = "kafka", feature = "aws"))]
    #[test]
    fn timeouts_are_positive_durations() {
        assert_eq!(
            timeout("500ms").unwrap(),
            std::time::Duration::from_millis(500)
        );
        for bad in ["0s", "soon", "", "-1s"] {
            let e = timeout(bad).unwrap_err().to_string();
            assert!(e.contains("timeout: expected a duration"), "{bad}: {e}");
        }
    }

    #[cfg(any(feature = "nats", feature = "amqp", feature = "http"))]
    #[test]
    fn decodes_user_info() {
        assert_eq!(percent_decode("s%40cret").as_deref(), Some("s@cret"));
        assert_eq!(percent_decode("%ff"), None);
    }
}

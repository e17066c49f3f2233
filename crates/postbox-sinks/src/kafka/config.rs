//! The Kafka sink's URL: `kafka://BROKER:PORT[,…]?topic=…&timeout=…&rdkafka.NAME=…`,
//! and the topic rules, checked before anything is sent. The sink has no
//! options table.

use crate::shared::{params, with_placeholders_filled};
use crate::KeyTemplate;
use postbox::redact::sanitize_error;
use postbox_sink::{Secrets, SinkError};
use rdkafka::ClientConfig;
use std::time::Duration;

const DEFAULT_TOPIC: &str = "postbox.{event_type}";
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(20);
/// Properties the sink sets itself.
const FIXED: [&str; 4] = [
    "bootstrap.servers",
    "enable.idempotence",
    "acks",
    "message.timeout.ms",
];

/// What a sink URL asks for.
pub(crate) struct KafkaConfig {
    /// The producer's librdkafka properties (values never printed).
    pub client: ClientConfig,
    pub topic: KeyTemplate,
    pub timeout: Duration,
    /// The brokers and the topic template.
    pub described: String,
    /// The values of secret-bearing properties (see [`secret_property`]).
    pub secrets: Secrets,
}

impl KafkaConfig {
    /// Parse and check the sink URL.
    pub(crate) fn from_url(raw: &str) -> Result<Self, SinkError> {
        let rest = raw.strip_prefix("kafka://").ok_or_else(|| {
            SinkError::Config(
                "sink URL: expected kafka://BROKER:PORT[,BROKER:PORT]?topic=TEMPLATE".into(),
            )
        })?;
        let (brokers, query) = rest.split_once('?').unwrap_or((rest, ""));
        let brokers = brokers.trim_end_matches('/');
        if brokers.contains('@') {
            return Err(SinkError::Config(
                "sink URL: credentials in a kafka:// URL are not supported (this build has no SASL)".into(),
            ));
        }
        if brokers.is_empty()
            || brokers
                .split(',')
                .any(|b| b.is_empty() || b.contains(|c: char| c.is_whitespace() || c == '/'))
        {
            return Err(SinkError::Config(format!(
                "sink URL: expected a comma-separated list of BROKER:PORT, got {:?}",
                sanitize_error(brokers)
            )));
        }
        let mut topic = DEFAULT_TOPIC.to_owned();
        let mut timeout = DEFAULT_TIMEOUT;
        let mut config = ClientConfig::new();
        let mut secrets = Secrets::new();
        for (name, value) in url::form_urlencoded::parse(query.as_bytes()) {
            match name.as_ref() {
                "topic" => topic = value.into_owned(),
                "timeout" => timeout = params::timeout(&value)?,
                other => match other.strip_prefix("rdkafka.") {
                    Some(property) if FIXED.contains(&property) => {
                        return Err(SinkError::Config(format!(
                            "sink URL parameter {other}: {property} is set by postbox and cannot be overridden"
                        )))
                    }
                    Some(property) if !property.is_empty() => {
                        if secret_property(property) {
                            secrets.add(&value);
                        }
                        config.set(property, value.as_ref());
                    }
                    _ => return Err(params::unknown(other, &["topic", "timeout", "rdkafka.PROPERTY"])),
                },
            }
        }
        check_topic_template(&topic)?;
        let template = KeyTemplate::parse("sink URL parameter topic", &topic)?;
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        config
            .set("bootstrap.servers", brokers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("message.timeout.ms", timeout_ms.to_string());
        if config.get("client.id").is_none() {
            config.set("client.id", "postbox-relay");
        }
        Ok(Self {
            client: config,
            described: format!("kafka://{brokers} topic {topic}"),
            topic: template,
            timeout,
            secrets,
        })
    }
}

/// Whether a librdkafka property holds a credential (`sasl.password`,
/// `ssl.key.password`, `sasl.oauthbearer.client.secret`, `ssl.key.pem`,
/// `sasl.jaas.config`, …): its value is masked in every error.
pub(crate) fn secret_property(property: &str) -> bool {
    let p = property.to_ascii_lowercase();
    [
        "password",
        "secret",
        "token",
        ".pem",
        "jaas",
        "oauthbearer.config",
        "credential",
    ]
    .iter()
    .any(|w| p.contains(w))
}

fn check_topic_template(template: &str) -> Result<(), SinkError> {
    check_topic(&with_placeholders_filled(template))
        .map_err(|why| SinkError::Config(format!("sink URL parameter topic: {template:?} {why}")))
}

/// Why `topic` is not a valid Kafka topic name.
pub(crate) fn check_topic(topic: &str) -> Result<(), &'static str> {
    if topic.is_empty() || topic.len() > 249 {
        return Err("must be 1 to 249 characters long");
    }
    if topic == "." || topic == ".." {
        return Err("cannot be '.' or '..'");
    }
    if !topic
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err("may only contain A-Z, a-z, 0-9, '.', '_' and '-'");
    }
    Ok(())
}

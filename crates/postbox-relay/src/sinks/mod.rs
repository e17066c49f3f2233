//! The transports. Each sink is built from a URL (`--sink`) plus the shared
//! [`SinkOptions`]; [`from_url`] picks the sink by scheme.

pub mod amqp;
pub mod http;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod nats;
pub mod qstash;
mod rate;
pub mod redis;
pub mod stdout;
mod template;

pub use template::KeyTemplate;

use crate::sink::{Sink, SinkError};
use std::sync::Arc;

/// Settings every sink shares.
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct SinkOptions {
    /// The CloudEvents `source` attribute of every message.
    #[serde(default = "default_source")]
    pub source: String,
    /// Settings of the HTTP webhook sink (`http://`, `https://`).
    #[serde(default)]
    pub http: http::HttpOptions,
    /// Settings of the QStash sink (`qstash:`).
    #[serde(default)]
    pub qstash: qstash::QstashOptions,
}

fn default_source() -> String {
    crate::cloudevents::DEFAULT_SOURCE.to_owned()
}

impl Default for SinkOptions {
    fn default() -> Self {
        Self {
            source: default_source(),
            http: http::HttpOptions::default(),
            qstash: qstash::QstashOptions::default(),
        }
    }
}

/// Build the sink a URL names: `redis://…`, `rediss://…`, `nats://…`,
/// `amqp://…`, `amqps://…`, `kafka://…` (cargo feature `kafka`), `http://…`,
/// `https://…` (webhooks), `qstash:DESTINATION_URL` or `stdout`.
///
/// The HTTP sink reads its signing secrets (`POSTBOX_WEBHOOK_SECRET`, or the
/// variable `http.secret_env` names) and the QStash sink its token
/// (`QSTASH_TOKEN`, `QSTASH_URL`) from the environment here, once.
pub fn from_url(url: &str, options: &SinkOptions) -> Result<Arc<dyn Sink>, SinkError> {
    if options.source.is_empty() {
        return Err(SinkError::Config(
            "sink.source: the CloudEvents source must not be empty".into(),
        ));
    }
    let scheme = url.split_once(':').map_or(url, |(s, _)| s);
    match scheme {
        "stdout" => Ok(Arc::new(stdout::StdoutSink::new(options.clone()))),
        "redis" | "rediss" => Ok(Arc::new(redis::RedisSink::from_url(url, options.clone())?)),
        "nats" => Ok(Arc::new(nats::NatsSink::from_url(url, options.clone())?)),
        "amqp" | "amqps" => Ok(Arc::new(amqp::AmqpSink::from_url(url, options.clone())?)),
        "http" | "https" => Ok(Arc::new(http::HttpSink::from_url(url, options.clone())?)),
        "qstash" => Ok(Arc::new(qstash::QstashSink::from_url(url, options.clone())?)),
        #[cfg(feature = "kafka")]
        "kafka" => Ok(Arc::new(kafka::KafkaSink::from_url(url, options.clone())?)),
        #[cfg(not(feature = "kafka"))]
        "kafka" => Err(SinkError::Config(
            "the kafka sink is not built into this binary: build postbox with --features kafka"
                .into(),
        )),
        _ => Err(SinkError::Config(format!(
            "unsupported sink {:?}: expected redis://, nats://, amqp://, kafka://, http://, https://, qstash: or stdout",
            crate::redact::sanitize_error(scheme)
        ))),
    }
}

/// The `timeout` URL parameter every broker sink takes: a positive duration
/// such as `5s` or `500ms`.
pub(crate) fn parse_timeout(value: &str) -> Result<std::time::Duration, SinkError> {
    humantime::parse_duration(value)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            SinkError::Config(format!(
                "sink URL parameter timeout: expected a duration like 5s or 500ms, got {value:?}"
            ))
        })
}

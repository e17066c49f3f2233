//! The RabbitMQ sink's URL: `amqp://USER:PASSWORD@HOST:PORT/VHOST?exchange=…`,
//! checked before anything is sent. The sink has no options table.

use crate::shared::params::{self, percent_decode};
use crate::KeyTemplate;
use lapin::types::ShortString;
use lapin::uri::{AMQPAuthority, AMQPQueryString, AMQPScheme, AMQPUri, AMQPUserInfo};
use postbox::redact::sanitize_error;
use postbox_sink::SinkError;
use std::time::Duration;

const DEFAULT_ROUTING_KEY: &str = "{event_type}";
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// What an unroutable (returned) message becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unroutable {
    /// Dead-letter it: the topology has no queue for it.
    Reject,
    /// Retry it with backoff: a queue may be bound later.
    Retry,
}

/// What a sink URL asks for.
pub(crate) struct AmqpConfig {
    /// Where to connect, with the credentials (never printed).
    pub uri: AMQPUri,
    pub exchange: ShortString,
    pub routing_key: KeyTemplate,
    pub unroutable: Unroutable,
    pub timeout: Duration,
    /// The URL without credentials, the exchange and the routing key.
    pub described: String,
}

impl AmqpConfig {
    /// Parse and check the sink URL.
    pub(crate) fn from_url(raw: &str) -> Result<Self, SinkError> {
        let url = url::Url::parse(raw).map_err(|e| {
            SinkError::Config(format!(
                "sink URL is not a valid amqp:// URL: {}",
                sanitize_error(&e.to_string())
            ))
        })?;
        let scheme = match url.scheme() {
            "amqp" => AMQPScheme::AMQP,
            "amqps" => AMQPScheme::AMQPS,
            other => {
                return Err(SinkError::Config(format!(
                    "sink URL scheme {other:?} is not amqp or amqps"
                )))
            }
        };
        let host = url
            .host_str()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| SinkError::Config("sink URL: the AMQP host is missing".into()))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = url.port().unwrap_or_else(|| scheme.default_port());
        let defaults = AMQPUserInfo::default();
        let username = match url.username() {
            "" => defaults.username,
            u => decode(u, "user name")?,
        };
        let password = match url.password() {
            None => defaults.password,
            Some(p) => decode(p, "password")?,
        };
        let vhost = match url.path() {
            "" | "/" => "/".to_owned(),
            path => decode(&path[1..], "vhost")?,
        };

        let mut exchange = None;
        let mut routing_key = DEFAULT_ROUTING_KEY.to_owned();
        let mut unroutable = Unroutable::Reject;
        let mut timeout = DEFAULT_TIMEOUT;
        let mut query = AMQPQueryString::default();
        for (name, value) in url.query_pairs() {
            match name.as_ref() {
                "exchange" => exchange = Some(value.into_owned()),
                "routing_key" => routing_key = value.into_owned(),
                "unroutable" => {
                    unroutable = match value.as_ref() {
                        "reject" => Unroutable::Reject,
                        "retry" => Unroutable::Retry,
                        other => {
                            return Err(SinkError::Config(format!(
                        "sink URL parameter unroutable: expected reject or retry, got {other:?}"
                    )))
                        }
                    }
                }
                "timeout" => timeout = params::timeout(&value)?,
                "heartbeat" => {
                    query.heartbeat = Some(value.parse::<u16>().map_err(|_| {
                        SinkError::Config(format!(
                        "sink URL parameter heartbeat: expected seconds (0-65535), got {value:?}"
                    ))
                    })?)
                }
                other => {
                    return Err(params::unknown(
                        other,
                        &[
                            "exchange",
                            "routing_key",
                            "unroutable",
                            "timeout",
                            "heartbeat",
                        ],
                    ))
                }
            }
        }
        let exchange = exchange.ok_or_else(|| {
            SinkError::Config(
                "sink URL parameter exchange is required (exchange= selects the default exchange)"
                    .into(),
            )
        })?;
        let exchange = ShortString::try_new(exchange).map_err(|_| {
            SinkError::Config("sink URL parameter exchange: longer than 255 bytes".into())
        })?;
        let routing_key = KeyTemplate::parse("sink URL parameter routing_key", &routing_key)?;
        query.connection_timeout = Some(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));

        let described = format!(
            "{}://{}:{}/{} exchange {:?} routing_key {}{}",
            url.scheme(),
            url.host_str().unwrap_or_default(),
            port,
            url.path().trim_start_matches('/'),
            exchange.as_str(),
            routing_key.as_str(),
            match unroutable {
                Unroutable::Reject => "",
                Unroutable::Retry => " unroutable=retry",
            }
        );
        Ok(Self {
            uri: AMQPUri {
                scheme,
                authority: AMQPAuthority {
                    userinfo: AMQPUserInfo { username, password },
                    host,
                    port,
                },
                vhost,
                query,
            },
            exchange,
            routing_key,
            unroutable,
            timeout,
            described,
        })
    }
}

fn decode(s: &str, what: &str) -> Result<String, SinkError> {
    percent_decode(s)
        .ok_or_else(|| SinkError::Config(format!("sink URL: the {what} is not valid UTF-8")))
}

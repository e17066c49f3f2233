//! Redis: `LPUSH` to a list (default) or `XADD` to a stream, pipelined per batch.
//!
//! URL: `redis://[USER:PASSWORD@]HOST:PORT[/DB][?mode=list|stream&key=TEMPLATE&maxlen=N]`
//! (`rediss://` for TLS). `key` defaults to `postbox:{event_type}`; placeholders
//! are `{event_type}`, `{aggregate_type}` and `{aggregate_id}`. In stream mode
//! each entry has the fields `id` (event id), `type` and `body` (the CloudEvents
//! JSON) plus one field per producer header (`h:NAME`); `maxlen` trims the
//! stream approximately (`MAXLEN ~ N`).
//!
//! A reply to the whole pipeline is the only acknowledgement Redis gives: any
//! error makes the whole batch a retry (a retry may duplicate entries; consumers
//! deduplicate on the event id).

use super::{KeyTemplate, SinkOptions};
use crate::cloudevents;
use crate::sink::{Message, Outcome, Sink, SinkError};
use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use std::time::Duration;
use tokio::sync::Mutex;

/// How messages are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `LPUSH key body`: consumers `BRPOP` (oldest first).
    List,
    /// `XADD key * id … type … body …`: consumer groups, replay, acknowledgements.
    Stream,
}

pub struct RedisSink {
    client: redis::Client,
    connection: Mutex<Option<ConnectionManager>>,
    mode: Mode,
    key: KeyTemplate,
    maxlen: Option<usize>,
    options: SinkOptions,
    described: String,
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);

impl RedisSink {
    /// Parse the sink URL; connects lazily.
    pub fn from_url(raw: &str, options: SinkOptions) -> Result<Self, SinkError> {
        let mut url = url::Url::parse(raw)
            .map_err(|e| SinkError::Config(format!("sink URL is not a valid redis:// URL: {e}")))?;
        let mut mode = Mode::List;
        let mut key = "postbox:{event_type}".to_owned();
        let mut maxlen = None;
        let mut passthrough = Vec::new();
        for (name, value) in url.query_pairs() {
            match name.as_ref() {
                "mode" => {
                    mode = match value.as_ref() {
                        "list" => Mode::List,
                        "stream" => Mode::Stream,
                        other => {
                            return Err(SinkError::Config(format!(
                                "sink URL parameter mode: expected list or stream, got {other:?}"
                            )))
                        }
                    }
                }
                "key" => key = value.into_owned(),
                "maxlen" => {
                    maxlen = Some(value.parse::<usize>().ok().filter(|n| *n > 0).ok_or_else(
                        || {
                            SinkError::Config(format!(
                            "sink URL parameter maxlen: expected a positive integer, got {value:?}"
                        ))
                        },
                    )?)
                }
                // Connection parameters the redis client understands.
                "protocol" | "insecure" => {
                    passthrough.push((name.into_owned(), value.into_owned()))
                }
                other => {
                    return Err(SinkError::Config(format!(
                        "sink URL parameter {other:?} is unknown; expected mode, key or maxlen"
                    )))
                }
            }
        }
        if maxlen.is_some() && mode == Mode::List {
            return Err(SinkError::Config(
                "sink URL parameter maxlen: only applies to mode=stream".into(),
            ));
        }
        let key = KeyTemplate::parse("sink URL parameter key", &key)?;
        url.set_query(None);
        if !passthrough.is_empty() {
            url.query_pairs_mut().extend_pairs(passthrough);
        }
        let described = format!(
            "{}://{}:{}{} {} {}",
            url.scheme(),
            url.host_str().unwrap_or("localhost"),
            url.port().unwrap_or(6379),
            url.path(),
            match mode {
                Mode::List => "list",
                Mode::Stream => "stream",
            },
            key.as_str()
        );
        let client = redis::Client::open(url.as_str()).map_err(|e| {
            SinkError::Config(format!(
                "sink URL is not a valid Redis URL: {}",
                crate::redact::sanitize_error(&e.to_string())
            ))
        })?;
        Ok(Self {
            client,
            connection: Mutex::new(None),
            mode,
            key,
            maxlen,
            options,
            described,
        })
    }

    async fn connection(&self) -> Result<ConnectionManager, redis::RedisError> {
        let mut slot = self.connection.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(CONNECT_TIMEOUT)
            .set_response_timeout(RESPONSE_TIMEOUT)
            .set_number_of_retries(2)
            .set_max_delay(1000);
        let c = ConnectionManager::new_with_config(self.client.clone(), config).await?;
        *slot = Some(c.clone());
        Ok(c)
    }

    fn pipeline(&self, batch: &[Message]) -> redis::Pipeline {
        let mut pipe = redis::pipe();
        for m in batch {
            let key = self.key.render(m);
            let body = cloudevents::to_json(m, &self.options.source);
            match self.mode {
                Mode::List => {
                    pipe.cmd("LPUSH").arg(key).arg(body).ignore();
                }
                Mode::Stream => {
                    let cmd = pipe.cmd("XADD").arg(key);
                    if let Some(n) = self.maxlen {
                        cmd.arg("MAXLEN").arg("~").arg(n);
                    }
                    cmd.arg("*")
                        .arg("id")
                        .arg(m.event_id.to_string())
                        .arg("type")
                        .arg(&m.event_type)
                        .arg("body")
                        .arg(body);
                    for (name, value) in &m.headers {
                        cmd.arg(format!("h:{name}")).arg(value);
                    }
                    cmd.ignore();
                }
            }
        }
        pipe
    }
}

#[async_trait]
impl Sink for RedisSink {
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        if batch.is_empty() {
            return Vec::new();
        }
        let result = match self.connection().await {
            Ok(mut conn) => self.pipeline(batch).query_async::<()>(&mut conn).await,
            Err(e) => Err(e),
        };
        match result {
            Ok(()) => vec![Outcome::Delivered; batch.len()],
            Err(e) => {
                let error = format!("redis: {}", crate::redact::sanitize_error(&e.to_string()));
                vec![Outcome::retry(error); batch.len()]
            }
        }
    }

    async fn check(&self) -> Result<(), SinkError> {
        let unreachable = |e: redis::RedisError| SinkError::Unreachable {
            sink: self.describe(),
            reason: crate::redact::sanitize_error(&e.to_string()),
        };
        let mut conn = self.connection().await.map_err(unreachable)?;
        redis::cmd("PING")
            .query_async::<()>(&mut conn)
            .await
            .map_err(unreachable)
    }

    fn describe(&self) -> String {
        self.described.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let s = RedisSink::from_url(
            "redis://:pw@127.0.0.1:6380/2?mode=stream&key=ev:{aggregate_type}&maxlen=1000",
            SinkOptions::default(),
        )
        .unwrap();
        assert_eq!(s.mode, Mode::Stream);
        assert_eq!(s.maxlen, Some(1000));
        assert_eq!(
            s.describe(),
            "redis://127.0.0.1:6380/2 stream ev:{aggregate_type}"
        );
        assert!(!s.describe().contains("pw"));
    }

    #[test]
    fn rejects_bad_parameters() {
        let cases = [
            ("redis://h?mode=queue", "mode: expected list or stream"),
            ("redis://h?colour=red", "\"colour\" is unknown"),
            ("redis://h?key={oops}", "unknown placeholder {oops}"),
            ("redis://h?maxlen=10", "only applies to mode=stream"),
            (
                "redis://h?mode=stream&maxlen=-1",
                "maxlen: expected a positive integer",
            ),
        ];
        for (url, want) in cases {
            let err = match RedisSink::from_url(url, SinkOptions::default()) {
                Ok(_) => panic!("{url} was accepted"),
                Err(e) => e.to_string(),
            };
            assert!(err.contains(want), "{url}: {err}");
        }
    }
}

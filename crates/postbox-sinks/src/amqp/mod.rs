//! RabbitMQ (AMQP 0-9-1): every event is published to an exchange with
//! publisher confirms; a broker confirm is the only thing that counts as
//! delivered.
//!
//! URL: `amqp://USER:PASSWORD@HOST:PORT/VHOST?exchange=NAME[&routing_key=TEMPLATE][&unroutable=reject|retry][&timeout=DURATION][&heartbeat=SECONDS]`
//! (`amqps://` for TLS, default port 5671).
//!
//! - `USER:PASSWORD` default to `guest:guest`; percent-encode special
//!   characters. `/VHOST` is percent-encoded (`/%2f` is the vhost `/`);
//!   omitted or empty it is the default vhost `/`.
//! - `exchange` (required): the exchange to publish to. It must exist; the
//!   start-up check fails when it does not. `exchange=` (empty) is RabbitMQ's
//!   default exchange, which routes to the queue named by the routing key.
//! - `routing_key` (default `{event_type}`): a template with the placeholders
//!   `{event_type}`, `{aggregate_type}` and `{aggregate_id}`; at most 255 bytes
//!   once rendered (a longer one is a reject).
//! - `unroutable` (default `reject`): what to do when the broker returns a
//!   message because no queue is bound for its routing key (messages are
//!   published `mandatory`). `reject` dead-letters the event at once;
//!   `retry` retries it with backoff, for topologies where queues are bound
//!   later.
//! - `timeout` (default `10s`): connecting, and waiting for the confirms of a
//!   batch. A batch not confirmed in time is retried.
//! - `heartbeat`: the AMQP heartbeat in seconds, passed to the broker.
//!
//! Each message: the body is the CloudEvents JSON document (structured mode);
//! properties `content_type` = `application/cloudevents+json`,
//! `delivery_mode` = 2 (persistent), `message_id` = the event id, `type` = the
//! event type, `timestamp` = the commit's insert time (seconds), `app_id` =
//! the CloudEvents source. Headers: the CloudEvents attributes with the
//! `cloudEvents_` prefix of the CloudEvents AMQP binding (`cloudEvents_id`,
//! `cloudEvents_specversion`, `cloudEvents_type`, `cloudEvents_source`,
//! `cloudEvents_subject` = aggregate id, `cloudEvents_time`,
//! `cloudEvents_aggregatetype`, `cloudEvents_schemaversion`), so a headers
//! exchange or a consumer can route and filter without parsing the body; and
//! the producer's headers under their own names (names of at most 255 bytes,
//! 64 KiB of producer headers in all, or the event is a reject; producer
//! headers starting with `cloudEvents` are not forwarded).
//!
//! Delivery: the batch is published on one channel in confirm mode, then every
//! confirm is awaited. An ack is `Delivered`; a nack, a timeout or a lost
//! connection is a retry; a returned (unroutable) message follows `unroutable`.
//! After a connection or channel error the next publish reconnects. RabbitMQ
//! does not deduplicate: a retry after an ambiguous failure (connection lost
//! before the confirm) is delivered again with the same `message_id`, and
//! consumers deduplicate on it.
//!
//! Credentials from the URL are sent only to the broker, never logged, shown
//! by `describe()` or put into an outcome.

mod config;
#[cfg(test)]
mod tests;

pub use config::Unroutable;

use crate::{BuiltSink, KeyTemplate, SinkOptions};
use async_trait::async_trait;
use chrono::SecondsFormat;
use config::AmqpConfig;
use futures::future;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::AMQPUri;
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};
use postbox::redact::sanitize_error;
use postbox_sink::cloudevents;
use postbox_sink::{Message, Outcome, Secrets, Sink, SinkError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;
use tokio::sync::Mutex;

/// The registry's entry for this sink.
pub(crate) const SINK: BuiltSink = BuiltSink {
    usage: "amqp://USER:PASSWORD@HOST:PORT/VHOST?exchange=NAME[&routing_key=TEMPLATE&unroutable=reject|retry&timeout=DURATION&heartbeat=SECONDS]  RabbitMQ (amqps:// for TLS)",
    build: |url, options| Ok(Arc::new(AmqpSink::from_url(url, options.clone())?)),
};

const CONTENT_TYPE: &str = "application/cloudevents+json";
const PERSISTENT: u8 = 2;
/// The most producer header bytes a message may carry (properties travel in
/// one frame; RabbitMQ's smallest allowed `frame_max` is 4 KiB, its default 128 KiB).
const MAX_HEADER_BYTES: usize = 64 * 1024;
/// The prefix of the CloudEvents AMQP binding for attributes in headers.
const CE_PREFIX: &str = "cloudEvents_";

/// The RabbitMQ sink; see the module docs for the URL.
pub struct AmqpSink {
    uri: AMQPUri,
    exchange: ShortString,
    routing_key: KeyTemplate,
    unroutable: Unroutable,
    timeout: Duration,
    options: SinkOptions,
    described: String,
    /// The URL's credentials, masked in every error.
    secrets: Secrets,
    session: Mutex<Option<Session>>,
    generations: AtomicU64,
}

/// One message, ready to publish.
struct Encoded {
    /// The event id, also the AMQP `message_id`.
    message_id: String,
    routing_key: ShortString,
    properties: BasicProperties,
    body: String,
}

struct Session {
    connection: Connection,
    channel: Channel,
    /// Tells sessions apart (channel ids repeat across connections).
    generation: u64,
}

/// Why talking to the broker failed (always sanitized before display).
#[derive(Debug, thiserror::Error)]
enum AmqpError {
    #[error("{what}: {source}")]
    Broker {
        what: &'static str,
        #[source]
        source: lapin::Error,
    },
    #[error("{0}: timed out after {1:?}")]
    Timeout(&'static str, Duration),
}

impl AmqpSink {
    /// Parse the sink URL; connects lazily (on [`Sink::check`] or the first publish).
    pub fn from_url(raw: &str, options: SinkOptions) -> Result<Self, SinkError> {
        let AmqpConfig {
            uri,
            exchange,
            routing_key,
            unroutable,
            timeout,
            described,
        } = AmqpConfig::from_url(raw)?;
        let mut secrets = Secrets::new();
        secrets.add_userinfo(raw, false);
        Ok(Self {
            uri,
            exchange,
            routing_key,
            unroutable,
            timeout,
            options,
            described,
            secrets,
            session: Mutex::new(None),
            generations: AtomicU64::new(0),
        })
    }

    /// What an unroutable message becomes.
    pub fn unroutable(&self) -> Unroutable {
        self.unroutable
    }

    /// Connect and open a channel in confirm mode.
    async fn connect(&self) -> Result<Session, AmqpError> {
        let properties =
            ConnectionProperties::default().with_connection_name("postbox-relay".into());
        let connection = self
            .bounded(
                "connecting",
                Connection::connect_uri(self.uri.clone(), properties),
            )
            .await?;
        let channel = self
            .bounded("opening a channel", connection.create_channel())
            .await?;
        self.bounded(
            "enabling publisher confirms",
            channel.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        Ok(Session {
            connection,
            channel,
            generation: self.generations.fetch_add(1, Ordering::Relaxed),
        })
    }

    async fn bounded<T>(
        &self,
        what: &'static str,
        work: impl std::future::Future<Output = lapin::Result<T>>,
    ) -> Result<T, AmqpError> {
        tokio::time::timeout(self.timeout, work)
            .await
            .map_err(|_| AmqpError::Timeout(what, self.timeout))?
            .map_err(|source| AmqpError::Broker { what, source })
    }

    /// The channel to publish on (and its session's generation), reconnecting
    /// when the last one is gone.
    async fn channel(&self) -> Result<(Channel, u64), AmqpError> {
        let mut slot = self.session.lock().await;
        if let Some(s) = slot.as_ref() {
            if s.connection.status().connected() && s.channel.status().connected() {
                return Ok((s.channel.clone(), s.generation));
            }
        }
        if let Some(old) = slot.take() {
            close_in_background(old);
        }
        let session = self.connect().await?;
        let channel = (session.channel.clone(), session.generation);
        *slot = Some(session);
        Ok(channel)
    }

    /// Forget the session after an error so the next publish reconnects.
    async fn discard(&self, generation: u64) {
        let mut slot = self.session.lock().await;
        if slot.as_ref().is_some_and(|s| s.generation == generation) {
            if let Some(old) = slot.take() {
                close_in_background(old);
            }
        }
    }

    fn properties(&self, m: &Message) -> Result<BasicProperties, String> {
        let header_bytes: usize = m.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
        if header_bytes > MAX_HEADER_BYTES {
            // The properties must fit in one frame; a larger header table would
            // fail the whole channel (and so the batch) on every attempt.
            return Err(format!(
                "the producer headers take {header_bytes} bytes; at most {MAX_HEADER_BYTES} fit in an AMQP message"
            ));
        }
        let mut headers = FieldTable::default();
        for (name, value) in &m.headers {
            if name.starts_with("cloudEvents") {
                continue;
            }
            let key = ShortString::try_new(name.as_str())
                .map_err(|_| format!("producer header name {name:?} is longer than 255 bytes"))?;
            headers.insert(key, AMQPValue::LongString(LongString::from(value.as_str())));
        }
        let id = m.event_id.hyphenated().to_string();
        let time = m.created_at.to_rfc3339_opts(SecondsFormat::Micros, true);
        let text = [
            ("id", id.as_str()),
            ("specversion", "1.0"),
            ("type", m.event_type.as_str()),
            ("source", cloudevents::source_of(m, &self.options.source)),
            ("subject", m.aggregate_id.as_str()),
            ("time", time.as_str()),
            ("aggregatetype", m.aggregate_type.as_str()),
        ];
        for (name, value) in text {
            headers.insert(
                ShortString::from(format!("{CE_PREFIX}{name}")),
                AMQPValue::LongString(LongString::from(value)),
            );
        }
        headers.insert(
            ShortString::from(format!("{CE_PREFIX}schemaversion")),
            AMQPValue::LongInt(m.schema_version),
        );
        let short = |what: &str, value: &str| {
            ShortString::try_new(value).map_err(|_| format!("{what} is longer than 255 bytes"))
        };
        let mut properties = BasicProperties::default()
            .with_content_type(ShortString::from(CONTENT_TYPE))
            .with_delivery_mode(PERSISTENT)
            .with_message_id(ShortString::from(id))
            .with_type(short("the event type", &m.event_type)?)
            .with_app_id(short(
                "the CloudEvents source",
                cloudevents::source_of(m, &self.options.source),
            )?)
            .with_headers(headers);
        if let Ok(seconds) = u64::try_from(m.created_at.timestamp()) {
            properties = properties.with_timestamp(seconds);
        }
        Ok(properties)
    }

    /// Everything one message needs on the wire, or the reject that explains why it cannot go.
    fn encode(&self, m: &Message) -> Result<Encoded, Outcome> {
        let rendered = self.routing_key.render(m);
        let routing_key = ShortString::try_new(rendered.as_str()).map_err(|_| {
            Outcome::reject(format!(
                "amqp: routing key {:?} is longer than 255 bytes",
                sanitize_error(&rendered)
            ))
        })?;
        let properties = self
            .properties(m)
            .map_err(|why| Outcome::reject(format!("amqp: {}", sanitize_error(&why))))?;
        Ok(Encoded {
            message_id: m.event_id.hyphenated().to_string(),
            routing_key,
            properties,
            body: cloudevents::to_json(m, &self.options.source),
        })
    }

    fn returned(&self, encoded: &Encoded, reply_code: u16, reply_text: &str) -> Outcome {
        let error = format!(
            "amqp: unroutable: exchange {:?} returned the message with routing key {:?} ({} {})",
            self.exchange.as_str(),
            sanitize_error(encoded.routing_key.as_str()),
            reply_code,
            sanitize_error(reply_text)
        );
        match self.unroutable {
            Unroutable::Reject => Outcome::reject(error),
            Unroutable::Retry => Outcome::retry(error),
        }
    }
}

fn close_in_background(session: Session) {
    tokio::spawn(async move {
        let close = session
            .connection
            .close(200, ShortString::from("postbox: reconnecting"));
        let _ = tokio::time::timeout(Duration::from_secs(5), close).await;
    });
}

#[async_trait]
impl Sink for AmqpSink {
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        if batch.is_empty() {
            return Vec::new();
        }
        let (channel, generation) = match self.channel().await {
            Ok(c) => c,
            Err(e) => {
                let error = format!("amqp: {}", sanitize_error(&e.to_string()));
                return vec![Outcome::retry(error); batch.len()];
            }
        };
        let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
        // Encode everything first: the publish futures borrow the bodies.
        let mut ready = Vec::with_capacity(batch.len());
        for (i, m) in batch.iter().enumerate() {
            match self.encode(m) {
                Ok(encoded) => ready.push((i, encoded)),
                Err(reject) => outcomes[i] = Some(reject),
            }
        }
        let deadline = tokio::time::Instant::now() + self.timeout;
        let options = BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        };
        // Pipelining: polling a publish once queues its frames for the
        // connection (in call order, which keeps each aggregate's order on
        // the wire); the writes and the confirms are awaited together after.
        let mut in_flight = Vec::with_capacity(ready.len());
        let mut broken: Option<String> = None;
        for (i, encoded) in &ready {
            if let Some(error) = &broken {
                outcomes[*i] = Some(Outcome::retry(format!("amqp: {error}")));
                continue;
            }
            let mut publish = Box::pin(channel.basic_publish(
                self.exchange.clone(),
                encoded.routing_key.clone(),
                options,
                encoded.body.as_bytes(),
                encoded.properties.clone(),
            ));
            match futures::poll!(publish.as_mut()) {
                Poll::Ready(Err(e)) => {
                    let error = format!("publishing: {}", sanitize_error(&e.to_string()));
                    outcomes[*i] = Some(Outcome::retry(format!("amqp: {error}")));
                    broken = Some(error);
                }
                Poll::Ready(Ok(confirm)) => {
                    in_flight.push((*i, encoded, future::Either::Left(async { Ok(confirm) })))
                }
                Poll::Pending => in_flight.push((*i, encoded, future::Either::Right(publish))),
            }
        }
        let waits = in_flight
            .into_iter()
            .map(|(i, encoded, publish)| async move {
                let confirmed = tokio::time::timeout_at(deadline, async {
                    let confirm = publish.await?;
                    confirm.await
                })
                .await;
                (i, encoded, confirmed)
            });
        let confirmed = future::join_all(waits).await;
        // A returned message is handed to whichever confirm the client library
        // resolves next, which under a multiple-ack need not be its own: tell
        // returned messages apart by their message_id (the event id) instead.
        let mut returned: HashMap<String, (u16, String)> = HashMap::new();
        for (_, _, result) in &confirmed {
            if let Ok(Ok(Confirmation::Ack(Some(ret)) | Confirmation::Nack(Some(ret)))) = result {
                if let Some(id) = ret.delivery.properties.message_id() {
                    returned.insert(id.to_string(), (ret.reply_code, ret.reply_text.to_string()));
                }
            }
        }
        for (i, encoded, result) in confirmed {
            if let Some((code, text)) = returned.get(&encoded.message_id) {
                outcomes[i] = Some(self.returned(encoded, *code, text));
                continue;
            }
            outcomes[i] = Some(match result {
                Ok(Ok(Confirmation::Ack(_))) => Outcome::Delivered,
                Ok(Ok(Confirmation::Nack(_))) => {
                    Outcome::retry("amqp: the broker refused the message (basic.nack)")
                }
                Ok(Ok(Confirmation::NotRequested)) => {
                    Outcome::retry("amqp: publisher confirms were not enabled on the channel")
                }
                Ok(Err(e)) => {
                    let error = sanitize_error(&e.to_string());
                    broken.get_or_insert_with(|| error.clone());
                    Outcome::retry(format!("amqp: {error}"))
                }
                Err(_) => {
                    broken.get_or_insert_with(|| "confirm timed out".into());
                    Outcome::retry(format!("amqp: no confirm within {:?}", self.timeout))
                }
            });
        }
        if broken.is_some() {
            self.discard(generation).await;
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Outcome::retry("amqp: no confirm")))
            .collect()
    }

    async fn check(&self) -> Result<(), SinkError> {
        let unreachable = |e: AmqpError| SinkError::Unreachable {
            sink: self.describe(),
            reason: sanitize_error(&e.to_string()),
        };
        self.channel().await.map_err(unreachable)?;
        if self.exchange.as_str().is_empty() {
            return Ok(());
        }
        // A passive declare of a missing exchange closes its channel: use a spare one.
        let spare = {
            let slot = self.session.lock().await;
            match slot.as_ref() {
                Some(s) => {
                    self.bounded("opening a channel", s.connection.create_channel())
                        .await
                }
                None => Err(AmqpError::Timeout("opening a channel", self.timeout)),
            }
        }
        .map_err(unreachable)?;
        let declared = self
            .bounded(
                "checking the exchange",
                spare.exchange_declare(
                    self.exchange.clone(),
                    ExchangeKind::Topic,
                    ExchangeDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                ),
            )
            .await;
        let _ = tokio::time::timeout(
            self.timeout,
            spare.close(200, ShortString::from("check done")),
        )
        .await;
        declared.map_err(|e| match &e {
            // The broker answered: the exchange is not there (or not a usable one).
            AmqpError::Broker { source, .. } => match source.kind() {
                lapin::ErrorKind::ProtocolError(refused) => SinkError::Misconfigured {
                    sink: self.describe(),
                    reason: format!(
                        "exchange {:?} does not exist or cannot be used (declare it first; the broker said: {})",
                        self.exchange.as_str(),
                        sanitize_error(refused.get_message().as_str())
                    ),
                },
                _ => unreachable(e),
            },
            AmqpError::Timeout(..) => unreachable(e),
        })
    }

    fn describe(&self) -> String {
        self.described.clone()
    }

    fn secrets(&self) -> &Secrets {
        &self.secrets
    }
}

//! NATS JetStream: every event is published to a subject and stored by the
//! stream that captures that subject; a PubAck from the stream is the only
//! thing that counts as delivered.
//!
//! URL: `nats://[USER:PASSWORD@|TOKEN@]HOST:PORT?subject=TEMPLATE[&stream=NAME][&timeout=DURATION][&tls=true]`
//!
//! - `subject` (default `postbox.{event_type}`): the subject template, with the
//!   placeholders `{event_type}`, `{aggregate_type}` and `{aggregate_id}`. A
//!   placeholder's value may contain dots (`order.created`), so it may span
//!   several subject tokens.
//! - `stream`: the JetStream stream to publish into. At start-up it is created
//!   when it is missing, with one subject filter that captures every subject
//!   the template can produce: the template's literal tokens up to the first
//!   placeholder, then `>` (`events.{event_type}` → `events.>`;
//!   `shop.{aggregate_type}.v1` → `shop.>`). `>` is the only NATS wildcard that
//!   matches several tokens, and it must be the last token, so a template must
//!   start with at least one literal token when `stream` is given. The stream
//!   is created with the server's defaults (file storage, limits retention
//!   without limits, a 2-minute duplicate window); create it yourself for
//!   anything else. When it exists its subjects are left alone.
//!   Without `stream`, start-up checks that some stream captures the
//!   template's subjects and fails if none does.
//! - `timeout` (default `10s`): connecting, and waiting for the PubAcks of a
//!   batch. A batch whose acks do not arrive in time is retried.
//! - `tls=true`: require TLS (the server's certificate is verified).
//!
//! A rendered subject with whitespace, an empty token, a `*` or `>` token, or
//! more than 1024 bytes makes that event a reject.
//!
//! Each message: the body is the CloudEvents JSON document
//! (`Content-Type: application/cloudevents+json`); headers are
//! `Nats-Msg-Id` (the event id), the attributes `ce-id`, `ce-type`,
//! `ce-source`, `ce-subject` (aggregate id), `ce-time`, `ce-aggregatetype`,
//! `ce-schemaversion`, and the producer's headers under their own names.
//! Producer headers named `Nats-*`, `ce-*` or `Content-Type` are not forwarded
//! (they would change how JetStream treats the message or contradict the
//! event); a producer header NATS cannot carry (a name with `:`, spaces or
//! non-ASCII; a value with CR or LF) makes the event a reject.
//!
//! Delivery: the batch is published pipelined on one connection, then every
//! PubAck is awaited. A PubAck (also one marked duplicate) is `Delivered`; a
//! missing stream, a timeout or a lost connection is a retry; a message larger
//! than the server's `max_payload` (1 MiB by default, for body plus headers)
//! or the stream's `max_msg_size` is a reject. Deduplication: JetStream drops
//! a second message with the same `Nats-Msg-Id` inside the stream's duplicate
//! window, so a retry shortly after an ambiguous failure is stored once;
//! outside the window consumers deduplicate on the event id.
//!
//! Credentials from the URL are sent only to the server, never logged or put
//! into an outcome.

mod config;
#[cfg(test)]
mod tests;

use crate::{BuiltSink, KeyTemplate, SinkOptions};
use async_nats::header::{HeaderMap, HeaderName, HeaderValue};
use async_nats::jetstream::{self, context::PublishErrorKind, stream};
use async_trait::async_trait;
use chrono::SecondsFormat;
use config::{check_subject, Auth, NatsConfig};
use postbox::redact::sanitize_error;
use postbox_sink::cloudevents;
use postbox_sink::{Message, Outcome, Secrets, Sink, SinkError};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

/// The registry's entry for this sink.
pub(crate) const SINK: BuiltSink = BuiltSink {
    usage: "nats://[USER:PASSWORD@|TOKEN@]HOST:PORT[?subject=TEMPLATE&stream=NAME&timeout=DURATION&tls=true]  NATS JetStream",
    build: |url, options| Ok(Arc::new(NatsSink::from_url(url, options.clone())?)),
};

const CONTENT_TYPE: &str = "application/cloudevents+json";

/// The NATS JetStream sink; see the module docs for the URL.
pub struct NatsSink {
    server: String,
    auth: Auth,
    tls: bool,
    subject: KeyTemplate,
    capture: String,
    stream: Option<String>,
    timeout: Duration,
    options: SinkOptions,
    described: String,
    /// The URL's credentials, masked in every error.
    secrets: Secrets,
    connection: Mutex<Option<jetstream::Context>>,
}

/// Why a connection or a stream operation failed (always sanitized before display).
#[derive(Debug, thiserror::Error)]
enum NatsError {
    #[error("connecting: {0}")]
    Connect(#[source] async_nats::ConnectError),
    #[error("connecting: timed out after {0:?}")]
    ConnectTimeout(Duration),
    #[error("looking up stream {name}: {source}")]
    GetStream {
        name: String,
        #[source]
        source: jetstream::context::GetStreamError,
    },
    #[error("creating stream {name}: {source}")]
    CreateStream {
        name: String,
        #[source]
        source: jetstream::context::CreateStreamError,
    },
    #[error("looking for a stream that captures {subject}: {source}")]
    FindStream {
        subject: String,
        #[source]
        source: jetstream::context::GetStreamByNameError,
    },
}

impl NatsSink {
    /// Parse the sink URL; connects lazily (on [`Sink::check`] or the first publish).
    pub fn from_url(raw: &str, options: SinkOptions) -> Result<Self, SinkError> {
        let NatsConfig {
            server,
            auth,
            tls,
            subject,
            capture,
            stream,
            timeout,
            described,
        } = NatsConfig::from_url(raw)?;
        let mut secrets = Secrets::new();
        secrets.add_userinfo(raw, true);
        Ok(Self {
            server,
            auth,
            tls,
            subject,
            capture,
            stream,
            timeout,
            options,
            described,
            secrets,
            connection: Mutex::new(None),
        })
    }

    /// The subject filter a stream needs to capture every subject the template produces.
    pub fn capture_subject(&self) -> &str {
        &self.capture
    }

    async fn context(&self) -> Result<jetstream::Context, NatsError> {
        let mut slot = self.connection.lock().await;
        if let Some(js) = slot.as_ref() {
            return Ok(js.clone());
        }
        let mut opts = async_nats::ConnectOptions::new()
            .name("postbox-relay")
            .connection_timeout(self.timeout)
            .request_timeout(Some(self.timeout))
            .require_tls(self.tls)
            .event_callback(|event| async move {
                tracing::debug!(event = %sanitize_error(&event.to_string()), "nats connection event");
            });
        opts = match &self.auth {
            Auth::None => opts,
            Auth::UserPassword(user, password) => {
                opts.user_and_password(user.clone(), password.clone())
            }
            Auth::Token(token) => opts.token(token.clone()),
        };
        let client = tokio::time::timeout(self.timeout, opts.connect(self.server.as_str()))
            .await
            .map_err(|_| NatsError::ConnectTimeout(self.timeout))?
            .map_err(NatsError::Connect)?;
        let js = jetstream::ContextBuilder::new()
            .timeout(self.timeout)
            .build(client);
        *slot = Some(js.clone());
        Ok(js)
    }

    async fn ensure_stream(&self, js: &jetstream::Context) -> Result<(), NatsError> {
        match &self.stream {
            Some(name) => match js.get_stream(name).await {
                Ok(_) => Ok(()),
                Err(e) if is_stream_not_found(&e) => {
                    let config = stream::Config {
                        name: name.clone(),
                        subjects: vec![self.capture.clone()],
                        ..Default::default()
                    };
                    match js.create_stream(config).await {
                        Ok(_) => Ok(()),
                        // Another relay created it in the meantime.
                        Err(e) if js.get_stream(name).await.is_ok() => {
                            tracing::debug!(error = %e, "stream created concurrently");
                            Ok(())
                        }
                        Err(source) => Err(NatsError::CreateStream {
                            name: name.clone(),
                            source,
                        }),
                    }
                }
                Err(source) => Err(NatsError::GetStream {
                    name: name.clone(),
                    source,
                }),
            },
            None => js
                .stream_by_subject(self.capture.clone())
                .await
                .map(|_| ())
                .map_err(|source| NatsError::FindStream {
                    subject: self.capture.clone(),
                    source,
                }),
        }
    }

    /// The headers of one message, or why NATS cannot carry them.
    fn headers(&self, m: &Message) -> Result<HeaderMap, String> {
        let mut headers = HeaderMap::new();
        for (name, value) in &m.headers {
            let lower = name.to_ascii_lowercase();
            if lower.starts_with("nats-") || lower.starts_with("ce-") || lower == "content-type" {
                continue;
            }
            let header_name = HeaderName::from_str(name).map_err(|_| {
                format!("producer header name {name:?} cannot be carried by NATS (use printable ASCII without ':' or spaces)")
            })?;
            let header_value = HeaderValue::from_str(value).map_err(|_| {
                format!("producer header {name:?} has a value NATS cannot carry (CR or LF)")
            })?;
            headers.insert(header_name, header_value);
        }
        let id = m.event_id.hyphenated().to_string();
        let attributes = [
            ("Nats-Msg-Id", id.clone()),
            ("Content-Type", CONTENT_TYPE.to_owned()),
            ("ce-id", id),
            ("ce-specversion", "1.0".to_owned()),
            ("ce-type", m.event_type.clone()),
            (
                "ce-source",
                cloudevents::source_of(m, &self.options.source).to_owned(),
            ),
            ("ce-subject", m.aggregate_id.clone()),
            (
                "ce-time",
                m.created_at.to_rfc3339_opts(SecondsFormat::Micros, true),
            ),
            ("ce-aggregatetype", m.aggregate_type.clone()),
            ("ce-schemaversion", m.schema_version.to_string()),
        ];
        for (name, value) in attributes {
            let value = HeaderValue::from_str(&value).map_err(|_| {
                format!("attribute {name} contains CR or LF, which NATS headers cannot carry")
            })?;
            headers.insert(name, value);
        }
        Ok(headers)
    }
}

#[async_trait]
impl Sink for NatsSink {
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        if batch.is_empty() {
            return Vec::new();
        }
        let js = match self.context().await {
            Ok(js) => js,
            Err(e) => {
                let error = format!("nats: {}", sanitize_error(&e.to_string()));
                return vec![Outcome::retry(error); batch.len()];
            }
        };
        let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
        let mut pending = Vec::with_capacity(batch.len());
        for (i, m) in batch.iter().enumerate() {
            let subject = self.subject.render(m);
            if let Err(why) = check_subject(&subject) {
                outcomes[i] = Some(Outcome::reject(format!(
                    "nats: subject {:?} {why}",
                    sanitize_error(&subject)
                )));
                continue;
            }
            let headers = match self.headers(m) {
                Ok(h) => h,
                Err(why) => {
                    outcomes[i] = Some(Outcome::reject(format!("nats: {}", sanitize_error(&why))));
                    continue;
                }
            };
            let body = cloudevents::to_json(m, &self.options.source);
            let publish = jetstream::message::PublishMessage::build()
                .payload(body.into_bytes().into())
                .headers(headers);
            match js.send_publish(subject.clone(), publish).await {
                Ok(ack) => pending.push((i, subject, ack)),
                Err(e) => outcomes[i] = Some(classify(&subject, &e)),
            }
        }
        let acks = futures::future::join_all(
            pending
                .into_iter()
                .map(|(i, subject, ack)| async move { (i, subject, ack.await) }),
        )
        .await;
        for (i, subject, ack) in acks {
            outcomes[i] = Some(match ack {
                Ok(_) => Outcome::Delivered,
                Err(e) => classify(&subject, &e),
            });
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Outcome::retry("nats: no acknowledgement")))
            .collect()
    }

    async fn check(&self) -> Result<(), SinkError> {
        let unreachable = |e: NatsError| SinkError::Unreachable {
            sink: self.describe(),
            reason: sanitize_error(&e.to_string()),
        };
        let js = self.context().await.map_err(unreachable)?;
        self.ensure_stream(&js).await.map_err(|e| match e {
            NatsError::FindStream { .. } => SinkError::Misconfigured {
                sink: self.describe(),
                reason: format!(
                    "no JetStream stream captures subjects matching {}: create one, or add stream=NAME \
                     to the sink URL to have it created ({})",
                    self.capture,
                    sanitize_error(&e.to_string())
                ),
            },
            other => unreachable(other),
        })
    }

    fn describe(&self) -> String {
        self.described.clone()
    }

    fn secrets(&self) -> &Secrets {
        &self.secrets
    }
}

/// Turn a publish or ack error into an outcome.
fn classify(subject: &str, e: &jetstream::context::PublishError) -> Outcome {
    let text = sanitize_error(&e.to_string());
    match e.kind() {
        PublishErrorKind::MaxPayloadExceeded => Outcome::reject(format!(
            "nats: the message is larger than the server's max_payload: {text}"
        )),
        PublishErrorKind::StreamNotFound => Outcome::retry(format!(
            "nats: no JetStream stream captures subject {}",
            sanitize_error(subject)
        )),
        PublishErrorKind::Other
            if jetstream_code(e) == Some(jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) =>
        {
            Outcome::reject(format!(
                "nats: the message is larger than the stream's max_msg_size: {text}"
            ))
        }
        _ => Outcome::retry(format!("nats: {text}")),
    }
}

fn jetstream_code(e: &jetstream::context::PublishError) -> Option<jetstream::ErrorCode> {
    let source = std::error::Error::source(e)?;
    source
        .downcast_ref::<jetstream::Error>()
        .map(jetstream::Error::error_code)
}

fn is_stream_not_found(e: &jetstream::context::GetStreamError) -> bool {
    matches!(
        e.kind(),
        jetstream::context::GetStreamErrorKind::JetStream(inner)
            if inner.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
    )
}

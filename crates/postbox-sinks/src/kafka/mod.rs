//! Kafka (cargo feature `kafka`): every event is produced by an idempotent
//! producer with `acks=all`; a delivery report from the partition leader,
//! after every in-sync replica has the record, is the only thing that counts
//! as delivered.
//!
//! URL: `kafka://BROKER:PORT[,BROKER:PORT…]?topic=TEMPLATE[&timeout=DURATION][&rdkafka.NAME=VALUE…]`
//!
//! - `topic` (default `postbox.{event_type}`): the topic template, with the
//!   placeholders `{event_type}`, `{aggregate_type}` and `{aggregate_id}`.
//!   Rendered topic names must be 1–249 characters of `A-Z a-z 0-9 . _ -`; an
//!   event whose topic is not is a reject. Topics must exist unless the
//!   brokers auto-create them (an unknown topic is retried).
//! - `timeout` (default `20s`): librdkafka's `message.timeout.ms`, the longest
//!   a record may wait for its delivery report (including retries); a record
//!   without a report a second after that is retried by the relay. Keep it
//!   below the relay's `publish_timeout`.
//! - `rdkafka.NAME=VALUE`: any other librdkafka producer property, e.g.
//!   `rdkafka.compression.type=zstd` or `rdkafka.message.max.bytes=2000000`.
//!   `bootstrap.servers`, `enable.idempotence`, `acks` and
//!   `message.timeout.ms` cannot be overridden. Values are never logged.
//!   This build of librdkafka has no TLS or SASL support.
//!
//! Each record: key = the aggregate id (so one aggregate's events share a
//! partition and keep their order); value = the CloudEvents JSON document;
//! headers `content-type` = `application/cloudevents+json` and the CloudEvents
//! attributes with the `ce_` prefix of the CloudEvents Kafka binding (`ce_id` =
//! the event id, `ce_specversion`, `ce_type`, `ce_source`, `ce_subject` =
//! aggregate id, `ce_time`, `ce_aggregatetype`, `ce_schemaversion`), plus the
//! producer's headers under their own names (producer headers named `ce_*` or
//! `content-type` are not forwarded).
//!
//! Delivery and deduplication: the idempotent producer numbers every record,
//! so the broker drops the duplicates its own internal retries would create
//! (within one producer session); records that librdkafka gives up on (timeout,
//! a retriable broker error) are retried by the relay, which may write them
//! twice — consumers deduplicate on `ce_id`. A record larger than the
//! producer's or the broker's `message.max.bytes` (about 1 MB by default) is a
//! reject. After a fatal idempotence error the producer is rebuilt on the next
//! publish.

mod config;
#[cfg(test)]
mod tests;

use crate::{BuiltSink, KeyTemplate, SinkOptions};
use async_trait::async_trait;
use chrono::SecondsFormat;
use config::{check_topic, KafkaConfig};
use postbox::redact::sanitize_error;
use postbox_sink::cloudevents;
use postbox_sink::{Message, Outcome, Secrets, Sink, SinkError};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::ClientConfig;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

/// The registry's entry for this sink.
pub(crate) const SINK: BuiltSink = BuiltSink {
    usage: "kafka://BROKER:PORT[,BROKER:PORT…][?topic=TEMPLATE&timeout=DURATION&rdkafka.NAME=VALUE…]  Kafka (idempotent producer, acks=all)",
    build: |url, options| Ok(Arc::new(KafkaSink::from_url(url, options.clone())?)),
};

const CONTENT_TYPE: &str = "application/cloudevents+json";

/// The Kafka sink; see the module docs for the URL.
pub struct KafkaSink {
    config: ClientConfig,
    topic: KeyTemplate,
    timeout: Duration,
    options: SinkOptions,
    described: String,
    /// The values of secret properties (`rdkafka.sasl.password`…), masked in every error.
    secrets: Secrets,
    producer: Mutex<Option<FutureProducer>>,
}

impl KafkaSink {
    /// Parse the sink URL; the producer is created on the first use.
    pub fn from_url(raw: &str, options: SinkOptions) -> Result<Self, SinkError> {
        let KafkaConfig {
            client,
            topic,
            timeout,
            described,
            secrets,
        } = KafkaConfig::from_url(raw)?;
        Ok(Self {
            config: client,
            topic,
            timeout,
            options,
            described,
            secrets,
            producer: Mutex::new(None),
        })
    }

    async fn producer(&self) -> Result<FutureProducer, KafkaError> {
        let mut slot = self.producer.lock().await;
        if let Some(p) = slot.as_ref() {
            if p.client().fatal_error().is_none() {
                return Ok(p.clone());
            }
            tracing::warn!("kafka: the producer hit a fatal error; creating a new one");
        }
        let producer: FutureProducer = self.config.create()?;
        *slot = Some(producer.clone());
        Ok(producer)
    }

    fn headers(&self, m: &Message) -> OwnedHeaders {
        let mut headers = OwnedHeaders::new_with_capacity(9 + m.headers.len());
        for (name, value) in &m.headers {
            let lower = name.to_ascii_lowercase();
            if lower.starts_with("ce_") || lower == "content-type" {
                continue;
            }
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        let id = m.event_id.hyphenated().to_string();
        let time = m.created_at.to_rfc3339_opts(SecondsFormat::Micros, true);
        let schema_version = m.schema_version.to_string();
        let attributes = [
            ("content-type", CONTENT_TYPE),
            ("ce_id", id.as_str()),
            ("ce_specversion", "1.0"),
            ("ce_type", m.event_type.as_str()),
            ("ce_source", cloudevents::source_of(m, &self.options.source)),
            ("ce_subject", m.aggregate_id.as_str()),
            ("ce_time", time.as_str()),
            ("ce_aggregatetype", m.aggregate_type.as_str()),
            ("ce_schemaversion", schema_version.as_str()),
        ];
        for (key, value) in attributes {
            headers = headers.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        headers
    }
}

fn classify(e: &KafkaError) -> Outcome {
    let text = format!("kafka: {}", sanitize_error(&e.to_string()));
    match e.rdkafka_error_code() {
        Some(RDKafkaErrorCode::MessageSizeTooLarge | RDKafkaErrorCode::InvalidMessageSize) => {
            Outcome::reject(text)
        }
        _ => Outcome::retry(text),
    }
}

#[async_trait]
impl Sink for KafkaSink {
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        if batch.is_empty() {
            return Vec::new();
        }
        let producer = match self.producer().await {
            Ok(p) => p,
            Err(e) => return vec![classify(&e); batch.len()],
        };
        let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
        let mut pending = Vec::with_capacity(batch.len());
        for (i, m) in batch.iter().enumerate() {
            let topic = self.topic.render(m);
            if let Err(why) = check_topic(&topic) {
                outcomes[i] = Some(Outcome::reject(format!(
                    "kafka: topic {:?} {why}",
                    sanitize_error(&topic)
                )));
                continue;
            }
            let body = cloudevents::to_json(m, &self.options.source);
            let record = FutureRecord::to(&topic)
                .key(m.aggregate_id.as_str())
                .payload(body.as_str())
                .headers(self.headers(m));
            match producer.send_result(record) {
                Ok(delivery) => pending.push((i, delivery)),
                Err((e, _)) => outcomes[i] = Some(classify(&e)),
            }
        }
        // librdkafka should report every record within message.timeout.ms, but
        // it holds records back while the idempotent producer re-establishes
        // its state; past the margin those count as retries (a later delivery
        // is a duplicate the consumers absorb).
        let deadline = tokio::time::Instant::now() + self.timeout + Duration::from_secs(1);
        let waits = pending.into_iter().map(|(i, delivery)| async move {
            (i, tokio::time::timeout_at(deadline, delivery).await)
        });
        for (i, report) in futures::future::join_all(waits).await {
            outcomes[i] = Some(match report {
                Ok(Ok(Ok(_))) => Outcome::Delivered,
                Ok(Ok(Err((e, _)))) => classify(&e),
                Ok(Err(_canceled)) => {
                    Outcome::retry("kafka: the producer was closed before the delivery report")
                }
                Err(_) => Outcome::retry(format!(
                    "kafka: no delivery report within {:?}",
                    self.timeout
                )),
            });
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Outcome::retry("kafka: no delivery report")))
            .collect()
    }

    async fn check(&self) -> Result<(), SinkError> {
        let unreachable = |reason: String| SinkError::Unreachable {
            sink: self.describe(),
            reason,
        };
        let producer = self
            .producer()
            .await
            .map_err(|e| unreachable(sanitize_error(&e.to_string())))?;
        let timeout = self.timeout;
        let metadata = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(None, timeout)
                .map(|m| m.brokers().len())
        })
        .await
        .map_err(|e| unreachable(format!("metadata request task failed: {e}")))?;
        match metadata {
            Ok(0) => Err(unreachable("the cluster reported no brokers".into())),
            Ok(_) => Ok(()),
            Err(e) => Err(unreachable(sanitize_error(&e.to_string()))),
        }
    }

    fn describe(&self) -> String {
        self.described.clone()
    }

    fn secrets(&self) -> &Secrets {
        &self.secrets
    }
}

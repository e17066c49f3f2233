//! The consumer: reads what the relays delivered to the broker and applies
//! each event's effect through the inbox — one transaction per batch
//! recording the inbox row and the effect — then acknowledges to the broker.
//! It keeps the figures the final checks use.

use super::tables::Tables;
use crate::{error_chain, lock, AnyError};
use futures::StreamExt;
use postbox::{InboxOutcome, Outbox, SequenceCheck};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redis::AsyncCommands;
use sqlx::PgPool;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The consumer's name in the inbox.
pub const CONSUMER: &str = "verify";
const BATCH: usize = 500;
/// How long a message whose acknowledgement was dropped waits to come again.
const REDELIVER_AFTER: Duration = Duration::from_secs(2);

/// What the consumer saw. Updated only after a batch committed, except
/// `deliveries` and `seen` (everything the broker handed over).
#[derive(Default)]
pub struct Seen {
    pub deliveries: AtomicU64,
    /// Deliveries the inbox recognized as applied before.
    pub duplicates: AtomicU64,
    /// Deliveries the broker repeated because the consumer had not acknowledged.
    pub redeliveries: AtomicU64,
    pub applied: AtomicU64,
    /// Batches whose transaction failed (or was rolled back on purpose) and were tried again.
    pub retried_batches: AtomicU64,
    /// Batches whose broker acknowledgement was dropped on purpose.
    pub acks_dropped: AtomicU64,
    /// Deliveries per event id.
    pub by_event: Mutex<HashMap<Uuid, u32>>,
    /// Bodies that were not a postbox CloudEvent.
    pub malformed: AtomicU64,
    /// Per-aggregate order violations (ordered runs): one line each.
    pub order_violations: Mutex<Vec<String>>,
    /// When the consumer last made progress: a delivery arrived or a batch
    /// was applied.
    pub last_delivery: Mutex<Option<Instant>>,
}

impl Seen {
    pub fn quiet_for(&self) -> Duration {
        lock(&self.last_delivery).map_or(Duration::MAX, |t| t.elapsed())
    }
}

/// One message, as far as the consumer cares.
pub struct Delivery {
    event_id: Uuid,
    aggregate_type: String,
    aggregate_id: String,
    sequence: i64,
    redelivered: bool,
    ack: AckToken,
}

enum AckToken {
    Redis(String),
    Nats(Box<async_nats::jetstream::Message>),
    Amqp(lapin::Acker),
    /// A consumer group's receipt.
    Receipt(String),
}

/// Parse a CloudEvents body into what the checks need.
fn parse_body(body: &[u8]) -> Option<(Uuid, String, String, i64)> {
    #[derive(serde::Deserialize)]
    struct Body {
        id: Uuid,
        aggregatetype: String,
        subject: String,
        sequence: Option<i64>,
    }
    let b: Body = serde_json::from_slice(body).ok()?;
    Some((b.id, b.aggregatetype, b.subject, b.sequence.unwrap_or(0)))
}

/// Where deliveries come from.
pub enum Source {
    Redis {
        conn: redis::aio::MultiplexedConnection,
        key: String,
        /// Read this consumer's unacknowledged entries again after this instant.
        reread_at: Option<Instant>,
    },
    Nats {
        consumer: Box<
            async_nats::jetstream::consumer::Consumer<
                async_nats::jetstream::consumer::pull::Config,
            >,
        >,
    },
    /// A RabbitMQ queue, consumed with manual acknowledgements: what is not
    /// acknowledged when the channel goes away, the broker delivers again.
    Amqp(Box<AmqpSource>),
    /// A consumer group of the run's log, read over SQL or HTTP: what is
    /// not acknowledged within its visibility is handed out again.
    Group(Box<super::pull::PullReader>),
}

pub struct AmqpSource {
    uri: String,
    queue: String,
    /// The channel and its consumer; `None` after an error or a dropped
    /// acknowledgement, reopened at the next read.
    session: Option<(lapin::Connection, lapin::Consumer)>,
}

impl AmqpSource {
    async fn open(&mut self) -> Result<&mut lapin::Consumer, AnyError> {
        use lapin::options::{BasicConsumeOptions, BasicQosOptions};
        if self.session.is_none() {
            let properties = lapin::ConnectionProperties::default()
                .with_connection_name("postbox-verify".into());
            let connection = lapin::Connection::connect(&self.uri, properties).await?;
            let channel = connection.create_channel().await?;
            channel
                .basic_qos(BATCH as u16 * 2, BasicQosOptions::default())
                .await?;
            let consumer = channel
                .basic_consume(
                    self.queue.as_str().into(),
                    CONSUMER.into(),
                    BasicConsumeOptions::default(),
                    lapin::types::FieldTable::default(),
                )
                .await?;
            self.session = Some((connection, consumer));
        }
        match self.session.as_mut() {
            Some((_, consumer)) => Ok(consumer),
            None => Err("no AMQP session".into()),
        }
    }

    /// Close the connection: the broker delivers its unacknowledged
    /// messages again (with `redelivered` set).
    fn drop_session(&mut self) {
        if let Some((connection, _)) = self.session.take() {
            tokio::spawn(async move {
                let _ = connection.close(200, "postbox verify".into()).await;
            });
        }
    }

    async fn next_batch(&mut self) -> Result<Vec<Delivery>, AnyError> {
        let result = self.read().await;
        if result.is_err() {
            self.drop_session();
        }
        result
    }

    async fn read(&mut self) -> Result<Vec<Delivery>, AnyError> {
        let consumer = self.open().await?;
        let mut out = Vec::new();
        // Wait up to 500 ms for a first message, then take what is ready.
        let mut wait = Duration::from_millis(500);
        while out.len() < BATCH {
            let next = match tokio::time::timeout(wait, consumer.next()).await {
                Err(_elapsed) => break,
                Ok(None) => return Err("the AMQP consumer was cancelled".into()),
                Ok(Some(d)) => d?,
            };
            let (event_id, aggregate_type, aggregate_id, sequence) =
                parse_body(&next.data).unwrap_or((Uuid::nil(), String::new(), String::new(), 0));
            out.push(Delivery {
                event_id,
                aggregate_type,
                aggregate_id,
                sequence,
                redelivered: next.redelivered,
                ack: AckToken::Amqp(next.acker),
            });
            wait = Duration::from_millis(20);
        }
        Ok(out)
    }
}

const GROUP: &str = "verify";

impl Source {
    /// Consume the Redis stream `key` with a consumer group created now, from its start.
    pub async fn redis_stream(url: &str, key: &str) -> Result<Source, AnyError> {
        let client = redis::Client::open(url)?;
        let mut conn = crate::redis_connection(&client).await?;
        let _: () = conn.xgroup_create_mkstream(key, GROUP, "0").await?;
        Ok(Source::Redis {
            conn,
            key: key.to_owned(),
            reread_at: None,
        })
    }

    /// Consume JetStream stream `stream` (created now, capturing `subjects`)
    /// with a durable pull consumer.
    pub async fn jetstream(url: &str, stream: &str, subjects: &str) -> Result<Source, AnyError> {
        use async_nats::jetstream;
        let client = async_nats::connect(url).await?;
        let js = jetstream::new(client);
        let stream = js
            .get_or_create_stream(jetstream::stream::Config {
                name: stream.to_owned(),
                subjects: vec![subjects.to_owned()],
                ..Default::default()
            })
            .await?;
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::Config {
                durable_name: Some(GROUP.to_owned()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: REDELIVER_AFTER,
                max_ack_pending: 50_000,
                ..Default::default()
            })
            .await?;
        Ok(Source::Nats {
            consumer: Box::new(consumer),
        })
    }

    /// Consume RabbitMQ queue `queue` (declared now, durable) at `uri`.
    pub async fn amqp_queue(uri: &str, queue: &str) -> Result<Source, AnyError> {
        use lapin::options::QueueDeclareOptions;
        let connection =
            lapin::Connection::connect(uri, lapin::ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await?;
        let _ = connection.close(200, "declared".into()).await;
        Ok(Source::Amqp(Box::new(AmqpSource {
            uri: uri.to_owned(),
            queue: queue.to_owned(),
            session: None,
        })))
    }

    async fn next_batch(&mut self) -> Result<Vec<Delivery>, AnyError> {
        match self {
            Source::Amqp(source) => source.next_batch().await,
            Source::Group(reader) => Ok(reader
                .receive(BATCH)
                .await?
                .into_iter()
                .map(|h| Delivery {
                    event_id: h.event_id,
                    aggregate_type: h.aggregate_type,
                    aggregate_id: h.aggregate_id,
                    sequence: h.sequence,
                    redelivered: h.attempts > 1,
                    ack: AckToken::Receipt(h.receipt),
                })
                .collect()),
            Source::Redis {
                conn,
                key,
                reread_at,
            } => {
                use redis::streams::{StreamReadOptions, StreamReadReply};
                let again = reread_at.is_some_and(|t| Instant::now() >= t);
                let (start, options) = if again {
                    (
                        "0",
                        StreamReadOptions::default()
                            .group(GROUP, CONSUMER)
                            .count(BATCH),
                    )
                } else {
                    (
                        ">",
                        StreamReadOptions::default()
                            .group(GROUP, CONSUMER)
                            .count(BATCH)
                            .block(500),
                    )
                };
                let reply: Option<StreamReadReply> = conn
                    .xread_options(&[key.as_str()], &[start], &options)
                    .await?;
                let entries: Vec<_> = reply
                    .into_iter()
                    .flat_map(|r| r.keys)
                    .flat_map(|k| k.ids)
                    .collect();
                if again && entries.is_empty() {
                    *reread_at = None;
                }
                Ok(entries
                    .into_iter()
                    .map(|e| {
                        let body: Option<Vec<u8>> = e
                            .map
                            .get("body")
                            .and_then(|v| redis::from_redis_value_ref(v).ok());
                        let (event_id, aggregate_type, aggregate_id, sequence) = body
                            .as_deref()
                            .and_then(parse_body)
                            .unwrap_or((Uuid::nil(), String::new(), String::new(), 0));
                        Delivery {
                            event_id,
                            aggregate_type,
                            aggregate_id,
                            sequence,
                            redelivered: again,
                            ack: AckToken::Redis(e.id),
                        }
                    })
                    .collect())
            }
            Source::Nats { consumer } => {
                let mut batch = consumer
                    .batch()
                    .max_messages(BATCH)
                    .expires(Duration::from_millis(500))
                    .messages()
                    .await?;
                let mut out = Vec::new();
                while let Some(m) = batch.next().await {
                    let m = m?;
                    let redelivered = m.info().map(|i| i.delivered > 1).unwrap_or(false);
                    let (event_id, aggregate_type, aggregate_id, sequence) = parse_body(&m.payload)
                        .unwrap_or((Uuid::nil(), String::new(), String::new(), 0));
                    out.push(Delivery {
                        event_id,
                        aggregate_type,
                        aggregate_id,
                        sequence,
                        redelivered,
                        ack: AckToken::Nats(Box::new(m)),
                    });
                }
                Ok(out)
            }
        }
    }

    async fn ack(&mut self, batch: &[Delivery]) -> Result<(), AnyError> {
        match self {
            Source::Group(reader) => {
                let receipts: Vec<String> = batch
                    .iter()
                    .filter_map(|d| match &d.ack {
                        AckToken::Receipt(r) => Some(r.clone()),
                        _ => None,
                    })
                    .collect();
                reader.ack(&receipts).await
            }
            Source::Redis { conn, key, .. } => {
                let ids: Vec<&str> = batch
                    .iter()
                    .filter_map(|d| match &d.ack {
                        AckToken::Redis(id) => Some(id.as_str()),
                        _ => None,
                    })
                    .collect();
                if !ids.is_empty() {
                    let _: i64 = conn.xack(key.as_str(), GROUP, &ids).await?;
                    let _: i64 = conn.xdel(key.as_str(), &ids).await?;
                }
                Ok(())
            }
            Source::Nats { .. } => {
                for d in batch {
                    if let AckToken::Nats(m) = &d.ack {
                        m.ack().await?;
                    }
                }
                Ok(())
            }
            Source::Amqp(_) => {
                // After the inbox committed: one by one (a batch can span a
                // reconnection, whose tags belong to another channel).
                for d in batch {
                    if let AckToken::Amqp(acker) = &d.ack {
                        acker
                            .ack(lapin::options::BasicAckOptions::default())
                            .await?;
                    }
                }
                Ok(())
            }
        }
    }

    /// The acknowledgements of a batch were not sent: have it delivered again.
    fn acks_lost(&mut self) {
        match self {
            Source::Redis { reread_at, .. } => {
                reread_at.get_or_insert_with(|| Instant::now() + REDELIVER_AFTER);
            }
            // RabbitMQ redelivers what a closed channel left unacknowledged.
            Source::Amqp(source) => source.drop_session(),
            // JetStream redelivers by itself after ack_wait, a group after
            // the visibility.
            Source::Nats { .. } | Source::Group(_) => {}
        }
    }
}

#[derive(Clone)]
pub struct Consumer {
    pub pool: PgPool,
    pub outbox: Outbox,
    /// Where the effects go.
    pub tables: Arc<Tables>,
    pub ordered: bool,
    /// Consumer-side faults: drop acknowledgements, roll back batches.
    pub faults: bool,
    /// The planted bug `consumer-async-commit`: commit the inbox without
    /// waiting for the WAL, then acknowledge the broker.
    pub async_commit: bool,
    /// The planted bug `reader-acks-first`: acknowledge a batch, work on it
    /// for 50 ms, then apply it.
    pub ack_first: bool,
    pub seed: u64,
}

/// What one batch's transaction found, counted only once it committed.
#[derive(Default)]
struct BatchResult {
    applied: u64,
    duplicates: u64,
    order_violations: Vec<String>,
}

impl Consumer {
    pub async fn run(self, mut source: Source, seen: &Seen, stop: CancellationToken) {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let mut failures = 0u32;
        while !stop.is_cancelled() {
            let batch = tokio::select! {
                b = source.next_batch() => b,
                _ = stop.cancelled() => return,
            };
            let batch = match batch {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(error = %error_chain(e.as_ref()), "reading from the broker failed; trying again");
                    // A read whose reply was lost may still have been handed
                    // to us (a Redis group read moves entries to our pending
                    // list): read what we hold again, as for lost acks.
                    source.acks_lost();
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            if batch.is_empty() {
                continue;
            }
            seen.deliveries
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
            *lock(&seen.last_delivery) = Some(Instant::now());
            {
                let mut by_event = lock(&seen.by_event);
                for d in &batch {
                    *by_event.entry(d.event_id).or_default() += 1;
                }
            }
            let redelivered = batch.iter().filter(|d| d.redelivered).count() as u64;
            seen.redeliveries.fetch_add(redelivered, Ordering::Relaxed);
            seen.malformed.fetch_add(
                batch.iter().filter(|d| d.event_id.is_nil()).count() as u64,
                Ordering::Relaxed,
            );
            if self.ack_first {
                // The planted bug: the batch is let go before its effects
                // exist; a reader that dies now loses it.
                if source.ack(&batch).await.is_err() {
                    source.acks_lost();
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // Apply the batch; a failed transaction is tried again with the
            // same messages before anything newer (that keeps order).
            loop {
                let crash = self.faults && rng.random_bool(0.01);
                match self.apply_batch(&batch, crash).await {
                    Ok(r) => {
                        failures = 0;
                        *lock(&seen.last_delivery) = Some(Instant::now());
                        seen.applied.fetch_add(r.applied, Ordering::Relaxed);
                        seen.duplicates.fetch_add(r.duplicates, Ordering::Relaxed);
                        lock(&seen.order_violations).extend(r.order_violations);
                        break;
                    }
                    Err(e) => {
                        seen.retried_batches.fetch_add(1, Ordering::Relaxed);
                        if !crash {
                            failures += 1;
                            tracing::debug!(error = %error_chain(e.as_ref()), "the consumer's transaction failed; trying the batch again");
                            let pause = Duration::from_millis(50 * u64::from(failures.min(20)));
                            tokio::select! {
                                _ = tokio::time::sleep(pause) => {}
                                _ = stop.cancelled() => return,
                            }
                        }
                    }
                }
            }
            if self.ack_first {
                continue;
            }
            if self.faults && rng.random_bool(0.03) {
                seen.acks_dropped.fetch_add(1, Ordering::Relaxed);
                source.acks_lost();
                continue;
            }
            if let Err(e) = source.ack(&batch).await {
                tracing::debug!(error = %error_chain(e.as_ref()), "acknowledging to the broker failed; the batch comes again");
                source.acks_lost();
            }
        }
    }

    async fn apply_batch(&self, batch: &[Delivery], crash: bool) -> Result<BatchResult, AnyError> {
        let mut result = BatchResult::default();
        let mut tx = self.pool.begin().await?;
        for d in batch {
            if d.event_id.is_nil() {
                continue;
            }
            let outcome =
                postbox::sqlx::record_inbox(&self.outbox, &mut tx, CONSUMER, d.event_id).await?;
            if outcome == InboxOutcome::Duplicate {
                result.duplicates += 1;
                continue;
            }
            if self.ordered {
                let check = postbox::sqlx::check_sequence(
                    &self.outbox,
                    &mut tx,
                    CONSUMER,
                    &d.aggregate_type,
                    &d.aggregate_id,
                    d.sequence,
                )
                .await?;
                match check {
                    SequenceCheck::Apply => {}
                    SequenceCheck::Gap { expected, got } => {
                        result.order_violations.push(format!(
                            "{} {}/{}: sequence {got} arrived before {expected}",
                            d.event_id, d.aggregate_type, d.aggregate_id
                        ));
                        let _moved = postbox::sqlx::accept_gap(
                            &self.outbox,
                            &mut tx,
                            CONSUMER,
                            &d.aggregate_type,
                            &d.aggregate_id,
                            d.sequence,
                        )
                        .await?;
                    }
                    SequenceCheck::Duplicate { last } => {
                        result.order_violations.push(format!(
                            "{} {}/{}: sequence {} arrived after {last}",
                            d.event_id, d.aggregate_type, d.aggregate_id, d.sequence
                        ));
                    }
                }
            }
            self.tables.apply_effect(&mut tx, d.event_id).await?;
            result.applied += 1;
        }
        if self.async_commit {
            self.tables.commit_without_flush(&mut tx).await?;
        }
        if crash {
            // The consumer "crashes" after applying, before its commit.
            tx.rollback().await?;
            return Err("consumer crash (fault)".into());
        }
        tx.commit().await?;
        Ok(result)
    }
}

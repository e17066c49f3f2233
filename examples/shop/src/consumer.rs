//! The consumer: applies each `order.placed` once, however often Redis delivers it.
//!
//! It reads the relay's stream through a consumer group. For every entry:
//!
//! 1. decode the CloudEvents body, then the payload by (type, version);
//! 2. in **one** transaction, record the event id in postbox's inbox and apply
//!    the effect (bump the customer's counter) only when the record is new;
//! 3. commit, then `XACK`.
//!
//! A crash before the commit leaves nothing behind; a crash between the commit
//! and the `XACK` leaves the entry pending. Either way the entry is read again
//! (at start-up the consumer first re-reads its own pending entries), and the
//! inbox turns a second application into a no-op. A relay may also publish an
//! event twice: same event id, same no-op. An entry that cannot be decoded is
//! moved to the stream `<stream>:dead` with the reason, and acknowledged.

use crate::events::{self, ShopEvent};
use postbox::typed::{DecodeError, Decoder};
use postbox::{InboxOutcome, Outbox};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::streams::{StreamId, StreamReadOptions, StreamReadReply};
use redis::AsyncCommands;
use serde::Deserialize;
use serde_json::value::RawValue;
use sqlx::{PgConnection, PgPool};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The consumer group, and the consumer name in postbox's inbox.
pub const GROUP: &str = "customer-stats";

const BATCH: usize = 100;
const BLOCK: Duration = Duration::from_secs(2);

/// Counters since start, updated after each commit.
#[derive(Debug, Default)]
pub struct ConsumerStats {
    /// Events whose effect was applied.
    pub applied: AtomicU64,
    /// Deliveries of events applied before: the inbox skipped them.
    pub duplicates: AtomicU64,
    /// Entries moved to the dead-letter stream.
    pub dead_lettered: AtomicU64,
}

/// Why a batch was not processed; it is read again after a pause.
#[derive(Debug, thiserror::Error)]
pub enum ConsumeError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("inbox: {0}")]
    Inbox(#[from] postbox::Error),
}

/// Why an entry can never be processed.
#[derive(Debug, thiserror::Error)]
enum Poison {
    #[error("the entry has no body field")]
    NoBody,
    #[error("the body is not a CloudEvents JSON document: {0}")]
    NotCloudEvents(serde_json::Error),
    #[error("{}", .0.reason())]
    Undecodable(DecodeError),
}

/// The CloudEvents attributes the consumer needs.
#[derive(Deserialize)]
struct CloudEvent {
    id: Uuid,
    #[serde(rename = "type")]
    event_type: String,
    schemaversion: i32,
    data: Box<RawValue>,
}

pub struct Consumer {
    pool: PgPool,
    outbox: Outbox,
    redis: ConnectionManager,
    stream: String,
    name: String,
    decoder: Decoder<ShopEvent>,
    stats: Arc<ConsumerStats>,
}

impl Consumer {
    /// Connect to Redis and create the group on `stream` if needed (from the
    /// stream's start, so entries published before the first start count).
    /// `name` identifies this process in the group: keep it stable across
    /// restarts, so that it finds its own pending entries again.
    pub async fn connect(
        pool: PgPool,
        outbox: Outbox,
        redis_url: &str,
        stream: &str,
        name: &str,
    ) -> Result<Self, redis::RedisError> {
        let config = ConnectionManagerConfig::new().set_response_timeout(Some(BLOCK * 3));
        let client = redis::Client::open(redis_url)?;
        let mut redis = ConnectionManager::new_with_config(client, config).await?;
        let created: redis::RedisResult<()> =
            redis.xgroup_create_mkstream(stream, GROUP, "0").await;
        match created {
            Err(e) if e.code() != Some("BUSYGROUP") => return Err(e),
            _ => {}
        }
        Ok(Self {
            pool,
            outbox,
            redis,
            stream: stream.to_owned(),
            name: name.to_owned(),
            decoder: events::decoder(),
            stats: Arc::default(),
        })
    }

    pub fn stats(&self) -> Arc<ConsumerStats> {
        self.stats.clone()
    }

    /// Consume until `stop` is cancelled. Failures are logged and retried.
    pub async fn run(mut self, stop: CancellationToken) {
        // "0": this consumer's pending entries (read before, never acknowledged);
        // ">": new entries. Start with the former, and go back to them after a failure.
        let mut cursor = "0";
        let mut failures = 0;
        while !stop.is_cancelled() {
            let read = tokio::select! {
                read = self.read(cursor) => read,
                _ = stop.cancelled() => break,
            };
            let done = match read {
                Ok(entries) if entries.is_empty() && cursor == "0" => {
                    cursor = ">";
                    Ok(())
                }
                Ok(entries) => self.handle_all(&entries).await,
                Err(e) => Err(e.into()),
            };
            match done {
                Ok(()) => failures = 0,
                Err(e) => {
                    failures += 1;
                    let pause = Duration::from_millis(100 * 2u64.pow(failures.min(6)));
                    tracing::warn!(error = %e, retry_in = ?pause, "consumer: batch failed");
                    cursor = "0";
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        _ = stop.cancelled() => {}
                    }
                }
            }
        }
    }

    async fn read(&mut self, cursor: &str) -> Result<Vec<StreamId>, redis::RedisError> {
        let options = StreamReadOptions::default()
            .group(GROUP, &self.name)
            .count(BATCH)
            .block(BLOCK.as_millis() as usize);
        let reply: StreamReadReply = self
            .redis
            .xread_options(&[&self.stream], &[cursor], &options)
            .await?;
        Ok(reply.keys.into_iter().flat_map(|k| k.ids).collect())
    }

    async fn handle_all(&mut self, entries: &[StreamId]) -> Result<(), ConsumeError> {
        for entry in entries {
            self.handle(entry).await?;
        }
        Ok(())
    }

    async fn handle(&mut self, entry: &StreamId) -> Result<(), ConsumeError> {
        match self.decode(entry) {
            Ok((event_id, event)) => {
                let mut tx = self.pool.begin().await?;
                let outcome =
                    postbox::sqlx::record_inbox(&self.outbox, &mut tx, GROUP, event_id).await?;
                if outcome == InboxOutcome::New {
                    apply(&mut tx, &event).await?;
                }
                tx.commit().await?;
                let counter = match outcome {
                    InboxOutcome::New => &self.stats.applied,
                    InboxOutcome::Duplicate => &self.stats.duplicates,
                };
                counter.fetch_add(1, Ordering::Relaxed);
            }
            Err(poison) => {
                tracing::warn!(entry = %entry.id, reason = %poison, "consumer: dead-lettering an entry");
                let body = entry.get::<String>("body").unwrap_or_default();
                let dead = format!("{}:dead", self.stream);
                let reason = poison.to_string();
                let fields = [
                    ("entry", entry.id.as_str()),
                    ("reason", &reason),
                    ("body", &body),
                ];
                let _: String = self.redis.xadd(dead, "*", &fields).await?;
                self.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
            }
        }
        let _: u64 = self.redis.xack(&self.stream, GROUP, &[&entry.id]).await?;
        Ok(())
    }

    fn decode(&self, entry: &StreamId) -> Result<(Uuid, ShopEvent), Poison> {
        let body: String = entry.get("body").ok_or(Poison::NoBody)?;
        let event: CloudEvent = serde_json::from_str(&body).map_err(Poison::NotCloudEvents)?;
        let decoded = self
            .decoder
            .decode(&event.event_type, event.schemaversion, event.data.get())
            .map_err(Poison::Undecodable)?;
        Ok((event.id, decoded))
    }
}

/// The effect: not idempotent by itself (a counter), which is why it runs only
/// for a new inbox record, in the same transaction.
async fn apply(conn: &mut PgConnection, event: &ShopEvent) -> Result<(), sqlx::Error> {
    match event {
        ShopEvent::OrderPlaced(order) => {
            sqlx::query(
                "INSERT INTO customer_stats AS s (customer, orders, spent_cents) \
                 VALUES ($1, 1, $2) \
                 ON CONFLICT (customer) DO UPDATE \
                 SET orders = s.orders + 1, spent_cents = s.spent_cents + EXCLUDED.spent_cents, \
                     updated_at = now()",
            )
            .bind(&order.customer)
            .bind(order.total_cents)
            .execute(conn)
            .await?;
        }
    }
    Ok(())
}

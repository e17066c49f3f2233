//! An example shop built on postbox: the whole flow, written the way an
//! application would write it.
//!
//! - [`api`]: `POST /orders` inserts the order **and** its `order.placed` event
//!   in one transaction, behind the `Idempotency-Key` header; `GET /orders/{id}`
//!   and `GET /customers/{customer}` read back.
//! - [`relay`]: postbox's relay, in-process, publishing committed events to a
//!   Redis stream.
//! - [`consumer`]: reads that stream with a consumer group and applies each
//!   event once through postbox's inbox (a per-customer counter).
//! - [`events`]: the typed, versioned event both sides share.
//!
//! The shop's tables live in the same schema as postbox's: [`connect`] sets the
//! pool's `search_path` to it, and [`setup`] creates both.

pub mod api;
pub mod consumer;
pub mod events;

pub use api::{router, App};
pub use consumer::{Consumer, ConsumerStats};

use postbox::Schema;
use postbox_relay::sinks::{self, SinkOptions};
use postbox_relay::{Relay, RelayConfig, Store};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use std::str::FromStr;

/// Why the shop could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Postbox(#[from] postbox::Error),
    #[error("the Redis URL is not valid: {0}")]
    RedisUrl(#[from] url::ParseError),
    #[error("relay: {0}")]
    Sink(#[from] postbox_relay::SinkError),
    #[error(transparent)]
    Config(#[from] postbox_relay::ConfigError),
}

/// A pool on `database_url` whose connections resolve unqualified table names
/// in `schema` (postbox's own statements always name their schema).
pub async fn connect(database_url: &str, schema: &Schema) -> Result<PgPool, sqlx::Error> {
    let options =
        PgConnectOptions::from_str(database_url)?.options([("search_path", schema.name())]);
    PgPoolOptions::new()
        .max_connections(10)
        .connect_with(options)
        .await
}

/// Bring `schema` up to date: postbox's migrations, then the shop's tables.
/// Safe to run at every start, from several processes at once.
pub async fn setup(pool: &PgPool, schema: &Schema) -> Result<(), StartError> {
    let mut conn = pool.acquire().await?;
    postbox::sqlx::migrate(&mut conn, schema).await?;
    sqlx::raw_sql(include_str!("tables.sql"))
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// postbox's relay, publishing every committed event of `schema` to the Redis
/// stream `stream` (entry fields `id`, `type` and `body`, the CloudEvents JSON).
/// Run it with [`Relay::run`].
pub fn relay(
    pool: PgPool,
    schema: Schema,
    redis_url: &str,
    stream: &str,
    config: RelayConfig,
) -> Result<Relay, StartError> {
    let mut url = url::Url::parse(redis_url)?;
    url.query_pairs_mut()
        .append_pair("mode", "stream")
        .append_pair("key", stream);
    let sink = sinks::from_url(url.as_str(), &SinkOptions::default())?;
    Ok(Relay::new(Store::new(pool, schema), sink, config)?)
}

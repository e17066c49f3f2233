//! postbox: a transactional outbox for PostgreSQL.
//!
//! An application writes its business change and the event describing it in
//! **one** Postgres transaction; the postbox relay delivers every committed event
//! at least once, and the inbox lets consumers apply each event exactly once.
//!
//! This crate is the part an application links: it knows the schema, enqueues
//! events inside the caller's transaction and records inbox entries. It depends
//! on no sink or broker client, and on an HTTP stack only with the `axum` feature.
//!
//! ```no_run
//! # #[cfg(feature = "sqlx")]
//! # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use postbox::{NewEvent, Outbox};
//!
//! let outbox = Outbox::default(); // schema `postbox`
//! let mut tx = pool.begin().await?;
//! sqlx::query("INSERT INTO orders (id) VALUES ($1)").bind(42_i64).execute(&mut *tx).await?;
//! let event = NewEvent::new("order.created", "order", "42", &serde_json::json!({"id": 42}))?;
//! let event_id = postbox::sqlx::enqueue(&outbox, &mut tx, &event).await?;
//! tx.commit().await?; // the event exists if and only if the order does
//! # let _ = event_id; Ok(()) }
//! ```
//!
//! Cargo features: `sqlx` (default) and `tokio-postgres` select the driver
//! functions; `verify` adds signature verification for deliveries, and `axum` an
//! extractor that applies it before a handler runs, `serve` (an HTTP server
//! with header, request and connection bounds) and, with `sqlx`, the HTTP
//! receiver `received::http` that `postbox receive` serves.

mod error;
mod event;
pub mod glob;
mod inbox;
mod migrations;
pub mod otel;
pub mod received;
pub mod redact;
mod schema;
mod sql;
pub mod statements;
pub mod typed;

#[cfg(feature = "axum")]
pub mod axum;
#[cfg(feature = "sqlx")]
pub mod idempotency;
#[cfg(feature = "axum")]
pub mod serve;
#[cfg(feature = "sqlx")]
pub mod sqlx;
#[cfg(feature = "tokio-postgres")]
pub mod tokio_postgres;
#[cfg(feature = "verify")]
pub mod verify;

pub use error::Error;
pub use event::{NewEvent, MAX_DELIVER_AFTER, MAX_NAME_BYTES};
pub use inbox::{InboxOutcome, SequenceCheck};
pub use migrations::{Migration, MIGRATIONS};
pub use schema::Schema;

use std::sync::Arc;

/// A handle on one postbox schema: the validated schema name and the SQL for it.
///
/// Cheap to clone; build it once at start-up and share it.
#[derive(Clone, Debug)]
pub struct Outbox {
    schema: Schema,
    sql: Arc<sql::Queries>,
    max_payload_bytes: usize,
}

/// Default upper bound for an event's serialized payload: 1 MiB.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

impl Outbox {
    /// An outbox in the given schema.
    pub fn new(schema: Schema) -> Self {
        let sql = Arc::new(sql::Queries::new(&schema));
        Self {
            schema,
            sql,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
        }
    }

    /// An outbox in the schema called `name` (validated, see [`Schema::new`]).
    pub fn with_schema(name: &str) -> Result<Self, Error> {
        Ok(Self::new(Schema::new(name)?))
    }

    /// Refuse payloads larger than `bytes` once serialized (default 1 MiB).
    pub fn max_payload_bytes(mut self, bytes: usize) -> Self {
        self.max_payload_bytes = bytes;
        self
    }

    /// The schema this outbox lives in.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    fn check(&self, event: &NewEvent) -> Result<(), Error> {
        event.check_payload_size(self.max_payload_bytes)
    }
}

impl Default for Outbox {
    /// The outbox in the default schema, `postbox`.
    fn default() -> Self {
        Self::new(Schema::default())
    }
}

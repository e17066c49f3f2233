//! The postbox relay: claims committed outbox events under leases, publishes
//! them through a [`Sink`], and settles each one — delivered, retried with
//! backoff, or dead-lettered — only while its lease still holds.
//!
//! Layout: the data layer is the `postbox-store` crate (every statement the
//! relay runs); [`relay`] is the engine; [`sink`] is the transport boundary and [`sinks`] the transports;
//! [`cloudevents`] the message body; [`redact`] keeps secrets out of errors;
//! [`metrics`] names every exported metric; [`retention`] keeps the tables small;
//! [`tenants`] serves many outboxes from one process.
//!
//! Cargo features, one per transport (a sink URL whose feature is not built
//! is a configuration error naming it; `stdout` is always built):
//! `redis`, `nats` (JetStream), `amqp` (RabbitMQ), `http` (webhooks),
//! `qstash`, `sqs`, `sns` and `kinesis` (Amazon) are on by default; `kafka`
//! is opt-in (it compiles the bundled librdkafka: a C compiler and make). `failpoints` arms the named
//! failpoints of [`failpoint`] for fault-injection runs.

pub mod backoff;
pub mod cloudevents;
pub mod config;
pub mod failpoint;
pub mod health;
mod log_mode;
pub mod logical_mode;
mod logical_stream;
pub mod metrics;
mod otel;
mod page;
pub mod relay;
pub mod retention;
pub mod router;
pub mod sink;
pub mod sinks;
pub mod tenants;
mod trouble;

/// Secret masking and payload redaction (shared with the console and the CLI).
pub use postbox::redact;

pub use config::{ConfigError, LogicalTransport, ReadMode, RelayConfig};
pub use health::HealthConfig;
pub use postbox_store::Store;
pub use relay::{Relay, RunMode, StartError, Stats, StatsSnapshot};
pub use retention::RetentionConfig;
pub use router::{Destination, PoisonPolicy, RouteConfig, Router};
pub use sink::{Message, Outcome, Sink, SinkError};
pub use tenants::{OutboxSource, OutboxStatus, Tenants, TenantsConfig};

//! The postbox relay: claims committed outbox events under leases, publishes
//! them through a [`Sink`], and settles each one — delivered, retried with
//! backoff, or dead-lettered — only while its lease still holds.
//!
//! Layout (ARCHITECTURE.md has the rules each boundary keeps):
//! [`relay`] is the builder and the lifecycle; `engine` what every reading
//! mode shares (the publish path, per-destination failure runs, the page
//! publisher, wake-up signals, batch permits); `modes` the reading modes
//! (`claim`, `log`, `logical`); `tasks` the background tasks ([`health`],
//! [`retention`], rescue, listen, gauges); `telemetry` metrics
//! ([`metrics`]), OpenTelemetry spans and the outbox label; [`sink`] is the
//! transport boundary (the `postbox-sink` crate) and [`sinks`] the
//! transports (the `postbox-sinks` crate, re-exported here); [`router`]
//! plans who gets what; [`shape`] runs the routes' and destinations' jq
//! filters and transforms; [`tenants`] serves many outboxes from one process.
//! The data layer is the `postbox-store` crate (every statement the relay
//! runs).
//!
//! Cargo features, one per transport, forwarded to `postbox-sinks` (a sink
//! URL whose feature is not built is a configuration error naming it;
//! `stdout` is always built): `redis`, `nats` (JetStream), `amqp`
//! (RabbitMQ), `http` (webhooks), `qstash`, `sqs`, `sns` and `kinesis`
//! (Amazon) are on by default; `kafka` is opt-in (it compiles the bundled
//! librdkafka: a C compiler and make). `failpoints` arms the named
//! failpoints of [`failpoint`] for fault-injection runs.

pub mod backoff;
pub mod config;
mod engine;
pub mod failpoint;
mod modes;
pub mod relay;
pub mod replay;
pub mod router;
pub mod shape;
mod tasks;
mod telemetry;
pub mod tenants;

/// Secret masking and payload redaction (shared with the console and the CLI).
pub use postbox::redact;
/// The sink contract (the `postbox-sink` crate): the `Sink` trait, `Message`,
/// `Outcome`, and the CloudEvents body.
pub use postbox_sink::{self as sink, cloudevents};
/// The transports (the `postbox-sinks` crate): every sink, the registry
/// [`sinks::from_url`] builds one from, and the shared `[sink]` options.
pub use postbox_sinks as sinks;

pub use config::{ConfigError, LogicalTransport, ReadMode, RelayConfig};
pub use engine::permits;
pub use engine::{message, message_of};
pub use modes::logical::at_risk;
pub use postbox_store::Store;
pub use relay::{Relay, RunMode, StartError, Stats, StatsSnapshot};
pub use router::{Destination, PoisonPolicy, RouteConfig, Router};
pub use sink::{Message, Outcome, Sink, SinkError};
pub use tasks::health::{self, HealthConfig};
pub use tasks::retention::{self, RetentionConfig};
pub use telemetry::{label, metrics};
pub use tenants::{OutboxSource, OutboxStatus, Tenants, TenantsConfig};

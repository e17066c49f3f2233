//! The relay's integration tests, against real PostgreSQL and Redis (one schema per test).
//! The tests of each sink run when its cargo feature is built.

mod support;

mod engine;
mod health;
mod hostile;
mod log_mode;
mod logical;
mod metrics;
mod ordering;
mod quarantine;
#[cfg(feature = "redis")]
mod redis_sink;
mod retention_idempotency;
mod roles;
mod routing;
mod scheduled;
mod secrets;
mod shaping;
mod tenants;
#[cfg(feature = "redis")]
mod trouble;

#[cfg(feature = "amqp")]
mod amqp;
#[cfg(any(feature = "sqs", feature = "sns", feature = "kinesis"))]
mod aws;
#[cfg(any(
    feature = "redis",
    feature = "nats",
    feature = "amqp",
    feature = "http",
    feature = "qstash",
    feature = "kafka",
    feature = "sqs",
    feature = "sns",
    feature = "kinesis"
))]
mod conformance;
#[cfg(feature = "http")]
mod http;
mod kafka;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "qstash")]
mod qstash;
#[cfg(any(feature = "http", feature = "qstash"))]
mod receiver;

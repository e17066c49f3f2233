//! The relay's integration tests, against real PostgreSQL and Redis (one schema per test).

mod support;

mod engine;
mod health;
mod hostile;
mod log_mode;
mod metrics;
mod ordering;
mod quarantine;
mod redis_sink;
mod retention_idempotency;
mod roles;
mod routing;

mod amqp;
mod conformance;
mod http;
mod kafka;
mod nats;
mod qstash;

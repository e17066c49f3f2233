//! The relay's integration tests, against real PostgreSQL and Redis (one schema per test).

mod support;

mod engine;
mod quarantine;
mod redis_sink;

mod amqp;
mod conformance;
mod kafka;
mod nats;

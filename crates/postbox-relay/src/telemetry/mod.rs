//! What the relay tells the outside: metric names and recording
//! ([`metrics`]), OpenTelemetry spans ([`otel`]) and the `outbox` label a
//! multi-outbox relay adds to both ([`label`]).
//!
//! **Boundary:** telemetry imports no other part of the relay but the sink
//! contract (what a span describes); the engine, modes and tasks import it.

pub mod label;
pub mod metrics;
pub(crate) mod otel;

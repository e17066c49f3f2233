//! The library's integration tests, against a real PostgreSQL (one schema per test).

mod emit;
mod enqueue;
mod hostile;
mod idempotency;
mod inbox;
mod least_privilege;
mod migrate;
mod received;
mod scheduled;
mod sequences;

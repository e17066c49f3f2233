// The tests signal their child processes through libc.
#![allow(unsafe_code)]

//! End-to-end tests of the `postbox` binary against real PostgreSQL and Redis.

mod cli;
mod console;
mod dlq;
mod guidance;
mod installs;
mod log_cursors;
mod logical;
// The OTLP receiver shared with the `otel` test binary (not every part used here).
mod ops;
#[allow(dead_code)]
#[path = "common/otlp.rs"]
mod otlp;
mod pipes;
mod receive;
mod replay;
mod restore;
mod routes;
mod tenants;
mod verify;

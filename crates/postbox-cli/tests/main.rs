//! End-to-end tests of the `postbox` binary against real PostgreSQL and Redis.

mod cli;
mod console;
mod dlq;
mod guidance;
mod installs;
mod logical;
mod ops;
mod pipes;
mod receive;
mod restore;
mod tenants;
mod verify;

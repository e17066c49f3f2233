//! The relay's background tasks, one file each, each a loop that runs until
//! its stop token is cancelled: [`rescue`] (expired leases back to
//! pending), [`listen`] (LISTEN, waking the readers), [`gauges`] (the
//! backlog metrics), [`retention`] (purging old rows), [`health`] (the
//! database health watch) and [`tally`] (deliveries by minute).
//!
//! **Boundary:** a task imports the engine (`crate::engine`), never a
//! reading mode (`crate::modes`). `.ci/layers` checks it.

pub(crate) mod gauges;
pub mod health;
pub(crate) mod listen;
pub(crate) mod rescue;
pub mod retention;
pub(crate) mod tally;

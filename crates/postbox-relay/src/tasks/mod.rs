//! The relay's background tasks, one file each, each a loop that runs until
//! its stop token is cancelled: [`rescue`] (expired leases back to
//! pending), [`listen`] (LISTEN, waking the readers), [`gauges`] (the
//! backlog metrics), [`retention`] (purging old rows), [`health`] (the
//! database health watch), [`tally`] (deliveries by minute) and `replays`
//! (where a destination added in claim or logical mode starts).
//!
//! **Boundary:** a task imports the engine (`crate::engine`), never a
//! reading mode (`crate::modes`). `.ci/layers` checks it.

pub(crate) mod gauges;
pub mod health;
pub(crate) mod listen;
pub(crate) mod replays;
pub(crate) mod rescue;
pub mod retention;
pub(crate) mod tally;

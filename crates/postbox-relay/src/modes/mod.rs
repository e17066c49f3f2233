//! The reading modes, one module each: [`claim`] (claims and leases on the
//! outbox table; also the outbox half of the other two), [`log`] (snapshot
//! cursors over the append-only log) and [`logical`] (a replication slot).
//! Each turns what it reads into `Message`s for the engine's one publish
//! path and settles outcomes through its own store type.
//!
//! **Boundary:** no mode imports another mode; shared code lives in
//! `crate::engine`. `.ci/layers` checks it.

pub(crate) mod claim;
pub(crate) mod log;
pub(crate) mod logical;

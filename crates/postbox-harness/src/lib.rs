//! What `postbox verify`, `postbox bench` and `postbox demo` run, shipped
//! with the `postbox` binary (these are user-facing commands, not tests).
//!
//! - [`proxy`]: the TCP fault proxy (also what `postbox_testkit::proxy`
//!   wraps for test suites; it is all this crate offers without its default
//!   `workloads` feature).

pub mod proxy;

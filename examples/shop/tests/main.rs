//! The shop's tests, against the real PostgreSQL (one schema per test) and
//! Redis (one stream per test).

mod support;

mod api;
mod flow;

//! The operator console against a real PostgreSQL: HTTP-level tests of access
//! control, CSRF and rate limits, the pages and bulk actions, and end-to-end
//! tests in headless Chromium; one console over many outboxes; replay jobs.

mod access;
mod browser;
mod guard;
mod outbox_roles;
mod outboxes;
mod pages;
mod replays;
mod sign_in_token;
mod support;

//! The boundary between the relay and every transport.
//!
//! A [`Sink`] receives a batch of committed events and answers with exactly one
//! [`Outcome`] per event, in input order. The contract every sink keeps:
//!
//! - **Delivered** means the transport durably accepted the message (a broker
//!   acknowledgement, a 2xx answer), not merely that a write call returned.
//! - When in doubt, answer **Retry**: the relay will deliver again with the same
//!   event id, and consumers deduplicate. Duplicates are allowed; losses are not.
//! - **Reject** is for a message the destination will never accept as it is; the
//!   event becomes a dead letter for an operator to inspect and replay.
//! - Errors in outcomes should not contain credentials. The relay masks, in
//!   every outcome and every [`SinkError`] of a sink, the literal secrets the
//!   sink declares in [`Sink::secrets`] and credentials by their shape
//!   ([`sanitize_error`](postbox::redact::sanitize_error)) before an error is
//!   stored (`last_error`) or logged: a sink holding a credential declares it
//!   there, so an endpoint echoing it back cannot leak it.
//!
//! Sinks know nothing about Postgres: this crate depends on the `postbox`
//! library alone (its secret masking), never on the store or the relay,
//! which turns its own rows into [`Message`]s.

pub mod cloudevents;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
pub use postbox::redact::Secrets;
use serde_json::value::RawValue;
use std::collections::BTreeMap;
use std::time::Duration;
use uuid::Uuid;

/// One committed event on its way out.
#[derive(Clone, Debug)]
pub struct Message {
    /// The stable id: the same on every attempt and every replay.
    pub event_id: Uuid,
    pub event_type: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub schema_version: i32,
    /// The payload, as the JSON text that was committed.
    pub payload: Box<RawValue>,
    /// Producer-supplied headers, forwarded by transports that carry headers.
    pub headers: BTreeMap<String, String>,
    /// When the producing transaction inserted the event.
    pub created_at: DateTime<Utc>,
    /// 1 on the first delivery attempt.
    pub attempt: i32,
    /// The event's number within its aggregate (1, 2, …), assigned in the
    /// producing transaction; `None` for events committed before schema version 5.
    pub sequence: Option<i64>,
    /// The CloudEvents `source` of this event when it is not the sink's own
    /// (a relay serving many outboxes names the event's outbox).
    pub source: Option<std::sync::Arc<str>>,
}

/// What happened to one message.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// The transport durably accepted the message.
    Delivered,
    /// Not delivered (or not known to be): try again, after `after` when given.
    Retry {
        error: String,
        after: Option<Duration>,
    },
    /// The destination will never accept this message: dead-letter it.
    Reject { error: String },
    /// Not sent at all — the sink's own rate limit or time budget left no room
    /// for it in this batch: try again (after `after` when given) without
    /// counting an attempt, so a throttled backlog never exhausts its budget.
    Deferred {
        reason: String,
        after: Option<Duration>,
    },
}

impl Outcome {
    /// A retry with no preferred delay.
    pub fn retry(error: impl Into<String>) -> Self {
        Outcome::Retry {
            error: error.into(),
            after: None,
        }
    }

    /// A permanent rejection.
    pub fn reject(error: impl Into<String>) -> Self {
        Outcome::Reject {
            error: error.into(),
        }
    }
}

/// A sink could not be set up or reached.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SinkError {
    /// The sink's configuration (usually its URL) is invalid; the message names the part.
    #[error("invalid sink configuration: {0}")]
    Config(String),
    /// The destination could not be reached (or did not answer in time): it
    /// may come up later, and the relay retries.
    #[error("sink {sink} is unreachable: {reason}")]
    Unreachable { sink: String, reason: String },
    /// The broker answered, and what the configuration names is not there
    /// (a missing exchange, no stream capturing the subjects): retrying will
    /// not help until someone fixes the configuration or the broker, so a
    /// relay does not start.
    #[error("sink {sink} is misconfigured: {reason}")]
    Misconfigured { sink: String, reason: String },
}

/// A transport the relay publishes to.
#[async_trait]
pub trait Sink: Send + Sync + 'static {
    /// Publish a batch; return exactly one outcome per message, in input order.
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome>;

    /// Check that the destination is reachable (start-up and readiness).
    async fn check(&self) -> Result<(), SinkError>;

    /// A description for logs, metrics, `postbox status` and the console,
    /// without credentials, query values or secret-looking path segments
    /// (e.g. `redis://127.0.0.1:6379/0 list postbox:{event_type}`; build URLs
    /// with [`display_url`](postbox::redact::display_url)).
    fn describe(&self) -> String;

    /// The literal secrets this sink holds (passwords, tokens, credential
    /// headers), in every encoding it sends them: the relay masks them in
    /// every error text before storing or logging it. None by default.
    fn secrets(&self) -> &Secrets {
        &NO_SECRETS
    }
}

/// What a sink holding no secret declares.
static NO_SECRETS: Secrets = Secrets::NONE;

impl SinkError {
    /// The same error with `secrets` masked out of its text.
    pub fn masked(self, secrets: &Secrets) -> Self {
        match self {
            SinkError::Config(text) => SinkError::Config(secrets.sanitize(&text)),
            SinkError::Unreachable { sink, reason } => SinkError::Unreachable {
                sink: secrets.sanitize(&sink),
                reason: secrets.sanitize(&reason),
            },
            SinkError::Misconfigured { sink, reason } => SinkError::Misconfigured {
                sink: secrets.sanitize(&sink),
                reason: secrets.sanitize(&reason),
            },
        }
    }
}

impl Outcome {
    /// The same outcome with `secrets` masked out of its error text.
    pub fn masked(self, secrets: &Secrets) -> Self {
        if secrets.is_empty() {
            return self;
        }
        match self {
            Outcome::Delivered => Outcome::Delivered,
            Outcome::Retry { error, after } => Outcome::Retry {
                error: secrets.sanitize(&error),
                after,
            },
            Outcome::Reject { error } => Outcome::Reject {
                error: secrets.sanitize(&error),
            },
            Outcome::Deferred { reason, after } => Outcome::Deferred {
                reason: secrets.sanitize(&reason),
                after,
            },
        }
    }
}

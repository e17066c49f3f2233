//! Relay settings: data, validated once at start-up with errors that name the field.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// A setting is out of range; `field` is its path in the config file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration: {field}: {reason}")]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

impl ConfigError {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// How a relay reads committed events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReadMode {
    /// Claim due rows of the outbox table under leases, mark them sent.
    #[default]
    Claim,
    /// Read the append-only log by snapshot windows, one cursor per
    /// destination; events a destination does not take go to the outbox's
    /// retry and dead-letter machinery, which runs alongside.
    Log,
    /// Read events emitted into the WAL (`emit`) from a replication slot;
    /// events a destination does not take go to the outbox's retry and
    /// dead-letter machinery, which runs alongside.
    Logical,
}

impl std::str::FromStr for ReadMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "claim" => Ok(ReadMode::Claim),
            "log" => Ok(ReadMode::Log),
            "logical" => Ok(ReadMode::Logical),
            other => Err(format!(
                "unknown mode {other:?}: expected claim, log or logical"
            )),
        }
    }
}

/// How logical mode reads its replication slot (`relay.logical_transport`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogicalTransport {
    /// The streaming replication protocol: the server pushes each
    /// transaction's events as it commits, decoded once; the relay confirms
    /// with standby status updates. Needs a replication connection (a
    /// `replication` entry in pg_hba.conf, a role with `REPLICATION`, a free
    /// `max_wal_senders` slot).
    #[default]
    Stream,
    /// The SQL interface: the slot is peeked round after round (idle rounds
    /// back off up to 250 ms) and advanced with `pg_replication_slot_advance`;
    /// each peek decodes the WAL again from the slot's restart position. For
    /// servers that admit no replication connection.
    Sql,
}

/// How the relay claims, publishes and retries (`[relay]` in the config file).
/// Durations are written like `500ms`, `30s`, `10m`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RelayConfig {
    /// How the relay reads events: `claim` (the outbox table, claims under
    /// leases) or `log` (the append-only log, snapshot cursors per destination).
    pub mode: ReadMode,
    /// Events claimed under one lease and handed to the sink at once (1–10000).
    pub batch_size: u32,
    /// Log mode: how long producers write into one segment of the log's ring
    /// of four before moving to the next; a segment every cursor has read
    /// past is emptied (truncated, or archived with `retention.archive`), so
    /// delivered events leave no dead tuples. An event stays in the log for
    /// up to about one segment age after it was written, once every cursor
    /// has read it.
    #[serde(with = "humantime_serde")]
    pub log_segment_age: Duration,
    /// Log mode: into how many partitions each destination's cursor is split
    /// (1–1024), by a hash of the aggregate, so several relays share one
    /// destination: each partition has its own cursor and lease, and each
    /// relay takes about 1/(relays) of them. One aggregate is always in one
    /// partition, so ordered routes keep their order. Applies when the
    /// cursors are made; a destination split otherwise is re-split when a
    /// relay starts while no relay holds any of its cursors.
    pub log_partitions: u16,
    /// Longest wait between two claims when no notification arrives.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// How long a claim is owned before any relay may reclaim it. Must exceed
    /// twice `publish_timeout`: the next batch is claimed while the current one
    /// publishes, so a claim may wait one publish before its own starts. A
    /// publish still running when its lease expires may be delivered twice.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// Longest wait for the sink to answer a batch; then the batch is retried.
    #[serde(with = "humantime_serde")]
    pub publish_timeout: Duration,
    /// Delivery attempts before an event becomes a dead letter (`failed`).
    pub max_attempts: i32,
    /// First retry delay; doubles per attempt up to `backoff_max`, with full jitter.
    #[serde(with = "humantime_serde")]
    pub backoff_base: Duration,
    /// Longest retry delay (also caps a destination's `Retry-After`).
    #[serde(with = "humantime_serde")]
    pub backoff_max: Duration,
    /// How often expired leases are looked for.
    #[serde(with = "humantime_serde")]
    pub rescue_interval: Duration,
    /// LISTEN for the outbox's insert notifications to claim without waiting for the next poll.
    pub listen: bool,
    /// On SIGTERM/SIGINT, how long in-flight batches may take to finish before the relay exits anyway.
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    /// Whether the relay's claims and acknowledgements wait for the WAL flush
    /// (the default). `false` saves a flush per statement; losing one in a
    /// PostgreSQL crash only redelivers the event (see
    /// [`postbox_store::RelayCommit`]).
    pub synchronous_commit: bool,
    /// Logical mode: the replication slot to read (created on first start,
    /// with a publication of the same name); default `postbox_<schema>`.
    pub logical_slot: Option<String>,
    /// Logical mode: how the slot is read, `stream` (the streaming
    /// replication protocol, the default) or `sql` (peeked through SQL).
    pub logical_transport: LogicalTransport,
    /// Logical mode over `sql`: how often the slot is read when the last read
    /// found nothing new (a read that finds events is followed by the next at
    /// once). The stream transport does not poll.
    #[serde(with = "humantime_serde")]
    pub logical_poll_interval: Duration,
    /// Logical mode: the health watch, `postbox status` and `postbox slot
    /// status` say so loudly when no relay has held the slot for longer
    /// than this (the slot retains WAL meanwhile).
    #[serde(with = "humantime_serde")]
    pub logical_inactive_warn: Duration,
    /// Evaluation steps a `filter`, `transform` or `headers` expression may
    /// take for one event (1–100000000); an expression that needs more stops,
    /// and the event becomes a dead letter of that destination. About 10 ms
    /// of CPU per 100,000 steps.
    pub expression_steps: u64,
    /// Claim and logical mode: the pace, in events a second, of the replay
    /// jobs the relay runs for destinations added with a start in the past
    /// (0: as fast as the destination takes them). 1–1000000, or 0.
    pub replay_rate: u32,
}

/// The pace of the replay jobs a relay runs, unless `relay.replay_rate`
/// says otherwise: on a 2-core machine a replay at this pace moved live
/// delivery's median by under a millisecond (its p99 by 2–8 ms; unpaced,
/// at 30,000–60,000 events/s, by 4–10 ms and more): the book's
/// performance page.
pub const DEFAULT_REPLAY_RATE: u32 = 10_000;

/// Evaluation steps a filter or transform may take for one event, unless
/// `relay.expression_steps` says otherwise.
pub const DEFAULT_EXPRESSION_STEPS: u64 = 100_000;

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            mode: ReadMode::Claim,
            batch_size: 500,
            log_segment_age: Duration::from_secs(60),
            log_partitions: 1,
            poll_interval: Duration::from_secs(1),
            lease: Duration::from_secs(60),
            publish_timeout: Duration::from_secs(20),
            max_attempts: 20,
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(600),
            rescue_interval: Duration::from_secs(5),
            listen: true,
            shutdown_timeout: Duration::from_secs(30),
            synchronous_commit: true,
            logical_slot: None,
            logical_transport: LogicalTransport::Stream,
            logical_poll_interval: Duration::from_millis(10),
            logical_inactive_warn: Duration::from_secs(300),
            expression_steps: DEFAULT_EXPRESSION_STEPS,
            replay_rate: DEFAULT_REPLAY_RATE,
        }
    }
}

impl RelayConfig {
    /// Check every setting; the error names the first field out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let f = |name: &str| format!("relay.{name}");
        if !(1..=10_000).contains(&self.batch_size) {
            return Err(ConfigError::new(
                f("batch_size"),
                format!("must be between 1 and 10000, got {}", self.batch_size),
            ));
        }
        if !(1..=1024).contains(&self.log_partitions) {
            return Err(ConfigError::new(
                f("log_partitions"),
                format!("must be between 1 and 1024, got {}", self.log_partitions),
            ));
        }
        let positive = [
            ("poll_interval", self.poll_interval),
            ("lease", self.lease),
            ("publish_timeout", self.publish_timeout),
            ("backoff_max", self.backoff_max),
            ("rescue_interval", self.rescue_interval),
            ("log_segment_age", self.log_segment_age),
            ("logical_poll_interval", self.logical_poll_interval),
            ("logical_inactive_warn", self.logical_inactive_warn),
        ];
        for (name, d) in positive {
            if d.is_zero() {
                return Err(ConfigError::new(f(name), "must be greater than zero"));
            }
        }
        if self.lease < Duration::from_secs(1) {
            return Err(ConfigError::new(f("lease"), "must be at least 1s"));
        }
        if self.publish_timeout.saturating_mul(2) >= self.lease {
            return Err(ConfigError::new(
                f("publish_timeout"),
                format!(
                    "must be less than half of relay.lease ({}): a batch claimed ahead may wait \
                     one publish before its own, and a publish outliving its lease is delivered twice",
                    humantime::format_duration(self.lease)
                ),
            ));
        }
        if let Some(slot) = &self.logical_slot {
            check_slot_name(slot).map_err(|reason| ConfigError::new(f("logical_slot"), reason))?;
        }
        if !(1..=100_000_000).contains(&self.expression_steps) {
            return Err(ConfigError::new(
                f("expression_steps"),
                format!(
                    "must be between 1 and 100000000, got {}",
                    self.expression_steps
                ),
            ));
        }
        if self.replay_rate > 1_000_000 {
            return Err(ConfigError::new(
                f("replay_rate"),
                format!(
                    "must be at most 1000000 events a second (0: unpaced), got {}",
                    self.replay_rate
                ),
            ));
        }
        if self.max_attempts < 1 {
            return Err(ConfigError::new(
                f("max_attempts"),
                format!("must be at least 1, got {}", self.max_attempts),
            ));
        }
        if self.backoff_base > self.backoff_max {
            return Err(ConfigError::new(
                f("backoff_base"),
                "must not exceed relay.backoff_max",
            ));
        }
        Ok(())
    }
}

impl RelayConfig {
    /// The replication slot logical mode reads for `schema`.
    pub fn slot_name(&self, schema: &postbox::Schema) -> String {
        self.logical_slot
            .clone()
            .unwrap_or_else(|| postbox_store::default_slot_name(schema))
    }
}

/// PostgreSQL's rule for replication slot names.
pub fn check_slot_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 63 {
        return Err(format!(
            "must be 1 to 63 characters long, got {}",
            name.len()
        ));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Err("only lower-case ASCII letters, digits and '_' are allowed".to_owned());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        RelayConfig::default().validate().unwrap();
    }

    #[test]
    fn errors_name_the_field() {
        let cases: Vec<(RelayConfig, &str)> = vec![
            (
                RelayConfig {
                    replay_rate: 1_000_001,
                    ..Default::default()
                },
                "relay.replay_rate",
            ),
            (
                RelayConfig {
                    batch_size: 0,
                    ..Default::default()
                },
                "relay.batch_size",
            ),
            (
                RelayConfig {
                    max_attempts: 0,
                    ..Default::default()
                },
                "relay.max_attempts",
            ),
            (
                RelayConfig {
                    publish_timeout: Duration::from_secs(90),
                    ..Default::default()
                },
                "relay.publish_timeout",
            ),
            (
                RelayConfig {
                    logical_slot: Some("Bad-Name".to_owned()),
                    ..Default::default()
                },
                "relay.logical_slot",
            ),
            (
                RelayConfig {
                    poll_interval: Duration::ZERO,
                    ..Default::default()
                },
                "relay.poll_interval",
            ),
        ];
        for (c, field) in cases {
            let err = c.validate().unwrap_err();
            assert_eq!(err.field, field);
            assert!(err
                .to_string()
                .starts_with(&format!("invalid configuration: {field}: ")));
        }
    }

    #[test]
    fn parses_from_toml_and_rejects_unknown_fields() {
        let c: RelayConfig =
            toml_like(r#"{"batch_size": 10, "lease": "2m", "publish_timeout": "5s"}"#);
        assert_eq!(c.batch_size, 10);
        assert_eq!(c.lease, Duration::from_secs(120));
        let err = serde_json::from_str::<RelayConfig>(r#"{"batch_sise": 1}"#).unwrap_err();
        assert!(
            err.to_string().contains("unknown field `batch_sise`"),
            "{err}"
        );
    }

    fn toml_like(json: &str) -> RelayConfig {
        serde_json::from_str(json).unwrap()
    }
}

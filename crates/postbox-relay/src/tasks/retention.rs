//! Retention: keep the outbox small by deleting (or archiving) sent events,
//! old inbox records and expired request idempotency keys, in bounded batches
//! with a pause between batches.
//!
//! Pending, processing and failed rows are never touched: only events the
//! relay acknowledged (`status = 'sent'`) more than `older_than` ago. Idempotency
//! keys go once their own `expires_at` has passed (the TTL the application gave
//! them; `older_than` does not apply): an expired key is already treated as new,
//! so deleting it changes no answer. The same code serves `postbox purge` and the
//! relay's background task.

use crate::config::ConfigError;
use crate::redact::sanitize_error;
use postbox_store::Store;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// `[retention]` in the config file. Off unless `enabled = true`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// Run retention inside the relay (every `interval`). `postbox purge` ignores it.
    pub enabled: bool,
    /// Sent events acknowledged longer ago than this are removed; inbox records
    /// processed longer ago too (when `inbox` is on). Keep it above your replay window.
    #[serde(with = "humantime_serde")]
    pub older_than: Duration,
    /// Move sent events to `<schema>.outbox_archive` instead of deleting them.
    pub archive: bool,
    /// Also delete inbox records older than `older_than`.
    pub inbox: bool,
    /// Rows removed per statement (1–100000): each batch is one short transaction.
    pub batch_size: u32,
    /// Pause between two batches, so that retention never starves the relay or replicas.
    #[serde(with = "humantime_serde")]
    pub pause: Duration,
    /// How often the relay runs a retention pass.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// After a relay pass that removed events, `VACUUM (ANALYZE)` the outbox so
    /// the space is reused at once — for databases where autovacuum is off or
    /// too slow for the outbox's churn. Needs the table's owner (the relay
    /// role is not); off by default.
    pub vacuum: bool,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            older_than: Duration::from_secs(7 * 86_400),
            archive: false,
            inbox: false,
            batch_size: 5_000,
            pause: Duration::from_millis(100),
            interval: Duration::from_secs(600),
            vacuum: false,
        }
    }
}

impl RetentionConfig {
    /// Check every setting; the error names the first field out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let f = |name: &str| format!("retention.{name}");
        if self.older_than.is_zero() {
            return Err(ConfigError::new(
                f("older_than"),
                "must be greater than zero",
            ));
        }
        if !(1..=100_000).contains(&self.batch_size) {
            return Err(ConfigError::new(
                f("batch_size"),
                format!("must be between 1 and 100000, got {}", self.batch_size),
            ));
        }
        if self.interval.is_zero() {
            return Err(ConfigError::new(f("interval"), "must be greater than zero"));
        }
        if self.pause > Duration::from_secs(60) {
            return Err(ConfigError::new(f("pause"), "must be at most 1m"));
        }
        Ok(())
    }
}

/// Which table a purge step worked on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Table {
    Outbox,
    Inbox,
    /// `<schema>.idempotency_keys`: expired request idempotency keys.
    IdempotencyKeys,
}

impl Table {
    pub fn as_str(self) -> &'static str {
        match self {
            Table::Outbox => "outbox",
            Table::Inbox => "inbox",
            Table::IdempotencyKeys => "idempotency_keys",
        }
    }
}

/// Progress after one batch.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    pub table: Table,
    /// Rows removed from `table` so far in this pass.
    pub removed: u64,
    pub elapsed: Duration,
}

/// What one pass removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PurgeReport {
    /// Sent events deleted or archived.
    pub outbox: u64,
    /// Inbox records deleted.
    pub inbox: u64,
    /// Expired idempotency keys deleted.
    pub idempotency_keys: u64,
    /// The pass was stopped before it finished.
    pub interrupted: bool,
}

/// A retention batch failed. Batches committed before it stay done.
#[derive(Debug, thiserror::Error)]
#[error("purging {}", table.as_str())]
pub struct PurgeError {
    /// The table the failed batch worked on.
    pub table: Table,
    #[source]
    pub source: postbox::Error,
}

/// One retention pass over the outbox, then the inbox (when `config.inbox`),
/// then expired idempotency keys: for each, batches until a batch comes back
/// short (or `stop` is cancelled), pausing `config.pause` between batches.
/// `progress` is called after every batch.
pub async fn purge(
    store: &Store,
    config: &RetentionConfig,
    stop: &CancellationToken,
    mut progress: impl FnMut(Progress),
) -> Result<PurgeReport, PurgeError> {
    let started = Instant::now();
    let limit = i64::from(config.batch_size);
    let mut report = PurgeReport::default();
    let mut tables = vec![Table::Outbox];
    if config.inbox {
        tables.push(Table::Inbox);
    }
    tables.push(Table::IdempotencyKeys);
    // The library owns the idempotency keys' statements.
    let outbox = postbox::Outbox::new(store.schema().clone());
    for table in tables {
        let mut removed = 0;
        loop {
            if stop.is_cancelled() {
                report.interrupted = true;
                return Ok(report);
            }
            let n = batch(store, &outbox, config, table, limit)
                .await
                .map_err(|source| PurgeError { table, source })?;
            removed += n;
            match table {
                Table::Outbox => report.outbox = removed,
                Table::Inbox => report.inbox = removed,
                Table::IdempotencyKeys => report.idempotency_keys = removed,
            }
            metrics::counter!(crate::telemetry::metrics::RETENTION_PURGED, "table" => table.as_str())
                .increment(n);
            progress(Progress {
                table,
                removed,
                elapsed: started.elapsed(),
            });
            if n < limit as u64 {
                break;
            }
            tokio::select! {
                _ = tokio::time::sleep(config.pause) => {}
                _ = stop.cancelled() => {}
            }
        }
    }
    Ok(report)
}

/// One bounded batch on `table`; returns how many rows went.
async fn batch(
    store: &Store,
    outbox: &postbox::Outbox,
    config: &RetentionConfig,
    table: Table,
    limit: i64,
) -> Result<u64, postbox::Error> {
    Ok(match table {
        Table::Outbox => {
            store
                .purge_sent(config.older_than, limit, config.archive)
                .await?
        }
        Table::Inbox => store.purge_inbox(config.older_than, limit).await?,
        Table::IdempotencyKeys => {
            let mut conn = store.pool().acquire().await?;
            postbox::idempotency::purge_expired(outbox, &mut conn, limit).await?
        }
    })
}

/// Run a retention pass every `config.interval` (the first one after one interval).
pub(crate) async fn retention_loop(
    shared: Arc<crate::engine::Shared>,
    config: RetentionConfig,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(config.interval) => {}
            _ = stop.cancelled() => return,
        }
        match purge(&shared.store, &config, &stop, |_| {}).await {
            Ok(r) if r.outbox + r.inbox + r.idempotency_keys > 0 => {
                tracing::info!(
                    outbox = r.outbox,
                    inbox = r.inbox,
                    idempotency_keys = r.idempotency_keys,
                    archived = config.archive,
                    "retention removed old rows"
                );
                if config.vacuum && r.outbox > 0 {
                    if let Err(e) = shared.store.vacuum_outbox().await {
                        tracing::warn!(error = %sanitize_error(&e.to_string()), "VACUUM of the outbox after retention failed (retention.vacuum needs the table's owner)");
                    }
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %sanitize_error(&crate::redact::error_chain(&e)), "retention pass failed; trying again next interval")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_off() {
        let c = RetentionConfig::default();
        c.validate().unwrap();
        assert!(!c.enabled);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (
                RetentionConfig {
                    older_than: Duration::ZERO,
                    ..Default::default()
                },
                "retention.older_than",
            ),
            (
                RetentionConfig {
                    batch_size: 0,
                    ..Default::default()
                },
                "retention.batch_size",
            ),
            (
                RetentionConfig {
                    interval: Duration::ZERO,
                    ..Default::default()
                },
                "retention.interval",
            ),
        ];
        for (c, field) in cases {
            assert_eq!(c.validate().unwrap_err().field, field);
        }
    }
}

//! The database health watch: what silently degrades an outbox in production.
//!
//! Every `interval` the relay reads [`DbHealth`] and exports it as gauges;
//! it logs a warning when a threshold is crossed (and again every
//! `repeat_warning` while it stays crossed):
//!
//! - a transaction older than `max_transaction_age` holds back the xmin
//!   horizon, so vacuum cannot remove the outbox's dead rows and every claim
//!   wades through more of them;
//! - a replication slot holds xmin back by more than `max_slot_xmin_age`
//!   transactions (an abandoned slot does this forever);
//! - dead tuples exceed `max_dead_tuple_ratio` of the outbox table (autovacuum
//!   is not keeping up, or is blocked by one of the above).
//!
//! The LISTEN check lives in the relay's LISTEN task: after connecting it
//! sends itself a probe notification; when the probe does not come back (the
//! connection goes through a pooler in transaction mode, which drops
//! notifications) it says so once and the relay relies on polling.

use crate::config::ConfigError;
use metrics::gauge;
use postbox_store::{DbHealth, Store};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

pub use crate::telemetry::metrics::{
    DEAD_TUPLES, DEAD_TUPLE_RATIO, LISTEN_WORKING, OLDEST_TRANSACTION_AGE, SLOT_XMIN_AGE,
};

/// `[health]` in the config file.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// Run the watch while the relay runs.
    pub enabled: bool,
    /// How often the statistics are read.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Warn when a transaction holding back xmin is older than this.
    #[serde(with = "humantime_serde")]
    pub max_transaction_age: Duration,
    /// Warn when a replication slot holds back xmin by more transactions than this.
    pub max_slot_xmin_age: i64,
    /// Warn when dead tuples exceed this share of the outbox table (0–1)…
    pub max_dead_tuple_ratio: f64,
    /// …and number at least this many (small tables churn harmlessly).
    pub min_dead_tuples: i64,
    /// While a condition lasts, repeat its warning this often.
    #[serde(with = "humantime_serde")]
    pub repeat_warning: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            interval: Duration::from_secs(30),
            max_transaction_age: Duration::from_secs(300),
            max_slot_xmin_age: 100_000_000,
            max_dead_tuple_ratio: 0.5,
            min_dead_tuples: 100_000,
            repeat_warning: Duration::from_secs(600),
        }
    }
}

impl HealthConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, d) in [
            ("interval", self.interval),
            ("max_transaction_age", self.max_transaction_age),
            ("repeat_warning", self.repeat_warning),
        ] {
            if d.is_zero() {
                return Err(ConfigError::new(
                    format!("health.{name}"),
                    "must be greater than zero",
                ));
            }
        }
        if !(0.0..=1.0).contains(&self.max_dead_tuple_ratio) {
            return Err(ConfigError::new(
                "health.max_dead_tuple_ratio",
                format!("must be between 0 and 1, got {}", self.max_dead_tuple_ratio),
            ));
        }
        if self.max_slot_xmin_age < 1 || self.min_dead_tuples < 0 {
            return Err(ConfigError::new(
                if self.max_slot_xmin_age < 1 {
                    "health.max_slot_xmin_age"
                } else {
                    "health.min_dead_tuples"
                },
                "must be positive",
            ));
        }
        Ok(())
    }
}

/// A condition the watch warns about.
#[derive(Clone, Debug, PartialEq)]
pub enum Finding {
    OldTransaction {
        pid: Option<i32>,
        application: String,
        state: String,
        age: Duration,
    },
    SlotHoldsXmin {
        slot: String,
        active: bool,
        transactions: i64,
    },
    DeadTuples {
        dead: i64,
        ratio: f64,
    },
    AutovacuumOff,
}

impl Finding {
    /// The condition's name, as `status` and `/outboxes` show it.
    pub fn key(&self) -> &'static str {
        match self {
            Finding::OldTransaction { .. } => "old_transaction",
            Finding::SlotHoldsXmin { .. } => "slot",
            Finding::DeadTuples { .. } => "dead_tuples",
            Finding::AutovacuumOff => "autovacuum_off",
        }
    }

    /// A condition of the whole database (or server), not of one outbox table.
    pub fn database_wide(&self) -> bool {
        !matches!(self, Finding::DeadTuples { .. })
    }

    /// One line saying what is wrong (no secret: the application name is masked).
    pub fn summary(&self) -> String {
        match self {
            Finding::OldTransaction {
                pid,
                application,
                age,
                ..
            } => format!(
                "a transaction open for {} (pid {}, application {:?}) holds back vacuum",
                humantime::format_duration(Duration::from_secs(age.as_secs())),
                pid.map_or_else(|| "unknown".to_owned(), |p| p.to_string()),
                crate::redact::sanitize_error(application),
            ),
            Finding::SlotHoldsXmin {
                slot, transactions, ..
            } => {
                format!("replication slot {slot} holds back vacuum by {transactions} transactions")
            }
            Finding::DeadTuples { dead, ratio } => format!(
                "{dead} dead tuples, {:.0}% of the outbox table: vacuum is not keeping up",
                ratio * 100.0
            ),
            Finding::AutovacuumOff => "autovacuum is off on the server".to_owned(),
        }
    }

    /// Log the condition; serving many outboxes, naming the database or the
    /// outbox it is found in.
    pub(crate) fn warn(&self, database: Option<&str>, outbox: Option<&str>) {
        let database = database.map(tracing::field::display);
        let outbox = outbox.map(tracing::field::display);
        match self {
            Finding::OldTransaction {
                pid,
                application,
                state,
                age,
            } => tracing::warn!(
                database,
                outbox,
                ?pid,
                application = %crate::redact::sanitize_error(application),
                %state,
                age = %humantime::format_duration(Duration::from_secs(age.as_secs())),
                "a long transaction holds back the xmin horizon: vacuum cannot clean the outbox table until it ends"
            ),
            Finding::SlotHoldsXmin {
                slot,
                active,
                transactions,
            } => tracing::warn!(
                database,
                outbox,
                slot = %slot,
                active,
                transactions,
                "a replication slot holds back the xmin horizon: vacuum cannot clean the outbox table (drop the slot if it is abandoned)"
            ),
            Finding::AutovacuumOff => tracing::warn!(
                database,
                outbox,
                "autovacuum is off on this server: the outbox's dead rows are never cleaned unless something vacuums it; turn autovacuum on, or set retention.vacuum = true"
            ),
            Finding::DeadTuples { dead, ratio } => tracing::warn!(
                database,
                outbox,
                dead,
                ratio = format!("{ratio:.2}"),
                "the outbox table is mostly dead tuples: autovacuum is not keeping up or is held back; claims slow down"
            ),
        }
    }
}

/// The conditions `health` shows against `config`'s thresholds.
pub fn findings(health: &DbHealth, config: &HealthConfig) -> Vec<Finding> {
    let mut out = Vec::new();
    if !health.autovacuum {
        out.push(Finding::AutovacuumOff);
    }
    if let Some(age) = health.oldest_xact_age_seconds {
        let age = Duration::from_secs_f64(age.clamp(0.0, 1e9));
        if age > config.max_transaction_age {
            out.push(Finding::OldTransaction {
                pid: health.oldest_xact_pid,
                application: health.oldest_xact_application.clone().unwrap_or_default(),
                state: health.oldest_xact_state.clone().unwrap_or_default(),
                age,
            });
        }
    }
    if let (Some(slot), Some(age)) = (&health.slot_name, health.slot_xmin_age) {
        if age > config.max_slot_xmin_age {
            out.push(Finding::SlotHoldsXmin {
                slot: slot.clone(),
                active: health.slot_active.unwrap_or(false),
                transactions: age,
            });
        }
    }
    if let (Some(ratio), Some(dead)) = (health.dead_tuple_ratio(), health.dead_tuples) {
        if ratio > config.max_dead_tuple_ratio && dead >= config.min_dead_tuples {
            out.push(Finding::DeadTuples { dead, ratio });
        }
    }
    out
}

/// A finding as `status` and the relay's `/outboxes` report it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// `old_transaction`, `slot`, `dead_tuples` or `autovacuum_off`.
    pub kind: String,
    pub message: String,
}

impl From<&Finding> for Problem {
    fn from(f: &Finding) -> Self {
        Self {
            kind: f.key().to_owned(),
            message: f.summary(),
        }
    }
}

/// Which findings were warned about when, so each is repeated only every
/// `repeat_warning` while it lasts.
#[derive(Debug, Default)]
pub struct Warnings(std::collections::HashMap<&'static str, Instant>);

impl Warnings {
    /// Of `found`, those to warn about now (new, or last warned `repeat`
    /// ago), marked as warned; conditions no longer found are forgotten.
    pub fn due<'a>(&mut self, found: &'a [Finding], repeat: Duration) -> Vec<&'a Finding> {
        self.0.retain(|k, _| found.iter().any(|f| f.key() == *k));
        let mut due = Vec::new();
        for f in found {
            if self.0.get(f.key()).is_none_or(|at| at.elapsed() >= repeat) {
                self.0.insert(f.key(), Instant::now());
                due.push(f);
            }
        }
        due
    }
}

fn export(health: &DbHealth) {
    gauge!(OLDEST_TRANSACTION_AGE).set(health.oldest_xact_age_seconds.unwrap_or(0.0));
    gauge!(SLOT_XMIN_AGE).set(health.slot_xmin_age.unwrap_or(0) as f64);
    gauge!(DEAD_TUPLES).set(health.dead_tuples.unwrap_or(0) as f64);
    gauge!(DEAD_TUPLE_RATIO).set(health.dead_tuple_ratio().unwrap_or(0.0));
}

/// Logical mode's slot as the watch sees it: its name, and how long it may
/// go without a relay holding it (`relay.logical_inactive_warn`).
#[derive(Clone, Debug)]
pub struct SlotWatch {
    pub slot: String,
    pub inactive_warn: Duration,
}

/// Export how long `watch.slot` has gone unread; warn (every
/// `repeat_warning`) while that is longer than its bound.
async fn check_slot(
    store: &Store,
    watch: &SlotWatch,
    repeat: Duration,
    warned: &mut Option<Instant>,
) {
    let Ok(Some(status)) = store
        .logical()
        .status(Some(&watch.slot))
        .await
        .map(|s| s.into_iter().next())
    else {
        return;
    };
    let unread = match status.unread_for() {
        None => 0.0,
        Some(postbox_store::Unread::For(d)) => d.as_secs_f64(),
        Some(postbox_store::Unread::Unknown) => f64::NAN,
    };
    gauge!(crate::telemetry::metrics::SLOT_UNREAD_SECONDS, "slot" => watch.slot.clone())
        .set(unread);
    if !status.unread_longer_than(watch.inactive_warn) {
        *warned = None;
        return;
    }
    if warned.is_none_or(|at| at.elapsed() >= repeat) {
        *warned = Some(Instant::now());
        tracing::error!(
            slot = %watch.slot,
            state = %status.summary(),
            bound = %humantime::format_duration(watch.inactive_warn),
            "no relay has read the replication slot for longer than relay.logical_inactive_warn: events wait and the slot retains WAL; start a relay in logical mode"
        );
    }
}

/// Read, export and warn every `config.interval` until `stop`; in logical
/// mode, watch the slot too.
pub async fn watch(
    store: &Store,
    config: &HealthConfig,
    slot: Option<SlotWatch>,
    stop: &tokio_util::sync::CancellationToken,
) {
    let mut warned = Warnings::default();
    let mut slot_warned = None;
    let mut failing = false;
    loop {
        if let Some(slot) = &slot {
            check_slot(store, slot, config.repeat_warning, &mut slot_warned).await;
        }
        match store.db_health().await {
            Ok(h) => {
                failing = false;
                export(&h);
                let found = findings(&h, config);
                for f in warned.due(&found, config.repeat_warning) {
                    f.warn(None, None);
                }
            }
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(error = %crate::redact::sanitize_error(&e.to_string()), "reading database health failed; trying again next interval");
            }
            Err(_) => {}
        }
        tokio::select! {
            _ = tokio::time::sleep(config.interval) => {}
            _ = stop.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_decide_the_findings() {
        let config = HealthConfig::default();
        let mut h = DbHealth {
            autovacuum: true,
            oldest_xact_age_seconds: Some(10.0),
            live_tuples: Some(1_000_000),
            dead_tuples: Some(10),
            ..Default::default()
        };
        assert!(findings(&h, &config).is_empty());
        h.oldest_xact_age_seconds = Some(3600.0);
        h.oldest_xact_application = Some("psql".into());
        h.dead_tuples = Some(3_000_000);
        h.slot_name = Some("old_slot".into());
        h.slot_xmin_age = Some(200_000_000);
        let f = findings(&h, &config);
        assert_eq!(f.len(), 3, "{f:?}");
        assert!(matches!(&f[2], Finding::DeadTuples { ratio, .. } if *ratio > 0.7));
        // A small table churning is not a finding.
        let small = DbHealth {
            autovacuum: true,
            live_tuples: Some(10),
            dead_tuples: Some(500),
            ..Default::default()
        };
        assert!(findings(&small, &config).is_empty());
        let off = DbHealth::default();
        assert_eq!(findings(&off, &config), vec![Finding::AutovacuumOff]);
    }

    #[test]
    fn config_errors_name_the_field() {
        let bad = HealthConfig {
            max_dead_tuple_ratio: 1.5,
            ..Default::default()
        };
        assert_eq!(
            bad.validate().unwrap_err().field,
            "health.max_dead_tuple_ratio"
        );
        let bad = HealthConfig {
            interval: Duration::ZERO,
            ..Default::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "health.interval");
    }
}

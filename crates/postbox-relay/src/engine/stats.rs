//! The relay's counters and how long `run` runs.

use std::sync::atomic::{AtomicU64, Ordering};

/// Whether `run` returns when the outbox is empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunMode {
    /// Run until cancelled.
    Forever,
    /// Return once nothing is pending or in flight (events waiting for a retry
    /// or for an expired lease are waited for; dead letters are not, nor, in
    /// ordered mode, events held back behind a blocking dead letter), or when
    /// cancelled.
    Drain,
}

/// Counters since the relay started.
#[derive(Debug, Default)]
pub struct Stats {
    pub delivered: AtomicU64,
    /// Events a destination's filters kept from it (once per destination).
    pub filtered: AtomicU64,
    pub retried: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub lost_acks: AtomicU64,
    pub rescued: AtomicU64,
    pub claimed: AtomicU64,
    /// Logical mode: how many times in a row the slot's reader failed (0
    /// while it reads). `/readyz` answers unready from three on.
    pub reader_failures: AtomicU64,
}

/// A copy of [`Stats`] at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StatsSnapshot {
    pub delivered: u64,
    pub filtered: u64,
    pub retried: u64,
    pub dead_lettered: u64,
    pub lost_acks: u64,
    pub rescued: u64,
    pub claimed: u64,
}

impl Stats {
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            delivered: self.delivered.load(Ordering::Relaxed),
            filtered: self.filtered.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            lost_acks: self.lost_acks.load(Ordering::Relaxed),
            rescued: self.rescued.load(Ordering::Relaxed),
            claimed: self.claimed.load(Ordering::Relaxed),
        }
    }
}

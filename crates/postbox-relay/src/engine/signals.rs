//! Who a notification on the schema's channel wakes. The database says what
//! changed (an outbox insert, a log insert, a log lease moved); each reader
//! waits on the signal for what it reads, so a relay reading one thing sleeps
//! through changes to the other.

use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::{watch, Notify};

/// The payload of the notification an insert into the log sends (the log's
/// trigger, migration 18).
const LOG_INSERTED: &str = "log";

/// The payload of the notification a log cursor's lease sends when a reader
/// joins a destination or gives a partition back (`cursors_acquire`).
const LOG_LEASES_MOVED: &str = "log-lease";

pub(crate) struct Signals {
    /// The outbox changed (an insert, a settled batch, a rescue): wakes the claimer.
    pub(crate) outbox: Notify,
    /// Bumped whenever the log may hold new events: wakes every log reader.
    pub(crate) log: watch::Sender<u64>,
    /// Bumped when another reader joined a destination or a partition was
    /// given back: log readers check their lease (and share) at their next
    /// round instead of at the next renewal.
    pub(crate) leases: AtomicU64,
}

impl Default for Signals {
    fn default() -> Self {
        Self {
            outbox: Notify::new(),
            log: watch::channel(0).0,
            leases: AtomicU64::new(0),
        }
    }
}

impl Signals {
    fn log_changed(&self) {
        self.log.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Something changed, or may have: wake the claimer and every log reader.
    pub(crate) fn wake_all(&self) {
        self.outbox.notify_one();
        self.log_changed();
    }

    /// Notifications may have gone unheard (LISTEN began, or its connection
    /// was lost): wake everyone, and have log readers check their leases.
    pub(crate) fn missed_notifications(&self) {
        self.leases.fetch_add(1, Ordering::Relaxed);
        self.wake_all();
    }

    /// A notification with `payload` came on the schema's channel: an insert
    /// into the log (payload `log`, migration 18) wakes only the log readers
    /// — the claimer reads the outbox, which it did not touch — and anything
    /// else (an outbox insert, an older schema's log) wakes everyone.
    pub(crate) fn notified(&self, payload: &str) {
        if payload == LOG_INSERTED {
            self.log_changed();
        } else if payload == LOG_LEASES_MOVED {
            // Leases moved: readers holding a partition check their share,
            // readers waiting for one try it now.
            self.leases.fetch_add(1, Ordering::Relaxed);
            self.log_changed();
        } else {
            self.wake_all();
        }
    }

    /// The lease generation, for a reader to compare with what it last saw.
    pub(crate) fn lease_generation(&self) -> u64 {
        self.leases.load(Ordering::Relaxed)
    }
}

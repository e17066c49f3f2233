//! The batch permits every outbox of a multi-outbox relay shares: a global
//! cap on batches claimed and not yet settled, split so that an outbox with
//! nothing in flight never waits behind one draining a backlog.
//!
//! `max_in_flight_batches` permits are split in two pools:
//!
//! - the **shared** pool (`max − reserved`), which any outbox takes from,
//!   first come, first served;
//! - the **reserve** (`max / 4`, at least 1 when `max ≥ 2`, none when
//!   `max = 1`), which only an outbox with **no batch in flight** may also
//!   take from.
//!
//! An outbox draining a backlog asks for its next batch while its previous
//! ones are being published and settled, so it only ever waits on the shared
//! pool: however many busy outboxes there are, they hold at most the shared
//! permits, and a quiet outbox's first batch finds a reserved permit free
//! (unless as many other quiet outboxes are starting a batch at that very
//! moment) instead of waiting for a busy batch to settle.

use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The permits of [`crate::Tenants`]; see the module documentation.
#[derive(Debug)]
pub struct BatchPermits {
    shared: Arc<Semaphore>,
    reserve: Arc<Semaphore>,
    reserved: usize,
}

impl BatchPermits {
    /// `max` permits in all, of which `max / 4` (at least one when `max ≥ 2`)
    /// are reserved for outboxes with no batch in flight.
    pub fn new(max: usize) -> Self {
        let reserved = if max >= 2 { (max / 4).max(1) } else { 0 };
        Self {
            shared: Arc::new(Semaphore::new(max - reserved)),
            reserve: Arc::new(Semaphore::new(reserved)),
            reserved,
        }
    }

    /// Permits only outboxes with nothing in flight may take.
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// Permits free right now (shared and reserved).
    pub fn available(&self) -> usize {
        self.shared.available_permits() + self.reserve.available_permits()
    }

    /// A permit for one batch, held until the batch is settled. `idle`: the
    /// outbox asking has no batch in flight, so it may take a reserved permit.
    /// `None` only if the permits were closed (they never are).
    pub async fn acquire(&self, idle: bool) -> Option<OwnedSemaphorePermit> {
        if idle && self.reserved > 0 {
            // A free shared permit first; otherwise whichever frees first.
            // Dropping the other wait gives back anything it was granted.
            tokio::select! {
                biased;
                p = self.shared.clone().acquire_owned() => p.ok(),
                p = self.reserve.clone().acquire_owned() => p.ok(),
            }
        } else {
            self.shared.clone().acquire_owned().await.ok()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    #[tokio::test]
    async fn an_idle_outbox_gets_a_reserved_permit_when_busy_ones_hold_the_rest() {
        let permits = BatchPermits::new(8);
        assert_eq!(permits.reserved(), 2);
        let mut held = Vec::new();
        for _ in 0..6 {
            held.push(permits.acquire(false).await.unwrap());
        }
        // A busy outbox now waits for a settled batch…
        let busy = permits.acquire(false).now_or_never();
        assert!(busy.is_none(), "a busy outbox cannot take reserved permits");
        // …while an idle one is served at once, twice.
        held.push(permits.acquire(true).await.unwrap());
        held.push(permits.acquire(true).await.unwrap());
        assert_eq!(permits.available(), 0);
        // Never more than the cap in all.
        let over = permits.acquire(true).now_or_never();
        assert!(over.is_none(), "the cap holds for idle outboxes too");
        drop(held);
        assert_eq!(permits.available(), 8);
    }

    #[test]
    fn one_permit_has_no_reserve() {
        let permits = BatchPermits::new(1);
        assert_eq!((permits.reserved(), permits.available()), (0, 1));
        let permits = BatchPermits::new(2);
        assert_eq!((permits.reserved(), permits.available()), (1, 2));
    }
}

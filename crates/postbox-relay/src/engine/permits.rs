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
//!
//! An engine takes its permits through [`OutboxPermits`], whatever its mode:
//! claim mode's claimer, and in log mode every reader (one per destination
//! and partition) as well as the claimer retrying what the readers handed
//! off. Its tasks ask one at a time, and "nothing in flight" means the
//! outbox holds no permit at all, so an outbox with many readers takes at
//! most one reserved permit however many of them start at once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

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

/// One outbox's way to the shared [`BatchPermits`]: its tasks ask one at a
/// time, and it counts the permits it holds, so it asks as idle only while
/// it holds none — including when its last permit comes back while it waits.
#[derive(Debug)]
pub struct OutboxPermits {
    permits: Arc<BatchPermits>,
    held: Arc<Held>,
    asking: tokio::sync::Mutex<()>,
}

/// The permits one outbox holds.
#[derive(Debug, Default)]
struct Held {
    count: AtomicUsize,
    /// Notified when the count drops to zero.
    none: Notify,
}

/// A permit for one batch of one outbox, given back when dropped (once the
/// batch is settled, or at once when there was nothing to read).
#[derive(Debug)]
pub struct BatchPermit {
    _permit: OwnedSemaphorePermit,
    held: Arc<Held>,
}

impl Drop for BatchPermit {
    fn drop(&mut self) {
        if self.held.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.held.none.notify_waiters();
        }
    }
}

impl OutboxPermits {
    pub fn new(permits: Arc<BatchPermits>) -> Self {
        Self {
            permits,
            held: Arc::default(),
            asking: tokio::sync::Mutex::new(()),
        }
    }

    /// Permits this outbox holds right now.
    pub fn held(&self) -> usize {
        self.held.count.load(Ordering::SeqCst)
    }

    /// A permit for one batch of this outbox: a reserved one may do while
    /// the outbox holds none. `None` only if the permits were closed.
    pub async fn acquire(&self) -> Option<BatchPermit> {
        // One asker at a time: the next one sees this one's permit as held.
        let _turn = self.asking.lock().await;
        let permit = loop {
            let none = self.held.none.notified();
            tokio::pin!(none);
            // Registered before looking, so a drop to zero is not missed.
            none.as_mut().enable();
            if self.held() == 0 {
                break self.permits.acquire(true).await?;
            }
            // Busy: the shared permits only, until its last permit comes back.
            tokio::select! {
                p = self.permits.acquire(false) => break p?,
                _ = none => {}
            }
        };
        self.held.count.fetch_add(1, Ordering::SeqCst);
        Some(BatchPermit {
            _permit: permit,
            held: self.held.clone(),
        })
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

    #[tokio::test]
    async fn an_outbox_with_many_askers_takes_no_reserved_permit_while_it_holds_one() {
        // Three shared permits, one reserved.
        let permits = Arc::new(BatchPermits::new(4));
        let busy = OutboxPermits::new(permits.clone());
        // Its readers all start at once: one asks as idle, the others not.
        let (a, b, c) = tokio::join!(busy.acquire(), busy.acquire(), busy.acquire());
        assert_eq!(busy.held(), 3);
        let more = busy.acquire().now_or_never();
        assert!(
            more.is_none(),
            "an outbox holding permits cannot take the reserve"
        );
        // A quiet outbox is served from the reserve.
        let quiet = OutboxPermits::new(permits.clone());
        let q = quiet.acquire().now_or_never().flatten();
        assert!(q.is_some(), "the quiet outbox takes the reserved permit");
        drop((a, b, c, q));
        assert_eq!((busy.held(), quiet.held(), permits.available()), (0, 0, 4));
    }

    #[tokio::test]
    async fn a_waiting_outbox_whose_last_batch_settles_may_take_the_reserve() {
        // One shared permit, one reserved.
        let permits = Arc::new(BatchPermits::new(2));
        let other = OutboxPermits::new(permits.clone());
        let outbox = OutboxPermits::new(permits.clone());
        let theirs = other.acquire().await.unwrap();
        let mine = outbox.acquire().await.unwrap();
        assert_eq!(permits.available(), 0);
        // Holding one, it waits for the shared permit…
        let mut next = Box::pin(outbox.acquire());
        assert!(next.as_mut().now_or_never().is_none());
        // …until its own batch settles: holding none, it may take the reserve.
        drop(mine);
        let again = next.as_mut().now_or_never().flatten();
        assert!(
            again.is_some(),
            "an outbox holding nothing takes the reserve"
        );
        assert_eq!((outbox.held(), permits.available()), (1, 0));
        drop((again, theirs));
        assert_eq!(permits.available(), 2);
    }

    #[test]
    fn one_permit_has_no_reserve() {
        let permits = BatchPermits::new(1);
        assert_eq!((permits.reserved(), permits.available()), (0, 1));
        let permits = BatchPermits::new(2);
        assert_eq!((permits.reserved(), permits.available()), (1, 2));
    }
}

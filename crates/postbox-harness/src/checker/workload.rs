//! The producers: transactions that commit or roll back events across many
//! aggregates, each with a business row (`verify_produced`) in the same
//! transaction, and the ledger of what they know about each event.

use super::tables::Tables;
use crate::lock;
use postbox::{NewEvent, Outbox};
use postbox_relay::failpoint;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::PgPool;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// What the producers know. An event whose commit outcome was lost (the
/// connection dropped during COMMIT) is `uncertain` until the end, when the
/// database says whether its business row exists.
#[derive(Default)]
pub struct Ledger {
    pub committed: Mutex<HashSet<Uuid>>,
    pub rolled_back: Mutex<HashSet<Uuid>>,
    pub uncertain: Mutex<HashSet<Uuid>>,
    pub tx_committed: AtomicU64,
    pub tx_rolled_back: AtomicU64,
    /// Transactions that failed before their commit was sent (a fault).
    pub tx_aborted: AtomicU64,
    pub tx_uncertain: AtomicU64,
}

fn add(set: &Mutex<HashSet<Uuid>>, ids: &[Uuid]) {
    lock(set).extend(ids.iter().copied());
}

pub struct Producer {
    pub index: u64,
    pub pool: PgPool,
    pub outbox: Outbox,
    /// Where the business row goes.
    pub tables: Arc<Tables>,
    /// Time between two transactions of this producer.
    pub period: Duration,
    pub aggregates: u32,
    pub rollback_percent: u32,
    /// Logical mode: `emit` each event into the WAL instead of `enqueue_batch`.
    pub emit: bool,
    pub seed: u64,
}

const EVENT_TYPES: [&str; 3] = ["verify.opened", "verify.credited", "verify.debited"];

enum Fate {
    Committed,
    RolledBack,
    /// Failed before COMMIT was sent: certainly not committed.
    Aborted,
    /// COMMIT was sent; its answer was lost.
    Uncertain,
}

impl Producer {
    pub async fn run(self, ledger: &Ledger, stop: CancellationToken) {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let mut ticks = tokio::time::interval(self.period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut n: u64 = 0;
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                _ = stop.cancelled() => return,
            }
            let count = rng.random_range(1..=4);
            let mut events = Vec::with_capacity(count);
            for _ in 0..count {
                n += 1;
                let aggregate = rng.random_range(0..self.aggregates);
                let kind = EVENT_TYPES[rng.random_range(0..EVENT_TYPES.len())];
                let payload = format!(
                    r#"{{"producer":{},"n":{n},"amount":{}}}"#,
                    self.index,
                    rng.random_range(1..10_000)
                );
                match NewEvent::from_json(kind, "account", format!("acct-{aggregate}"), payload) {
                    Ok(e) => events.push(e),
                    Err(e) => {
                        tracing::error!(error = %e, "verify built an invalid event");
                        return;
                    }
                }
            }
            let ids: Vec<Uuid> = events.iter().map(NewEvent::event_id).collect();
            let roll_back = rng.random_range(0..100) < self.rollback_percent;
            let lose_commit = rng.random_bool(0.5);
            match self
                .transaction(&events, &ids, roll_back, lose_commit)
                .await
            {
                Fate::Committed => {
                    ledger.tx_committed.fetch_add(1, Ordering::Relaxed);
                    add(&ledger.committed, &ids);
                }
                Fate::RolledBack => {
                    ledger.tx_rolled_back.fetch_add(1, Ordering::Relaxed);
                    add(&ledger.rolled_back, &ids);
                }
                Fate::Aborted => {
                    ledger.tx_aborted.fetch_add(1, Ordering::Relaxed);
                    add(&ledger.rolled_back, &ids);
                    // The database is being taken away: do not spin.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Fate::Uncertain => {
                    ledger.tx_uncertain.fetch_add(1, Ordering::Relaxed);
                    add(&ledger.uncertain, &ids);
                }
            }
        }
    }

    async fn transaction(
        &self,
        events: &[NewEvent],
        ids: &[Uuid],
        roll_back: bool,
        lose_commit: bool,
    ) -> Fate {
        let Ok(mut tx) = self.pool.begin().await else {
            return Fate::Aborted;
        };
        if self.emit {
            for e in events {
                if postbox::sqlx::emit(&self.outbox, &mut tx, e).await.is_err() {
                    return Fate::Aborted;
                }
            }
        } else if postbox::sqlx::enqueue_batch(&self.outbox, &mut tx, events)
            .await
            .is_err()
        {
            return Fate::Aborted;
        }
        if self.tables.record_produced(&mut tx, ids).await.is_err() {
            return Fate::Aborted;
        }
        if roll_back {
            // Whether or not the ROLLBACK arrives, nothing was committed.
            let _ = tx.rollback().await;
            return Fate::RolledBack;
        }
        if failpoint::hit(failpoint::points::PRODUCER_COMMIT).await {
            // The commit's answer is lost: it committed, or never arrived.
            if lose_commit {
                let _ = tx.commit().await;
            } else {
                drop(tx);
            }
            return Fate::Uncertain;
        }
        match tx.commit().await {
            Ok(()) => Fate::Committed,
            Err(_) => Fate::Uncertain,
        }
    }
}

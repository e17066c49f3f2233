//! The fault schedule: relays killed and stalled, the broker and the
//! database taken away, PostgreSQL crashed, on a seeded random schedule.

use super::pull::Readers;
use crate::error_chain;
use crate::pgcluster::{ClusterError, Crash};
use crate::supervisor::Supervisor;
use postbox_proxy::FaultProxy;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Kinds of fault a run can inject (`--faults`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// SIGKILL a relay (restarted shortly after)
    Kill,
    /// SIGSTOP a relay for longer than its lease, then SIGCONT
    Stall,
    /// Take the broker away: connections reset, refused, hung or stalled
    Sink,
    /// Take PostgreSQL away: connections reset, refused or stalled
    Db,
    /// The consumer drops acknowledgements and rolls back batches
    Consumer,
    /// Crash PostgreSQL (immediate stop: no checkpoint, unwritten WAL lost)
    /// and start it again: only on the throwaway cluster verify owns
    Crash,
}

#[derive(Debug, Default, serde::Serialize)]
pub struct FaultCounters {
    pub relay_kills: AtomicU64,
    /// Consumer-group readers killed (a pull run): aborted wherever they were.
    pub reader_kills: AtomicU64,
    pub relay_stalls: AtomicU64,
    pub sink_resets: AtomicU64,
    pub sink_outages: AtomicU64,
    pub sink_hangs: AtomicU64,
    pub sink_stalls: AtomicU64,
    pub db_resets: AtomicU64,
    pub db_outages: AtomicU64,
    pub db_stalls: AtomicU64,
    /// PostgreSQL crashes (immediate stop, then crash recovery) survived.
    pub db_crashes: AtomicU64,
    /// The longest time from a crash to accepting connections again, in ms.
    pub db_crash_longest_downtime_ms: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Sleep `d`; false if `stop` came first.
async fn pause(d: Duration, stop: &CancellationToken) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = stop.cancelled() => false,
    }
}

fn jitter(rng: &mut StdRng, mean: Duration) -> Duration {
    mean.mul_f64(rng.random_range(0.5..1.5))
}

/// Kill a random relay every `every` (on average) until `stop`.
pub async fn kill_relays(
    relays: &Supervisor,
    every: Duration,
    seed: u64,
    counters: &FaultCounters,
    stop: CancellationToken,
) {
    if relays.is_empty() {
        return;
    }
    let mut rng = StdRng::seed_from_u64(seed);
    while pause(jitter(&mut rng, every), &stop).await {
        let i = rng.random_range(0..relays.len());
        if relays.kill(i) {
            bump(&counters.relay_kills);
        }
    }
}

/// Kill a random reader of a pull run every `every` (on average) until `stop`.
pub async fn kill_readers(
    readers: &Readers,
    every: Duration,
    seed: u64,
    counters: &FaultCounters,
    stop: CancellationToken,
) {
    if readers.is_empty() {
        return;
    }
    let mut rng = StdRng::seed_from_u64(seed);
    while pause(jitter(&mut rng, every), &stop).await {
        readers.kill(rng.random_range(0..readers.len()));
        bump(&counters.reader_kills);
    }
}

/// The other faults, one at a time, every `every` on average, until `stop`;
/// whatever a fault took away is given back before this returns.
#[allow(clippy::too_many_arguments)]
pub async fn disturb(
    kinds: &[FaultKind],
    relays: &Supervisor,
    db: &FaultProxy,
    brokers: &[FaultProxy],
    lease: Duration,
    every: Duration,
    seed: u64,
    counters: &FaultCounters,
    stop: CancellationToken,
) {
    let kinds: Vec<FaultKind> = kinds
        .iter()
        .copied()
        .filter(|k| match k {
            FaultKind::Stall => !relays.is_empty(),
            FaultKind::Sink => !brokers.is_empty(),
            FaultKind::Db => true,
            _ => false,
        })
        .collect();
    if kinds.is_empty() {
        return;
    }
    let mut rng = StdRng::seed_from_u64(seed);
    while pause(jitter(&mut rng, every), &stop).await {
        match kinds[rng.random_range(0..kinds.len())] {
            FaultKind::Stall => {
                let i = rng.random_range(0..relays.len());
                if let Some(pid) = relays.stall(i) {
                    bump(&counters.relay_stalls);
                    // Past the lease: other relays take its batches over, and
                    // when it wakes up its settlements must be refused.
                    let d = lease + Duration::from_millis(rng.random_range(500..2000));
                    pause(d, &stop).await;
                    relays.resume(i, pid);
                }
            }
            FaultKind::Sink => {
                let broker = &brokers[rng.random_range(0..brokers.len())];
                let d = Duration::from_millis(rng.random_range(500..4000));
                match rng.random_range(0..4) {
                    0 => {
                        bump(&counters.sink_resets);
                        broker.reset();
                    }
                    1 => {
                        bump(&counters.sink_outages);
                        broker.down();
                        pause(d, &stop).await;
                    }
                    2 => {
                        bump(&counters.sink_hangs);
                        broker.hang();
                        pause(d, &stop).await;
                    }
                    _ => {
                        bump(&counters.sink_stalls);
                        broker.stall();
                        pause(d, &stop).await;
                    }
                }
                broker.restore();
            }
            FaultKind::Db => {
                match rng.random_range(0..3) {
                    0 => {
                        bump(&counters.db_resets);
                        db.reset();
                    }
                    1 => {
                        bump(&counters.db_outages);
                        db.down();
                        pause(Duration::from_millis(rng.random_range(500..3000)), &stop).await;
                    }
                    _ => {
                        // Sometimes past the lease: acknowledgements arrive late.
                        bump(&counters.db_stalls);
                        db.stall();
                        let d = Duration::from_millis(rng.random_range(200..1000))
                            + lease.mul_f64(rng.random_range(0.0..1.3));
                        pause(d, &stop).await;
                    }
                }
                db.restore();
            }
            FaultKind::Kill | FaultKind::Consumer | FaultKind::Crash => {}
        }
    }
}

/// Crash PostgreSQL every `every` (on average) until `stop`, and start it
/// again each time; false when it could not be started again (the run
/// cannot go on).
pub async fn crash_database<F, Fut>(
    crash: F,
    every: Duration,
    seed: u64,
    counters: &FaultCounters,
    stop: CancellationToken,
) -> bool
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<Crash, ClusterError>>,
{
    let mut rng = StdRng::seed_from_u64(seed);
    while pause(jitter(&mut rng, every), &stop).await {
        match crash().await {
            Ok(crash) => {
                bump(&counters.db_crashes);
                counters.db_crash_longest_downtime_ms.fetch_max(
                    u64::try_from(crash.downtime.as_millis()).unwrap_or(u64::MAX),
                    Ordering::Relaxed,
                );
            }
            Err(e) => {
                crate::errln!(
                    "  PostgreSQL did not come back after a crash: {}",
                    error_chain(&e)
                );
                return false;
            }
        }
    }
    true
}

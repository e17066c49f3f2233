//! `postbox bench --only groups`: consumer groups read over SQL — `receive`
//! a batch, `ack` its receipts, one transaction each — by one reader and
//! by four sharing a group, against PgQ's consumer API (`next_batch`,
//! `get_batch_events`, `finish_batch` in one transaction) on the same
//! server with `--peers pgq`. No sink: what is measured is the reading.
//! The log is seeded once; each run reads it through a group of its own
//! created at its beginning. Two rounds, the order of the readers reversed
//! in the second.

use super::report::{Groups, GroupsRow};
use super::{pgq, Bench, Peer};
use crate::AnyError;
use postbox_store::{GroupStart, Groups as StoreGroups, NewGroup};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a hand-out stays hidden: far longer than a run.
const VISIBILITY: Duration = Duration::from_secs(600);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Reader {
    Sql(usize),
    Pgq,
}

impl Reader {
    fn label(self) -> String {
        match self {
            Reader::Sql(1) => "SQL receive + ack, 1 reader".to_owned(),
            Reader::Sql(n) => format!("SQL receive + ack, {n} readers"),
            Reader::Pgq => "PgQ consumer API, 1 reader".to_owned(),
        }
    }
}

impl Bench<'_> {
    pub(super) async fn groups(&self) -> Result<Groups, AnyError> {
        let events = self.options.events;
        let batch = i32::try_from(self.options.batch_size.clamp(1, 1000))?;
        self.store.reset().await?;
        crate::progressln!("groups: seeding {events} events into the log…");
        self.store.seed_log(events, self.options.aggregates).await?;
        let groups = StoreGroups::new(self.pool.clone(), &self.schema);

        let mut pgq_skipped = None;
        let peer = if self.options.peers.contains(&Peer::Pgq) {
            let queue = format!("{}_pgq", self.schema.name());
            match pgq::PgqPeer::open(self.pool.clone(), &queue).await? {
                Ok(peer) => Some(peer),
                Err(why) => {
                    crate::errln!("groups: PgQ skipped: {why}");
                    pgq_skipped = Some(why);
                    None
                }
            }
        } else {
            None
        };
        let mut order = vec![Reader::Sql(1), Reader::Sql(4)];
        if peer.is_some() {
            order.insert(1, Reader::Pgq);
        }
        let mut rates: Vec<(Reader, Vec<f64>)> = order.iter().map(|&r| (r, Vec::new())).collect();
        let measured = async {
            for round in 0..2 {
                let this_round: Vec<Reader> = if round == 0 {
                    order.clone()
                } else {
                    order.iter().rev().copied().collect()
                };
                for reader in this_round {
                    crate::progressln!("groups: {} (round {})…", reader.label(), round + 1);
                    let elapsed = match (reader, &peer) {
                        (Reader::Sql(n), _) => {
                            let name = format!("bench-{round}-{n}");
                            read_group(&groups, &name, n, batch, events).await?
                        }
                        (Reader::Pgq, Some(peer)) => {
                            peer.seed(events, i64::from(batch)).await?;
                            peer.drain(None, events).await?.elapsed
                        }
                        (Reader::Pgq, None) => unreachable!("PgQ runs only when it opened"),
                    };
                    let rate = events as f64 / elapsed.as_secs_f64();
                    if let Some((_, r)) = rates.iter_mut().find(|(r, _)| *r == reader) {
                        r.push(rate);
                    }
                }
            }
            Ok::<_, AnyError>(())
        }
        .await;
        if let Some(peer) = peer {
            peer.close().await?;
        }
        measured?;
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let pgq_rate = rates
            .iter()
            .find(|(r, _)| *r == Reader::Pgq)
            .map(|(_, v)| mean(v));
        Ok(Groups {
            events,
            batch_size: batch,
            rows: rates
                .iter()
                .map(|(reader, v)| GroupsRow {
                    reader: reader.label(),
                    readers: match reader {
                        Reader::Sql(n) => *n,
                        Reader::Pgq => 1,
                    },
                    rounds_events_per_s: v.iter().map(|r| r.round()).collect(),
                    events_per_s: mean(v).round(),
                    vs_pgq: pgq_rate.map(|p| super::round2(mean(v) / p)),
                })
                .collect(),
            pgq_skipped,
        })
    }
}

/// Create group `name` at the log's beginning and let `readers` readers
/// receive and acknowledge all `events` of it; the time they took.
async fn read_group(
    groups: &StoreGroups,
    name: &str,
    readers: usize,
    batch: i32,
    events: i64,
) -> Result<Duration, AnyError> {
    groups
        .create(&NewGroup {
            start: GroupStart::Beginning,
            ..NewGroup::new(name)
        })
        .await?;
    let done = Arc::new(AtomicI64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(readers);
    for _ in 0..readers {
        let (groups, done, name) = (groups.clone(), done.clone(), name.to_owned());
        tasks.push(tokio::spawn(async move {
            while done.load(Ordering::Relaxed) < events {
                let got = groups
                    .receive(&name, batch, VISIBILITY, Duration::ZERO)
                    .await?;
                if got.is_empty() {
                    // The rest is in another reader's hands.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                let receipts: Vec<String> = got.into_iter().map(|e| e.receipt).collect();
                let acked = groups.ack(&name, &receipts).await?;
                done.fetch_add(i64::from(acked), Ordering::Relaxed);
            }
            Ok::<_, sqlx::Error>(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    let elapsed = started.elapsed();
    groups.drop_group(name, "postbox bench", None).await?;
    Ok(elapsed)
}

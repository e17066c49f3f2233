//! The sustained part of `postbox bench`: producers at a steady high rate
//! (batches of 100 per transaction) for a long time, one relay with retention
//! on; the outbox's sizes and dead tuples sampled throughout, and the relay's
//! peak RSS.

use super::report::{round2, Sample, Sustained};
use super::{redis_target, Bench};
use crate::os::Signal;
use crate::AnyError;
use postbox::{NewEvent, Outbox};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

const PRODUCERS: u64 = 4;
/// Events per producer transaction.
const BATCH: u64 = 100;

impl Bench<'_> {
    pub(super) async fn sustained(&self) -> Result<Sustained, AnyError> {
        let options = self.options;
        let rate = options.sustained_rate.max(1);
        crate::progressln!(
            "sustained: {rate} events/s for {} with retention on…",
            humantime::format_duration(options.sustained_duration)
        );
        self.reset().await?;
        let config = self.write_config(
            "postbox-bench-sustained",
            format!(
                "[relay]\nbatch_size = {}\n[retention]\nenabled = true\nolder_than = \"5s\"\ninterval = \"2s\"\nbatch_size = 5000\npause = \"10ms\"\nvacuum = true\n",
                options.batch_size
            ),
        )?;
        let relay = self
            .relay()?
            .config(&config)
            .args(["--sink", &self.sink])
            .spawn(None)?;
        let trimmer = self.trim_redis_list();

        let started = Instant::now();
        let deadline = started + options.sustained_duration;
        let produced = Arc::new(AtomicU64::new(0));
        let producers = self.produce_batches(rate, deadline, &produced);
        let samples = self.sample_until(started, deadline).await?;
        for t in producers {
            t.await??;
        }
        // The relay finishes its batches and exits.
        relay.signal(Signal::Terminate);
        let rss = relay.wait().await?.peak_rss_mb;
        if let Some(t) = trimmer {
            t.abort();
        }
        let _ = std::fs::remove_file(&config);
        Ok(Sustained {
            rate,
            duration_s: round2(started.elapsed().as_secs_f64()),
            events: produced.load(Ordering::Relaxed),
            samples,
            relay_peak_rss_mb: round2(rss),
        })
    }

    /// Keep the Redis list from growing without bound, as a consumer would.
    fn trim_redis_list(&self) -> Option<JoinHandle<()>> {
        redis_target(&self.sink).map(|(url, key)| {
            tokio::spawn(async move {
                let Ok(client) = redis::Client::open(url) else {
                    return;
                };
                let Ok(mut c) = crate::redis_connection(&client).await else {
                    return;
                };
                loop {
                    let _: Result<(), _> = redis::AsyncCommands::del(&mut c, &key).await;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            })
        })
    }

    /// Producers enqueueing batches at `rate` events/s until `deadline`,
    /// counting what they committed in `produced`.
    fn produce_batches(
        &self,
        rate: u64,
        deadline: Instant,
        produced: &Arc<AtomicU64>,
    ) -> Vec<JoinHandle<Result<(), AnyError>>> {
        let period = Duration::from_secs_f64((PRODUCERS * BATCH) as f64 / rate as f64);
        (0..PRODUCERS)
            .map(|p| {
                let pool = self.pool.clone();
                let outbox = Outbox::new(self.schema.clone());
                let produced = produced.clone();
                tokio::spawn(async move {
                    let mut tick = tokio::time::interval(period);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    let mut i = 0_u64;
                    while Instant::now() < deadline {
                        tick.tick().await;
                        let events = (0..BATCH)
                            .map(|_| {
                                i += 1;
                                NewEvent::new(
                                    "order.created",
                                    "order",
                                    format!("{p}-{i}"),
                                    &serde_json::json!({"p": p, "i": i, "note": "x".repeat(120)}),
                                )
                            })
                            .collect::<Result<Vec<_>, _>>()?;
                        let mut tx = pool.begin().await?;
                        postbox::sqlx::enqueue_batch(&outbox, &mut tx, &events).await?;
                        tx.commit().await?;
                        produced.fetch_add(BATCH, Ordering::Relaxed);
                    }
                    Ok(())
                })
            })
            .collect()
    }

    /// Samples of the outbox every tenth of the run (a second apart at least)
    /// until `deadline`.
    async fn sample_until(
        &self,
        started: Instant,
        deadline: Instant,
    ) -> Result<Vec<Sample>, AnyError> {
        let every = (self.options.sustained_duration / 10).max(Duration::from_secs(1));
        let mut samples = Vec::new();
        while Instant::now() < deadline {
            tokio::time::sleep(every.min(deadline.saturating_duration_since(Instant::now()))).await;
            let size = self.store.table_size().await?;
            let pending = self.store.pending().await?;
            samples.push(Sample {
                at_s: round2(started.elapsed().as_secs_f64()),
                table_bytes: size.table_bytes,
                index_bytes: size.index_bytes,
                dead_tuples: size.dead_tuples,
                pending,
            });
        }
        Ok(samples)
    }
}

//! The sustained part of `postbox bench`: producers at a steady high rate
//! (batches of 100 per transaction) for a long time, one relay with retention
//! on; the outbox's sizes and dead tuples sampled throughout, and the relay's
//! peak RSS.

use super::report::{round2, LogSample, LogSustained, Sample, Sustained};
use super::{redis_target, Bench};
use crate::os::Signal;
use crate::AnyError;
use postbox::{NewEvent, Outbox};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// Producer tasks sharing the rate: enough that a slow commit (a WAL flush,
/// a busy core) does not hold the rate back.
const PRODUCERS: u64 = 8;
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

    /// The same producers appending to the log, one relay in log mode, no
    /// retention, autovacuum off: the log's segments and the outbox sampled
    /// throughout; then the relay catches up and exits.
    pub(super) async fn log_sustained(&self) -> Result<LogSustained, AnyError> {
        let options = self.options;
        let rate = options.sustained_rate.max(1);
        crate::progressln!(
            "sustained, log mode: {rate} events/s for {} with autovacuum off and no vacuum…",
            humantime::format_duration(options.sustained_duration)
        );
        self.reset().await?;
        postbox_store::Store::new(self.pool.clone(), self.schema.clone())
            .log()
            .set_producer_target(postbox_store::ProducerTarget::Log)
            .await?;
        self.store.autovacuum_off().await?;
        let (redis_url, key) = redis_target(&self.sink)
            .ok_or("sustained in log mode needs a Redis list sink with a fixed key (…?key=NAME)")?;
        // Segments of a tenth of the run (10 s at least): the ring of four
        // turns over several times.
        let segment = (options.sustained_duration / 10).max(Duration::from_secs(10));
        let config = self.write_config(
            "postbox-bench-log-sustained",
            format!(
                "[relay]\nmode = \"log\"\nbatch_size = {}\nlog_segment_age = \"{}\"\n",
                options.batch_size,
                humantime::format_duration(segment)
            ),
        )?;
        let relay = self
            .relay()?
            .config(&config)
            .args(["--sink", &self.sink])
            .spawn(None)?;
        let delivered = Arc::new(AtomicU64::new(0));
        let counter = count_and_clear(redis_url, key, delivered.clone());

        let started = Instant::now();
        let deadline = started + options.sustained_duration;
        let produced = Arc::new(AtomicU64::new(0));
        let producers = self.produce_batches(rate, deadline, &produced);
        let every = (options.sustained_duration / 10).max(Duration::from_secs(1));
        let mut samples = Vec::new();
        while Instant::now() < deadline {
            tokio::time::sleep(every.min(deadline.saturating_duration_since(Instant::now()))).await;
            let log = self.store.log_size().await?;
            let outbox = self.store.table_size().await?;
            samples.push(LogSample {
                at_s: round2(started.elapsed().as_secs_f64()),
                log_table_bytes: log.table_bytes,
                log_index_bytes: log.index_bytes,
                log_dead_tuples: log.dead_tuples,
                outbox_table_bytes: outbox.table_bytes,
                outbox_dead_tuples: outbox.dead_tuples,
            });
        }
        for t in producers {
            t.await??;
        }
        let duration_s = round2(started.elapsed().as_secs_f64());
        let events = produced.load(Ordering::Relaxed);
        // The relay catches up (at most a minute), then exits.
        let catch_up = Instant::now() + Duration::from_secs(60);
        while delivered.load(Ordering::Relaxed) < events && Instant::now() < catch_up {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        relay.signal(Signal::Terminate);
        let rss = relay.wait().await?.peak_rss_mb;
        counter.abort();
        let _ = std::fs::remove_file(&config);
        Ok(LogSustained {
            rate,
            duration_s,
            events,
            delivered: delivered.load(Ordering::Relaxed),
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

/// Empty the Redis list every 200 ms, counting what it held into `count`
/// (LLEN and DEL in one transaction, so nothing is missed).
fn count_and_clear(url: String, key: String, count: Arc<AtomicU64>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let Ok(client) = redis::Client::open(url) else {
            return;
        };
        let Ok(mut c) = crate::redis_connection(&client).await else {
            return;
        };
        loop {
            let taken: Result<(u64,), _> = redis::pipe()
                .atomic()
                .llen(&key)
                .del(&key)
                .ignore()
                .query_async(&mut c)
                .await;
            if let Ok((n,)) = taken {
                count.fetch_add(n, Ordering::Relaxed);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

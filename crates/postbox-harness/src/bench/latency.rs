//! The latency part of `postbox bench`: producers commit one event per
//! transaction at a steady rate while a relay (a child process, in the mode
//! measured) pushes them to a Redis list; a reader pops them and notes when
//! each arrived. Latency is arrival minus commit, per event.

use super::report::{percentile, round2, Latency};
use super::{redis_target, Bench, RELAY_GRACE};
use crate::{lock, AnyError};
use postbox::{NewEvent, Outbox};
use postbox_relay::ReadMode;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use uuid::Uuid;

/// How long the relay may take to deliver the warm-up event.
const WARM_UP_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the last events may take to arrive after the producers stop.
const ARRIVAL_TIMEOUT: Duration = Duration::from_secs(30);

/// When each event was committed.
type Commits = HashMap<Uuid, Instant>;

impl Bench<'_> {
    /// One latency run: LISTEN/NOTIFY or polling, synchronous or
    /// asynchronous relay commits, claim, log (producers then append to the
    /// log) or logical mode (producers emit; the relay reads a replication
    /// slot, created before it starts and dropped after the run). With
    /// `replay` > 0, a `postbox replay` of that many retained events (rows
    /// already delivered) runs beside the live traffic, into another list.
    pub(super) async fn latency(
        &self,
        listen: bool,
        synchronous: bool,
        reading: ReadMode,
        replay: i64,
    ) -> Result<Latency, AnyError> {
        let options = self.options;
        let mut mode = match reading {
            ReadMode::Claim => mode(listen, synchronous, options.poll_interval),
            ReadMode::Log => format!(
                "log mode, {}",
                mode(listen, synchronous, options.poll_interval)
            ),
            ReadMode::Logical => "logical mode (emit, replication slot)".to_owned(),
        };
        if replay > 0 {
            mode += &format!(", beside a replay of {replay} events");
            if options.replay_rate > 0 {
                mode += &format!(" at {}/s", options.replay_rate);
            }
        }
        crate::progressln!(
            "latency: {} events/s for {} with {mode}…",
            options.rate,
            humantime::format_duration(options.duration)
        );
        self.reset().await?;
        if reading == ReadMode::Logical {
            return self
                .with_slot(self.latency_run(listen, synchronous, reading, mode, replay))
                .await;
        }
        self.latency_run(listen, synchronous, reading, mode, replay)
            .await
    }

    async fn latency_run(
        &self,
        listen: bool,
        synchronous: bool,
        reading: ReadMode,
        mut mode: String,
        replay: i64,
    ) -> Result<Latency, AnyError> {
        let options = self.options;
        // What the replay reads: rows already delivered, created an hour ago.
        let replay_from = chrono::Utc::now() - chrono::Duration::hours(1);
        if replay > 0 {
            crate::progressln!("latency: {replay} delivered events for the replay to read…");
            self.store
                .seed_sent(replay, replay_from + chrono::Duration::seconds(1))
                .await?;
        }
        if reading == ReadMode::Log {
            postbox_store::Store::new(self.pool.clone(), self.schema.clone())
                .log()
                .set_producer_target(postbox_store::ProducerTarget::Log)
                .await?;
        }
        let (redis_url, key) = redis_target(&self.sink)
            .ok_or("latency needs a Redis list sink with a fixed key (…?key=NAME)")?;

        // The relay, as a real process with a config file for the mode.
        let config = self.write_config(
            "postbox-bench",
            format!(
                "[relay]\nmode = \"{}\"\nlisten = {listen}\nsynchronous_commit = {synchronous}\npoll_interval = \"{}\"\nbatch_size = {}\nlogical_slot = \"{}\"\n",
                match reading {
                    ReadMode::Claim => "claim",
                    ReadMode::Log => "log",
                    ReadMode::Logical => "logical",
                },
                humantime::format_duration(options.poll_interval),
                options.batch_size,
                self.slot()
            ),
        )?;
        let relay = self
            .relay()?
            .config(&config)
            .args(["--sink", &self.sink])
            .spawn(None)?;
        let arrivals = Arrivals::start(&redis_url, key.clone()).await?;
        let emit = reading == ReadMode::Logical;
        if let Err(e) = self.warm_up(&arrivals, emit).await {
            let _ = relay.stop(RELAY_GRACE).await;
            return Err(e);
        }
        arrivals.clear();

        let replaying = if replay > 0 {
            Some(self.start_replay(&redis_url, &key, replay_from)?)
        } else {
            None
        };
        let committed = self.produce_steadily(emit).await;
        let replayed = match replaying {
            Some((runner, replay_config, replay_key)) => {
                let _ = runner.stop(RELAY_GRACE).await;
                let _ = std::fs::remove_file(&replay_config);
                super::clear_redis(&replay_key).await;
                Some(self.store.replayed().await?)
            }
            None => None,
        };
        let committed = committed?;
        arrivals.wait_for(committed.len(), ARRIVAL_TIMEOUT).await;
        let arrived = arrivals.stop();
        let _ = relay.stop(RELAY_GRACE).await;
        let _ = std::fs::remove_file(&config);
        if let Some((n, seconds)) = replayed {
            mode += &format!(
                " ({n} replayed in {seconds:.1} s, {:.0}/s)",
                n as f64 / seconds.max(0.001)
            );
        }
        measure(mode, options.rate, options.duration, &committed, &arrived)
    }

    /// `postbox replay` of every event created since `from` into the list
    /// `KEY_replay` beside the sink's: the runner, its config file and that
    /// list's sink URL (to clear it afterwards).
    fn start_replay(
        &self,
        redis_url: &str,
        key: &str,
        from: chrono::DateTime<chrono::Utc>,
    ) -> Result<(crate::process::ChildProcess, std::path::PathBuf, String), AnyError> {
        let sink = format!("{redis_url}?key={key}_replay");
        let config = self.write_config(
            "postbox-bench-replay",
            format!("[sink]\nurl = \"{sink}\"\n"),
        )?;
        let from = from.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        let batch = self.options.batch_size.to_string();
        let rate = self.options.replay_rate;
        let paced = (rate > 0).then(|| ["--rate".to_owned(), format!("{rate}/s")]);
        let runner = crate::supervisor::RelayCommand::replay(self.url, &self.schema)?
            .config(&config)
            .args(paced.into_iter().flatten())
            .args([
                "--destination",
                "sink",
                "--from",
                &from,
                "--source",
                "outbox",
                "--quiet",
                "--batch-size",
                &batch,
            ])
            .spawn(None)?;
        Ok((runner, config, sink))
    }

    /// One event through the whole path, so that the relay's start
    /// (connections, LISTEN, the sink) is not measured as latency.
    async fn warm_up(&self, arrivals: &Arrivals, emit: bool) -> Result<(), AnyError> {
        let warm_up = NewEvent::new("bench.warm_up", "bench", "0", &serde_json::json!({}))?;
        let warm_up_id = {
            let mut tx = self.pool.begin().await?;
            let outbox = Outbox::new(self.schema.clone());
            let id = if emit {
                postbox::sqlx::emit(&outbox, &mut tx, &warm_up).await?
            } else {
                postbox::sqlx::enqueue(&outbox, &mut tx, &warm_up).await?
            };
            tx.commit().await?;
            id
        };
        let ready_by = Instant::now() + WARM_UP_TIMEOUT;
        while !arrivals.has(warm_up_id) {
            if Instant::now() > ready_by {
                return Err("latency: the relay delivered nothing within 60 s of starting".into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Producers committing one event per transaction at the target rate for
    /// the run's duration (with `emit`, or `enqueue`); when each event
    /// committed.
    pub(super) async fn produce_steadily(&self, emit: bool) -> Result<Commits, AnyError> {
        let options = self.options;
        let committed: Arc<Mutex<Commits>> = Arc::default();
        // Enough producers that a slow commit (a WAL flush each) does not
        // hold the rate back: concurrent commits share flushes.
        let producers = (options.rate / 25).clamp(16, 48);
        // Their connections exist before the clock starts: a new backend's
        // start-up is CPU the first run would otherwise pay inside its tail.
        let mut warm = Vec::new();
        for _ in 0..producers {
            warm.push(self.pool.acquire().await?);
        }
        drop(warm);
        let deadline = Instant::now() + options.duration;
        let period = Duration::from_secs_f64(producers as f64 / options.rate as f64);
        let start = tokio::time::Instant::now();
        let mut tasks = Vec::new();
        for p in 0..producers {
            // The producers take turns: producer p's ticks come p/producers
            // of a period after producer 0's, so events are committed one
            // every 1/rate s. (Ticks in step, as they were until 2026-12-06,
            // commit all producers' events at once, a burst of `producers`
            // events every period, and the burst's last events wait behind
            // the others on two cores: p95 about 8 ms in every mode.)
            let first = start + turn(p, producers, period);
            let pool = self.pool.clone();
            let outbox = Outbox::new(self.schema.clone());
            let committed = committed.clone();
            tasks.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval_at(first, period);
                let mut i = 0_u64;
                while Instant::now() < deadline {
                    tick.tick().await;
                    i += 1;
                    let event = NewEvent::new(
                        "order.created",
                        "order",
                        format!("{p}-{i}"),
                        &serde_json::json!({"p": p, "i": i}),
                    )?;
                    let mut tx = pool.begin().await?;
                    let id = if emit {
                        postbox::sqlx::emit(&outbox, &mut tx, &event).await?
                    } else {
                        postbox::sqlx::enqueue(&outbox, &mut tx, &event).await?
                    };
                    tx.commit().await?;
                    lock(&committed).insert(id, Instant::now());
                }
                Ok::<_, AnyError>(())
            }));
        }
        for t in tasks {
            t.await??;
        }
        let committed = std::mem::take(&mut *lock(&committed));
        Ok(committed)
    }
}

/// How long after producer 0's ticks producer `p` of `producers` ticks,
/// ticking every `period`: their turns split the period evenly.
fn turn(p: u64, producers: u64, period: Duration) -> Duration {
    period.mul_f64(p as f64 / producers as f64)
}

/// The name of a latency mode, as the report shows it.
fn mode(listen: bool, synchronous: bool, poll_interval: Duration) -> String {
    if listen && !synchronous {
        "LISTEN/NOTIFY, asynchronous relay commits".to_owned()
    } else if listen {
        "LISTEN/NOTIFY".to_owned()
    } else {
        format!(
            "polling every {}",
            humantime::format_duration(poll_interval)
        )
    }
}

/// Latency percentiles of the events that arrived; an error if some never did.
pub(super) fn measure(
    mode: String,
    rate: u64,
    duration: Duration,
    committed: &Commits,
    arrived: &[(Uuid, Instant)],
) -> Result<Latency, AnyError> {
    let total = committed.len();
    let mut ms: Vec<f64> = arrived
        .iter()
        .filter_map(|(id, at)| {
            committed
                .get(id)
                .map(|c| at.saturating_duration_since(*c).as_secs_f64() * 1000.0)
        })
        .collect();
    if ms.len() < total {
        return Err(format!(
            "latency: only {} of {total} events arrived within 30 s",
            ms.len()
        )
        .into());
    }
    ms.sort_by(f64::total_cmp);
    Ok(Latency {
        mode,
        rate,
        achieved_rate: (total as f64 / duration.as_secs_f64()).round(),
        events: ms.len(),
        p50_ms: round2(percentile(&ms, 0.50)),
        p95_ms: round2(percentile(&ms, 0.95)),
        p99_ms: round2(percentile(&ms, 0.99)),
        max_ms: round2(ms.last().copied().unwrap_or_default()),
    })
}

/// The reader of the Redis list: pops everything that has arrived (up to
/// 1,000 at a time, blocking while the list is empty) and notes when each
/// event id arrived.
pub(super) struct Arrivals {
    received: Arc<Mutex<Vec<(Uuid, Instant)>>>,
    task: JoinHandle<()>,
}

impl Arrivals {
    pub(super) async fn start(redis_url: &str, key: String) -> Result<Self, AnyError> {
        let received: Arc<Mutex<Vec<(Uuid, Instant)>>> = Arc::default();
        let client = redis::Client::open(redis_url)?;
        let mut conn = crate::redis_connection(&client).await?;
        let task = {
            let received = received.clone();
            tokio::spawn(async move {
                loop {
                    let popped: Result<Option<(String, Vec<String>)>, _> = redis::cmd("BLMPOP")
                        .arg(0.5)
                        .arg(1)
                        .arg(&key)
                        .arg("RIGHT")
                        .arg("COUNT")
                        .arg(1000)
                        .query_async(&mut conn)
                        .await;
                    match popped {
                        Ok(Some((_, bodies))) => {
                            let at = Instant::now();
                            lock(&received).extend(
                                bodies.iter().filter_map(|b| event_id(b)).map(|id| (id, at)),
                            );
                        }
                        Ok(None) => {}
                        Err(_) => return,
                    }
                }
            })
        };
        Ok(Self { received, task })
    }

    fn has(&self, id: Uuid) -> bool {
        lock(&self.received).iter().any(|(got, _)| *got == id)
    }

    /// How many of `ids` have arrived.
    pub(super) fn count_of(&self, ids: &std::collections::HashMap<Uuid, Instant>) -> usize {
        lock(&self.received)
            .iter()
            .filter(|(id, _)| ids.contains_key(id))
            .count()
    }

    pub(super) fn len(&self) -> usize {
        lock(&self.received).len()
    }

    pub(super) fn clear(&self) {
        lock(&self.received).clear();
    }

    /// Wait until `n` events have arrived, or `timeout` has passed.
    pub(super) async fn wait_for(&self, n: usize, timeout: Duration) {
        let until = Instant::now() + timeout;
        while lock(&self.received).len() < n && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stop reading; what arrived.
    pub(super) fn stop(self) -> Vec<(Uuid, Instant)> {
        self.task.abort();
        std::mem::take(&mut *lock(&self.received))
    }
}

/// The CloudEvents id of a message body.
fn event_id(body: &str) -> Option<Uuid> {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["id"].as_str().and_then(|s| s.parse().ok()))
}

#[cfg(test)]
mod tests {
    use super::turn;
    use std::time::Duration;

    /// At 1,000 events/s, 40 producers ticking every 40 ms commit one event
    /// every millisecond between them, not 40 at once.
    #[test]
    fn producers_take_turns_across_the_period() {
        let period = Duration::from_millis(40);
        let mut ticks: Vec<Duration> = (0..40).map(|p| turn(p, 40, period)).collect();
        ticks.sort();
        ticks.dedup();
        assert_eq!(ticks.len(), 40, "two producers tick at once");
        assert_eq!(ticks[0], Duration::ZERO);
        for pair in ticks.windows(2) {
            assert_eq!(pair[1] - pair[0], Duration::from_millis(1));
        }
    }
}

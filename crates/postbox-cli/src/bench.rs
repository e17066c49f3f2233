//! `postbox bench`: throughput and latency of the relay on this machine, next
//! to the Postgres-side ceiling and a naive relay, measured in one run.
//!
//! - **drain**: N seeded events through `postbox relay --drain` (a child
//!   process, so its peak RSS is the real binary's) into the sink; in the same
//!   run, the pure-SQL claim-and-ack loop on the same schema (no broker), and a
//!   naive row-at-a-time relay (SELECT 100, then LPUSH + UPDATE + COMMIT per row).
//! - **latency**: a steady producer at R events/s for T; commit-to-Redis
//!   percentiles, once with LISTEN/NOTIFY and once with polling only.
//! - **scale**: 1, 2 and 4 relay processes draining N events together.
//! - **ordered**: N events over A aggregates drained unordered, then with
//!   `--ordered`, in the same run.
//! - **sustained**: producers at a steady high rate for a long time, the relay
//!   with retention on; the outbox's table and index size and dead tuples
//!   sampled throughout, and the relay's peak RSS. (Not in the default set.)

use crate::commands::{AnyError, Settings};
use clap::{Args, ValueEnum};
use postbox::{NewEvent, Outbox, Schema};
use postbox_harness::os::Signal;
use postbox_harness::pgcluster::TempCluster;
use postbox_harness::supervisor::{run_together, RelayCommand, TogetherRun};
use postbox_relay::store::bench::{BenchStore, TableSize};
use redis::AsyncCommands;
use serde::Serialize;
use sqlx::PgPool;
use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Events for the drain and scale-out runs
    #[arg(long, default_value_t = 200_000)]
    pub events: i64,
    /// Relay batch size (the ceiling uses the same)
    #[arg(long, default_value_t = 1000)]
    pub batch_size: u32,
    /// Sink for the relay runs [default: redis://127.0.0.1:6379]; latency needs a Redis list sink
    #[arg(long)]
    pub sink: Option<String>,
    /// Events for the naive relay (it is slow)
    #[arg(long, default_value_t = 20_000)]
    pub naive_events: i64,
    /// Producer rate for the latency run, events/s
    #[arg(long, default_value_t = 1000)]
    pub rate: u64,
    /// Length of each latency run
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Poll interval of the polling-only latency run
    #[arg(long, default_value = "250ms", value_parser = humantime::parse_duration)]
    pub poll_interval: Duration,
    /// Relay process counts for the scale-out run
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub relays: Vec<usize>,
    /// Aggregates the ordered run spreads its events over
    #[arg(long, default_value_t = 10_000)]
    pub aggregates: i64,
    /// Producer rate of the sustained run, events/s (batches of 100 per transaction)
    #[arg(long, default_value_t = 5_000)]
    pub sustained_rate: u64,
    /// Length of the sustained run
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub sustained_duration: Duration,
    /// Which parts to run
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "drain,latency,scale,ordered"
    )]
    pub only: Vec<Part>,
    /// Schema the benchmark creates and drops (never your outbox's)
    #[arg(long, default_value = "postbox_bench")]
    pub bench_schema: String,
    /// Print the results as JSON
    #[arg(long)]
    pub json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Part {
    Drain,
    Latency,
    Scale,
    Ordered,
    Sustained,
}

const REDIS_DEFAULT: &str = "redis://127.0.0.1:6379";
const KEY: &str = "postbox-bench:events";
/// How long a relay stopped after a latency run may take to exit.
const RELAY_GRACE: Duration = Duration::from_secs(35);

#[derive(Debug, Default, Serialize)]
struct Report {
    machine: Machine,
    drain: Option<Drain>,
    latency: Vec<Latency>,
    scale: Vec<Scale>,
    ordered: Option<Ordered>,
    sustained: Option<Sustained>,
}

#[derive(Debug, Serialize)]
struct Sustained {
    rate: u64,
    duration_s: f64,
    events: u64,
    /// Samples of the outbox table: seconds since the start, sizes, pending.
    samples: Vec<Sample>,
    relay_peak_rss_mb: f64,
}

#[derive(Debug, Clone, Copy, Serialize)]
struct Sample {
    at_s: f64,
    table_bytes: i64,
    index_bytes: i64,
    dead_tuples: i64,
    pending: i64,
}

#[derive(Debug, Serialize)]
struct Ordered {
    events: i64,
    aggregates: i64,
    unordered_events_per_s: f64,
    ordered_events_per_s: f64,
    ordered_vs_unordered: f64,
}

#[derive(Debug, Default, Serialize)]
struct Machine {
    cpus: usize,
    postgres: String,
    sink: String,
}

#[derive(Debug, Serialize)]
struct Drain {
    events: i64,
    batch_size: u32,
    relay_events_per_s: f64,
    relay_peak_rss_mb: f64,
    ceiling_events_per_s: f64,
    naive_events: i64,
    naive_events_per_s: f64,
    relay_vs_ceiling: f64,
    relay_vs_naive: f64,
    table_after: TableSize,
}

#[derive(Debug, Serialize)]
struct Latency {
    mode: String,
    rate: u64,
    /// Events per second the producers committed (each commit waits for a flush).
    achieved_rate: f64,
    events: usize,
    p50_ms: f64,
    p95_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

#[derive(Debug, Serialize)]
struct Scale {
    relays: usize,
    events: i64,
    events_per_s: f64,
    peak_rss_mb: f64,
}

pub async fn run(settings: &Settings, args: BenchArgs) -> Result<ExitCode, AnyError> {
    if args.events < 1
        || args.naive_events < 1
        || args.rate < 1
        || args.relays.contains(&0)
        || args.aggregates < 1
    {
        return Err(
            "--events, --naive-events, --rate, --relays and --aggregates must be positive".into(),
        );
    }
    let (cluster, url) = match &settings.database_url {
        Some(url) => (None, url.clone()),
        None => {
            eprintln!("No DATABASE_URL: benchmarking a throwaway PostgreSQL cluster (fsync off).");
            let c = TempCluster::start().await?;
            let url = c.url().to_owned();
            (Some(c), url)
        }
    };
    let result = run_on(&url, &args).await;
    if let Some(c) = cluster {
        let _ = c.stop().await;
    }
    let report = result?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(ExitCode::SUCCESS)
}

struct Bench<'a> {
    url: &'a str,
    pool: PgPool,
    schema: Schema,
    sink: String,
    args: &'a BenchArgs,
}

async fn run_on(url: &str, args: &BenchArgs) -> Result<Report, AnyError> {
    let options = crate::db::options(Some(url), "postbox-bench")?;
    let pool = crate::db::pool(options, 56, Duration::from_secs(15)).await?;
    let sink = args
        .sink
        .clone()
        .unwrap_or_else(|| format!("{REDIS_DEFAULT}?key={KEY}"));
    let bench = Bench {
        url,
        pool: pool.clone(),
        schema: bench_schema(&args.bench_schema)?,
        sink: sink.clone(),
        args,
    };
    let postgres: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&pool)
        .await?;
    let mut report = Report {
        machine: Machine {
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            postgres,
            sink: postbox_relay::sinks::from_url(&sink, &Default::default())?.describe(),
        },
        ..Report::default()
    };
    if args.only.contains(&Part::Drain) {
        report.drain = Some(bench.drain().await?);
    }
    if args.only.contains(&Part::Latency) {
        if is_redis_list(&sink) {
            // LISTEN with the relay's default (synchronous) commits, the same
            // with asynchronous ones (no flush per claim), polling.
            for (listen, synchronous) in [(true, true), (true, false), (false, true)] {
                report
                    .latency
                    .push(bench.latency(listen, synchronous).await?);
            }
        } else {
            eprintln!("latency: skipped (it reads the messages back from a Redis list sink)");
        }
    }
    if args.only.contains(&Part::Scale) {
        for &n in &args.relays {
            report.scale.push(bench.scale(n).await?);
        }
    }
    if args.only.contains(&Part::Ordered) {
        report.ordered = Some(bench.ordered().await?);
    }
    if args.only.contains(&Part::Sustained) {
        report.sustained = Some(bench.sustained().await?);
    }
    bench.reset().await?;
    sqlx::raw_sql(
        &bench
            .schema
            .render("DROP SCHEMA IF EXISTS {schema} CASCADE"),
    )
    .execute(&pool)
    .await?;
    clear_redis(&sink).await;
    Ok(report)
}

fn bench_schema(name: &str) -> Result<Schema, AnyError> {
    if !name.contains("bench") {
        return Err(format!(
            "--bench-schema {name:?}: the benchmark drops this schema, so its name must contain \"bench\""
        )
        .into());
    }
    Ok(Schema::new(name)?)
}

fn is_redis_list(sink: &str) -> bool {
    (sink.starts_with("redis://") || sink.starts_with("rediss://")) && !sink.contains("mode=stream")
}

/// The Redis list the relay pushes to, when the sink is one (a key without placeholders).
fn redis_target(sink: &str) -> Option<(String, String)> {
    if !is_redis_list(sink) {
        return None;
    }
    let url = url::Url::parse(sink).ok()?;
    let key = url
        .query_pairs()
        .find(|(k, _)| k == "key")
        .map(|(_, v)| v.into_owned())?;
    if key.contains('{') {
        return None;
    }
    let mut base = url.clone();
    base.set_query(None);
    Some((base.to_string(), key))
}

async fn clear_redis(sink: &str) {
    if let Some((url, key)) = redis_target(sink) {
        if let Ok(client) = redis::Client::open(url) {
            if let Ok(mut c) = client.get_multiplexed_async_connection().await {
                let _: Result<(), _> = c.del(&key).await;
            }
        }
    }
}

impl Bench<'_> {
    async fn reset(&self) -> Result<(), AnyError> {
        sqlx::raw_sql(&self.schema.render("DROP SCHEMA IF EXISTS {schema} CASCADE"))
            .execute(&self.pool)
            .await?;
        let mut conn = self.pool.acquire().await?;
        postbox::sqlx::migrate(&mut conn, &self.schema).await?;
        clear_redis(&self.sink).await;
        Ok(())
    }

    fn store(&self) -> BenchStore {
        BenchStore::new(self.pool.clone(), &self.schema)
    }

    async fn seeded(&self, n: i64) -> Result<BenchStore, AnyError> {
        self.seeded_over(n, 0).await
    }

    /// `n` events over `aggregates` aggregates (0: one aggregate per event).
    async fn seeded_over(&self, n: i64, aggregates: i64) -> Result<BenchStore, AnyError> {
        self.reset().await?;
        let store = self.store();
        store
            .seed(n, aggregates, &self.schema.render("{schema}.outbox"))
            .await?;
        Ok(store)
    }

    async fn sustained(&self) -> Result<Sustained, AnyError> {
        let args = self.args;
        let rate = args.sustained_rate.max(1);
        eprintln!(
            "sustained: {rate} events/s for {} with retention on…",
            humantime::format_duration(args.sustained_duration)
        );
        self.reset().await?;
        let store = self.store();
        let config = std::env::temp_dir().join(format!(
            "postbox-bench-sustained-{}.toml",
            std::process::id()
        ));
        std::fs::write(
            &config,
            format!(
                "[relay]\nbatch_size = {}\n[retention]\nenabled = true\nolder_than = \"5s\"\ninterval = \"2s\"\nbatch_size = 5000\npause = \"10ms\"\nvacuum = true\n",
                args.batch_size
            ),
        )?;
        let relay = RelayCommand::new(self.url, &self.schema)?
            .config(&config)
            .args(["--sink", &self.sink])
            .spawn(None)?;

        // Keep the Redis list from growing without bound: a consumer would.
        let trimmer = redis_target(&self.sink).map(|(url, key)| {
            tokio::spawn(async move {
                let Ok(client) = redis::Client::open(url) else {
                    return;
                };
                let Ok(mut c) = client.get_multiplexed_async_connection().await else {
                    return;
                };
                loop {
                    let _: Result<(), _> = c.del(&key).await;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            })
        });

        let started = Instant::now();
        let deadline = started + args.sustained_duration;
        let produced = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let producers = 4_u64;
        let batch = 100_u64;
        let mut tasks = Vec::new();
        for p in 0..producers {
            let pool = self.pool.clone();
            let outbox = Outbox::new(self.schema.clone());
            let produced = produced.clone();
            let period = Duration::from_secs_f64((producers * batch) as f64 / rate as f64);
            tasks.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut i = 0_u64;
                while Instant::now() < deadline {
                    tick.tick().await;
                    let events = (0..batch)
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
                    produced.fetch_add(batch, std::sync::atomic::Ordering::Relaxed);
                }
                Ok::<_, AnyError>(())
            }));
        }
        let every = (args.sustained_duration / 10).max(Duration::from_secs(1));
        let mut samples = Vec::new();
        while Instant::now() < deadline {
            tokio::time::sleep(every.min(deadline.saturating_duration_since(Instant::now()))).await;
            let size = store.table_size().await?;
            let pending: i64 = store.pending().await?;
            samples.push(Sample {
                at_s: round2(started.elapsed().as_secs_f64()),
                table_bytes: size.table_bytes,
                index_bytes: size.index_bytes,
                dead_tuples: size.dead_tuples,
                pending,
            });
        }
        for t in tasks {
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
            events: produced.load(std::sync::atomic::Ordering::Relaxed),
            samples,
            relay_peak_rss_mb: round2(rss),
        })
    }

    async fn ordered(&self) -> Result<Ordered, AnyError> {
        let (events, aggregates) = (self.args.events, self.args.aggregates);
        let mut rates = [0.0; 2];
        for (rate, extra) in rates.iter_mut().zip([&[][..], &["--ordered"][..]]) {
            eprintln!(
                "ordered: {events} events over {aggregates} aggregates, relay {}…",
                if extra.is_empty() {
                    "unordered"
                } else {
                    "--ordered"
                }
            );
            self.seeded_over(events, aggregates).await?;
            let run = self.relays(1, extra).await?;
            *rate = events as f64 / run.elapsed.as_secs_f64();
        }
        Ok(Ordered {
            events,
            aggregates,
            unordered_events_per_s: rates[0].round(),
            ordered_events_per_s: rates[1].round(),
            ordered_vs_unordered: round2(rates[1] / rates[0]),
        })
    }

    async fn drain(&self) -> Result<Drain, AnyError> {
        let args = self.args;
        eprintln!("drain: {} events through the relay…", args.events);
        let store = self.seeded(args.events).await?;
        let relay = self.relays(1, &[]).await?;
        let table_after = store.table_size().await?;

        eprintln!("drain: the same events through the pure-SQL ceiling…");
        let store = self.seeded(args.events).await?;
        let started = Instant::now();
        store.ceiling(args.batch_size).await?;
        let ceiling = args.events as f64 / started.elapsed().as_secs_f64();

        eprintln!(
            "drain: {} events through the naive relay…",
            args.naive_events
        );
        let store = self.seeded(args.naive_events).await?;
        let naive_key = format!("{}:naive", self.schema.name());
        let naive = naive_relay(&store, args.naive_events, &naive_key).await?;

        let relay_rate = args.events as f64 / relay.elapsed.as_secs_f64();
        Ok(Drain {
            events: args.events,
            batch_size: args.batch_size,
            relay_events_per_s: relay_rate.round(),
            relay_peak_rss_mb: relay.peak_rss_mb,
            ceiling_events_per_s: ceiling.round(),
            naive_events: args.naive_events,
            naive_events_per_s: naive.round(),
            relay_vs_ceiling: round2(relay_rate / ceiling),
            relay_vs_naive: round2(relay_rate / naive),
            table_after,
        })
    }

    async fn scale(&self, n: usize) -> Result<Scale, AnyError> {
        eprintln!(
            "scale: {} events through {n} relay process(es)…",
            self.args.events
        );
        self.seeded(self.args.events).await?;
        let run = self.relays(n, &[]).await?;
        Ok(Scale {
            relays: n,
            events: self.args.events,
            events_per_s: (self.args.events as f64 / run.elapsed.as_secs_f64()).round(),
            peak_rss_mb: run.peak_rss_mb,
        })
    }

    /// Run `n` `postbox relay --drain` processes at once; wall time and the largest peak RSS.
    async fn relays(&self, n: usize, extra: &[&str]) -> Result<TogetherRun, AnyError> {
        let command = RelayCommand::new(self.url, &self.schema)?
            .args(["--drain", "--sink", &self.sink])
            .args(["--batch-size".to_owned(), self.args.batch_size.to_string()])
            .args(extra.iter().copied());
        run_together(&command, n).await
    }

    async fn latency(&self, listen: bool, synchronous: bool) -> Result<Latency, AnyError> {
        let args = self.args;
        let mode = if listen && !synchronous {
            "LISTEN/NOTIFY, asynchronous relay commits".to_owned()
        } else if listen {
            "LISTEN/NOTIFY".to_owned()
        } else {
            format!(
                "polling every {}",
                humantime::format_duration(args.poll_interval)
            )
        };
        eprintln!(
            "latency: {} events/s for {} with {mode}…",
            args.rate,
            humantime::format_duration(args.duration)
        );
        self.reset().await?;
        let (redis_url, key) = redis_target(&self.sink)
            .ok_or("latency needs a Redis list sink with a fixed key (…?key=NAME)")?;

        // The relay, as a real process with a config file for the mode.
        let config =
            std::env::temp_dir().join(format!("postbox-bench-{}.toml", std::process::id()));
        std::fs::write(
            &config,
            format!(
                "[relay]\nlisten = {listen}\nsynchronous_commit = {synchronous}\npoll_interval = \"{}\"\nbatch_size = {}\n",
                humantime::format_duration(args.poll_interval),
                args.batch_size
            ),
        )?;
        let relay = RelayCommand::new(self.url, &self.schema)?
            .config(&config)
            .args(["--sink", &self.sink])
            .spawn(None)?;

        // The consumer: pop everything that has arrived (up to 1,000 at a
        // time, blocking while the list is empty), note when each id arrived.
        let received: Arc<Mutex<Vec<(uuid::Uuid, Instant)>>> = Arc::default();
        let consumer = {
            let received = received.clone();
            let client = redis::Client::open(redis_url)?;
            let mut conn = client.get_multiplexed_async_connection().await?;
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
                            let mut received = received.lock().unwrap_or_else(|p| p.into_inner());
                            for body in bodies {
                                if let Some(id) = serde_json::from_str::<serde_json::Value>(&body)
                                    .ok()
                                    .and_then(|v| v["id"].as_str().and_then(|s| s.parse().ok()))
                                {
                                    received.push((id, at));
                                }
                            }
                        }
                        Ok(None) => {}
                        Err(_) => return,
                    }
                }
            })
        };

        // Warm-up: one event through the whole path, so that the relay's
        // start (connections, LISTEN, the sink) is not measured as latency.
        let warm_up = NewEvent::new("bench.warm_up", "bench", "0", &serde_json::json!({}))?;
        let warm_up_id = {
            let mut tx = self.pool.begin().await?;
            let id = postbox::sqlx::enqueue(&Outbox::new(self.schema.clone()), &mut tx, &warm_up)
                .await?;
            tx.commit().await?;
            id
        };
        let ready_by = Instant::now() + Duration::from_secs(60);
        loop {
            let arrived = received
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .any(|(id, _)| *id == warm_up_id);
            if arrived {
                break;
            }
            if Instant::now() > ready_by {
                let _ = relay.stop(RELAY_GRACE).await;
                return Err("latency: the relay delivered nothing within 60 s of starting".into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        received.lock().unwrap_or_else(|e| e.into_inner()).clear();

        // The producers: one transaction per event, at the target rate.
        let committed: Arc<Mutex<HashMap<uuid::Uuid, Instant>>> = Arc::default();
        // Enough producers that a slow commit (a WAL flush each) does not
        // hold the rate back: concurrent commits share flushes.
        let producers = (args.rate / 25).clamp(16, 48);
        // Their connections exist before the clock starts: a new backend's
        // start-up is CPU the first run would otherwise pay inside its tail.
        let mut warm = Vec::new();
        for _ in 0..producers {
            warm.push(self.pool.acquire().await?);
        }
        drop(warm);
        let deadline = Instant::now() + args.duration;
        let mut tasks = Vec::new();
        for p in 0..producers {
            let pool = self.pool.clone();
            let outbox = Outbox::new(self.schema.clone());
            let committed = committed.clone();
            let period = Duration::from_secs_f64(producers as f64 / args.rate as f64);
            tasks.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(period);
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
                    let id = postbox::sqlx::enqueue(&outbox, &mut tx, &event).await?;
                    tx.commit().await?;
                    committed
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(id, Instant::now());
                }
                Ok::<_, AnyError>(())
            }));
        }
        for t in tasks {
            t.await??;
        }
        let total = committed.lock().unwrap_or_else(|e| e.into_inner()).len();
        let wait_until = Instant::now() + Duration::from_secs(30);
        while received.lock().unwrap_or_else(|e| e.into_inner()).len() < total
            && Instant::now() < wait_until
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        consumer.abort();
        let _ = relay.stop(RELAY_GRACE).await;
        let _ = std::fs::remove_file(&config);

        let committed = committed.lock().unwrap_or_else(|e| e.into_inner());
        let mut ms: Vec<f64> = received
            .lock()
            .unwrap_or_else(|e| e.into_inner())
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
            rate: args.rate,
            achieved_rate: (total as f64 / args.duration.as_secs_f64()).round(),
            events: ms.len(),
            p50_ms: round2(percentile(&ms, 0.50)),
            p95_ms: round2(percentile(&ms, 0.95)),
            p99_ms: round2(percentile(&ms, 0.99)),
            max_ms: round2(ms.last().copied().unwrap_or_default()),
        })
    }
}

async fn naive_relay(store: &BenchStore, n: i64, key: &str) -> Result<f64, AnyError> {
    let client = redis::Client::open(REDIS_DEFAULT)?;
    let mut redis = client.get_multiplexed_async_connection().await?;
    let _: () = redis.del(key).await?;
    let started = Instant::now();
    let mut done = 0_i64;
    loop {
        let rows = store.naive_select().await?;
        if rows.is_empty() {
            break;
        }
        for (id, payload) in rows {
            let _: () = redis.lpush(key, payload).await?;
            store.naive_mark(id).await?;
            done += 1;
        }
    }
    let rate = done as f64 / started.elapsed().as_secs_f64();
    let _: () = redis.del(key).await?;
    if done != n {
        return Err(format!("naive relay moved {done} of {n} events").into());
    }
    Ok(rate)
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn print_table(r: &Report) {
    println!(
        "postbox bench: {} CPUs, PostgreSQL {}, sink {}",
        r.machine.cpus, r.machine.postgres, r.machine.sink
    );
    if let Some(d) = &r.drain {
        println!();
        println!("drain ({} events, batch {})", d.events, d.batch_size);
        println!(
            "  relay → sink               {:>9.0} events/s   peak RSS {:.1} MB",
            d.relay_events_per_s, d.relay_peak_rss_mb
        );
        println!(
            "  pure-SQL ceiling           {:>9.0} events/s   relay = {:.2} × ceiling",
            d.ceiling_events_per_s, d.relay_vs_ceiling
        );
        println!(
            "  naive relay ({:>6} ev.)   {:>9.0} events/s   relay = {:.1} × naive",
            d.naive_events, d.naive_events_per_s, d.relay_vs_naive
        );
        println!(
            "  outbox after the drain: table {:.1} MB, indexes {:.1} MB, {} dead tuples",
            d.table_after.table_bytes as f64 / 1e6,
            d.table_after.index_bytes as f64 / 1e6,
            d.table_after.dead_tuples
        );
    }
    if !r.latency.is_empty() {
        println!();
        println!("commit-to-Redis latency (target rate)            committed/s   events   p50 ms   p95 ms   p99 ms   max ms");
        for l in &r.latency {
            println!(
                "  {:<46} {:>11.0} {:>8} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
                format!("{} ({}/s)", l.mode, l.rate),
                l.achieved_rate,
                l.events,
                l.p50_ms,
                l.p95_ms,
                l.p99_ms,
                l.max_ms
            );
        }
    }
    if let Some(o) = &r.ordered {
        println!();
        println!(
            "ordered ({} events over {} aggregates)",
            o.events, o.aggregates
        );
        println!(
            "  unordered                  {:>9.0} events/s",
            o.unordered_events_per_s
        );
        println!(
            "  --ordered                  {:>9.0} events/s   = {:.2} × unordered",
            o.ordered_events_per_s, o.ordered_vs_unordered
        );
    }
    if let Some(s) = &r.sustained {
        println!();
        println!(
            "sustained ({} events/s for {:.0} s, {} events, retention on; relay peak RSS {:.1} MB)",
            s.rate, s.duration_s, s.events, s.relay_peak_rss_mb
        );
        println!("  at s     table MB  indexes MB  dead tuples   pending");
        for x in &s.samples {
            println!(
                "  {:>6.0} {:>10.1} {:>11.1} {:>12} {:>9}",
                x.at_s,
                x.table_bytes as f64 / 1e6,
                x.index_bytes as f64 / 1e6,
                x.dead_tuples,
                x.pending
            );
        }
    }
    if !r.scale.is_empty() {
        println!();
        println!("scale-out ({} events)", r.scale[0].events);
        for s in &r.scale {
            println!(
                "  {} relay process(es)       {:>9.0} events/s   peak RSS {:.1} MB each",
                s.relays, s.events_per_s, s.peak_rss_mb
            );
        }
    }
}

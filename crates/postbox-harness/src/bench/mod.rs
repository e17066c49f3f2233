//! `postbox bench`: throughput and latency of the relay on this machine, next
//! to the Postgres-side ceiling and a naive relay, measured in one run.
//!
//! - **drain**: N seeded events through `postbox relay --drain` (a child
//!   process, so its peak RSS is the real binary's) into the sink; in the same
//!   run, the pure-SQL claim-and-ack loop on the same schema (no broker), and a
//!   naive row-at-a-time relay (SELECT 100, then LPUSH + UPDATE + COMMIT per row).
//!   With `--peers pgq` (`pgq.rs`), the same events through PgQ's canonical
//!   consumer into the same sink. Each reading mode's CPU per million events,
//!   the relay's and the PostgreSQL server's (`cpu.rs`).
//! - **latency** (`latency.rs`): a steady producer at R events/s for T;
//!   commit-to-Redis percentiles, once with LISTEN/NOTIFY and once with
//!   polling only, then in log mode and in logical mode (producers `emit`).
//!   The same drain in log mode, and in logical mode (events emitted into
//!   the WAL in transactions of 1,000, read from a replication slot), and one
//!   transaction of 100,000 emitted events (the logical relay's peak RSS).
//! - **producer**: producers committing one event per transaction, with
//!   `enqueue`, with `emit` (the default: the WAL only) and with `emit`
//!   numbering its events (`migrate --emit-sequence on`), in the same run:
//!   commits per second, against enqueue's, and table rows written.
//! - **scale**: 1, 2 and 4 relay processes draining N events together; in
//!   log mode (`--modes log`), relays sharing one log whose cursor is split
//!   into partitions: the rate against one relay, and the duplicates the
//!   sink received.
//! - **ordered**: N events over A aggregates drained unordered, then with
//!   `--ordered`, in the same run.
//! - **sustained** (`sustained.rs`): producers at a steady high rate for a
//!   long time, the relay with retention on; the outbox's table and index
//!   size and dead tuples sampled throughout, and the relay's peak RSS; in
//!   log mode (`--modes log`), the log's segments and the outbox sampled
//!   with autovacuum off and no vacuum step. (Not in the default set.)
//! - **groups** (`groups.rs`): consumer groups read over SQL (receive a
//!   batch, ack it) by one and by four readers, against PgQ's consumer API
//!   with `--peers pgq`. (Not in the default set.)
//! - **tenants** (`tenants.rs`): one relay process serving hundreds of
//!   outboxes over many databases: RSS, connections, idle CPU, cross-tenant
//!   latency under a backlog, drain of 100 outboxes against one. (Not in the
//!   default set.)
//!
//! Its statements are `sql/bench.sql` ([`store::BenchStore`]); what it
//! measured is a [`report::BenchReport`].

mod cpu;
mod groups;
mod latency;
mod pgq;
pub mod report;
pub mod store;
mod sustained;
mod tenants;

use crate::pgcluster::TempCluster;
use crate::supervisor::{run_together, RelayCommand, TogetherRun};
use crate::AnyError;
use postbox::Schema;
use postbox_relay::ReadMode;
use postbox_store::connect as db;
use redis::AsyncCommands;
use report::{
    print_table, round2, BenchReport, Cost, Drain, LogScale, Machine, Ordered, PgqDrain, Producer,
    Scale, ShapedDrain,
};
use std::time::{Duration, Instant};
use store::BenchStore;

/// What `postbox bench` runs.
#[derive(Clone, Debug)]
pub struct Options {
    /// Events for the drain and scale-out runs.
    pub events: i64,
    /// Relay batch size (the ceiling uses the same).
    pub batch_size: u32,
    /// Sink for the relay runs [default: a Redis list on 127.0.0.1:6379].
    pub sink: Option<String>,
    /// Events for the naive relay.
    pub naive_events: i64,
    /// Producer rate for the latency run, events/s.
    pub rate: u64,
    /// Length of each latency run.
    pub duration: Duration,
    /// Poll interval of the polling-only latency run.
    pub poll_interval: Duration,
    /// Relay process counts for the scale-out run.
    pub relays: Vec<usize>,
    /// Aggregates the ordered run spreads its events over.
    pub aggregates: i64,
    /// Producer rate of the sustained run, events/s.
    pub sustained_rate: u64,
    /// Length of the sustained run.
    pub sustained_duration: Duration,
    /// Many outboxes: schemas in one database, extra databases, the backlog
    /// one tenant drains, and the events of the drain comparison.
    pub tenant_schemas: usize,
    pub tenant_databases: usize,
    pub tenant_backlog: i64,
    pub tenant_drain_events: i64,
    /// Which parts to run.
    pub parts: Vec<Part>,
    /// Other systems the drain compares with, when the server has them.
    pub peers: Vec<Peer>,
    /// Reading modes of the scale-out and sustained runs.
    pub modes: Vec<Mode>,
    /// Reading modes of the latency run.
    pub latency_modes: Vec<ReadMode>,
    /// With N > 0, each mode's LISTEN latency run is followed by the same
    /// run with a replay of N retained events beside the live traffic.
    pub replay_beside: i64,
    /// The pace of that replay, events/s (0: unpaced).
    pub replay_rate: u32,
    /// Schema the benchmark creates and drops (its name must contain "bench").
    pub bench_schema: String,
    /// Print the results as JSON rather than a table.
    pub json: bool,
    /// Without `DATABASE_URL`: run the throwaway cluster with fsync (and
    /// synchronous_commit, full_page_writes) off — figures no durable
    /// server reaches, labelled as such. Off: a production server's
    /// durability.
    pub fsync_off: bool,
}

/// A reading mode the scale-out and sustained runs measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Claim,
    Log,
}

/// Another system the drain runs the same events through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    /// PgQ's canonical consumer (the `pgq` extension).
    Pgq,
}

/// The parts of a benchmark run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Drain,
    Latency,
    Producer,
    Scale,
    Ordered,
    Sustained,
    Tenants,
    Groups,
}

const REDIS_DEFAULT: &str = "redis://127.0.0.1:6379";
const KEY: &str = "postbox-bench:events";
/// Events per transaction of the logical-mode drain's producers.
const EMIT_PER_TRANSACTION: i64 = 1000;
/// Events of the one large transaction the logical relay drains (fewer when
/// `--events` is smaller: a short run stays short).
const BIG_TRANSACTION: i64 = 100_000;
/// The shaped log drain's expressions: a filter every seeded event passes
/// (so both runs deliver the same events) and a transform that slims the
/// payload, as a third-party consumer would want it.
const SHAPED_FILTER: &str = r#".event_type == "order.created" and .payload.currency == "EUR""#;
const SHAPED_TRANSFORM: &str = "{order: .payload.order_id, customer: .payload.customer, amount_cents: .payload.total_cents, items: [.payload.items[] | {sku, qty}]}";
/// How often a long drain says how far it got.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// Run the benchmark on `database_url`, or on a throwaway cluster without
/// one, and print what it measured.
pub async fn run(database_url: Option<&str>, options: &Options) -> Result<(), AnyError> {
    if options.events < 1
        || options.naive_events < 1
        || options.rate < 1
        || options.relays.contains(&0)
        || options.aggregates < 1
    {
        return Err(
            "--events, --naive-events, --rate, --relays and --aggregates must be positive".into(),
        );
    }
    let (cluster, url) = match database_url {
        Some(url) => (None, url.to_owned()),
        None => {
            let durability = if options.fsync_off {
                crate::pgcluster::Durability::Fast
            } else {
                crate::pgcluster::Durability::Production
            };
            crate::errln!(
                "No DATABASE_URL: benchmarking a throwaway PostgreSQL cluster ({}).",
                durability.describe()
            );
            let c = TempCluster::start_with(durability).await?;
            let url = c.url().to_owned();
            (Some(c), url)
        }
    };
    let result = run_on(&url, options).await;
    if let Some(c) = cluster {
        let _ = c.stop().await;
    }
    let report = result?;
    if options.json {
        crate::outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

/// One benchmark run: the database, the schema it owns, the sink.
struct Bench<'a> {
    url: &'a str,
    pool: sqlx::PgPool,
    schema: Schema,
    store: BenchStore,
    sink: String,
    options: &'a Options,
}

async fn run_on(url: &str, options: &Options) -> Result<BenchReport, AnyError> {
    let connect = db::options(Some(url), "postbox-bench")?;
    let pool = db::pool(connect, 56, db::CONNECT_PATIENCE).await?;
    let sink = options
        .sink
        .clone()
        .unwrap_or_else(|| format!("{REDIS_DEFAULT}?key={KEY}"));
    let schema = bench_schema(&options.bench_schema)?;
    let bench = Bench {
        url,
        pool: pool.clone(),
        store: BenchStore::new(pool, &schema),
        schema,
        sink: sink.clone(),
        options,
    };
    let mut report = BenchReport {
        machine: Machine {
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            postgres: bench.store.server_version().await?,
            sink: postbox_relay::sinks::from_url(&sink, &Default::default())?.describe(),
        },
        ..BenchReport::default()
    };
    let parts = &options.parts;
    if parts.contains(&Part::Drain) {
        report.drain = Some(bench.drain().await?);
    }
    if parts.contains(&Part::Latency) {
        if is_redis_list(&sink) {
            // LISTEN with the relay's default (synchronous) commits, the same
            // with asynchronous ones (no flush per claim), polling.
            // Then log mode with LISTEN, synchronous and asynchronous cursor
            // moves, and logical mode (producers emit).
            for (listen, synchronous, mode) in [
                (true, true, ReadMode::Claim),
                (true, false, ReadMode::Claim),
                (false, true, ReadMode::Claim),
                (true, true, ReadMode::Log),
                (true, false, ReadMode::Log),
                (true, true, ReadMode::Logical),
            ] {
                if options.latency_modes.contains(&mode) {
                    report
                        .latency
                        .push(bench.latency(listen, synchronous, mode, 0).await?);
                    if listen && synchronous && options.replay_beside > 0 {
                        report.latency.push(
                            bench
                                .latency(listen, synchronous, mode, options.replay_beside)
                                .await?,
                        );
                    }
                }
            }
        } else {
            crate::errln!("latency: skipped (it reads the messages back from a Redis list sink)");
        }
    }
    if parts.contains(&Part::Producer) {
        report.producer = Some(bench.producer().await?);
    }
    if parts.contains(&Part::Scale) {
        if options.modes.contains(&Mode::Claim) {
            for &n in &options.relays {
                report.scale.push(bench.scale(n).await?);
            }
        }
        if options.modes.contains(&Mode::Log) {
            if is_redis_list(&sink) {
                report.log_scale = bench.log_scale().await?;
            } else {
                crate::errln!(
                    "scale, log mode: skipped (it counts duplicates in a Redis list sink)"
                );
            }
        }
    }
    if parts.contains(&Part::Ordered) {
        report.ordered = Some(bench.ordered().await?);
    }
    if parts.contains(&Part::Sustained) {
        if options.modes.contains(&Mode::Claim) {
            report.sustained = Some(bench.sustained().await?);
        }
        if options.modes.contains(&Mode::Log) {
            report.log_sustained = Some(bench.log_sustained().await?);
        }
    }
    if parts.contains(&Part::Tenants) {
        report.tenants = Some(bench.tenants().await?);
    }
    if parts.contains(&Part::Groups) {
        report.groups = Some(bench.groups().await?);
    }
    bench.reset().await?;
    bench.store.drop_schema().await?;
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
            if let Ok(mut c) = crate::redis_connection(&client).await {
                let _: Result<(), _> = c.del(&key).await;
            }
        }
    }
}

impl Bench<'_> {
    /// A freshly migrated schema and an empty Redis list.
    async fn reset(&self) -> Result<(), AnyError> {
        self.store.reset().await?;
        clear_redis(&self.sink).await;
        Ok(())
    }

    /// A fresh schema holding `n` events, each its own aggregate.
    async fn seeded(&self, n: i64) -> Result<(), AnyError> {
        self.seeded_over(n, 0).await
    }

    /// A fresh schema holding `n` events over `aggregates` aggregates (0: one
    /// aggregate per event).
    async fn seeded_over(&self, n: i64, aggregates: i64) -> Result<(), AnyError> {
        self.reset().await?;
        self.store.seed(n, aggregates).await?;
        Ok(())
    }

    /// `postbox relay` on the benchmark's schema.
    fn relay(&self) -> std::io::Result<RelayCommand> {
        RelayCommand::new(self.url, &self.schema)
    }

    /// Run `n` `postbox relay --drain` processes at once; wall time, the
    /// largest peak RSS, and the CPU the relays and the server used.
    async fn drain_with_relays(&self, n: usize, extra: &[&str]) -> Result<Drained, AnyError> {
        let postgres_before = cpu::postgres_seconds();
        let run = self.run_relays(n, extra).await?;
        let postgres_cpu_s = cpu::postgres_seconds()
            .zip(postgres_before)
            .map(|(after, before)| after - before);
        Ok(Drained {
            elapsed: run.elapsed,
            peak_rss_mb: run.peak_rss_mb,
            relay_cpu_s: run.cpu_s,
            postgres_cpu_s,
        })
    }

    async fn run_relays(&self, n: usize, extra: &[&str]) -> Result<TogetherRun, AnyError> {
        let command = self
            .relay()?
            .args(["--drain", "--sink", &self.sink])
            .args([
                "--batch-size".to_owned(),
                self.options.batch_size.to_string(),
            ])
            .args(extra.iter().copied());
        // Progress within a long drain (on a terminal only): what is no
        // longer pending (claim mode only).
        let log_mode = extra.contains(&"--mode");
        let total = u64::try_from(self.options.events).ok();
        let mut progress = crate::progress::Progress::new("  drained", total);
        let run = run_together(&command, n);
        tokio::pin!(run);
        loop {
            tokio::select! {
                done = &mut run => return done,
                _ = tokio::time::sleep(PROGRESS_EVERY), if crate::progress::shown() => {
                    match self.store.pending().await {
                        Ok(left) if !log_mode => {
                            let left = u64::try_from(left).unwrap_or(0);
                            progress.update(total.unwrap_or(0).saturating_sub(left));
                        }
                        _ => progress.update_with(0, "(no pending count in this mode)"),
                    }
                }
            }
        }
    }

    async fn drain(&self) -> Result<Drain, AnyError> {
        let options = self.options;
        crate::progressln!("drain: {} events through the relay…", options.events);
        self.seeded(options.events).await?;
        let lsn = self.store.wal_lsn().await?;
        let relay = self.drain_with_relays(1, &[]).await?;
        let wal_claim = self.store.wal_since(&lsn).await?;
        let table_after = self.store.table_size().await?;

        crate::progressln!("drain: the same events through the relay in log mode…");
        self.reset().await?;
        self.store.seed_log(options.events, 0).await?;
        let lsn = self.store.wal_lsn().await?;
        let log_relay = self.drain_with_relays(1, &["--mode", "log"]).await?;
        let wal_log = self.store.wal_since(&lsn).await?;
        let log_after = self.store.log_size().await?;
        // PgQ right after log mode: the design log mode follows, measured
        // back to back on the same server state.
        let pgq = if self.options.peers.contains(&Peer::Pgq) {
            self.pgq_drain().await?
        } else {
            None
        };

        let shaped = self.shaped_log_drains().await?;

        crate::progressln!(
            "drain: the same events emitted into the WAL ({EMIT_PER_TRANSACTION} per transaction), through the relay in logical mode…"
        );
        let logical_relay = self
            .logical_drain(options.events, EMIT_PER_TRANSACTION)
            .await?;
        let big_events = BIG_TRANSACTION.min(options.events);
        crate::progressln!(
            "drain: one transaction of {big_events} emitted events through the relay in logical mode…"
        );
        let big = self.logical_drain(big_events, big_events).await?;

        crate::progressln!("drain: the same events through the pure-SQL log ceiling…");
        self.reset().await?;
        self.store.seed_log(options.events, 0).await?;
        let started = Instant::now();
        self.store.log_ceiling(options.batch_size).await?;
        let log_ceiling = options.events as f64 / started.elapsed().as_secs_f64();
        crate::progressln!(
            "drain: the same events read page by page over one connection, neither decoded nor sent…"
        );
        let started = Instant::now();
        let read = self.store.log_read(options.batch_size).await?;
        let log_read = read as f64 / started.elapsed().as_secs_f64();

        crate::progressln!("drain: the same events through the pure-SQL ceiling…");
        self.seeded(options.events).await?;
        let started = Instant::now();
        self.store.ceiling(options.batch_size).await?;
        let ceiling = options.events as f64 / started.elapsed().as_secs_f64();

        crate::progressln!(
            "drain: {} events through the naive relay…",
            options.naive_events
        );
        self.seeded(options.naive_events).await?;
        let naive_key = format!("{}:naive", self.schema.name());
        let naive = naive_relay(&self.store, options.naive_events, &naive_key).await?;

        let relay_rate = options.events as f64 / relay.elapsed.as_secs_f64();
        let log_rate = options.events as f64 / log_relay.elapsed.as_secs_f64();
        let logical_rate = options.events as f64 / logical_relay.elapsed.as_secs_f64();
        let per_event = |bytes: i64| round2(bytes as f64 / options.events as f64);
        let cost = |reader: &'static str, run: &Drained| Cost {
            reader,
            reader_cpu_s_per_million: cpu::per_million(run.relay_cpu_s, options.events),
            postgres_cpu_s_per_million: run
                .postgres_cpu_s
                .map(|s| cpu::per_million(s, options.events)),
        };
        let mut costs = vec![
            cost("claim", &relay),
            cost("log", &log_relay),
            cost("logical", &logical_relay),
        ];
        let pgq = pgq.map(|run| {
            let rate = options.events as f64 / run.elapsed.as_secs_f64();
            costs.push(Cost {
                reader: "pgq",
                reader_cpu_s_per_million: cpu::per_million(run.consumer_cpu_s, options.events),
                postgres_cpu_s_per_million: run
                    .postgres_cpu_s
                    .map(|s| cpu::per_million(s, options.events)),
            });
            PgqDrain {
                events_per_s: rate.round(),
                log_vs_pgq: round2(log_rate / rate),
            }
        });
        Ok(Drain {
            shaped,
            cost: costs,
            pgq,
            wal_bytes_per_event: per_event(wal_claim),
            log_relay_events_per_s: log_rate.round(),
            log_relay_peak_rss_mb: log_relay.peak_rss_mb,
            log_wal_bytes_per_event: per_event(wal_log),
            log_vs_claim: round2(log_rate / relay_rate),
            log_vs_naive: round2(log_rate / naive),
            log_ceiling_events_per_s: log_ceiling.round(),
            log_vs_log_ceiling: round2(log_rate / log_ceiling),
            log_read_events_per_s: log_read.round(),
            log_vs_log_read: round2(log_rate / log_read),
            log_after,
            logical_events_per_transaction: EMIT_PER_TRANSACTION,
            logical_relay_events_per_s: logical_rate.round(),
            logical_relay_peak_rss_mb: logical_relay.peak_rss_mb,
            logical_vs_log: round2(logical_rate / log_rate),
            logical_vs_claim: round2(logical_rate / relay_rate),
            logical_vs_naive: round2(logical_rate / naive),
            logical_big_transaction_events: big_events,
            logical_big_transaction_events_per_s: (big_events as f64 / big.elapsed.as_secs_f64())
                .round(),
            logical_big_transaction_peak_rss_mb: big.peak_rss_mb,
            events: options.events,
            batch_size: options.batch_size,
            relay_events_per_s: relay_rate.round(),
            relay_peak_rss_mb: relay.peak_rss_mb,
            ceiling_events_per_s: ceiling.round(),
            naive_events: options.naive_events,
            naive_events_per_s: naive.round(),
            relay_vs_ceiling: round2(relay_rate / ceiling),
            relay_vs_naive: round2(relay_rate / naive),
            table_after,
        })
    }

    /// Log mode with a typical filter and transform on the sink, against
    /// the same drain without them: two rounds, alternating, each on a
    /// freshly seeded log.
    async fn shaped_log_drains(&self) -> Result<ShapedDrain, AnyError> {
        let config = std::env::temp_dir().join(format!("{}_shaped.toml", self.schema.name()));
        std::fs::write(
            &config,
            format!("[sink]\nfilter = '{SHAPED_FILTER}'\ntransform = '{SHAPED_TRANSFORM}'\n"),
        )?;
        let path = config.to_string_lossy().into_owned();
        let shaped_args = ["--mode", "log", "--config", path.as_str()];
        let (mut plain, mut shaped) = (Duration::ZERO, Duration::ZERO);
        let result = async {
            for round in 1..=2 {
                for with in [true, false] {
                    crate::progressln!(
                        "drain: log mode {} a filter and a transform (round {round} of 2)…",
                        if with { "with" } else { "without" }
                    );
                    self.reset().await?;
                    self.store.seed_log(self.options.events, 0).await?;
                    let args: &[&str] = if with {
                        &shaped_args
                    } else {
                        &["--mode", "log"]
                    };
                    let run = self.drain_with_relays(1, args).await?;
                    *if with { &mut shaped } else { &mut plain } += run.elapsed;
                }
            }
            Ok::<_, AnyError>(())
        }
        .await;
        let _ = std::fs::remove_file(&config);
        result?;
        let rate = |d: Duration| 2.0 * self.options.events as f64 / d.as_secs_f64();
        Ok(ShapedDrain {
            filter: SHAPED_FILTER,
            transform: SHAPED_TRANSFORM,
            events_per_s: rate(shaped).round(),
            without_events_per_s: rate(plain).round(),
            vs_without: round2(rate(shaped) / rate(plain)),
        })
    }

    /// The drain's events through PgQ's consumer into the same sink, or
    /// `None` (said on stderr, with why) when PgQ cannot run on the server.
    async fn pgq_drain(&self) -> Result<Option<pgq::PgqRun>, AnyError> {
        let events = self.options.events;
        let queue = format!("{}_pgq", self.schema.name());
        let peer = match pgq::PgqPeer::open(self.pool.clone(), &queue).await? {
            Ok(peer) => peer,
            Err(why) => {
                crate::errln!("drain: PgQ skipped: {why}");
                return Ok(None);
            }
        };
        crate::progressln!(
            "drain: the same events through PgQ's consumer ({} per batch)…",
            self.options.batch_size
        );
        clear_redis(&self.sink).await;
        let run = async {
            peer.seed(events, i64::from(self.options.batch_size))
                .await?;
            let sink = postbox_relay::sinks::from_url(&self.sink, &Default::default())?;
            peer.drain(Some(sink.as_ref()), events).await
        }
        .await;
        let closed = peer.close().await;
        clear_redis(&self.sink).await;
        let run = run?;
        closed?;
        Ok(Some(run))
    }

    /// The replication slot of the benchmark's logical-mode runs.
    fn slot(&self) -> String {
        format!("{}_slot", self.schema.name())
    }

    /// Run `body` with the benchmark's replication slot created first (so
    /// that what it emits is in the slot) and dropped afterwards, even when
    /// `body` fails (a slot left behind retains WAL).
    async fn with_slot<T>(
        &self,
        body: impl std::future::Future<Output = Result<T, AnyError>>,
    ) -> Result<T, AnyError> {
        let slot = self.slot();
        let logical = postbox_store::Store::new(self.pool.clone(), self.schema.clone()).logical();
        {
            let mut conn = self.pool.acquire().await?;
            logical.ensure_slot(&mut conn, &slot).await?;
        }
        let result = body.await;
        let dropped =
            crate::slots::drop_slot_when_free(&logical, &slot, crate::slots::SLOT_PATIENCE).await;
        let value = result?;
        dropped?;
        Ok(value)
    }

    /// A fresh schema; `n` events emitted into the WAL, `per_tx` per
    /// transaction, drained by one relay in logical mode.
    async fn logical_drain(&self, n: i64, per_tx: i64) -> Result<Drained, AnyError> {
        self.reset().await?;
        let slot = self.slot();
        self.with_slot(async {
            self.store.seed_emit(n, per_tx).await?;
            self.drain_with_relays(1, &["--mode", "logical", "--slot", &slot])
                .await
        })
        .await
    }

    /// Producers committing one event per transaction as fast as they can
    /// for the latency run's duration: with `enqueue`, then with `emit`
    /// (not numbered, the default), then with `emit` numbering each event
    /// (`migrate --emit-sequence on`).
    async fn producer(&self) -> Result<Producer, AnyError> {
        const PRODUCERS: usize = 16;
        let duration = self.options.duration;
        let mut rates = [0.0; 3];
        let mut rows = [0; 3];
        let runs = [
            (false, false, "enqueue"),
            (true, false, "emit"),
            (true, true, "emit, numbered"),
        ];
        for (i, (emit, numbered, name)) in runs.into_iter().enumerate() {
            crate::progressln!(
                "producer: {PRODUCERS} producers committing one event per transaction with {name} for {}…",
                humantime::format_duration(duration)
            );
            self.reset().await?;
            postbox_store::Store::new(self.pool.clone(), self.schema.clone())
                .logical()
                .set_numbered_emits(numbered)
                .await?;
            let commits = self.commit_as_fast(PRODUCERS, duration, emit).await?;
            rates[i] = commits as f64 / duration.as_secs_f64();
            rows[i] = self.store.table_rows().await?;
        }
        Ok(Producer {
            producers: PRODUCERS,
            duration_s: duration.as_secs_f64(),
            enqueue_commits_per_s: rates[0].round(),
            emit_commits_per_s: rates[1].round(),
            emit_vs_enqueue: round2(rates[1] / rates[0]),
            emit_numbered_commits_per_s: rates[2].round(),
            emit_numbered_vs_enqueue: round2(rates[2] / rates[0]),
            enqueue_table_rows: rows[0],
            emit_table_rows: rows[1],
            emit_numbered_table_rows: rows[2],
        })
    }

    /// `producers` tasks, each committing one event per transaction in a
    /// loop for `duration`; how many transactions committed.
    async fn commit_as_fast(
        &self,
        producers: usize,
        duration: Duration,
        emit: bool,
    ) -> Result<u64, AnyError> {
        let mut warm = Vec::new();
        for _ in 0..producers {
            warm.push(self.pool.acquire().await?);
        }
        drop(warm);
        let deadline = Instant::now() + duration;
        let mut tasks = Vec::new();
        for p in 0..producers {
            let pool = self.pool.clone();
            let outbox = postbox::Outbox::new(self.schema.clone());
            tasks.push(tokio::spawn(async move {
                let mut n = 0_u64;
                while Instant::now() < deadline {
                    let event = postbox::NewEvent::new(
                        "order.created",
                        "order",
                        format!("{p}-{n}"),
                        &serde_json::json!({"p": p, "n": n}),
                    )?;
                    let mut tx = pool.begin().await?;
                    if emit {
                        postbox::sqlx::emit(&outbox, &mut tx, &event).await?;
                    } else {
                        postbox::sqlx::enqueue(&outbox, &mut tx, &event).await?;
                    }
                    tx.commit().await?;
                    n += 1;
                }
                Ok::<_, AnyError>(n)
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += t.await??;
        }
        Ok(total)
    }

    async fn scale(&self, n: usize) -> Result<Scale, AnyError> {
        let events = self.options.events;
        crate::progressln!("scale: {events} events through {n} relay process(es)…");
        self.seeded(events).await?;
        let run = self.drain_with_relays(n, &[]).await?;
        Ok(Scale {
            relays: n,
            events,
            events_per_s: (events as f64 / run.elapsed.as_secs_f64()).round(),
            peak_rss_mb: run.peak_rss_mb,
        })
    }

    /// Log mode: one relay, then each count of `--relays` above one,
    /// draining one log whose destination's cursor is split into as many
    /// partitions as the most relays (4 at least); the sink's list tells the
    /// duplicates.
    async fn log_scale(&self) -> Result<Vec<LogScale>, AnyError> {
        let events = self.options.events;
        let mut counts = vec![1];
        counts.extend(self.options.relays.iter().copied().filter(|&n| n > 1));
        let partitions =
            u16::try_from(counts.iter().copied().max().unwrap_or(1).max(4)).unwrap_or(u16::MAX);
        let config = self.write_config(
            "postbox-bench-log-scale",
            format!("[relay]\nmode = \"log\"\nlog_partitions = {partitions}\n"),
        )?;
        let mut out: Vec<LogScale> = Vec::new();
        for n in counts {
            crate::progressln!(
                "scale: {events} events through {n} relay process(es) on one log ({partitions} partitions)…"
            );
            self.reset().await?;
            self.store.seed_log(events, 0).await?;
            let path = config.display().to_string();
            let run = self
                .drain_with_relays(n, &["--mode", "log", "--config", &path])
                .await?;
            let received = self.received().await?;
            if received < events {
                return Err(format!(
                    "scale, log mode: the sink received {received} messages for {events} events"
                )
                .into());
            }
            let rate = events as f64 / run.elapsed.as_secs_f64();
            let one = out.first().map_or(rate, |o| o.events_per_s);
            out.push(LogScale {
                relays: n,
                partitions,
                events,
                events_per_s: rate.round(),
                vs_one_relay: round2(rate / one),
                duplicates: received - events,
                peak_rss_mb: run.peak_rss_mb,
            });
        }
        let _ = std::fs::remove_file(&config);
        Ok(out)
    }

    /// Messages in the sink's Redis list.
    async fn received(&self) -> Result<i64, AnyError> {
        let (url, key) = redis_target(&self.sink).ok_or("not a Redis list sink")?;
        let client = redis::Client::open(url)?;
        let mut c = crate::redis_connection(&client).await?;
        Ok(c.llen(&key).await?)
    }

    async fn ordered(&self) -> Result<Ordered, AnyError> {
        let (events, aggregates) = (self.options.events, self.options.aggregates);
        let mut rates = [0.0; 2];
        for (rate, extra) in rates.iter_mut().zip([&[][..], &["--ordered"][..]]) {
            crate::progressln!(
                "ordered: {events} events over {aggregates} aggregates, relay {}…",
                if extra.is_empty() {
                    "unordered"
                } else {
                    "--ordered"
                }
            );
            self.seeded_over(events, aggregates).await?;
            let run = self.drain_with_relays(1, extra).await?;
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

    /// A relay config file for one run, in the temporary directory.
    fn write_config(&self, name: &str, toml: String) -> std::io::Result<std::path::PathBuf> {
        let path = std::env::temp_dir().join(format!("{name}-{}.toml", std::process::id()));
        std::fs::write(&path, toml)?;
        Ok(path)
    }
}

/// Relays run to their end, with what they cost.
struct Drained {
    /// From the first start to the last exit.
    elapsed: Duration,
    /// The largest peak RSS among them, in MB.
    peak_rss_mb: f64,
    /// CPU the relays used, in seconds.
    relay_cpu_s: f64,
    /// CPU the PostgreSQL server used meanwhile, when it runs on this machine.
    postgres_cpu_s: Option<f64>,
}

/// The naive relay: 100 rows at a time, then LPUSH + UPDATE + COMMIT per row.
async fn naive_relay(store: &BenchStore, n: i64, key: &str) -> Result<f64, AnyError> {
    let client = redis::Client::open(REDIS_DEFAULT)?;
    let mut redis = crate::redis_connection(&client).await?;
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

/// How long a relay stopped after a timed run may take to exit.
const RELAY_GRACE: Duration = Duration::from_secs(35);

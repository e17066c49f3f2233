//! `postbox verify`: a self-contained check of the delivery contract under
//! faults.
//!
//! In a schema of its own it runs producers (committed and rolled-back
//! transactions over many aggregates, each event with a business row in the
//! same transaction), N `postbox relay` child processes, and a consumer that
//! applies every delivery through the inbox. The relays reach PostgreSQL and
//! the broker through [`FaultProxy`]s, and on a seeded schedule
//! ([`faults`]) relays are SIGKILLed and restarted, stalled past their lease,
//! and the broker and the database are reset, refused, hung or stalled;
//! failpoints (cargo feature `failpoints`) add crashes inside the relay. After
//! the run it drains and checks: every committed event delivered, no
//! rolled-back event delivered, every effect applied exactly once, and (with
//! `--ordered`) each aggregate's events applied in sequence.

mod consumer;
mod faults;
mod workload;

use crate::commands::{AnyError, Settings};
use clap::Args;
use consumer::{lock, Consumer, Seen, Source};
use faults::{FaultCounters, FaultKind};
use postbox::{Outbox, Schema};
use postbox_harness::pgcluster::TempCluster;
use postbox_harness::proxy::FaultProxy;
use postbox_harness::supervisor::{RelayCommand, Supervisor};
use postbox_relay::{failpoint, Store};
use rand::Rng;
use sqlx::PgPool;
use std::collections::HashSet;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;
use workload::{Ledger, Producer};

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// How long producers and faults run; then the run drains and is checked
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Relay processes (`postbox relay` children of this binary)
    #[arg(long, default_value_t = 3)]
    pub relays: usize,
    /// The broker: redis://HOST:PORT[/DB] (a stream) or nats://HOST:PORT (JetStream)
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    pub sink: String,
    /// Relays deliver each aggregate's events in sequence, and the consumer checks it
    #[arg(long)]
    pub ordered: bool,
    /// Seed of the workload and the fault schedule [default: random; printed]
    #[arg(long)]
    pub seed: Option<u64>,
    /// Events per second, all producers together (about)
    #[arg(long, default_value_t = 400)]
    pub rate: u32,
    /// Aggregates the events are spread over
    #[arg(long, default_value_t = 1000)]
    pub aggregates: u32,
    /// Percent of producer transactions rolled back
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub rollback_percent: u32,
    /// Faults to inject (comma-separated), or none
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kill,stall,sink,db,consumer"
    )]
    pub faults: Vec<FaultChoice>,
    /// Mean time between two relay kills
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub kill_every: Duration,
    /// Mean time between two other faults (stall, sink, db)
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub fault_every: Duration,
    /// The relays' lease (a stalled relay is stopped for longer than this)
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub lease: Duration,
    /// Failpoints armed in the relays and the producers, NAME=[P%]ACTION,…
    /// (needs a build with the `failpoints` feature)
    #[arg(long, value_name = "SPEC")]
    pub failpoints: Option<String>,
    /// Plant a bug in the relays, to see verify catch it (needs `failpoints`)
    #[arg(long, value_name = "BUG")]
    pub plant: Option<Plant>,
    /// Longest wait after the run for every committed event to arrive
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// Keep the schema, the broker's stream and the relay logs even when the checks pass
    #[arg(long)]
    pub keep: bool,
    /// Print the report as JSON
    #[arg(long)]
    pub json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FaultChoice {
    Kill,
    Stall,
    Sink,
    Db,
    Consumer,
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Plant {
    /// The relay acknowledges some batches without publishing them
    AckBeforePublish,
}

/// Exit status when a check fails (setup errors exit with 2).
const VIOLATION: u8 = 1;
const SETUP_ERROR: u8 = 2;
/// Violating event ids printed per check.
const SHOW: usize = 20;

pub async fn run(settings: &Settings, args: VerifyArgs) -> Result<ExitCode, AnyError> {
    match run_checked(settings, args).await {
        Ok(code) => Ok(code),
        Err(e) => {
            eprintln!("error: {}", crate::report(e.as_ref()));
            Ok(ExitCode::from(SETUP_ERROR))
        }
    }
}

async fn run_checked(settings: &Settings, args: VerifyArgs) -> Result<ExitCode, AnyError> {
    if args.relays == 0 {
        return Err("--relays must be at least 1".into());
    }
    if args.rate == 0 || args.aggregates == 0 {
        return Err("--rate and --aggregates must be at least 1".into());
    }
    let mut spec = args.failpoints.clone().unwrap_or_default();
    if let Some(Plant::AckBeforePublish) = args.plant {
        if !spec.is_empty() {
            spec.push(',');
        }
        spec.push_str("ack_before_publish=10%fail");
    }
    let rules = failpoint::parse(&spec)?;
    if rules.iter().any(|(name, rule)| {
        name == failpoint::points::PRODUCER_COMMIT && rule.action == failpoint::Action::Exit
    }) {
        return Err("--failpoints: producer_commit runs inside verify itself; use fail or sleep(MS) there, not exit".into());
    }
    if !spec.is_empty() && !failpoint::ENABLED {
        return Err(
            "--failpoints and --plant need a postbox built with failpoints: \
                    cargo build -p postbox-cli --features failpoints"
                .into(),
        );
    }
    failpoint::configure(&spec)?;
    let cluster = match &settings.database_url {
        Some(_) => None,
        None => {
            eprintln!("No DATABASE_URL: starting a throwaway PostgreSQL cluster…");
            Some(TempCluster::start().await?)
        }
    };
    let url = match (&cluster, &settings.database_url) {
        (Some(c), _) => c.url().to_owned(),
        (None, Some(u)) => u.clone(),
        (None, None) => unreachable!("a cluster is started when no URL is given"),
    };
    let result = verify(&url, &spec, &args).await;
    if let Some(c) = cluster {
        if let Err(e) = c.stop().await {
            tracing::warn!(error = %crate::report(&e), "stopping the throwaway cluster failed");
        }
    }
    result
}

/// The broker, as the relays and the consumer see it.
struct Broker {
    /// The sink URL for the relays (through the proxy).
    relay_url: String,
    /// The broker's address, for the proxy.
    target: String,
    /// What the run left on the broker, to delete afterwards.
    cleanup: Cleanup,
    source: Source,
}

enum Cleanup {
    RedisKey { url: String, key: String },
    NatsStream { url: String, stream: String },
}

impl Cleanup {
    async fn run(&self) -> Result<(), AnyError> {
        match self {
            Cleanup::RedisKey { url, key } => {
                let mut conn = redis::Client::open(url.as_str())?
                    .get_multiplexed_async_connection()
                    .await?;
                redis::cmd("DEL")
                    .arg(key)
                    .query_async::<()>(&mut conn)
                    .await?;
            }
            Cleanup::NatsStream { url, stream } => {
                let client = async_nats::connect(url.as_str()).await?;
                async_nats::jetstream::new(client)
                    .delete_stream(stream)
                    .await?;
            }
        }
        Ok(())
    }

    fn describe(&self) -> String {
        match self {
            Cleanup::RedisKey { key, .. } => format!("Redis stream {key}"),
            Cleanup::NatsStream { stream, .. } => format!("JetStream stream {stream}"),
        }
    }
}

/// Replace `url`'s host and port with the proxy's.
fn through(url: &url::Url, port: u16) -> Result<url::Url, AnyError> {
    let mut u = url.clone();
    u.set_host(Some("127.0.0.1"))
        .map_err(|e| format!("cannot point {} at the fault proxy: {e}", url.scheme()))?;
    u.set_port(Some(port))
        .map_err(|()| format!("cannot point {} at the fault proxy", url.scheme()))?;
    Ok(u)
}

fn host_port(url: &url::Url, default_port: u16) -> Result<String, AnyError> {
    let host = url
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| format!("{}: the URL needs a host", url.scheme()))?;
    Ok(format!("{host}:{}", url.port().unwrap_or(default_port)))
}

async fn broker(sink: &str, run_id: &str) -> Result<(Broker, FaultProxy), AnyError> {
    let url = url::Url::parse(sink).map_err(|e| format!("--sink: {e}"))?;
    if url.query().is_some() {
        return Err("--sink: give the broker's address only (verify chooses the stream)".into());
    }
    match url.scheme() {
        "redis" => {
            let target = host_port(&url, 6379)?;
            let proxy = FaultProxy::start(&target).await?;
            let key = format!("postbox_verify:{run_id}");
            let mut relay = through(&url, proxy.port())?;
            relay
                .query_pairs_mut()
                .append_pair("mode", "stream")
                .append_pair("key", &key);
            let source = Source::redis(sink, &key).await?;
            Ok((
                Broker {
                    relay_url: relay.to_string(),
                    target,
                    cleanup: Cleanup::RedisKey {
                        url: sink.to_owned(),
                        key,
                    },
                    source,
                },
                proxy,
            ))
        }
        "nats" => {
            let target = host_port(&url, 4222)?;
            let proxy = FaultProxy::start(&target).await?;
            let stream = format!("POSTBOX_VERIFY_{}", run_id.to_uppercase());
            let prefix = format!("postbox_verify_{run_id}");
            let mut relay = through(&url, proxy.port())?;
            relay
                .query_pairs_mut()
                .append_pair("subject", &format!("{prefix}.{{event_type}}"))
                .append_pair("stream", &stream);
            let source = Source::nats(sink, &stream, &format!("{prefix}.>")).await?;
            Ok((
                Broker {
                    relay_url: relay.to_string(),
                    target,
                    cleanup: Cleanup::NatsStream {
                        url: sink.to_owned(),
                        stream,
                    },
                    source,
                },
                proxy,
            ))
        }
        other => Err(format!(
            "--sink: verify runs with redis:// or nats:// brokers, not {other}://"
        )
        .into()),
    }
}

/// The figures and findings of one run.
#[derive(Debug, Default, serde::Serialize)]
struct Report {
    passed: bool,
    sink: String,
    relays: usize,
    ordered: bool,
    seed: u64,
    duration_seconds: f64,
    drain_seconds: f64,
    failpoints: String,
    transactions_committed: u64,
    transactions_rolled_back: u64,
    transactions_aborted_by_faults: u64,
    commit_outcomes_lost: u64,
    events_committed: u64,
    events_not_committed: u64,
    deliveries: u64,
    duplicates: u64,
    redeliveries: u64,
    effects_applied: u64,
    consumer_batches_retried: u64,
    consumer_acks_dropped: u64,
    relay_starts: u64,
    relay_kills: u64,
    relay_failpoint_exits: u64,
    relay_unexpected_exits: u64,
    faults: FaultCounters,
    dead_letters: i64,
    /// Committed events never delivered.
    lost: Vec<Uuid>,
    lost_count: usize,
    /// Events whose transaction did not commit, delivered anyway.
    rolled_back_delivered: Vec<Uuid>,
    /// Effects applied other than once: (event id, times).
    effects_not_once: Vec<(Uuid, i32)>,
    /// Events the producers saw committed whose business row is missing.
    commits_missing: Vec<Uuid>,
    /// Deliveries of ids no producer made, or bodies that were not events.
    unknown_deliveries: u64,
    order_violations: Vec<String>,
    order_violation_count: usize,
    schema: String,
    logs: String,
}

async fn verify(url: &str, spec: &str, args: &VerifyArgs) -> Result<ExitCode, AnyError> {
    let seed = args.seed.unwrap_or_else(|| rand::rng().random());
    let run_id = format!("{:08x}", rand::rng().random::<u32>());
    let schema = Schema::new(&format!("postbox_verify_{run_id}"))?;
    let kinds: Vec<FaultKind> = args
        .faults
        .iter()
        .filter_map(|f| match f {
            FaultChoice::Kill => Some(FaultKind::Kill),
            FaultChoice::Stall => Some(FaultKind::Stall),
            FaultChoice::Sink => Some(FaultKind::Sink),
            FaultChoice::Db => Some(FaultKind::Db),
            FaultChoice::Consumer => Some(FaultKind::Consumer),
            FaultChoice::None => None,
        })
        .collect();
    let logs = std::env::temp_dir().join(format!("postbox-verify-{run_id}"));
    std::fs::create_dir_all(&logs)?;

    // The database: direct for verify's own bookkeeping, through the proxy for everyone else.
    let db_url = url::Url::parse(url).map_err(|e| format!("DATABASE_URL: {e}"))?;
    let db_proxy = FaultProxy::start(&host_port(&db_url, 5432)?).await?;
    let proxied_db = through(&db_url, db_proxy.port())?.to_string();
    let direct = crate::db::pool(
        crate::db::options(Some(url), "postbox-verify")?,
        4,
        Duration::from_secs(15),
    )
    .await?;
    prepare(&direct, &schema).await?;
    let lazy = |name: &str, size: u32| -> Result<PgPool, AnyError> {
        let options = crate::db::options(Some(&proxied_db), name)?;
        Ok(sqlx::postgres::PgPoolOptions::new()
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(5))
            // Slow acquisitions are what the faults are for.
            .acquire_slow_level(tracing::log::LevelFilter::Debug)
            .connect_lazy_with(options))
    };

    let (broker, broker_proxy) = broker(&args.sink, &run_id).await?;
    let header = format!(
        "postbox verify: {} ({} through a fault proxy), {} relays, {}{}, seed {seed}, schema {schema}",
        args.sink,
        broker.target,
        args.relays,
        humantime::format_duration(args.duration),
        if args.ordered { ", ordered" } else { "" },
    );
    if args.json {
        eprintln!("{header}");
    } else {
        println!("{header}");
    }
    if !spec.is_empty() {
        eprintln!("  failpoints: {spec}");
    }

    // The relays.
    let config_path = logs.join("relay.toml");
    std::fs::write(&config_path, relay_config(&broker.relay_url, args.lease))?;
    let mut command = RelayCommand::new(&proxied_db, &schema)?
        .config(&config_path)
        .env(failpoint::ENV, spec)
        .env("NO_COLOR", "1");
    if args.ordered {
        command = command.args(["--ordered"]);
    }
    let relays = Supervisor::start(args.relays, command, &logs, seed ^ 0x5e1a);

    // The consumer.
    let seen = Arc::new(Seen::default());
    let stop_consumer = CancellationToken::new();
    let consumer = Consumer {
        pool: lazy("postbox-verify-consumer", 2)?,
        outbox: Outbox::new(schema.clone()),
        effect: schema.render(
            "INSERT INTO {schema}.verify_effects (event_id, applied) VALUES ($1, 1) \
             ON CONFLICT (event_id) DO UPDATE SET applied = verify_effects.applied + 1",
        ),
        ordered: args.ordered,
        faults: kinds.contains(&FaultKind::Consumer),
        seed: seed ^ 0xc0,
    };
    let consumer_task = {
        let (seen, stop) = (seen.clone(), stop_consumer.clone());
        let source = broker.source;
        tokio::spawn(async move { consumer.run(source, &seen, stop).await })
    };

    // The producers.
    let ledger = Arc::new(Ledger::default());
    let stop_producing = CancellationToken::new();
    // One producer per 60 events/s: each waits for its own commits.
    let producers_n = u64::from(args.rate / 60).clamp(4, 32);
    // 2.5 events per transaction on average.
    let period = Duration::from_secs_f64(producers_n as f64 * 2.5 / f64::from(args.rate));
    let producer_pool = lazy("postbox-verify-producer", producers_n as u32 + 1)?;
    let mut producers = Vec::new();
    for p in 0..producers_n {
        let producer = Producer {
            index: p,
            pool: producer_pool.clone(),
            outbox: Outbox::new(schema.clone()),
            record: schema.render(
                "INSERT INTO {schema}.verify_produced (event_id) SELECT unnest($1::uuid[])",
            ),
            period,
            aggregates: args.aggregates,
            rollback_percent: args.rollback_percent,
            seed: seed.wrapping_add(p * 7919),
        };
        let (ledger, stop) = (ledger.clone(), stop_producing.clone());
        producers.push(tokio::spawn(
            async move { producer.run(&ledger, stop).await },
        ));
    }

    // The faults.
    let counters = FaultCounters::default();
    let stop_faults = CancellationToken::new();
    let started = Instant::now();
    let progress = progress(&ledger, &seen, &relays, &counters, started, args.json);
    let faulting = async {
        let killing = async {
            if kinds.contains(&FaultKind::Kill) {
                faults::kill_relays(
                    &relays,
                    args.kill_every,
                    seed ^ 0x4b,
                    &counters,
                    stop_faults.clone(),
                )
                .await;
            }
        };
        let disturbing = faults::disturb(
            &kinds,
            &relays,
            &db_proxy,
            &broker_proxy,
            args.lease,
            args.fault_every,
            seed ^ 0xd1,
            &counters,
            stop_faults.clone(),
        );
        tokio::join!(killing, disturbing);
    };
    let interrupted = CancellationToken::new();
    tokio::spawn(crate::commands::cancel_on_signal(interrupted.clone()));
    let timer = async {
        tokio::select! {
            _ = tokio::time::sleep(args.duration) => {}
            _ = interrupted.cancelled() => {}
        }
        stop_producing.cancel();
        stop_faults.cancel();
    };
    tokio::select! {
        _ = async { tokio::join!(faulting, timer) } => {}
        _ = progress => {}
    }
    for p in producers {
        let _ = p.await;
    }
    db_proxy.restore();
    broker_proxy.restore();
    let ran_for = started.elapsed();
    if interrupted.is_cancelled() {
        relays.shutdown().await;
        return Err("interrupted".into());
    }

    // Drain: wait until nothing is pending or in flight and the consumer has
    // applied every committed event (or has gone quiet: some are lost).
    let drain_started = Instant::now();
    let committed_rows: i64 =
        sqlx::query_scalar(&schema.render("SELECT count(*) FROM {schema}.verify_produced"))
            .fetch_one(&direct)
            .await?;
    let store = Store::new(direct.clone(), schema.clone());
    let dead_letters = loop {
        let counts = store.status_counts().await?;
        let idle = counts.pending == 0 && counts.processing == 0;
        let applied = seen.applied.load(Ordering::Relaxed) as i64;
        if idle && applied >= committed_rows && seen.quiet_for() > Duration::from_millis(500) {
            break counts.failed;
        }
        if idle && seen.quiet_for() > Duration::from_secs(5) {
            break counts.failed;
        }
        if drain_started.elapsed() > args.drain_timeout {
            eprintln!(
                "  drain timed out after {}: {} pending, {} in flight",
                humantime::format_duration(args.drain_timeout),
                counts.pending,
                counts.processing
            );
            break counts.failed;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let drained_in = drain_started.elapsed();
    let relay_counters = relays.counters.clone();
    relays.shutdown().await;
    // Late copies (a relay that woke up and published again) are consumed too.
    let quiet_since = Instant::now();
    while seen.quiet_for() < Duration::from_secs(1)
        && quiet_since.elapsed() < Duration::from_secs(10)
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop_consumer.cancel();
    let _ = consumer_task.await;

    // Check.
    let mut report = check(&direct, &schema, &ledger, &seen).await?;
    report.sink = args.sink.clone();
    report.relays = args.relays;
    report.ordered = args.ordered;
    report.seed = seed;
    report.duration_seconds = ran_for.as_secs_f64();
    report.drain_seconds = drained_in.as_secs_f64();
    report.failpoints = spec.to_owned();
    report.relay_starts = relay_counters.starts.load(Ordering::Relaxed);
    report.relay_kills = relay_counters.killed.load(Ordering::Relaxed);
    report.relay_failpoint_exits = relay_counters.failpoint_exits.load(Ordering::Relaxed);
    report.relay_unexpected_exits = relay_counters.unexpected_exits.load(Ordering::Relaxed);
    report.faults = counters;
    report.dead_letters = dead_letters;
    report.schema = schema.name().to_owned();
    report.logs = logs.display().to_string();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }

    if report.passed && !args.keep {
        let _ = sqlx::query(&schema.render("DROP SCHEMA {schema} CASCADE"))
            .execute(&direct)
            .await;
        if let Err(e) = broker.cleanup.run().await {
            tracing::warn!(error = %crate::report(e.as_ref()), "could not delete {}", broker.cleanup.describe());
        }
        let _ = std::fs::remove_dir_all(&logs);
    } else if !report.passed {
        eprintln!(
            "kept for inspection: schema {schema}, {}, relay logs in {}",
            broker.cleanup.describe(),
            logs.display()
        );
    }
    Ok(if report.passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(VIOLATION)
    })
}

/// Relay settings for a run with short leases and retries, no dead letters.
fn relay_config(sink: &str, lease: Duration) -> String {
    let lease_ms = lease.as_millis().max(1000);
    format!(
        "[relay]\n\
         batch_size = 100\n\
         lease = \"{lease_ms}ms\"\n\
         publish_timeout = \"{}ms\"\n\
         poll_interval = \"500ms\"\n\
         rescue_interval = \"500ms\"\n\
         backoff_base = \"50ms\"\n\
         backoff_max = \"2s\"\n\
         max_attempts = 1000000\n\
         shutdown_timeout = \"5s\"\n\
         [health]\n\
         enabled = false\n\
         [sink]\n\
         url = {}\n",
        (lease_ms / 3).max(300),
        toml_string(sink)
    )
}

fn toml_string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

async fn prepare(pool: &PgPool, schema: &Schema) -> Result<(), AnyError> {
    let mut conn = pool.acquire().await?;
    postbox::sqlx::migrate(&mut conn, schema).await?;
    for statement in [
        "CREATE TABLE {schema}.verify_produced (event_id uuid PRIMARY KEY)",
        "CREATE TABLE {schema}.verify_effects (event_id uuid PRIMARY KEY, applied int NOT NULL)",
    ] {
        sqlx::query(&schema.render(statement))
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// A progress line every 10 s on stderr; never returns.
async fn progress(
    ledger: &Ledger,
    seen: &Seen,
    relays: &Supervisor,
    counters: &FaultCounters,
    started: Instant,
    quiet: bool,
) {
    let mut every = tokio::time::interval(Duration::from_secs(10));
    every.tick().await;
    loop {
        every.tick().await;
        if quiet {
            continue;
        }
        let c = &relays.counters;
        eprintln!(
            "  {:>4}s: {} tx committed, {} applied, {} deliveries, relays killed {} (+{} at failpoints), stalls {}",
            started.elapsed().as_secs(),
            ledger.tx_committed.load(Ordering::Relaxed),
            seen.applied.load(Ordering::Relaxed),
            seen.deliveries.load(Ordering::Relaxed),
            c.killed.load(Ordering::Relaxed),
            c.failpoint_exits.load(Ordering::Relaxed),
            counters.relay_stalls.load(Ordering::Relaxed),
        );
    }
}

async fn check(
    pool: &PgPool,
    schema: &Schema,
    ledger: &Ledger,
    seen: &Seen,
) -> Result<Report, AnyError> {
    let committed: HashSet<Uuid> = sqlx::query_scalar::<_, Uuid>(
        &schema.render("SELECT event_id FROM {schema}.verify_produced"),
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .collect();
    let effects: Vec<(Uuid, i32)> =
        sqlx::query_as(&schema.render("SELECT event_id, applied FROM {schema}.verify_effects"))
            .fetch_all(pool)
            .await?;
    let applied: HashSet<Uuid> = effects.iter().map(|(id, _)| *id).collect();

    let mut r = Report::default();
    let known_committed = lock(&ledger.committed);
    let rolled_back = lock(&ledger.rolled_back);
    let uncertain = lock(&ledger.uncertain);
    let by_event = lock(&seen.by_event);

    let mut lost: Vec<Uuid> = committed.difference(&applied).copied().collect();
    lost.sort_unstable();
    r.lost_count = lost.len();
    lost.truncate(SHOW);
    r.lost = lost;

    let mut not_committed: HashSet<Uuid> = rolled_back.iter().copied().collect();
    not_committed.extend(uncertain.iter().filter(|id| !committed.contains(id)));
    let mut bad: Vec<Uuid> = not_committed
        .iter()
        .filter(|id| by_event.contains_key(id) || applied.contains(id))
        .copied()
        .collect();
    bad.sort_unstable();
    bad.truncate(SHOW);
    r.rolled_back_delivered = bad;

    let mut not_once: Vec<(Uuid, i32)> = effects.iter().filter(|(_, n)| *n != 1).copied().collect();
    not_once.sort_unstable();
    not_once.truncate(SHOW);
    r.effects_not_once = not_once;

    let mut missing: Vec<Uuid> = known_committed.difference(&committed).copied().collect();
    missing.sort_unstable();
    missing.truncate(SHOW);
    r.commits_missing = missing;

    r.unknown_deliveries = by_event
        .keys()
        .filter(|id| !committed.contains(id) && !not_committed.contains(id))
        .count() as u64;

    let violations = lock(&seen.order_violations);
    r.order_violation_count = violations.len();
    r.order_violations = violations.iter().take(SHOW).cloned().collect();

    r.transactions_committed = ledger.tx_committed.load(Ordering::Relaxed);
    r.transactions_rolled_back = ledger.tx_rolled_back.load(Ordering::Relaxed);
    r.transactions_aborted_by_faults = ledger.tx_aborted.load(Ordering::Relaxed);
    r.commit_outcomes_lost = ledger.tx_uncertain.load(Ordering::Relaxed);
    r.events_committed = committed.len() as u64;
    r.events_not_committed = not_committed.len() as u64;
    r.deliveries = seen.deliveries.load(Ordering::Relaxed);
    r.duplicates = seen.duplicates.load(Ordering::Relaxed);
    r.redeliveries = seen.redeliveries.load(Ordering::Relaxed);
    r.effects_applied = effects.len() as u64;
    r.consumer_batches_retried = seen.retried_batches.load(Ordering::Relaxed);
    r.consumer_acks_dropped = seen.acks_dropped.load(Ordering::Relaxed);

    r.passed = r.lost_count == 0
        && r.rolled_back_delivered.is_empty()
        && r.effects_not_once.is_empty()
        && r.commits_missing.is_empty()
        && r.unknown_deliveries == 0
        && r.order_violation_count == 0
        && seen.malformed.load(Ordering::Relaxed) == 0;
    Ok(r)
}

fn count(n: &AtomicU64) -> u64 {
    n.load(Ordering::Relaxed)
}

fn render(r: &Report) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let f = &r.faults;
    let line = |o: &mut String, label: &str, value: String| {
        let _ = writeln!(o, "  {label:<42} {value}");
    };
    let _ = writeln!(
        o,
        "ran {:.0} s, drained in {:.1} s",
        r.duration_seconds, r.drain_seconds
    );
    line(
        &mut o,
        "transactions committed",
        r.transactions_committed.to_string(),
    );
    line(
        &mut o,
        "transactions rolled back",
        r.transactions_rolled_back.to_string(),
    );
    line(
        &mut o,
        "transactions failed by faults",
        format!(
            "{} before the commit, {} with the commit's outcome lost",
            r.transactions_aborted_by_faults, r.commit_outcomes_lost
        ),
    );
    line(&mut o, "events committed", r.events_committed.to_string());
    line(
        &mut o,
        "events not committed",
        r.events_not_committed.to_string(),
    );
    line(
        &mut o,
        "deliveries to the consumer",
        r.deliveries.to_string(),
    );
    line(
        &mut o,
        "duplicates absorbed by the inbox",
        r.duplicates.to_string(),
    );
    line(
        &mut o,
        "redeliveries by the broker",
        r.redeliveries.to_string(),
    );
    line(&mut o, "effects applied", r.effects_applied.to_string());
    line(
        &mut o,
        "relays started / killed / failpoint exits",
        format!(
            "{} / {} / {}",
            r.relay_starts, r.relay_kills, r.relay_failpoint_exits
        ),
    );
    if r.relay_unexpected_exits > 0 {
        line(
            &mut o,
            "relay exits not caused by verify",
            r.relay_unexpected_exits.to_string(),
        );
    }
    line(
        &mut o,
        "relays stalled past their lease",
        count(&f.relay_stalls).to_string(),
    );
    line(
        &mut o,
        "sink resets / outages / hangs / stalls",
        format!(
            "{} / {} / {} / {}",
            count(&f.sink_resets),
            count(&f.sink_outages),
            count(&f.sink_hangs),
            count(&f.sink_stalls)
        ),
    );
    line(
        &mut o,
        "database resets / outages / stalls",
        format!(
            "{} / {} / {}",
            count(&f.db_resets),
            count(&f.db_outages),
            count(&f.db_stalls)
        ),
    );
    line(
        &mut o,
        "consumer batches retried / acks dropped",
        format!(
            "{} / {}",
            r.consumer_batches_retried, r.consumer_acks_dropped
        ),
    );
    line(&mut o, "dead letters", r.dead_letters.to_string());
    let verdict = |ok: bool| if ok { "ok" } else { "FAILED" };
    let _ = writeln!(o, "checks");
    line(
        &mut o,
        "every committed event delivered",
        verdict(r.lost_count == 0).into(),
    );
    line(
        &mut o,
        "no rolled-back event delivered",
        verdict(r.rolled_back_delivered.is_empty() && r.unknown_deliveries == 0).into(),
    );
    line(
        &mut o,
        "every effect applied exactly once",
        verdict(r.effects_not_once.is_empty()).into(),
    );
    line(
        &mut o,
        "per-aggregate order held",
        if r.ordered {
            verdict(r.order_violation_count == 0).into()
        } else {
            "not checked (run with --ordered)".into()
        },
    );
    let ids = |v: &[Uuid], total: usize| {
        let mut s: Vec<String> = v.iter().map(Uuid::to_string).collect();
        if total > v.len() {
            s.push(format!("… ({} more)", total - v.len()));
        }
        s.join("\n    ")
    };
    if r.lost_count > 0 {
        let _ = writeln!(
            o,
            "LOST: {} committed events were never delivered:\n    {}",
            r.lost_count,
            ids(&r.lost, r.lost_count)
        );
    }
    if !r.rolled_back_delivered.is_empty() {
        let _ = writeln!(
            o,
            "DELIVERED AFTER ROLLBACK:\n    {}",
            ids(&r.rolled_back_delivered, r.rolled_back_delivered.len())
        );
    }
    if r.unknown_deliveries > 0 {
        let _ = writeln!(
            o,
            "UNKNOWN: {} delivered ids no producer made",
            r.unknown_deliveries
        );
    }
    if !r.effects_not_once.is_empty() {
        let list: Vec<String> = r
            .effects_not_once
            .iter()
            .map(|(id, n)| format!("{id} applied {n} times"))
            .collect();
        let _ = writeln!(o, "EFFECTS NOT ONCE:\n    {}", list.join("\n    "));
    }
    if !r.commits_missing.is_empty() {
        let _ = writeln!(
            o,
            "COMMITTED BUT MISSING from the database:\n    {}",
            ids(&r.commits_missing, r.commits_missing.len())
        );
    }
    if r.order_violation_count > 0 {
        let _ = writeln!(
            o,
            "ORDER: {} events applied out of sequence:\n    {}",
            r.order_violation_count,
            r.order_violations.join("\n    ")
        );
    }
    let _ = writeln!(
        o,
        "{}",
        if r.passed {
            "PASS: every committed event delivered at least once and applied exactly once; no rolled-back event delivered."
        } else {
            "FAIL"
        }
    );
    o
}

//! The delivery checker behind `postbox verify`: a self-contained check of the
//! delivery contract under faults.
//!
//! In a schema of its own it runs producers (committed and rolled-back
//! transactions over many aggregates, each event with a business row in the
//! same transaction: `workload.rs`), N `postbox relay` child processes (the
//! [`Supervisor`]), and a consumer that applies every delivery through the
//! inbox (`consumer.rs`). The relays reach PostgreSQL and the broker
//! (`broker.rs`) through [`FaultProxy`]s, and on a seeded schedule
//! (`faults.rs`) relays are SIGKILLed and restarted, stalled past their lease,
//! and the broker and the database are reset, refused, hung or stalled;
//! PostgreSQL itself is crashed (immediate stop) and restarted when verify
//! runs its own throwaway cluster; failpoints (cargo feature `failpoints`) add crashes inside the relay. After
//! the run it drains and checks (`report.rs`): every committed event
//! delivered, no rolled-back event delivered, every effect applied exactly
//! once, and (with `--ordered`) each aggregate's events applied in sequence.
//! Its own tables are `tables.rs` (`sql/checker.sql`). A pull run
//! (`--sink group:sql|group:http`, `pull.rs`) has no relay and no broker:
//! readers of a consumer group on the log apply and acknowledge, and the
//! `kill` fault kills readers (and, over HTTP, the `postbox group serve`
//! children they call).

mod broker;
mod consumer;
mod faults;
mod pull;
mod replay;
mod report;
mod tables;
mod workload;

pub use faults::FaultKind;

use crate::pgcluster::{ClusterError, TempCluster};
use crate::supervisor::{RelayCommand, Supervisor};
use crate::{error_chain, AnyError, Verdict};
use broker::{host_port, through, Broker};
use consumer::{Consumer, Seen};
use faults::FaultCounters;
use postbox::{Outbox, Schema};
use postbox_proxy::FaultProxy;
use postbox_relay::{failpoint, ReadMode};
use postbox_store::connect as db;
use postbox_store::{ProducerTarget, Store};
use pull::{Pull, Readers};
use rand::Rng;
use report::ContractReport;
use sqlx::PgPool;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tables::Tables;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use workload::{Ledger, Producer};

/// What a checker run does (the flags of `postbox verify`).
#[derive(Clone, Debug)]
pub struct Options {
    /// How long producers and faults run; then the run drains and is checked.
    pub duration: Duration,
    /// Relay processes.
    pub relays: usize,
    /// The broker: `redis://HOST:PORT[/DB]` (a stream), `nats://HOST:PORT`
    /// (JetStream) or `amqp://USER:PASS@HOST:PORT[/VHOST]` (a RabbitMQ queue).
    pub sink: String,
    /// How the relays read committed events (claim or log).
    pub mode: ReadMode,
    /// The relays' `relay.synchronous_commit`.
    pub relay_synchronous_commit: bool,
    /// Relays deliver each aggregate's events in sequence, and the consumer checks it.
    pub ordered: bool,
    /// Seed of the workload and the fault schedule (random when `None`).
    pub seed: Option<u64>,
    /// Events per second, all producers together (about).
    pub rate: u32,
    /// Aggregates the events are spread over.
    pub aggregates: u32,
    /// Percent of producer transactions rolled back.
    pub rollback_percent: u32,
    /// Faults to inject.
    pub faults: Vec<FaultKind>,
    /// Mean time between two relay kills.
    pub kill_every: Duration,
    /// Mean time between two other faults (stall, sink, db).
    pub fault_every: Duration,
    /// Mean time between two PostgreSQL crashes (fault `crash`).
    pub crash_every: Duration,
    /// Let the `crash` fault stop the server `DATABASE_URL` names: the
    /// PostgreSQL data directory (`pg_ctl -D`) it runs from. Without it
    /// verify crashes only the throwaway cluster it starts itself.
    pub crash_external: Option<std::path::PathBuf>,
    /// The relays' lease (a stalled relay is stopped for longer than this).
    pub lease: Duration,
    /// Failpoints armed in the relays and the producers, `NAME=[P%]ACTION,…`.
    pub failpoints: Option<String>,
    /// A bug to plant in the relays, to see the check catch it.
    pub plant: Option<PlantedBug>,
    /// Run a replay beside the live traffic (`postbox replay`, killed and
    /// resumed) and check that it delivered its range.
    pub replay: bool,
    /// Longest wait after the run for every committed event to arrive.
    pub drain_timeout: Duration,
    /// Keep the schema, the broker's stream and the relay logs even when the checks pass.
    pub keep: bool,
    /// Print the report as JSON (and the header and progress on stderr).
    pub json: bool,
}

/// Bugs a run can plant in its relays (needs the `failpoints` feature).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlantedBug {
    /// The relay acknowledges some batches without publishing them.
    AckBeforePublish,
    /// The consumer commits its inbox transaction with `synchronous_commit =
    /// off` and then acknowledges the broker: a PostgreSQL crash can forget
    /// an effect whose message the broker has already let go. Invisible
    /// without a crash (the `crash` fault).
    ConsumerAsyncCommit,
    /// The consumer acknowledges a batch first, then applies it (after
    /// 50 ms of work): a reader killed in between loses the batch. Visible
    /// in a pull run, whose readers the `kill` fault kills.
    ReaderAcksFirst,
    /// The replay runner moves its job past some pages without sending
    /// them (with `--replay`).
    ReplaySkipsPages,
}

/// Resolves when the user asks the run to stop (SIGINT, SIGTERM). It is
/// first polled once the run has started, not before.
pub type Interrupt = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Run the delivery checker on `database_url`, or on a throwaway cluster
/// without one, and print its report: [`Verdict::Fail`] when a check
/// failed, an error when the run could not be set up or finished.
pub async fn run(
    database_url: Option<&str>,
    options: &Options,
    interrupt: Interrupt,
) -> Result<Verdict, AnyError> {
    if options.relays == 0 {
        return Err("--relays must be at least 1".into());
    }
    if options.rate == 0 || options.aggregates == 0 {
        return Err("--rate and --aggregates must be at least 1".into());
    }
    if let Some(pull) = Pull::from_sink(&options.sink) {
        pull?;
        if options.mode != ReadMode::Log {
            return Err("--sink group:…: a consumer group reads the log; use --mode log".into());
        }
    }
    if options.replay && options.mode == ReadMode::Logical {
        return Err(
            "--replay: logical mode's emitted events leave no row to replay; \
                    run it in claim or log mode"
                .into(),
        );
    }
    if options.plant == Some(PlantedBug::ReplaySkipsPages) && !options.replay {
        return Err("--plant replay-skips-pages plants its bug in the replay: add --replay".into());
    }
    let crashes = options.faults.contains(&FaultKind::Crash);
    if crashes && database_url.is_some() && options.crash_external.is_none() {
        return Err(
            "--faults crash: verify crashes only a PostgreSQL it owns. Unset DATABASE_URL \
             to run on a throwaway cluster, or pass --crash-external-database PGDATA to \
             crash the server DATABASE_URL names (its data directory; verify stops it \
             with `pg_ctl restart -m immediate`)"
                .into(),
        );
    }
    let spec = arm_failpoints(options)?;
    let (cluster, url) = match database_url {
        Some(url) => (None, url.to_owned()),
        None => {
            crate::errln!("No DATABASE_URL: starting a throwaway PostgreSQL cluster…");
            let cluster = if crashes {
                TempCluster::start_crashable().await?
            } else {
                TempCluster::start().await?
            };
            let url = cluster.url().to_owned();
            (Some(tokio::sync::Mutex::new(cluster)), url)
        }
    };
    let crash = match (&cluster, &options.crash_external) {
        _ if !crashes => None,
        (Some(c), _) => Some(CrashTarget::Owned(c)),
        (None, Some(data_dir)) => Some(CrashTarget::External(data_dir)),
        (None, None) => None,
    };
    let throwaway = cluster.is_some();
    let result = run_on(&url, &spec, options, crash, throwaway, interrupt).await;
    if let Some(c) = cluster {
        if let Err(e) = c.into_inner().stop().await {
            tracing::warn!(error = %error_chain(&e), "stopping the throwaway cluster failed");
        }
    }
    result
}

/// The run's failpoints (`--failpoints`, plus the planted bug), armed in
/// this process too (the producers pass `producer_commit`).
fn arm_failpoints(options: &Options) -> Result<String, AnyError> {
    let mut spec = options.failpoints.clone().unwrap_or_default();
    if options.plant == Some(PlantedBug::AckBeforePublish) {
        if !spec.is_empty() {
            spec.push(',');
        }
        spec.push_str("ack_before_publish=10%fail");
    }
    if options.plant == Some(PlantedBug::ReplaySkipsPages) {
        if !spec.is_empty() {
            spec.push(',');
        }
        // One page in two: a replay of 15 pages (a ten-second run's) then
        // misses none with odds of 1 in 30,000; at one in five it was 1 in
        // 30, and CI once saw the bug go uncaught.
        spec.push_str("replay_skip_page=50%fail");
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
    Ok(spec)
}

/// What the `crash` fault crashes.
#[derive(Clone, Copy)]
enum CrashTarget<'a> {
    /// The throwaway cluster verify started.
    Owned(&'a tokio::sync::Mutex<TempCluster>),
    /// The server `DATABASE_URL` names, by its data directory (asked for
    /// with `--crash-external-database`).
    External(&'a Path),
}

impl CrashTarget<'_> {
    async fn crash(&self) -> Result<crate::pgcluster::Crash, ClusterError> {
        match self {
            CrashTarget::Owned(cluster) => cluster.lock().await.crash_and_restart().await,
            CrashTarget::External(data_dir) => {
                crate::pgcluster::crash_and_restart_external(data_dir).await
            }
        }
    }
}

async fn run_on(
    url: &str,
    spec: &str,
    options: &Options,
    crash: Option<CrashTarget<'_>>,
    throwaway: bool,
    interrupt: Interrupt,
) -> Result<Verdict, AnyError> {
    let seed = options.seed.unwrap_or_else(|| rand::rng().random());
    let run_id = format!("{:08x}", rand::rng().random::<u32>());
    let schema = Schema::new(&format!("postbox_verify_{run_id}"))?;
    let logs = std::env::temp_dir().join(format!("postbox-verify-{run_id}"));
    std::fs::create_dir_all(&logs)?;

    let db = RunDatabase::prepare(url, &schema, options.mode, options.ordered).await?;
    let result = run_in(
        &db, spec, options, crash, throwaway, interrupt, seed, &run_id, logs,
    )
    .await;
    // A replication slot left behind retains WAL on the server: drop it
    // whatever the outcome (a finished run dropped it before its clean-up).
    if result.is_err() {
        drop_slot_loudly(&db).await;
    }
    result
}

/// Drop the run's slot, or say how to.
async fn drop_slot_loudly(db: &RunDatabase) {
    if let Err(e) = db.drop_slot().await {
        crate::errln!(
            "could not drop the run's replication slot {} ({}); drop it with `postbox slot drop {}`",
            db.slot,
            error_chain(e.as_ref()),
            db.slot
        );
    }
}

#[allow(clippy::too_many_arguments)]
async fn run_in(
    db: &RunDatabase,
    spec: &str,
    options: &Options,
    crash: Option<CrashTarget<'_>>,
    throwaway: bool,
    interrupt: Interrupt,
    seed: u64,
    run_id: &str,
    logs: std::path::PathBuf,
) -> Result<Verdict, AnyError> {
    let schema = &db.schema;
    let Delivering {
        relays,
        brokers,
        consumer,
        cleanup,
    } = Delivering::start(options, db, spec, &logs, seed, run_id).await?;
    let replay_list = (
        replay_redis(&options.sink),
        format!("postbox-verify:{run_id}:replay"),
    );
    let stop_replay = CancellationToken::new();
    let replaying = if options.replay {
        Some(replay::ReplayBeside::start(
            replay::ReplaySetup {
                proxied_url: db.proxied_url.clone(),
                schema: db.schema.clone(),
                direct: db.direct.clone(),
                tables: db.tables.clone(),
                mode: options.mode,
                redis_url: replay_list.0.clone(),
                key: replay_list.1.clone(),
                logs: logs.clone(),
                failpoints: spec.to_owned(),
                seed,
                from: db.tables.now(&db.direct).await?,
                // Soon enough that log mode's ring still holds the range's
                // first events.
                after: (options.duration / 3).min(Duration::from_secs(5)),
            },
            stop_replay.clone(),
        ))
    } else {
        None
    };
    let mut producers = Producers::start(options, db, seed)?;

    let counters = FaultCounters::default();
    let started = Instant::now();
    let ended = inject_faults(
        options,
        seed,
        &Disturbed {
            relays: &relays,
            readers: consumer.readers(),
            db: &db.proxy,
            brokers: &brokers,
            crash,
        },
        &counters,
        &producers,
        consumer.seen(),
        interrupt,
    )
    .await;
    producers.join().await;
    db.proxy.restore();
    for broker in &brokers {
        broker.restore();
    }
    let ran_for = started.elapsed();
    if !matches!(ended, FaultsEnded::Done) {
        stop_replay.cancel();
    }
    let replaying = replaying.map(replay::ReplayBeside::calm);
    match ended {
        FaultsEnded::Done => {}
        FaultsEnded::Interrupted => {
            relays.shutdown().await;
            return Err("interrupted".into());
        }
        FaultsEnded::DatabaseLost => {
            relays.shutdown().await;
            return Err("PostgreSQL did not start again after a crash (see above); \
                        the run cannot be checked"
                .into());
        }
    }

    let pull = Pull::from_sink(&options.sink).is_some();
    let drained = drain(db, consumer.seen(), pull, options.drain_timeout).await?;
    let replayed = match replaying {
        Some(r) => Some(
            r.finish(
                (&replay_list.0, &replay_list.1),
                &db.direct,
                &db.tables,
                options.drain_timeout,
            )
            .await?,
        ),
        None => None,
    };
    let relay_counters = relays.counters.clone();
    relays.shutdown().await;
    let seen = consumer.stop_when_quiet().await;

    let mut report =
        ContractReport::check(&db.tables, &db.direct, &producers.ledger, &seen).await?;
    report.sink = options.sink.clone();
    report.pull = pull;
    report.mode = match options.mode {
        ReadMode::Claim => "claim",
        ReadMode::Log => "log",
        ReadMode::Logical => "logical",
    }
    .to_owned();
    report.relay_synchronous_commit = options.relay_synchronous_commit;
    report.planted = options.plant.map(|p| format!("{p:?}"));
    if let Some(r) = replayed {
        report.passed &= r.passed;
        report.replay = Some(r);
    }
    report.relays = options.relays;
    report.ordered = options.ordered;
    report.seed = seed;
    report.duration_seconds = ran_for.as_secs_f64();
    report.drain_seconds = drained.took.as_secs_f64();
    report.failpoints = spec.to_owned();
    report.relay_starts = relay_counters.starts.load(Ordering::Relaxed);
    report.relay_kills = relay_counters.killed.load(Ordering::Relaxed);
    report.relay_failpoint_exits = relay_counters.failpoint_exits.load(Ordering::Relaxed);
    report.relay_unexpected_exits = relay_counters.unexpected_exits.load(Ordering::Relaxed);
    report.faults = counters;
    report.dead_letters = drained.dead_letters;
    report.schema = schema.name().to_owned();
    report.logs = logs.display().to_string();
    if options.json {
        crate::outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        crate::out!("{}", report.text());
    }
    // Before the clean-up, which may drop the schema (and the slot's
    // functions with it); the relays are gone.
    drop_slot_loudly(db).await;
    clean_up(
        &report,
        options.keep,
        throwaway,
        db,
        cleanup.as_ref(),
        &logs,
    )
    .await;
    Ok(if report.passed {
        Verdict::Pass
    } else {
        Verdict::Fail
    })
}

/// The run's database: direct for its own bookkeeping, through a fault
/// proxy for everyone else.
struct RunDatabase {
    direct: PgPool,
    proxy: FaultProxy,
    proxied_url: String,
    schema: Schema,
    tables: Arc<Tables>,
    mode: ReadMode,
    /// Logical mode's replication slot (named after the schema; created
    /// before the producers start, dropped at the end).
    slot: String,
}

impl RunDatabase {
    /// Connect, and create the run's schema: postbox's tables and the run's
    /// own; in log mode, producers write into the log (`migrate --mode log`);
    /// in logical mode, the replication slot exists before anyone emits,
    /// and with `ordered` emits are numbered (`migrate --emit-sequence on`,
    /// which ordered routes in logical mode need).
    async fn prepare(
        url: &str,
        schema: &Schema,
        mode: ReadMode,
        ordered: bool,
    ) -> Result<Self, AnyError> {
        let db_url = url::Url::parse(url).map_err(|e| format!("DATABASE_URL: {e}"))?;
        let proxy = FaultProxy::start(&host_port(&db_url, 5432)?).await?;
        let proxied_url = through(&db_url, proxy.port())?.to_string();
        let direct = db::pool(
            db::options(Some(url), "postbox-verify")?,
            4,
            db::CONNECT_PATIENCE,
        )
        .await?;
        let tables = Arc::new(Tables::new(schema));
        let mut conn = direct.acquire().await?;
        postbox::sqlx::migrate(&mut conn, schema).await?;
        tables.create(&mut conn).await?;
        drop(conn);
        if mode == ReadMode::Log {
            Store::new(direct.clone(), schema.clone())
                .log()
                .set_producer_target(ProducerTarget::Log)
                .await?;
        }
        let slot = schema.name().to_owned();
        if mode == ReadMode::Logical {
            let logical = Store::new(direct.clone(), schema.clone()).logical();
            if ordered {
                logical.set_numbered_emits(true).await?;
            }
            let mut conn = direct.acquire().await?;
            logical.ensure_slot(&mut conn, &slot).await?;
        }
        Ok(Self {
            direct,
            proxy,
            proxied_url,
            schema: schema.clone(),
            tables,
            mode,
            slot,
        })
    }

    /// Drop logical mode's slot (waiting up to 30 s for a relay still
    /// holding it to go, or for a crashed server to be back).
    async fn drop_slot(&self) -> Result<(), AnyError> {
        if self.mode != ReadMode::Logical {
            return Ok(());
        }
        let logical = Store::new(self.direct.clone(), self.schema.clone()).logical();
        crate::slots::drop_slot_when_free(&logical, &self.slot, crate::slots::SLOT_PATIENCE)
            .await?;
        Ok(())
    }

    /// Logical mode: whether the slot is confirmed past `lsn` (every emit
    /// committed before `lsn` was taken by the relays).
    async fn slot_past(&self, lsn: postbox_store::Lsn) -> Result<bool, AnyError> {
        let logical = Store::new(self.direct.clone(), self.schema.clone()).logical();
        let mut conn = self.direct.acquire().await?;
        Ok(logical
            .confirmed(&mut conn, &self.slot)
            .await?
            .is_some_and(|c| c >= lsn))
    }

    /// A pool through the fault proxy, connecting on first use.
    fn proxied_pool(&self, application: &str, size: u32) -> Result<PgPool, AnyError> {
        let options = db::options(Some(&self.proxied_url), application)?;
        Ok(db::pool_options(&options)
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(5))
            // Slow acquisitions are what the faults are for.
            .acquire_slow_level(tracing::log::LevelFilter::Debug)
            .connect_lazy_with(options))
    }
}

/// What delivers and what reads in a run: relays into a broker that the
/// consumer reads, or (a pull run) a consumer group's readers.
struct Delivering {
    /// The relays, or a pull run's `postbox group serve` children (none
    /// over SQL).
    relays: Supervisor,
    /// The fault proxies in front of the broker (or the group servers).
    brokers: Vec<FaultProxy>,
    consumer: Consumers,
    /// What the run leaves on the broker (nothing in a pull run).
    cleanup: Option<broker::Cleanup>,
}

impl Delivering {
    async fn start(
        options: &Options,
        db: &RunDatabase,
        spec: &str,
        logs: &Path,
        seed: u64,
        run_id: &str,
    ) -> Result<Self, AnyError> {
        let Some(pull) = Pull::from_sink(&options.sink).transpose()? else {
            let (broker, source, proxy) = broker::set_up(&options.sink, run_id).await?;
            announce(options, &broker.target, "relays", seed, &db.schema, spec);
            let relays = start_relays(options, db, &broker, spec, logs, seed)?;
            let consumer = Consumers::One(ConsumerTask::start(options, db, source, seed)?);
            return Ok(Self {
                relays,
                brokers: vec![proxy],
                consumer,
                cleanup: Some(broker.cleanup),
            });
        };
        let groups = postbox_store::Groups::new(db.direct.clone(), &db.schema);
        pull::create_group(&groups, options.ordered).await?;
        let reader_pool = db.proxied_pool("postbox-verify-reader", options.relays as u32 + 1)?;
        let visibility = options.lease.max(Duration::from_secs(1));
        let (relays, brokers, http) = match pull {
            Pull::Sql => {
                announce(options, "the database", "readers", seed, &db.schema, spec);
                (
                    Supervisor::start_each(Vec::new(), logs, seed),
                    Vec::new(),
                    None,
                )
            }
            Pull::Http => {
                let side =
                    pull::HttpSide::prepare(options.relays, &db.proxied_url, &db.schema, &groups)
                        .await?;
                announce(
                    options,
                    "postbox group serve",
                    "group servers and readers",
                    seed,
                    &db.schema,
                    spec,
                );
                let servers = Supervisor::start_each(side.commands.clone(), logs, seed ^ 0x5e1a);
                let bases: Vec<String> = side
                    .proxies
                    .iter()
                    .map(|p| format!("http://127.0.0.1:{}/groups/{}", p.port(), pull::GROUP))
                    .collect();
                (
                    servers,
                    side.proxies,
                    Some((bases, side.token, side.client)),
                )
            }
        };
        let template = consumer_of(options, db, reader_pool.clone(), seed)?;
        let schema = db.schema.clone();
        let factory: pull::ReaderFactory = Arc::new(move |i| {
            let consumer = Consumer {
                seed: template.seed.wrapping_add(i as u64 * 7919),
                ..template.clone()
            };
            let reader = match &http {
                None => pull::GroupReader::Sql {
                    groups: postbox_store::Groups::new(reader_pool.clone(), &schema),
                    group: pull::GROUP.to_owned(),
                },
                Some((bases, token, client)) => pull::GroupReader::Http {
                    client: client.clone(),
                    base: bases[i % bases.len()].clone(),
                    token: token.clone(),
                },
            };
            let reader = pull::PullReader { reader, visibility };
            pull::ReaderParts {
                consumer,
                source: consumer::Source::Group(Box::new(reader)),
            }
        });
        let readers = Readers::start(
            options.relays.max(1),
            Arc::new(Seen::default()),
            CancellationToken::new(),
            factory,
        );
        Ok(Self {
            relays,
            brokers,
            consumer: Consumers::Readers(readers),
            cleanup: None,
        })
    }
}

/// The Redis server the replay's list is on: the run's sink's when it is
/// Redis, else the default one.
fn replay_redis(sink: &str) -> String {
    match url::Url::parse(sink) {
        Ok(mut u) if u.scheme() == "redis" => {
            u.set_query(None);
            u.to_string()
        }
        _ => "redis://127.0.0.1:6379".to_owned(),
    }
}

/// The run's first line: on stdout, or on stderr when the report is JSON.
fn announce(
    options: &Options,
    target: &str,
    workers: &str,
    seed: u64,
    schema: &Schema,
    spec: &str,
) {
    let header = format!(
        "postbox verify: {} ({target} through a fault proxy), {} {workers}, {}{}, seed {seed}, schema {schema}",
        options.sink,
        options.relays,
        humantime::format_duration(options.duration),
        if options.ordered { ", ordered" } else { "" },
    );
    if options.json {
        crate::errln!("{header}");
    } else {
        crate::outln!("{header}");
    }
    if !spec.is_empty() {
        crate::errln!("  failpoints: {spec}");
    }
}

/// The relays, supervised: through both proxies, with the run's failpoints,
/// each logging to `relay-N.log` in `logs`.
fn start_relays(
    options: &Options,
    db: &RunDatabase,
    broker: &Broker,
    spec: &str,
    logs: &Path,
    seed: u64,
) -> Result<Supervisor, AnyError> {
    let config_path = logs.join("relay.toml");
    std::fs::write(
        &config_path,
        relay_config_file(&broker.relay_url, &db.slot, options),
    )?;
    let mut command = RelayCommand::new(&db.proxied_url, &db.schema)?
        .config(&config_path)
        .env(failpoint::ENV, spec)
        .env("NO_COLOR", "1");
    if options.ordered {
        command = command.args(["--ordered"]);
    }
    Ok(Supervisor::start(
        options.relays,
        command,
        logs,
        seed ^ 0x5e1a,
    ))
}

/// Relay settings for a run with short leases and retries, no dead letters,
/// in the run's reading mode and commit setting. In log mode the cursor is
/// split into two partitions per relay, so the relays share the log (and
/// hand partitions over as they are killed and restarted).
fn relay_config_file(sink: &str, slot: &str, options: &Options) -> String {
    let lease_ms = options.lease.as_millis().max(1000);
    format!(
        "[relay]\n\
         mode = \"{}\"\n\
         log_partitions = {}\n\
         synchronous_commit = {}\n\
         log_segment_age = \"5s\"\n\
         batch_size = 100\n\
         lease = \"{lease_ms}ms\"\n\
         publish_timeout = \"{}ms\"\n\
         poll_interval = \"500ms\"\n\
         rescue_interval = \"500ms\"\n\
         backoff_base = \"50ms\"\n\
         backoff_max = \"2s\"\n\
         max_attempts = 1000000\n\
         shutdown_timeout = \"5s\"\n\
         logical_slot = {}\n\
         [health]\n\
         enabled = false\n\
         [sink]\n\
         url = {}\n",
        match options.mode {
            ReadMode::Claim => "claim",
            ReadMode::Log => "log",
            ReadMode::Logical => "logical",
        },
        (options.relays * 2).clamp(1, 1024),
        options.relay_synchronous_commit,
        (lease_ms / 3).max(300),
        toml_string(slot),
        toml_string(sink)
    )
}

fn toml_string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The consumer, running until [`ConsumerTask::stop_when_quiet`].
struct ConsumerTask {
    seen: Arc<Seen>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl ConsumerTask {
    fn start(
        options: &Options,
        db: &RunDatabase,
        source: consumer::Source,
        seed: u64,
    ) -> Result<Self, AnyError> {
        let consumer = consumer_of(
            options,
            db,
            db.proxied_pool("postbox-verify-consumer", 2)?,
            seed,
        )?;
        let seen = Arc::new(Seen::default());
        let stop = CancellationToken::new();
        let task = {
            let (seen, stop) = (seen.clone(), stop.clone());
            tokio::spawn(async move { consumer.run(source, &seen, stop).await })
        };
        Ok(Self { seen, stop, task })
    }

    /// Consume late copies (a relay that woke up and published again) until
    /// the broker has been quiet for a second (10 s at most), then stop.
    async fn stop_when_quiet(self) -> Arc<Seen> {
        wait_until_quiet(&self.seen).await;
        self.stop.cancel();
        let _ = self.task.await;
        self.seen
    }
}

/// The consumer of a run: its inbox transactions through `pool`.
fn consumer_of(
    options: &Options,
    db: &RunDatabase,
    pool: PgPool,
    seed: u64,
) -> Result<Consumer, AnyError> {
    Ok(Consumer {
        pool,
        outbox: Outbox::new(db.schema.clone()),
        tables: db.tables.clone(),
        ordered: options.ordered,
        faults: options.faults.contains(&FaultKind::Consumer),
        async_commit: options.plant == Some(PlantedBug::ConsumerAsyncCommit),
        ack_first: options.plant == Some(PlantedBug::ReaderAcksFirst),
        seed: seed ^ 0xc0,
    })
}

/// The broker's one consumer, or a pull run's readers.
enum Consumers {
    One(ConsumerTask),
    Readers(Readers),
}

impl Consumers {
    fn seen(&self) -> &Seen {
        match self {
            Consumers::One(c) => &c.seen,
            Consumers::Readers(r) => r.seen(),
        }
    }

    fn readers(&self) -> Option<&Readers> {
        match self {
            Consumers::One(_) => None,
            Consumers::Readers(r) => Some(r),
        }
    }

    /// Read late copies until quiet (see [`ConsumerTask::stop_when_quiet`]), then stop.
    async fn stop_when_quiet(self) -> Arc<Seen> {
        match self {
            Consumers::One(c) => c.stop_when_quiet().await,
            Consumers::Readers(r) => {
                let seen = r.seen_arc();
                wait_until_quiet(&seen).await;
                r.join().await;
                seen
            }
        }
    }
}

/// Until the consumer has been quiet for a second (10 s at most).
async fn wait_until_quiet(seen: &Seen) {
    let quiet_since = Instant::now();
    while seen.quiet_for() < Duration::from_secs(1)
        && quiet_since.elapsed() < Duration::from_secs(10)
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The producers, running until the run's duration is over.
struct Producers {
    ledger: Arc<Ledger>,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl Producers {
    fn start(options: &Options, db: &RunDatabase, seed: u64) -> Result<Self, AnyError> {
        let ledger = Arc::new(Ledger::default());
        let stop = CancellationToken::new();
        // One producer per 60 events/s: each waits for its own commits.
        let n = u64::from(options.rate / 60).clamp(4, 32);
        // 2.5 events per transaction on average.
        let period = Duration::from_secs_f64(n as f64 * 2.5 / f64::from(options.rate));
        let pool = db.proxied_pool("postbox-verify-producer", n as u32 + 1)?;
        let tasks = (0..n)
            .map(|p| {
                let producer = Producer {
                    index: p,
                    pool: pool.clone(),
                    outbox: Outbox::new(db.schema.clone()),
                    tables: db.tables.clone(),
                    period,
                    aggregates: options.aggregates,
                    rollback_percent: options.rollback_percent,
                    emit: options.mode == ReadMode::Logical,
                    seed: seed.wrapping_add(p * 7919),
                };
                let (ledger, stop) = (ledger.clone(), stop.clone());
                tokio::spawn(async move { producer.run(&ledger, stop).await })
            })
            .collect();
        Ok(Self {
            ledger,
            stop,
            tasks,
        })
    }

    /// Wait for the producers (stopped by [`inject_faults`]) to end.
    async fn join(&mut self) {
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
    }
}

/// What the fault schedule disturbs.
struct Disturbed<'a> {
    relays: &'a Supervisor,
    /// A pull run's readers, which the `kill` fault kills too.
    readers: Option<&'a Readers>,
    db: &'a FaultProxy,
    brokers: &'a [FaultProxy],
    /// What the `crash` fault crashes, when it runs.
    crash: Option<CrashTarget<'a>>,
}

/// How the fault schedule ended.
enum FaultsEnded {
    /// The run's duration is over.
    Done,
    /// The user interrupted the run.
    Interrupted,
    /// PostgreSQL did not start again after a crash.
    DatabaseLost,
}

/// Run the fault schedule for the run's duration (printing progress), then
/// stop the producers and the faults.
async fn inject_faults(
    options: &Options,
    seed: u64,
    disturbed: &Disturbed<'_>,
    counters: &FaultCounters,
    producers: &Producers,
    seen: &Seen,
    interrupt: Interrupt,
) -> FaultsEnded {
    let stop_faults = CancellationToken::new();
    let database_lost = CancellationToken::new();
    let started = Instant::now();
    let progress = progress(
        &producers.ledger,
        seen,
        disturbed.relays,
        counters,
        started,
        options.json,
    );
    let faulting = async {
        let killing = async {
            if options.faults.contains(&FaultKind::Kill) {
                let relays = faults::kill_relays(
                    disturbed.relays,
                    options.kill_every,
                    seed ^ 0x4b,
                    counters,
                    stop_faults.clone(),
                );
                let readers = async {
                    if let Some(readers) = disturbed.readers {
                        faults::kill_readers(
                            readers,
                            options.kill_every,
                            seed ^ 0x4e,
                            counters,
                            stop_faults.clone(),
                        )
                        .await;
                    }
                };
                tokio::join!(relays, readers);
            }
        };
        let disturbing = faults::disturb(
            &options.faults,
            disturbed.relays,
            disturbed.db,
            disturbed.brokers,
            options.lease,
            options.fault_every,
            seed ^ 0xd1,
            counters,
            stop_faults.clone(),
        );
        let crashing = async {
            if let Some(target) = disturbed.crash {
                let ok = faults::crash_database(
                    || target.crash(),
                    options.crash_every,
                    seed ^ 0xc7a5,
                    counters,
                    stop_faults.clone(),
                )
                .await;
                if !ok {
                    database_lost.cancel();
                }
            }
        };
        tokio::join!(killing, disturbing, crashing);
    };
    let interrupted = CancellationToken::new();
    tokio::spawn({
        let interrupted = interrupted.clone();
        async move {
            interrupt.await;
            interrupted.cancel();
        }
    });
    let timer = async {
        tokio::select! {
            _ = tokio::time::sleep(options.duration) => {}
            _ = interrupted.cancelled() => {}
            _ = database_lost.cancelled() => {}
        }
        producers.stop.cancel();
        stop_faults.cancel();
    };
    tokio::select! {
        _ = async { tokio::join!(faulting, timer) } => {}
        _ = progress => {}
    }
    if interrupted.is_cancelled() {
        FaultsEnded::Interrupted
    } else if database_lost.is_cancelled() {
        FaultsEnded::DatabaseLost
    } else {
        FaultsEnded::Done
    }
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
        crate::errln!(
            "  {:>4}s: {} tx committed, {} applied, {} deliveries, relays killed {} (+{} at failpoints), readers killed {}, stalls {}, database crashes {}",
            started.elapsed().as_secs(),
            ledger.tx_committed.load(Ordering::Relaxed),
            seen.applied.load(Ordering::Relaxed),
            seen.deliveries.load(Ordering::Relaxed),
            c.killed.load(Ordering::Relaxed),
            c.failpoint_exits.load(Ordering::Relaxed),
            counters.reader_kills.load(Ordering::Relaxed),
            counters.relay_stalls.load(Ordering::Relaxed),
            counters.db_crashes.load(Ordering::Relaxed),
        );
    }
}

/// How the drain ended.
struct Drained {
    dead_letters: i64,
    took: Duration,
}

/// How long the consumer must go without progress, once nothing is left to
/// deliver, before the events it has not applied count as lost.
const LOST_AFTER_QUIET: Duration = Duration::from_secs(15);

/// Wait until nothing is pending or in flight and the consumer has applied
/// every committed event (or has gone quiet: some are lost), at most `timeout`.
async fn drain(
    db: &RunDatabase,
    seen: &Seen,
    pull: bool,
    timeout: Duration,
) -> Result<Drained, AnyError> {
    let started = Instant::now();
    let committed_rows = db.tables.produced_count(&db.direct).await?;
    let store = Store::new(db.direct.clone(), db.schema.clone());
    let log = store.log();
    // In logical mode, every emit committed by now is before this position.
    let wal_end = if db.mode == ReadMode::Logical {
        let mut conn = db.direct.acquire().await?;
        Some(store.logical().flush_lsn(&mut conn).await?)
    } else {
        None
    };
    let dead_letters = loop {
        let counts = store.status_counts().await?;
        // In log mode, also every event of the log read by its cursor (in
        // a pull run, acknowledged by the group); in logical mode, the slot
        // confirmed past every committed emit.
        let (mut unread, group_dead) = if pull {
            group_unread(&store).await?
        } else {
            (log.unread().await?, 0)
        };
        let counts = postbox_store::StatusCounts {
            failed: counts.failed + group_dead,
            ..counts
        };
        if let Some(lsn) = wal_end {
            if !db.slot_past(lsn).await? {
                unread += 1;
            }
        }
        let idle = counts.pending == 0 && counts.processing == 0 && unread == 0;
        let applied = seen.applied.load(Ordering::Relaxed) as i64;
        if idle && applied >= committed_rows && seen.quiet_for() > Duration::from_millis(500) {
            break counts.failed;
        }
        // Lost, unless the consumer is still working: redeliveries come
        // within seconds, but on a loaded machine one transaction of the
        // consumer can take several.
        if idle && seen.quiet_for() > LOST_AFTER_QUIET {
            break counts.failed;
        }
        if started.elapsed() > timeout {
            crate::errln!(
                "  drain timed out after {}: {} pending, {} in flight, {} unread in the log (or the slot)",
                humantime::format_duration(timeout),
                counts.pending,
                counts.processing,
                unread
            );
            break counts.failed;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    Ok(Drained {
        dead_letters,
        took: started.elapsed(),
    })
}

/// What the run's consumer group (a pull run) has not had acknowledged
/// (unread, in flight or waiting), and its dead letters.
async fn group_unread(store: &Store) -> Result<(i64, i64), AnyError> {
    Ok(store
        .groups()
        .status()
        .await?
        .iter()
        .fold((0, 0), |(unread, dead), g| {
            (
                unread + g.unread + g.in_flight + g.waiting,
                dead + g.dead_letters,
            )
        }))
}

/// After a pass (unless `keep`): drop the schema, the broker's stream and
/// the logs. After a failure: say what was kept (on a throwaway cluster,
/// the schema goes with the cluster).
async fn clean_up(
    report: &ContractReport,
    keep: bool,
    throwaway: bool,
    db: &RunDatabase,
    cleanup: Option<&broker::Cleanup>,
    logs: &Path,
) {
    if report.passed && !keep {
        let _ = db.tables.drop_schema(&db.direct).await;
        if let Some(cleanup) = cleanup {
            if let Err(e) = cleanup.run().await {
                tracing::warn!(error = %error_chain(e.as_ref()), "could not delete {}", cleanup.describe());
            }
        }
        let _ = std::fs::remove_dir_all(logs);
    } else if !report.passed {
        let schema = if throwaway {
            format!(
                "(schema {} went with the throwaway cluster; set DATABASE_URL to keep it)",
                db.schema
            )
        } else {
            format!("schema {}", db.schema)
        };
        crate::errln!(
            "kept for inspection: {schema}, {}, relay logs in {}",
            cleanup.map_or_else(
                || "the consumer group".to_owned(),
                broker::Cleanup::describe
            ),
            logs.display()
        );
    }
}

//! `postbox bench`: its flags; the benchmark itself is `postbox_harness::bench`.

use crate::context::{AnyError, Settings};
use clap::{Args, ValueEnum};
use postbox_harness::bench;
use std::process::ExitCode;
use std::time::Duration;

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
    /// Many outboxes (--only tenants): schemas in one database
    #[arg(long, default_value_t = 500)]
    pub tenant_schemas: usize,
    /// Many outboxes: databases of one schema each, besides
    #[arg(long, default_value_t = 20)]
    pub tenant_databases: usize,
    /// Many outboxes: events one tenant drains while the others commit single events
    #[arg(long, default_value_t = 200_000)]
    pub tenant_backlog: i64,
    /// Many outboxes: events of the drain comparison (100 outboxes against one)
    #[arg(long, default_value_t = 100_000)]
    pub tenant_drain_events: i64,
    /// Which parts to run
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "drain,latency,producer,scale,ordered"
    )]
    pub only: Vec<Part>,
    /// Reading modes of the scale-out and sustained runs (log: relays sharing
    /// one log; the log's segments with autovacuum off)
    #[arg(long, value_enum, value_delimiter = ',', default_value = "claim")]
    pub modes: Vec<Mode>,
    /// Reading modes of the latency run (claim: LISTEN/NOTIFY, asynchronous
    /// relay commits, polling; log: synchronous and asynchronous cursor
    /// moves; logical: emitted events from a replication slot)
    #[arg(
        long,
        value_name = "MODES",
        value_delimiter = ',',
        default_value = "claim,log,logical",
        value_parser = super::parse_mode
    )]
    pub latency_modes: Vec<postbox_relay::ReadMode>,
    /// Latency again in each mode (LISTEN, synchronous commits) with a
    /// `postbox replay` of this many retained events running beside the
    /// live traffic, into another Redis list (0: no such rows)
    #[arg(long, value_name = "EVENTS", default_value_t = 0)]
    pub replay_beside: i64,
    /// The pace of that replay, events/s (0: unpaced)
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub replay_rate: u32,
    /// Other systems the drain runs the same events through, into the same
    /// sink, when the server has them: pgq (PgQ's canonical consumer; needs
    /// the pgq extension, e.g. Debian's postgresql-15-pgq3; the bench
    /// creates it and drops it again, with the roles it made)
    #[arg(long, value_enum, value_delimiter = ',')]
    pub peers: Vec<Peer>,
    /// Schema the benchmark creates and drops (never your outbox's)
    #[arg(long, default_value = "postbox_bench")]
    pub bench_schema: String,
    /// Print the results as JSON
    #[arg(long)]
    pub json: bool,
    /// Without DATABASE_URL: run the throwaway cluster with fsync,
    /// synchronous_commit and full_page_writes off (figures no durable
    /// server reaches; the first line says so). By default it runs with a
    /// production server's durability
    #[arg(long)]
    pub fsync_off: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Part {
    Drain,
    Latency,
    /// One event per transaction: enqueue against emit
    Producer,
    Scale,
    Ordered,
    Sustained,
    Tenants,
    /// Consumer groups read over SQL (receive + ack), 1 and 4 readers; with --peers pgq, against PgQ's consumer API
    Groups,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Peer {
    Pgq,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    Claim,
    Log,
}

impl From<Mode> for bench::Mode {
    fn from(mode: Mode) -> Self {
        match mode {
            Mode::Claim => bench::Mode::Claim,
            Mode::Log => bench::Mode::Log,
        }
    }
}

impl From<Part> for bench::Part {
    fn from(part: Part) -> Self {
        match part {
            Part::Drain => bench::Part::Drain,
            Part::Latency => bench::Part::Latency,
            Part::Producer => bench::Part::Producer,
            Part::Scale => bench::Part::Scale,
            Part::Ordered => bench::Part::Ordered,
            Part::Sustained => bench::Part::Sustained,
            Part::Tenants => bench::Part::Tenants,
            Part::Groups => bench::Part::Groups,
        }
    }
}

pub async fn run(settings: &Settings, args: BenchArgs) -> Result<ExitCode, AnyError> {
    let options = bench::Options {
        events: args.events,
        batch_size: args.batch_size,
        sink: args.sink,
        naive_events: args.naive_events,
        rate: args.rate,
        duration: args.duration,
        poll_interval: args.poll_interval,
        relays: args.relays,
        aggregates: args.aggregates,
        sustained_rate: args.sustained_rate,
        sustained_duration: args.sustained_duration,
        tenant_schemas: args.tenant_schemas,
        tenant_databases: args.tenant_databases,
        tenant_backlog: args.tenant_backlog,
        tenant_drain_events: args.tenant_drain_events,
        parts: args.only.into_iter().map(bench::Part::from).collect(),
        modes: args.modes.into_iter().map(bench::Mode::from).collect(),
        peers: args
            .peers
            .into_iter()
            .map(|Peer::Pgq| bench::Peer::Pgq)
            .collect(),
        latency_modes: args.latency_modes,
        replay_beside: args.replay_beside.max(0),
        replay_rate: args.replay_rate,
        bench_schema: args.bench_schema,
        json: args.json,
        fsync_off: args.fsync_off,
    };
    bench::run(settings.database_url.as_deref(), &options).await?;
    Ok(ExitCode::SUCCESS)
}

//! `postbox verify`: its flags and exit statuses; the delivery checker itself
//! is `postbox_harness::checker`.

use crate::context::{shutdown_signal, AnyError, Settings};
use crate::output::errln;
use clap::Args;
use postbox_harness::checker::{self, FaultKind, PlantedBug};
use postbox_harness::{error_chain, Verdict};
use postbox_relay::ReadMode;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// How long producers and faults run; then the run drains and is checked
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Relay processes (`postbox relay` children of this binary); in a pull
    /// run (group: sink), the readers, and over HTTP as many `postbox group
    /// serve` children
    #[arg(long, default_value_t = 3)]
    pub relays: usize,
    /// The broker: redis://HOST:PORT[/DB] (a stream), nats://HOST:PORT
    /// (JetStream) or amqp://USER:PASS@HOST:PORT[/VHOST] (a RabbitMQ queue);
    /// or, with no relay and no broker, a consumer group of the log whose
    /// readers pull: group:sql (receive/ack over SQL) or group:http
    /// (`postbox group serve` children, --relays of them)
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    pub sink: String,
    /// How the relays read committed events: claim (the outbox), log (the
    /// append-only log; verify points the producers at it) or logical (the
    /// producers emit into the WAL; the relays read a replication slot)
    /// [default: claim; log with a group: sink]
    #[arg(long, value_parser = super::parse_mode)]
    pub mode: Option<ReadMode>,
    /// The relays' relay.synchronous_commit: whether their claims and
    /// acknowledgements wait for the WAL flush
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub relay_synchronous_commit: bool,
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
    /// Faults to inject (comma-separated), or none; `crash` (PostgreSQL
    /// crashed and restarted) is not a default: add it
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
    /// Mean time between two PostgreSQL crashes (fault `crash`)
    #[arg(long, default_value = "8s", value_parser = humantime::parse_duration)]
    pub crash_every: Duration,
    /// Let the `crash` fault crash the server DATABASE_URL names, whose data
    /// directory this is (`pg_ctl restart -m immediate`, as the directory's
    /// owner). Without it, `crash` runs only on verify's throwaway cluster
    #[arg(long, value_name = "PGDATA")]
    pub crash_external_database: Option<PathBuf>,
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
    /// Run a replay beside the live traffic: a third of the way in (at
    /// most 5 s), `postbox replay` re-sends the events created since the run
    /// began to a Redis list of its own, killed at random and resumed; the
    /// check: every event of the range arrived, nothing outside it (claim
    /// and log mode)
    #[arg(long)]
    pub replay: bool,
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
    Crash,
    None,
}

impl FaultChoice {
    fn kind(self) -> Option<FaultKind> {
        match self {
            FaultChoice::Kill => Some(FaultKind::Kill),
            FaultChoice::Stall => Some(FaultKind::Stall),
            FaultChoice::Sink => Some(FaultKind::Sink),
            FaultChoice::Db => Some(FaultKind::Db),
            FaultChoice::Consumer => Some(FaultKind::Consumer),
            FaultChoice::Crash => Some(FaultKind::Crash),
            FaultChoice::None => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Plant {
    /// The relay acknowledges some batches without publishing them
    AckBeforePublish,
    /// The consumer commits its inbox with synchronous_commit = off, then
    /// acknowledges the broker (lost only in a PostgreSQL crash)
    ConsumerAsyncCommit,
    /// The consumer acknowledges a batch, works on it for 50 ms, then
    /// applies it (lost when a reader is killed in between: a pull run)
    ReaderAcksFirst,
    /// The replay runner moves its job past some pages without sending
    /// them (needs --replay)
    ReplaySkipsPages,
}

/// Exit status when a check fails (setup errors exit with 2).
const VIOLATION: u8 = 1;
const SETUP_ERROR: u8 = 2;

pub async fn run(settings: &Settings, args: VerifyArgs) -> Result<ExitCode, AnyError> {
    let options = checker::Options {
        duration: args.duration,
        relays: args.relays,
        mode: args.mode.unwrap_or(if args.sink.starts_with("group:") {
            ReadMode::Log
        } else {
            ReadMode::Claim
        }),
        sink: args.sink,
        relay_synchronous_commit: args.relay_synchronous_commit,
        ordered: args.ordered,
        seed: args.seed,
        rate: args.rate,
        aggregates: args.aggregates,
        rollback_percent: args.rollback_percent,
        faults: args.faults.iter().filter_map(|f| f.kind()).collect(),
        kill_every: args.kill_every,
        fault_every: args.fault_every,
        crash_every: args.crash_every,
        crash_external: args.crash_external_database,
        lease: args.lease,
        failpoints: args.failpoints,
        plant: args.plant.map(|p| match p {
            Plant::AckBeforePublish => PlantedBug::AckBeforePublish,
            Plant::ConsumerAsyncCommit => PlantedBug::ConsumerAsyncCommit,
            Plant::ReaderAcksFirst => PlantedBug::ReaderAcksFirst,
            Plant::ReplaySkipsPages => PlantedBug::ReplaySkipsPages,
        }),
        drain_timeout: args.drain_timeout,
        keep: args.keep,
        replay: args.replay,
        json: args.json,
    };
    let interrupt = Box::pin(shutdown_signal());
    match checker::run(settings.database_url.as_deref(), &options, interrupt).await {
        Ok(Verdict::Pass) => Ok(ExitCode::SUCCESS),
        Ok(Verdict::Fail) => Ok(ExitCode::from(VIOLATION)),
        Err(e) => {
            errln!("error: {}", error_chain(e.as_ref()));
            Ok(ExitCode::from(SETUP_ERROR))
        }
    }
}

//! `postbox`: the transactional outbox for PostgreSQL, from the command line.
//!
//! This file is the clap definitions and the dispatch; each command is a
//! module of `commands/`, and what they share is `context.rs`.

mod commands;
mod config;
mod context;
mod observe;

use clap::{Parser, Subcommand};
use commands::{
    bench, console, demo, dlq, enqueue, migrate, purge, receive, relay, status, verify,
};
use context::{error_chain, AnyError, Global, Settings};
use std::process::ExitCode;

/// Transactional outbox for PostgreSQL: deliver every committed event, at least once.
#[derive(Parser, Debug)]
#[command(name = "postbox", version, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Create or upgrade postbox's schema (idempotent; safe to run concurrently)
    Migrate(migrate::MigrateArgs),
    /// Enqueue one event (in its own transaction) and print its id
    Enqueue(enqueue::EnqueueArgs),
    /// Deliver committed events to a sink
    Relay(relay::RelayArgs),
    /// Show counts by status, the oldest pending event, attempts and dead letters
    Status(status::StatusArgs),
    /// Delete (or archive) sent events and old inbox records in bounded batches
    Purge(purge::PurgeArgs),
    /// Measure drain throughput, latency and scale-out on this machine
    Bench(bench::BenchArgs),
    /// Dead letters: list, show, replay (same or new id) and discard them, with an audit log
    Dlq(dlq::DlqArgs),
    /// Run the whole flow on a throwaway database: shop orders, relay, idempotent consumer
    Demo(demo::DemoArgs),
    /// Receive signed HTTP deliveries (QStash, Standard Webhooks) and store each once for the application
    Receive(receive::ReceiveArgs),
    /// The operator console (web): overview, events, dead letters, audit log; and its users
    Console(console::ConsoleArgs),
    /// Check the delivery contract under faults: producers, relays (killed, stalled), broker and database outages, an inbox consumer
    Verify(verify::VerifyArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// Resolve the shared settings, then run the command.
async fn run(cli: Cli) -> Result<ExitCode, AnyError> {
    let settings = Settings::resolve(&cli.global)?;
    match cli.command {
        Command::Migrate(args) => migrate::run(&settings, args).await,
        Command::Enqueue(args) => enqueue::run(&settings, args).await,
        Command::Relay(args) => relay::run(&settings, args).await,
        Command::Status(args) => status::run(&settings, args).await,
        Command::Purge(args) => purge::run(&settings, args).await,
        Command::Dlq(args) => dlq::run(&settings, args).await,
        Command::Demo(args) => demo::run(&settings, args).await,
        Command::Bench(args) => bench::run(&settings, args).await,
        Command::Receive(args) => receive::run(&settings, args).await,
        Command::Console(args) => console::run(&settings, args).await,
        Command::Verify(args) => verify::run(&settings, args).await,
    }
}

fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("POSTBOX_LOG")
        .or_else(|_| EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn,lapin=error"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
}

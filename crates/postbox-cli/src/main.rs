//! `postbox`: the transactional outbox for PostgreSQL, from the command line.

mod bench;
mod commands;
mod config;
mod console;
mod demo;
mod dlq;
mod observe;
mod receive;
mod verify;

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
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

/// Settings every command shares. A flag beats its environment variable, which
/// beats the config file.
#[derive(Args, Debug, Clone)]
pub struct Global {
    /// PostgreSQL connection URL, e.g. postgres://user@host:5432/db
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,
    /// Schema holding postbox's tables [default: postbox]
    #[arg(long, env = "POSTBOX_SCHEMA", global = true)]
    pub schema: Option<String>,
    /// TOML config file (see README: Configuration)
    #[arg(long, env = "POSTBOX_CONFIG", global = true)]
    pub config: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Create or upgrade postbox's schema (idempotent; safe to run concurrently)
    Migrate(commands::MigrateArgs),
    /// Enqueue one event (in its own transaction) and print its id
    Enqueue(commands::EnqueueArgs),
    /// Deliver committed events to a sink
    Relay(commands::RelayArgs),
    /// Show counts by status, the oldest pending event, attempts and dead letters
    Status(commands::StatusArgs),
    /// Delete (or archive) sent events and old inbox records in bounded batches
    Purge(commands::PurgeArgs),
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
    match runtime.block_on(commands::run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", postbox_harness::error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
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

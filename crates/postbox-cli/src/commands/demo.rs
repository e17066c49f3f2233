//! `postbox demo`: its flags; the demo itself is `postbox_harness::demo`.

use crate::context::{AnyError, Settings};
use clap::Args;
use postbox_harness::{demo, Verdict};
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Orders to attempt
    #[arg(long, default_value_t = 3000)]
    pub orders: u64,
    /// Orders attempted per second (all producers together)
    #[arg(long, default_value_t = 1500)]
    pub rate: u64,
    /// Percent of order transactions rolled back
    #[arg(long, default_value_t = 10)]
    pub rollback_percent: u32,
    /// Percent of deliveries the queue duplicates, or whose acknowledgement it loses
    #[arg(long, default_value_t = 5)]
    pub duplicate_percent: u32,
    /// How the relay reads the events: claim (the outbox table), log (an
    /// append-only log) or logical (emitted into the WAL, read from a
    /// replication slot; needs wal_level = logical, which the throwaway
    /// cluster has)
    #[arg(long, value_name = "MODE", default_value = "claim", value_parser = super::parse_mode)]
    pub mode: postbox_relay::ReadMode,
}

pub async fn run(settings: &Settings, args: DemoArgs) -> Result<ExitCode, AnyError> {
    let options = demo::Options {
        orders: args.orders,
        rate: args.rate,
        rollback_percent: args.rollback_percent,
        duplicate_percent: args.duplicate_percent,
        mode: args.mode,
    };
    Ok(
        match demo::run(settings.database_url.as_deref(), &options).await? {
            Verdict::Pass => ExitCode::SUCCESS,
            Verdict::Fail => ExitCode::FAILURE,
        },
    )
}

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
}

pub async fn run(settings: &Settings, args: DemoArgs) -> Result<ExitCode, AnyError> {
    let options = demo::Options {
        orders: args.orders,
        rate: args.rate,
        rollback_percent: args.rollback_percent,
        duplicate_percent: args.duplicate_percent,
    };
    Ok(
        match demo::run(settings.database_url.as_deref(), &options).await? {
            Verdict::Pass => ExitCode::SUCCESS,
            Verdict::Fail => ExitCode::FAILURE,
        },
    )
}

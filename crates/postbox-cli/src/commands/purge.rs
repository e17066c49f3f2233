//! `postbox purge`: delete (or archive) sent events, old inbox records and
//! expired idempotency keys in bounded batches.

use crate::context::{cancel_on_signal, name_the_flag, AnyError, Settings};
use crate::output::{outln, Progress};
use clap::Args;
use postbox_relay::retention::{self, Table};
use postbox_relay::{RetentionConfig, Store};
use std::process::ExitCode;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Args, Debug)]
pub struct PurgeArgs {
    /// Remove sent events acknowledged longer ago than this, e.g. 7d, 36h
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub older_than: Duration,
    /// Move the events to <schema>.outbox_archive instead of deleting them
    #[arg(long)]
    pub archive: bool,
    /// Rows per batch, each its own short transaction [default: 5000, or retention.batch_size]
    #[arg(long, value_name = "N")]
    pub batch_size: Option<u32>,
    /// Also delete inbox records processed longer ago than --older-than
    #[arg(long)]
    pub inbox: bool,
    /// Pause between batches [default: 100ms, or retention.pause]
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub pause: Option<Duration>,
}

pub async fn run(settings: &Settings, args: PurgeArgs) -> Result<ExitCode, AnyError> {
    let file = &settings.file.retention;
    let config = RetentionConfig {
        enabled: false,
        older_than: args.older_than,
        archive: args.archive || file.archive,
        inbox: args.inbox || file.inbox,
        batch_size: args.batch_size.unwrap_or(file.batch_size),
        pause: args.pause.unwrap_or(file.pause),
        interval: file.interval,
        vacuum: file.vacuum,
    };
    config.validate().map_err(|e| {
        name_the_flag(
            e,
            &[
                ("retention.older_than", "--older-than", true),
                (
                    "retention.batch_size",
                    "--batch-size",
                    args.batch_size.is_some(),
                ),
                ("retention.pause", "--pause", args.pause.is_some()),
            ],
        )
    })?;
    let pool = settings.pool("postbox-purge").await?;
    let store = Store::new(pool, settings.schema.clone());
    let stop = CancellationToken::new();
    tokio::spawn(cancel_on_signal(stop.clone()));
    let verb = if config.archive {
        "archived"
    } else {
        "deleted"
    };
    // On a terminal only: a line redrawn as batches go (quiet in a pipe).
    let mut progress = Progress::new("purge:", None);
    let report = retention::purge(&store, &config, &stop, |p: retention::Progress| {
        let what = match p.table {
            Table::Outbox => format!("sent events {verb}"),
            Table::Inbox => "inbox records deleted".to_owned(),
            Table::IdempotencyKeys => "expired idempotency keys deleted".to_owned(),
        };
        progress.update_with(p.removed, &what);
    })
    .await?;
    progress.finish();
    let mut line = format!("purged: {} sent events {verb}", report.outbox);
    if config.inbox {
        line.push_str(&format!(", {} inbox records deleted", report.inbox));
    }
    if report.idempotency_keys > 0 {
        line.push_str(&format!(
            ", {} expired idempotency keys deleted",
            report.idempotency_keys
        ));
    }
    if report.interrupted {
        line.push_str(" (interrupted)");
    }
    outln!("{line}");
    Ok(ExitCode::SUCCESS)
}

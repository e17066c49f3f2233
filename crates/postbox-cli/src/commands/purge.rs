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

    /// Purge many outboxes, one after the other (one line each)
    #[command(flatten)]
    pub select: crate::tenants::SelectArgs,
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
    let stop = CancellationToken::new();
    tokio::spawn(cancel_on_signal(stop.clone()));
    if crate::tenants::many(settings, &args.select) {
        return purge_many(settings, &args.select, &config, &stop).await;
    }
    let pool = settings.pool("postbox-purge").await?;
    let store = Store::new(pool, settings.schema.clone());
    let verb = verb(&config);
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
    outln!("purged: {}", summary(&config, &report));
    Ok(ExitCode::SUCCESS)
}

/// `purge --schemas GLOB` (or `--databases`, or the config's `[[outboxes]]`):
/// every outbox in turn, a line each, then the totals. An outbox that fails
/// is reported and the others are still purged; the exit status says so.
async fn purge_many(
    settings: &Settings,
    select: &crate::tenants::SelectArgs,
    config: &RetentionConfig,
    stop: &CancellationToken,
) -> Result<ExitCode, AnyError> {
    let found = crate::tenants::list(settings, select, true).await?;
    let mut total = retention::PurgeReport::default();
    let mut failed = 0;
    for outbox in &found {
        if stop.is_cancelled() {
            break;
        }
        let store = Store::new(outbox.pool.clone(), outbox.schema.clone());
        match retention::purge(&store, config, stop, |_| {}).await {
            Ok(report) => {
                outln!("{}: {}", outbox.name, summary(config, &report));
                total.outbox += report.outbox;
                total.inbox += report.inbox;
                total.idempotency_keys += report.idempotency_keys;
                total.interrupted |= report.interrupted;
            }
            Err(e) => {
                failed += 1;
                outln!("{}: failed: {e}: {}", outbox.name, e.source);
            }
        }
    }
    total.interrupted |= stop.is_cancelled();
    outln!(
        "purged {} outboxes: {}{}",
        found.len() - failed,
        summary(config, &total),
        if failed > 0 {
            format!("; {failed} failed")
        } else {
            String::new()
        }
    );
    Ok(if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn verb(config: &RetentionConfig) -> &'static str {
    if config.archive {
        "archived"
    } else {
        "deleted"
    }
}

/// `N sent events deleted[, …]` for one purge.
fn summary(config: &RetentionConfig, report: &retention::PurgeReport) -> String {
    let mut line = format!("{} sent events {}", report.outbox, verb(config));
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
    line
}

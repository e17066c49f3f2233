//! `postbox log`: log mode's cursors — how far each destination's cursor is
//! behind, whether a relay reads it, and dropping one whose destination is
//! gone (a cursor no relay reads keeps every log segment from truncation).

use crate::context::{actor as actor_or_user, AnyError, Settings};
use crate::output::outln;
use clap::{Args, Subcommand};
use postbox_relay::router::DEFAULT_DESTINATION;
use postbox_relay::Store;
use postbox_store::CursorDropped;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct LogArgs {
    #[command(subcommand)]
    pub command: LogCommand,
}

#[derive(Subcommand, Debug)]
pub enum LogCommand {
    /// Show each destination's cursor: unread events, the oldest unread, whether a relay reads it; exit 1 when one is not read
    Cursors {
        /// Print JSON
        #[arg(long)]
        json: bool,
        /// Say loudly (and exit 1) when no relay has read a cursor for
        /// longer than this [default: relay.logical_inactive_warn, 5m]
        #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
        inactive_warn: Option<Duration>,
    },
    /// Drop a destination's cursor (audited): what it has not read is no
    /// longer delivered to it, and the log's segments can be truncated again
    DropCursor {
        /// The destination's name
        name: String,
        /// Drop it even while a relay holds it
        #[arg(long)]
        force: bool,
        /// Why (kept in the audit log)
        #[arg(long)]
        reason: Option<String>,
        /// Who (kept in the audit log) [default: $USER]
        #[arg(long)]
        actor: Option<String>,
    },
}

/// The destinations the configuration names, when it names any: a cursor
/// outside them belongs to a destination that was removed.
pub fn configured(settings: &Settings) -> Option<Vec<String>> {
    if !settings.file.destinations.is_empty() {
        Some(settings.file.destinations.keys().cloned().collect())
    } else if settings.file.sink.url.is_some() {
        Some(vec![DEFAULT_DESTINATION.to_owned()])
    } else {
        None
    }
}

pub async fn run(settings: &Settings, args: LogArgs) -> Result<ExitCode, AnyError> {
    let pool = settings.pool("postbox-log").await?;
    let log = Store::new(pool, settings.schema.clone()).log();
    match args.command {
        LogCommand::Cursors {
            json,
            inactive_warn,
        } => {
            let bound = inactive_warn.unwrap_or(settings.file.relay.logical_inactive_warn);
            let cursors = log.cursor_lag().await?;
            let bytes = log.log_bytes().await?;
            let configured = configured(settings);
            if json {
                let report = serde_json::json!({
                    "log_bytes": bytes,
                    "cursors": cursors.iter().map(|c| {
                        let mut v = serde_json::to_value(c).unwrap_or_default();
                        v["unread_too_long"] = (c.unread_seconds > bound.as_secs_f64()).into();
                        if let Some(names) = &configured {
                            v["configured"] = names.contains(&c.destination).into();
                        }
                        v
                    }).collect::<Vec<_>>(),
                });
                outln!("{}", serde_json::to_string_pretty(&report)?);
                let alarm = cursors
                    .iter()
                    .any(|c| c.unread_seconds > bound.as_secs_f64());
                return Ok(if alarm {
                    ExitCode::FAILURE
                } else {
                    ExitCode::SUCCESS
                });
            }
            if cursors.is_empty() {
                outln!("no log cursor (no relay has read this schema in log mode)");
                return Ok(ExitCode::SUCCESS);
            }
            outln!("log  {}", human_bytes(bytes));
            let mut alarm = false;
            for c in &cursors {
                outln!(
                    "{:<20} unread {} (oldest {}), delivered {}, {}",
                    c.destination,
                    c.lag_events,
                    c.lag_seconds.map_or_else(|| "-".to_owned(), age),
                    c.delivered,
                    if c.held {
                        "read by a relay"
                    } else if c.unread_seconds > 0.0 {
                        "not read now"
                    } else {
                        "partly read"
                    }
                );
                let stray = configured
                    .as_ref()
                    .is_some_and(|names| !names.contains(&c.destination));
                if stray {
                    outln!("  NOT IN THE CONFIGURATION: no destination of this name is configured");
                }
                if c.unread_seconds > bound.as_secs_f64() {
                    alarm = true;
                    outln!(
                        "  NOT READ for {} (longer than {}): it keeps the log ({}) from being truncated; \
                         start a relay that delivers to {}, or drop the cursor: postbox log drop-cursor {}",
                        age(c.unread_seconds),
                        humantime::format_duration(bound),
                        human_bytes(bytes),
                        c.destination,
                        c.destination
                    );
                }
            }
            Ok(if alarm {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            })
        }
        LogCommand::DropCursor {
            name,
            force,
            reason,
            actor,
        } => {
            let actor = actor_or_user(actor)?;
            match log
                .drop_cursor(&name, force, &actor, reason.as_deref())
                .await?
            {
                CursorDropped::Dropped { parts, delivered } => {
                    outln!(
                        "dropped the log cursor of {name} ({parts} partition(s), {delivered} events delivered through it); recorded in the audit log"
                    );
                    Ok(ExitCode::SUCCESS)
                }
                CursorDropped::Held => Err(format!(
                    "a relay reads {name}'s cursor now: stop it (or remove {name} from its configuration) first, or pass --force"
                )
                .into()),
                CursorDropped::Missing => Err(format!("no log cursor named {name}").into()),
            }
        }
    }
}

fn age(secs: f64) -> String {
    humantime::format_duration(Duration::from_secs(secs.max(0.0).round() as u64)).to_string()
}

fn human_bytes(bytes: i64) -> String {
    let b = bytes.max(0) as f64;
    if b >= 1048576.0 {
        format!("{:.1} MB", b / 1048576.0)
    } else {
        format!("{:.0} kB", b / 1024.0)
    }
}

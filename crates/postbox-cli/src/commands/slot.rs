//! `postbox slot`: logical mode's replication slots — how far behind they
//! are, what WAL they retain, whether one was invalidated — and dropping one.

use crate::context::{AnyError, Settings};
use crate::output::outln;
use clap::{Args, Subcommand};
use postbox_relay::at_risk;
use postbox_relay::Store;
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct SlotArgs {
    #[command(subcommand)]
    pub command: SlotCommand,
}

#[derive(Subcommand, Debug)]
pub enum SlotCommand {
    /// Show the database's logical replication slots (or one): active, lag, retained WAL, wal_status
    Status {
        /// Only this slot
        name: Option<String>,
        /// Print JSON
        #[arg(long)]
        json: bool,
        /// Say loudly (and exit 1) when no relay has read a slot for longer
        /// than this [default: relay.logical_inactive_warn, 5m]
        #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
        inactive_warn: Option<std::time::Duration>,
    },
    /// Drop a slot and its publication: the WAL it retains is freed, and
    /// events emitted since its confirmed position are no longer delivered
    Drop {
        /// The slot's name
        name: String,
    },
}

pub async fn run(settings: &Settings, args: SlotArgs) -> Result<ExitCode, AnyError> {
    let pool = settings.pool("postbox-slot").await?;
    let logical = Store::new(pool, settings.schema.clone()).logical();
    match args.command {
        SlotCommand::Status {
            name,
            json,
            inactive_warn,
        } => {
            let bound = inactive_warn.unwrap_or(settings.file.relay.logical_inactive_warn);
            let slots = logical.status(name.as_deref()).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&slots)?);
                return Ok(ExitCode::SUCCESS);
            }
            if slots.is_empty() {
                outln!(
                    "no logical replication slot{}",
                    name.map(|n| format!(" named {n}")).unwrap_or_default()
                );
                return Ok(ExitCode::SUCCESS);
            }
            let mut alarm = false;
            for s in &slots {
                outln!("{}", s.summary());
                if s.is_lost() {
                    alarm = true;
                    outln!(
                        "  INVALIDATED: the server removed WAL this slot needed: {}. \
                         Recover: postbox slot drop {}, restart the relay, reconcile that range (see the README's operations section)",
                        s.lost_range(),
                        s.slot_name
                    );
                } else if let Some(reason) = at_risk(s) {
                    outln!("  AT RISK: {reason}");
                }
                if let Some(failing) = s.failing() {
                    alarm = true;
                    outln!("  READER FAILING: {failing}");
                }
                if s.unread_longer_than(bound) {
                    alarm = true;
                    outln!(
                        "  NOT READ for longer than {}: no relay reads this slot; events wait and WAL is retained (start a relay with --mode logical)",
                        humantime::format_duration(bound)
                    );
                }
            }
            Ok(if alarm {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            })
        }
        SlotCommand::Drop { name } => {
            postbox_relay::config::check_slot_name(&name)
                .map_err(|reason| format!("slot name {name:?}: {reason}"))?;
            if logical.drop_slot(&name).await? {
                outln!("dropped replication slot {name} and its publication");
            } else {
                outln!("no replication slot named {name} (its publication, if any, is dropped)");
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

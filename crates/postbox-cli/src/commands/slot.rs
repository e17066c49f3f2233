//! `postbox slot`: logical mode's replication slots — how far behind they
//! are, what WAL they retain, whether one was invalidated — and dropping one.

use crate::context::{AnyError, Settings};
use crate::output::outln;
use clap::{Args, Subcommand};
use postbox_relay::logical_mode::at_risk;
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
        SlotCommand::Status { name, json } => {
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
            let mut lost = false;
            for s in &slots {
                outln!("{}", s.summary());
                if s.is_lost() {
                    lost = true;
                    outln!(
                        "  INVALIDATED: the server removed WAL this slot needed; events emitted after {} may be lost. \
                         Recover: postbox slot drop {}, restart the relay, reconcile (see the README's operations section)",
                        s.confirmed_lsn.as_deref().unwrap_or("its last confirmed position"),
                        s.slot_name
                    );
                } else if let Some(reason) = at_risk(s) {
                    outln!("  AT RISK: {reason}");
                }
            }
            Ok(if lost {
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

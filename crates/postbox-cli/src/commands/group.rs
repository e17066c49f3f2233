//! `postbox group`: consumer groups — readers that pull events from the log
//! over SQL (`receive`, `ack`, `nack`): create one, see how each is doing,
//! list its dead letters, drop one (audited).

use crate::context::{actor as actor_or_user, AnyError, Settings};
use crate::output::{errln, outln};
use clap::{Args, Subcommand};
use postbox_relay::Store;
use postbox_store::{GroupStart, GroupStatus, NewGroup, ProducerTarget};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct GroupArgs {
    #[command(subcommand)]
    pub command: GroupCommand,
}

#[derive(Subcommand, Debug)]
pub enum GroupCommand {
    /// Create a consumer group: readers then call receive/ack/nack on it
    Create {
        /// 1 to 63 letters, digits, '.', '_' or '-'
        name: String,
        /// Where it starts: now (events committed from here on), beginning
        /// (everything the log retains) or an RFC 3339 time
        #[arg(long, default_value = "now", value_parser = parse_start)]
        start: GroupStart,
        /// Only events whose type matches this glob (`*`, `?`); repeat for several
        #[arg(long = "types", value_name = "GLOB")]
        types: Vec<String>,
        /// Never hand out an aggregate's event while an earlier one of it is in flight
        #[arg(long)]
        ordered: bool,
        /// Hand-outs before an event becomes one of the group's dead letters
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(i32).range(1..=1000))]
        max_attempts: i32,
    },
    /// Show each group: unread, in flight, waiting, dead letters, readers, lag
    List {
        /// Print JSON
        #[arg(long)]
        json: bool,
    },
    /// List a group's dead letters, oldest first
    DeadLetters {
        name: String,
        /// At most this many
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Print JSON
        #[arg(long)]
        json: bool,
    },
    /// Give a group's dead letters back to it, to be handed out again (audited)
    ReplayDead {
        name: String,
        /// Only this event (repeat for several)
        #[arg(long = "event-id", value_name = "ID", required_unless_present = "all")]
        event_ids: Vec<uuid::Uuid>,
        /// Every dead letter of the group
        #[arg(long, conflicts_with = "event_ids")]
        all: bool,
        /// Why (kept in the audit log)
        #[arg(long)]
        reason: Option<String>,
        /// Who (kept in the audit log) [default: $USER]
        #[arg(long)]
        actor: Option<String>,
    },
    /// Drop a group with everything it holds (audited)
    Drop {
        name: String,
        /// Why (kept in the audit log)
        #[arg(long)]
        reason: Option<String>,
        /// Who (kept in the audit log) [default: $USER]
        #[arg(long)]
        actor: Option<String>,
    },
}

fn parse_start(s: &str) -> Result<GroupStart, String> {
    s.parse()
}

pub async fn run(settings: &Settings, args: GroupArgs) -> Result<ExitCode, AnyError> {
    let pool = settings.pool("postbox-group").await?;
    let store = Store::new(pool, settings.schema.clone());
    let groups = store.groups();
    match args.command {
        GroupCommand::Create {
            name,
            start,
            types,
            ordered,
            max_attempts,
        } => {
            let group = NewGroup {
                name: name.clone(),
                start,
                types: (!types.is_empty()).then_some(types),
                ordered,
                max_attempts,
            };
            groups.create(&group).await?;
            outln!(
                "created consumer group {name}: readers call {schema}.receive('{name}', …), then ack or nack",
                schema = settings.schema.name()
            );
            if store.log().producer_target().await? != ProducerTarget::Log {
                errln!(
                    "warning: this outbox's producers write to the outbox table (claim mode), and \
                     consumer groups read the log: {name} gets nothing until producers write to \
                     the log (postbox migrate --mode log)"
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        GroupCommand::List { json } => {
            let status = groups.status().await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&status)?);
                return Ok(ExitCode::SUCCESS);
            }
            if status.is_empty() {
                outln!("no consumer group (create one: postbox group create NAME)");
            }
            for g in &status {
                outln!("{}", summary(g));
            }
            Ok(ExitCode::SUCCESS)
        }
        GroupCommand::DeadLetters { name, limit, json } => {
            if !(1..=10_000).contains(&limit) {
                return Err("--limit: must be 1 to 10000".into());
            }
            let dead = groups.dead_letters(&name, 0, limit).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&dead)?);
                return Ok(ExitCode::SUCCESS);
            }
            if dead.is_empty() {
                outln!("no dead letter in group {name}");
            }
            for d in &dead {
                outln!(
                    "{} {} {}/{} after {} attempt(s) at {}: {}",
                    d.event_id,
                    d.event_type.as_deref().unwrap_or("?"),
                    d.aggregate_type.as_deref().unwrap_or("?"),
                    d.aggregate_id.as_deref().unwrap_or("?"),
                    d.attempts,
                    d.dead_at.format("%Y-%m-%d %H:%M:%S UTC"),
                    d.last_error.as_deref().unwrap_or("-")
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        GroupCommand::ReplayDead {
            name,
            event_ids,
            all,
            reason,
            actor,
        } => {
            let actor = actor_or_user(actor)?;
            let ids = (!all).then_some(event_ids.as_slice());
            let n = groups
                .replay_dead(&name, ids, &actor, reason.as_deref())
                .await?;
            outln!(
                "{n} dead letter(s) of {name} wait to be handed out again; recorded in the audit log"
            );
            Ok(ExitCode::SUCCESS)
        }
        GroupCommand::Drop {
            name,
            reason,
            actor,
        } => {
            let actor = actor_or_user(actor)?;
            if groups.drop_group(&name, &actor, reason.as_deref()).await? {
                outln!(
                    "dropped consumer group {name} with what it held; recorded in the audit log"
                );
                Ok(ExitCode::SUCCESS)
            } else {
                Err(format!("no consumer group named {name}").into())
            }
        }
    }
}

/// One group on one line, as `group list` and `status` print it.
pub fn summary(g: &GroupStatus) -> String {
    let mut line = format!(
        "{:<20} unread {}, in flight {}, waiting {}, dead letters {}, readers {} (last minute), oldest unacknowledged {}",
        g.name,
        g.unread,
        g.in_flight,
        g.waiting,
        g.dead_letters,
        g.readers,
        g.lag_seconds.map_or_else(|| "-".to_owned(), age),
    );
    let mut traits = Vec::new();
    if g.ordered {
        traits.push("ordered".to_owned());
    }
    if let Some(types) = &g.types {
        traits.push(format!("types {}", types.join(", ")));
    }
    traits.push(format!("max attempts {}", g.max_attempts));
    line.push_str(&format!(" [{}]", traits.join("; ")));
    line
}

fn age(secs: f64) -> String {
    humantime::format_duration(Duration::from_secs(secs.max(0.0).round() as u64)).to_string()
}

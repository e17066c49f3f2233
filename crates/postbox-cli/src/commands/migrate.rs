//! `postbox migrate`: create or upgrade postbox's schema, and optionally the
//! least-privilege roles.

use crate::context::{error_chain, AnyError, Settings};
use crate::output::{out, outln, Progress};
use clap::Args;
use postbox::Schema;
use postbox_relay::{ReadMode, Store};
use postbox_store::{ProducerTarget, Roles};
use sqlx::PgPool;
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct MigrateArgs {
    /// Also create the NOLOGIN roles <schema>_producer (can only enqueue),
    /// <schema>_relay (what the relay needs), <schema>_monitor (read-only) and
    /// <schema>_consumer (reads consumer groups: receive, ack, nack),
    /// for a DBA to grant to login users. Idempotent.
    #[arg(long)]
    pub create_roles: bool,
    /// With --create-roles: print the roles' SQL and exit, without connecting
    #[arg(long, requires = "create_roles")]
    pub print_sql: bool,
    /// Where producers write: claim (the outbox table, read by `relay --mode
    /// claim`) or log (the append-only log, read by `relay --mode log`).
    /// Unchanged when not given. Going back to claim is refused while the
    /// log holds events a relay has not read.
    #[arg(long, value_name = "MODE", value_parser = super::parse_mode)]
    pub mode: Option<ReadMode>,
    /// Logical mode: whether emit numbers each event within its aggregate
    /// (on: each emit updates its aggregate's counter row, and ordered
    /// routes work; off, the default: emit writes no table row and its
    /// events are delivered unordered). Unchanged when not given.
    #[arg(long, value_name = "on|off", value_parser = super::parse_on_off)]
    pub emit_sequence: Option<bool>,
    /// Migrate many schemas at once (and every `[[outboxes]]` entry): each
    /// gets the same --mode, --emit-sequence and --create-roles; progress
    /// shows on a terminal
    #[command(flatten)]
    pub select: crate::tenants::SelectArgs,
}

pub async fn run(settings: &Settings, args: MigrateArgs) -> Result<ExitCode, AnyError> {
    let many = crate::tenants::many(settings, &args.select);
    if args.print_sql {
        if many {
            return Err("--print-sql prints one schema's roles: pass --schema".into());
        }
        let roles = Roles::for_schema(&settings.schema)?;
        out!("{}", roles.sql(&settings.schema));
        return Ok(ExitCode::SUCCESS);
    }
    if many {
        return migrate_many(settings, &args).await;
    }
    let pool = settings.pool("postbox-migrate").await?;
    let mut lines = Vec::new();
    let label = format!("schema {}", settings.schema);
    let mut result = migrate_one(&pool, &settings.schema, &label, &args, &mut lines).await;
    if result.is_ok() {
        let groups = settings.file.groups()?;
        result = ensure_groups(&pool, &settings.schema, &groups, &mut lines).await;
    }
    for line in lines {
        outln!("{line}");
    }
    result?;
    Ok(ExitCode::SUCCESS)
}

/// `migrate --schemas GLOB` / `--databases GLOB` (and `[[outboxes]]`):
/// migrate every matching schema (idempotent: one already up to date is
/// left as is), with a progress line on a terminal. Stops at the first
/// failure, naming the schema.
async fn migrate_many(settings: &Settings, args: &MigrateArgs) -> Result<ExitCode, AnyError> {
    if !settings.file.groups.is_empty() {
        crate::output::errln!(
            "note: [groups.*] are made by `postbox migrate` of one schema (--schema), not here"
        );
    }
    let found = crate::tenants::list(settings, &args.select, false).await?;
    let mut progress = Progress::new("migrated", Some(found.len() as u64));
    let mut changed = 0;
    for (done, outbox) in found.iter().enumerate() {
        progress.update_with(done as u64, &outbox.name);
        let mut lines = Vec::new();
        let label = format!("schema {}", outbox.name);
        let result = migrate_one(&outbox.pool, &outbox.schema, &label, args, &mut lines).await;
        progress.finish();
        if lines.first().is_some_and(|l| !l.ends_with("is up to date")) {
            changed += 1;
        }
        for line in lines {
            outln!("{line}");
        }
        result
            .map_err(|e| -> AnyError { format!("{label}: {}", error_chain(e.as_ref())).into() })?;
    }
    progress.update(found.len() as u64);
    progress.finish();
    outln!(
        "{} schema(s): {changed} migrated, {} already up to date",
        found.len(),
        found.len() - changed
    );
    Ok(ExitCode::SUCCESS)
}

/// Make the configuration's `[groups.NAME]` that do not exist yet; say
/// which exist with other settings (a group's settings are fixed when it is
/// made), and when producers do not write into the log.
async fn ensure_groups(
    pool: &PgPool,
    schema: &Schema,
    wanted: &[postbox_store::NewGroup],
    lines: &mut Vec<String>,
) -> Result<(), AnyError> {
    if wanted.is_empty() {
        return Ok(());
    }
    let store = Store::new(pool.clone(), schema.clone());
    let groups = store.groups();
    let existing = groups.status().await?;
    for want in wanted {
        let name = &want.name;
        match existing.iter().find(|g| &g.name == name) {
            None => {
                groups
                    .create(want)
                    .await
                    .map_err(|e| format!("groups.{name}: {}", error_chain(&e)))?;
                lines.push(format!("consumer group {name} created ([groups.{name}])"));
            }
            Some(have) => {
                let mut differ = Vec::new();
                if have.types != want.types {
                    differ.push("types");
                }
                if have.ordered != want.ordered {
                    differ.push("ordered");
                }
                if have.max_attempts != want.max_attempts {
                    differ.push("max_attempts");
                }
                if !differ.is_empty() {
                    lines.push(format!(
                        "warning: consumer group {name} exists with other {} than [groups.{name}]; \
                        a group's settings are fixed when it is made (drop it with `postbox group \
                        drop {name}` and migrate again to make it anew, losing what it holds)",
                        differ.join(", ")
                    ));
                }
            }
        }
    }
    if store.log().producer_target().await? != ProducerTarget::Log {
        lines.push(
            "warning: producers write to the outbox table (claim mode), and consumer groups read \
            the log: the groups get nothing until producers write to the log (--mode log)"
                .to_owned(),
        );
    }
    Ok(())
}

/// Migrate one schema, then switch its producers' target, number its emits
/// or not, and create its roles when asked; what it did goes into `lines` (printed once the progress
/// line is cleared).
async fn migrate_one(
    pool: &PgPool,
    schema: &Schema,
    label: &str,
    args: &MigrateArgs,
    lines: &mut Vec<String>,
) -> Result<(), AnyError> {
    let mut conn = pool.acquire().await?;
    let applied = postbox::sqlx::migrate(&mut conn, schema).await?;
    if applied.is_empty() {
        lines.push(format!("{label} is up to date"));
    } else {
        let list: Vec<String> = applied.iter().map(i32::to_string).collect();
        lines.push(format!("{label}: applied migration(s) {}", list.join(", ")));
    }
    drop(conn);
    if let Some(mode) = args.mode {
        let log = Store::new(pool.clone(), schema.clone()).log();
        let target = match mode {
            // Logical mode's producers call emit; enqueue keeps its table.
            ReadMode::Claim | ReadMode::Logical => ProducerTarget::Outbox,
            ReadMode::Log => ProducerTarget::Log,
        };
        if target == ProducerTarget::Outbox && log.producer_target().await? == ProducerTarget::Log {
            let unread = log.unread().await?;
            if unread > 0 {
                return Err(format!(
                    "--mode claim: the log holds {unread} event(s) a relay has not read; \
                     drain them first (postbox relay --mode log --drain), then switch"
                )
                .into());
            }
        }
        log.set_producer_target(target).await?;
        lines.push(format!(
            "{label}: producers write into the {}",
            target.as_str()
        ));
    }
    if let Some(on) = args.emit_sequence {
        let flag = if on { "on" } else { "off" };
        Store::new(pool.clone(), schema.clone())
            .logical()
            .set_numbered_emits(on)
            .await
            .map_err(|e| format!("--emit-sequence {flag}: {}", error_chain(&e)))?;
        lines.push(if on {
            format!(
                "{label}: emits are numbered (each emit updates its aggregate's counter row; \
                 ordered routes work in logical mode)"
            )
        } else {
            format!(
                "{label}: emits are not numbered (emit writes no table row; a relay with \
                 ordered routes in logical mode refuses to read)"
            )
        });
    }
    if args.create_roles {
        let roles = Store::new(pool.clone(), schema.clone())
            .create_roles()
            .await?;
        lines.push(format!(
            "roles {}, {}, {} and {} are in place (NOLOGIN: GRANT them to login users)",
            roles.producer, roles.relay, roles.monitor, roles.consumer
        ));
    }
    Ok(())
}

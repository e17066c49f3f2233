//! `postbox migrate`: create or upgrade postbox's schema, and optionally the
//! least-privilege roles.

use crate::context::{AnyError, Settings};
use crate::output::{out, outln};
use clap::Args;
use postbox_relay::{ReadMode, Store};
use postbox_store::{ProducerTarget, Roles};
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct MigrateArgs {
    /// Also create the NOLOGIN roles <schema>_producer (can only enqueue),
    /// <schema>_relay (what the relay needs) and <schema>_monitor (read-only),
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
    #[arg(long, value_name = "MODE", value_parser = parse_mode)]
    pub mode: Option<ReadMode>,

    /// Migrate many schemas at once (and every `[[outboxes]]` entry)
    #[command(flatten)]
    pub select: crate::tenants::SelectArgs,
}

fn parse_mode(s: &str) -> Result<ReadMode, String> {
    s.parse()
}

pub async fn run(settings: &Settings, args: MigrateArgs) -> Result<ExitCode, AnyError> {
    if args.print_sql {
        let roles = Roles::for_schema(&settings.schema)?;
        out!("{}", roles.sql(&settings.schema));
        return Ok(ExitCode::SUCCESS);
    }
    if crate::tenants::many(settings, &args.select) {
        return migrate_many(settings, &args).await;
    }
    let pool = settings.pool("postbox-migrate").await?;
    let mut conn = pool.acquire().await?;
    let applied = postbox::sqlx::migrate(&mut conn, &settings.schema).await?;
    if applied.is_empty() {
        outln!("schema {} is up to date", settings.schema);
    } else {
        let list: Vec<String> = applied.iter().map(i32::to_string).collect();
        outln!(
            "schema {}: applied migration(s) {}",
            settings.schema,
            list.join(", ")
        );
    }
    drop(conn);
    if let Some(mode) = args.mode {
        let log = Store::new(pool.clone(), settings.schema.clone()).log();
        let target = match mode {
            ReadMode::Claim => ProducerTarget::Outbox,
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
        outln!(
            "schema {}: producers write into the {}",
            settings.schema,
            target.as_str()
        );
    }
    if args.create_roles {
        let roles = Store::new(pool, settings.schema.clone())
            .create_roles()
            .await?;
        outln!(
            "roles {}, {} and {} are in place (NOLOGIN: GRANT them to login users)",
            roles.producer,
            roles.relay,
            roles.monitor
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `migrate --schemas GLOB` (and `[[outboxes]]`): migrate every matching
/// schema, each in its own run of `migrate` (idempotent: a schema already up
/// to date is left as is). Stops at the first failure, naming the schema.
async fn migrate_many(settings: &Settings, args: &MigrateArgs) -> Result<ExitCode, AnyError> {
    if args.mode.is_some() || args.create_roles {
        return Err("--mode and --create-roles work on one schema: pass --schema instead of --schemas / --databases".into());
    }
    let found = crate::tenants::list(settings, &args.select, false).await?;
    let mut changed = 0;
    for outbox in &found {
        let mut conn = outbox.pool.acquire().await?;
        let applied = postbox::sqlx::migrate(&mut conn, &outbox.schema)
            .await
            .map_err(|e| format!("{}: {e}", outbox.name))?;
        if applied.is_empty() {
            outln!("{} is up to date", outbox.name);
        } else {
            changed += 1;
            let list: Vec<String> = applied.iter().map(i32::to_string).collect();
            outln!("{}: applied migration(s) {}", outbox.name, list.join(", "));
        }
    }
    outln!(
        "{} schema(s): {changed} migrated, {} already up to date",
        found.len(),
        found.len() - changed
    );
    Ok(ExitCode::SUCCESS)
}

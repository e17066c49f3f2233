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
    /// Migrate these schemas instead of --schema (comma-separated or
    /// repeated), e.g. one per tenant; each gets the same --mode and
    /// --create-roles. Progress shows on a terminal.
    #[arg(long, value_name = "SCHEMA,…", value_delimiter = ',')]
    pub schemas: Vec<String>,
}

fn parse_mode(s: &str) -> Result<ReadMode, String> {
    s.parse()
}

pub async fn run(settings: &Settings, args: MigrateArgs) -> Result<ExitCode, AnyError> {
    let schemas = if args.schemas.is_empty() {
        vec![settings.schema.clone()]
    } else {
        args.schemas
            .iter()
            .map(|name| Schema::new(name.trim()).map_err(|e| format!("--schemas: {e}")))
            .collect::<Result<Vec<_>, _>>()?
    };
    if args.print_sql {
        for schema in &schemas {
            let roles = Roles::for_schema(schema)?;
            out!("{}", roles.sql(schema));
        }
        return Ok(ExitCode::SUCCESS);
    }
    let pool = settings.pool("postbox-migrate").await?;
    let mut progress = Progress::new("migrated", Some(schemas.len() as u64));
    for (done, schema) in schemas.iter().enumerate() {
        progress.update_with(done as u64, schema.name());
        let mut lines = Vec::new();
        let result = migrate_one(&pool, schema, &args, &mut lines).await;
        progress.finish();
        for line in lines {
            outln!("{line}");
        }
        result.map_err(|e| -> AnyError {
            if schemas.len() > 1 {
                format!("schema {schema}: {}", error_chain(e.as_ref())).into()
            } else {
                e
            }
        })?;
    }
    progress.update(schemas.len() as u64);
    progress.finish();
    Ok(ExitCode::SUCCESS)
}

/// Migrate one schema, then switch its producers' target and create its
/// roles when asked; what it did goes into `lines` (printed once the progress
/// line is cleared).
async fn migrate_one(
    pool: &PgPool,
    schema: &Schema,
    args: &MigrateArgs,
    lines: &mut Vec<String>,
) -> Result<(), AnyError> {
    let mut conn = pool.acquire().await?;
    let applied = postbox::sqlx::migrate(&mut conn, schema).await?;
    if applied.is_empty() {
        lines.push(format!("schema {schema} is up to date"));
    } else {
        let list: Vec<String> = applied.iter().map(i32::to_string).collect();
        lines.push(format!(
            "schema {schema}: applied migration(s) {}",
            list.join(", ")
        ));
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
            "schema {schema}: producers write into the {}",
            target.as_str()
        ));
    }
    if args.create_roles {
        let roles = Store::new(pool.clone(), schema.clone())
            .create_roles()
            .await?;
        lines.push(format!(
            "roles {}, {} and {} are in place (NOLOGIN: GRANT them to login users)",
            roles.producer, roles.relay, roles.monitor
        ));
    }
    Ok(())
}

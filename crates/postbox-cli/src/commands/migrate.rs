//! `postbox migrate`: create or upgrade postbox's schema, and optionally the
//! least-privilege roles.

use crate::context::{AnyError, Settings};
use clap::Args;
use postbox_relay::Store;
use postbox_store::Roles;
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
}

pub async fn run(settings: &Settings, args: MigrateArgs) -> Result<ExitCode, AnyError> {
    if args.print_sql {
        let roles = Roles::for_schema(&settings.schema)?;
        print!("{}", roles.sql(&settings.schema));
        return Ok(ExitCode::SUCCESS);
    }
    let pool = settings.pool("postbox-migrate").await?;
    let mut conn = pool.acquire().await?;
    let applied = postbox::sqlx::migrate(&mut conn, &settings.schema).await?;
    if applied.is_empty() {
        println!("schema {} is up to date", settings.schema);
    } else {
        let list: Vec<String> = applied.iter().map(i32::to_string).collect();
        println!(
            "schema {}: applied migration(s) {}",
            settings.schema,
            list.join(", ")
        );
    }
    drop(conn);
    if args.create_roles {
        let roles = Store::new(pool, settings.schema.clone())
            .create_roles()
            .await?;
        println!(
            "roles {}, {} and {} are in place (NOLOGIN: GRANT them to login users)",
            roles.producer, roles.relay, roles.monitor
        );
    }
    Ok(ExitCode::SUCCESS)
}

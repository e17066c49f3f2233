//! `postbox console`: serve the operator console, and manage its users.
//!
//! Only glue: the console itself is the `postbox-console` crate.

use crate::context::{cancel_on_signal, AnyError, Settings};
use crate::output::{errln, outln};
use clap::{Args, Subcommand};
use postbox_console::{Cidr, Console, ConsoleConfig, OutboxPatterns, Role};
use std::io::{BufRead, Write};
use std::process::ExitCode;
use tokio_util::sync::CancellationToken;

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct ConsoleArgs {
    #[command(subcommand)]
    pub command: Option<ConsoleCommand>,
    #[command(flatten)]
    pub serve: ServeArgs,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to serve the console on, e.g. 127.0.0.1:8088 (port 0: any free port)
    #[arg(
        long,
        env = "POSTBOX_CONSOLE_LISTEN",
        value_name = "ADDR",
        default_value = "127.0.0.1:8088"
    )]
    pub listen: String,
    /// Mark cookies Secure: set when users reach the console over HTTPS (through a TLS proxy)
    #[arg(long)]
    pub secure_cookies: bool,
    /// Dead letters per transaction (and per audit entry) in bulk actions
    #[arg(long, default_value_t = 500, value_name = "N")]
    pub batch_size: i64,
    /// How long a session lasts after signing in
    #[arg(long, default_value = "12h", value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub session_lifetime: std::time::Duration,
    /// A proxy (address or network, e.g. 10.0.0.0/8) whose X-Forwarded-For is believed; repeat for several [config: console.trusted_proxies]
    #[arg(long = "trusted-proxy", value_name = "CIDR")]
    pub trusted_proxies: Vec<Cidr>,

    /// Serve many outboxes, each under /o/<database>/<schema>/, with an
    /// overview of them all at / (users and sessions stay in --schema)
    #[command(flatten)]
    pub select: crate::tenants::SelectArgs,
}

#[derive(Subcommand, Debug)]
pub enum ConsoleCommand {
    /// Create a console user, or set an existing user's role, password and outboxes (their sessions end)
    AddUser(AddUserArgs),
    /// Remove a console user (their sessions end)
    RemoveUser(RemoveUserArgs),
}

#[derive(Args, Debug)]
pub struct AddUserArgs {
    /// User name: letters, digits, '.', '_', '-', '@' (at most 64)
    pub name: String,
    /// viewer (can look) or operator (can also replay and discard)
    #[arg(long, value_parser = ["viewer", "operator"])]
    pub role: String,
    /// The outboxes the role applies to, comma-separated: SCHEMA_GLOB or
    /// DATABASE_GLOB/SCHEMA_GLOB (`*` any run, `?` one character), e.g.
    /// 'tenant_a,tenant_b*'; '*' is every outbox. A new user without it may
    /// use every outbox; an existing one keeps its own
    #[arg(long, value_name = "PATTERNS")]
    pub outboxes: Option<String>,
    /// Read the password from the first line of standard input (required: never from a flag)
    #[arg(long, required = true)]
    pub password_stdin: bool,
}

#[derive(Args, Debug)]
pub struct RemoveUserArgs {
    pub name: String,
}

pub async fn run(settings: &Settings, args: ConsoleArgs) -> Result<ExitCode, AnyError> {
    match args.command {
        Some(ConsoleCommand::AddUser(a)) => add_user(settings, a).await,
        Some(ConsoleCommand::RemoveUser(a)) => remove_user(settings, a).await,
        None => serve(settings, args.serve).await,
    }
}

async fn add_user(settings: &Settings, args: AddUserArgs) -> Result<ExitCode, AnyError> {
    let role = Role::parse(&args.role)?;
    let outboxes = args
        .outboxes
        .as_deref()
        .map(OutboxPatterns::parse)
        .transpose()?;
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let password = line.trim_end_matches(['\r', '\n']);
    let pool = settings.pool("postbox-console").await?;
    let stored = postbox_console::set_user(
        &pool,
        &settings.schema,
        &args.name,
        role,
        outboxes.as_ref(),
        password,
    )
    .await?;
    let limit = if stored.outboxes.is_every() {
        String::new()
    } else {
        format!(", outboxes {}", stored.outboxes)
    };
    outln!(
        "{} console user {} ({}{limit})",
        if stored.created { "created" } else { "updated" },
        args.name,
        role.as_str()
    );
    Ok(ExitCode::SUCCESS)
}

async fn remove_user(settings: &Settings, args: RemoveUserArgs) -> Result<ExitCode, AnyError> {
    let pool = settings.pool("postbox-console").await?;
    if postbox_console::remove_user(&pool, &settings.schema, &args.name).await? {
        outln!("removed console user {}", args.name);
        Ok(ExitCode::SUCCESS)
    } else {
        errln!("no console user {}", args.name);
        Ok(ExitCode::FAILURE)
    }
}

async fn serve(settings: &Settings, args: ServeArgs) -> Result<ExitCode, AnyError> {
    let redactor = settings.file.redact.redactor()?;
    settings.warn_if_unredacted("the console");
    let pool = settings.pool("postbox-console").await?;
    let mut config = ConsoleConfig::new(settings.schema.clone());
    if crate::tenants::many(settings, &args.select) {
        config.outboxes = crate::tenants::console_sources(settings, &args.select)?;
        config.pool_size = settings.file.tenants.pool_size;
        config.rediscover_every = settings.file.tenants.rediscover_interval;
    }
    config.redactor = redactor;
    // The event page's "what each destination gets": from the relay's
    // destinations and routes in the same config file, when it has them.
    let file = &settings.file;
    if !file.destinations.is_empty() || file.sink.url.is_some() {
        let preview = super::route::Preview::from_file(file, None)
            .map_err(|e| format!("the config file's routes (for the event page's preview): {e}"))?;
        config.route_preview = Some(std::sync::Arc::new(preview));
    }
    config.secure_cookies = args.secure_cookies;
    config.batch_size = args.batch_size;
    config.session_lifetime = args.session_lifetime;
    config.trusted_proxies = if args.trusted_proxies.is_empty() {
        settings.file.console.trusted_proxies()?
    } else {
        args.trusted_proxies
    };
    if !(1..=postbox_store::MAX_BATCH).contains(&args.batch_size) {
        return Err(format!(
            "--batch-size must be between 1 and {}",
            postbox_store::MAX_BATCH
        )
        .into());
    }
    let console = Console::new(pool, config);
    console.check().await?;
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let addr = listener.local_addr()?;
    outln!("postbox console listening on http://{addr}");
    std::io::stdout().flush()?;
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    console.serve(listener, shutdown).await?;
    Ok(ExitCode::SUCCESS)
}

//! The commands other than `demo`.

use crate::config::FileConfig;
use crate::{db, Cli, Command, Global};
use clap::Args;
use postbox::{NewEvent, Outbox, Schema};
use postbox_relay::sinks::{self, SinkOptions};
use postbox_relay::{Relay, RelayConfig, RunMode, Store};
use std::process::ExitCode;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

pub type AnyError = Box<dyn std::error::Error + Send + Sync>;

/// How long one-shot commands keep retrying an unreachable database.
const CONNECT_PATIENCE: Duration = Duration::from_secs(15);

#[derive(Args, Debug)]
pub struct EnqueueArgs {
    /// Event type, e.g. order.created
    #[arg(long = "type", value_name = "TYPE")]
    pub event_type: String,
    /// Aggregate type, e.g. order
    #[arg(long)]
    pub aggregate_type: String,
    /// Aggregate id, e.g. 42
    #[arg(long)]
    pub aggregate_id: String,
    /// Payload as JSON
    #[arg(long)]
    pub payload: String,
    /// Header NAME=VALUE, forwarded by transports with headers (repeatable)
    #[arg(long = "header", value_name = "NAME=VALUE")]
    pub headers: Vec<String>,
    /// Payload schema version
    #[arg(long, default_value_t = 1)]
    pub schema_version: i32,
}

#[derive(Args, Debug)]
pub struct RelayArgs {
    /// Where to deliver: redis://HOST:PORT[/DB][?mode=list|stream&key=TEMPLATE] or stdout
    #[arg(long, env = "POSTBOX_SINK", hide_env_values = true)]
    pub sink: Option<String>,
    /// Events per claim [default: 500, or relay.batch_size in the config file]
    #[arg(long, env = "POSTBOX_BATCH_SIZE")]
    pub batch_size: Option<u32>,
    /// CloudEvents source attribute [default: postbox]
    #[arg(long, env = "POSTBOX_SOURCE")]
    pub source: Option<String>,
    /// Exit once nothing is pending or in flight, printing a summary
    #[arg(long)]
    pub drain: bool,
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Print JSON: pending, processing, sent, failed, oldest_pending_age_seconds
    #[arg(long)]
    pub json: bool,
}

/// Global settings after merging flags, environment and the config file.
pub struct Settings {
    pub file: FileConfig,
    pub database_url: Option<String>,
    pub schema: Schema,
}

impl Settings {
    pub fn resolve(global: &Global) -> Result<Self, AnyError> {
        let file = match &global.config {
            Some(path) => FileConfig::load(path)?,
            None => FileConfig::default(),
        };
        let schema_name = global
            .schema
            .clone()
            .or_else(|| file.schema.clone())
            .unwrap_or_else(|| "postbox".to_owned());
        let schema = Schema::new(&schema_name)?;
        let database_url = global
            .database_url
            .clone()
            .or_else(|| file.database_url.clone());
        Ok(Self {
            file,
            database_url,
            schema,
        })
    }

    pub async fn pool(&self, application: &str) -> Result<sqlx::PgPool, AnyError> {
        let options = db::options(self.database_url.as_deref(), application)?;
        Ok(db::pool(options, 4, CONNECT_PATIENCE).await?)
    }
}

pub async fn run(cli: Cli) -> Result<ExitCode, AnyError> {
    let settings = Settings::resolve(&cli.global)?;
    match cli.command {
        Command::Migrate => migrate(&settings).await,
        Command::Enqueue(args) => enqueue(&settings, args).await,
        Command::Relay(args) => relay(&settings, args).await,
        Command::Status(args) => status(&settings, args).await,
        Command::Demo(args) => crate::demo::run(&settings, args).await,
        Command::Receive(args) => crate::receive::run(&settings, args).await,
    }
}

async fn migrate(settings: &Settings) -> Result<ExitCode, AnyError> {
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
    Ok(ExitCode::SUCCESS)
}

async fn enqueue(settings: &Settings, args: EnqueueArgs) -> Result<ExitCode, AnyError> {
    let mut headers = Vec::new();
    for h in &args.headers {
        let (name, value) = h
            .split_once('=')
            .ok_or_else(|| format!("--header {h:?}: expected NAME=VALUE"))?;
        headers.push((name.to_owned(), value.to_owned()));
    }
    let event = NewEvent::from_json(
        args.event_type,
        args.aggregate_type,
        args.aggregate_id,
        args.payload,
    )?
    .schema_version(args.schema_version)?
    .headers(headers)?;
    let outbox = Outbox::new(settings.schema.clone());
    let pool = settings.pool("postbox-enqueue").await?;
    let mut tx = pool.begin().await?;
    let id = postbox::sqlx::enqueue(&outbox, &mut tx, &event).await?;
    tx.commit().await?;
    println!("{id}");
    Ok(ExitCode::SUCCESS)
}

/// The relay settings after merging flags, environment and file.
pub fn relay_config(
    settings: &Settings,
    args: &RelayArgs,
) -> Result<(RelayConfig, String, SinkOptions), AnyError> {
    let mut config = settings.file.relay.clone();
    if let Some(b) = args.batch_size {
        config.batch_size = b;
    }
    config.validate()?;
    let sink = args
        .sink
        .clone()
        .or_else(|| settings.file.sink.url.clone())
        .ok_or("no sink given: pass --sink (e.g. redis://127.0.0.1:6379 or stdout), set POSTBOX_SINK, or set [sink] url in the config file")?;
    let mut options = SinkOptions::default();
    if let Some(s) = args
        .source
        .clone()
        .or_else(|| settings.file.sink.source.clone())
    {
        options.source = s;
    }
    Ok((config, sink, options))
}

async fn relay(settings: &Settings, args: RelayArgs) -> Result<ExitCode, AnyError> {
    let (config, sink_url, sink_options) = relay_config(settings, &args)?;
    let sink = sinks::from_url(&sink_url, &sink_options)?;
    let options = db::options(settings.database_url.as_deref(), "postbox-relay")?;
    let pool = db::lazy_pool(options, 6);
    if let Err(e) = sink.check().await {
        tracing::warn!(error = %e, "the sink is not reachable yet; events will be retried until it is");
    }
    let store = Store::new(pool, settings.schema.clone());
    let relay = Relay::new(store, sink, config)?;
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    let mode = if args.drain {
        RunMode::Drain
    } else {
        RunMode::Forever
    };
    let stats = relay.run(mode, shutdown).await;
    if args.drain {
        println!(
            "drained: {} delivered, {} retried, {} dead-lettered, {} lost acknowledgements",
            stats.delivered, stats.retried, stats.dead_lettered, stats.lost_acks
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Cancel `token` on SIGINT or SIGTERM.
pub async fn cancel_on_signal(token: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!(
            "cannot install signal handlers; stop the relay with SIGKILL (leases will expire)"
        );
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("shutting down: no new claims; finishing in-flight batches");
    token.cancel();
}

async fn status(settings: &Settings, args: StatusArgs) -> Result<ExitCode, AnyError> {
    let pool = settings.pool("postbox-status").await?;
    let store = Store::new(pool, settings.schema.clone());
    let counts = store.status_counts().await?;
    if args.json {
        println!("{}", serde_json::to_string(&counts)?);
    } else {
        let age = counts
            .oldest_pending_age_seconds
            .map(|s| {
                humantime::format_duration(Duration::from_millis((s * 1000.0) as u64)).to_string()
            })
            .unwrap_or_else(|| "-".to_owned());
        println!("schema      {}", settings.schema);
        println!("pending     {}", counts.pending);
        println!("processing  {}", counts.processing);
        println!("sent        {}", counts.sent);
        println!("failed      {}", counts.failed);
        println!("oldest pending age  {age}");
    }
    Ok(ExitCode::SUCCESS)
}

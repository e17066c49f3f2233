//! The commands other than `demo`.

use crate::config::FileConfig;
use crate::{Cli, Command, Global};
use clap::Args;
use postbox::{NewEvent, Outbox, Schema};
use postbox_harness::db;
use postbox_relay::retention::{self, Progress, Table};
use postbox_relay::sinks::{self, SinkOptions};
use postbox_relay::store::{AttemptsCount, DestinationCounts, Roles, StatusCounts};
use postbox_relay::{
    Destination, PoisonPolicy, Relay, RelayConfig, RetentionConfig, Router, RunMode, Store,
};
use std::process::ExitCode;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

pub type AnyError = Box<dyn std::error::Error + Send + Sync>;

/// How often the relay refreshes its backlog gauges when metrics are served.
const GAUGE_INTERVAL: Duration = Duration::from_secs(5);
/// Least time between two progress lines of a long purge.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

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

#[derive(Args, Debug)]
pub struct PurgeArgs {
    /// Remove sent events acknowledged longer ago than this, e.g. 7d, 36h
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub older_than: Duration,
    /// Move the events to <schema>.outbox_archive instead of deleting them
    #[arg(long)]
    pub archive: bool,
    /// Rows per batch, each its own short transaction [default: 5000, or retention.batch_size]
    #[arg(long, value_name = "N")]
    pub batch_size: Option<u32>,
    /// Also delete inbox records processed longer ago than --older-than
    #[arg(long)]
    pub inbox: bool,
    /// Pause between batches [default: 100ms, or retention.pause]
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub pause: Option<Duration>,
}

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
    /// Serve Prometheus /metrics, /healthz and /readyz on ADDR, e.g. 0.0.0.0:9187
    #[arg(long, env = "POSTBOX_METRICS_LISTEN", value_name = "ADDR")]
    pub metrics_listen: Option<String>,
    /// Deliver each aggregate's events one at a time, in sequence (every route)
    #[arg(long)]
    pub ordered: bool,

    /// With --ordered: what a dead letter does to its aggregate: block (wait for
    /// an operator to replay or discard it) or skip (go on; consumers see the gap)
    #[arg(long, value_name = "POLICY", requires = "ordered", value_parser = parse_poison)]
    pub poison: Option<PoisonPolicy>,
}

fn parse_poison(s: &str) -> Result<PoisonPolicy, String> {
    match s {
        "block" => Ok(PoisonPolicy::Block),
        "skip" => Ok(PoisonPolicy::Skip),
        other => Err(format!("expected block or skip, got {other:?}")),
    }
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Print JSON: pending, processing, sent, failed, oldest_pending_age_seconds,
    /// oldest_pending_event_id, dead_letters, pending_attempts
    #[arg(long)]
    pub json: bool,
    /// Refresh every INTERVAL [default: 2s] until interrupted (JSON: one line per refresh)
    #[arg(long, value_name = "INTERVAL", num_args = 0..=1, default_missing_value = "2s",
          value_parser = humantime::parse_duration)]
    pub watch: Option<Duration>,
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
        Ok(db::pool(options, 4, db::CONNECT_PATIENCE).await?)
    }
}

pub async fn run(cli: Cli) -> Result<ExitCode, AnyError> {
    let settings = Settings::resolve(&cli.global)?;
    match cli.command {
        Command::Migrate(args) => migrate(&settings, args).await,
        Command::Enqueue(args) => enqueue(&settings, args).await,
        Command::Relay(args) => relay(&settings, args).await,
        Command::Status(args) => status(&settings, args).await,
        Command::Purge(args) => purge(&settings, args).await,
        Command::Dlq(args) => crate::dlq::run(&settings, args).await,
        Command::Demo(args) => crate::demo::run(&settings, args).await,
        Command::Bench(args) => crate::bench::run(&settings, args).await,
        Command::Receive(args) => crate::receive::run(&settings, args).await,
        Command::Console(args) => crate::console::run(&settings, args).await,
        Command::Verify(args) => crate::verify::run(&settings, args).await,
    }
}

async fn migrate(settings: &Settings, args: MigrateArgs) -> Result<ExitCode, AnyError> {
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

/// The relay settings after merging flags, environment and file, and the
/// destinations they name: `--sink` / `[sink]` (one destination, every event),
/// or `[destinations.*]` with `[[routes]]`.
pub fn relay_config(
    settings: &Settings,
    args: &RelayArgs,
) -> Result<(RelayConfig, Router), AnyError> {
    let file = &settings.file;
    let mut config = file.relay.clone();
    if let Some(b) = args.batch_size {
        config.batch_size = b;
    }
    config.validate()?;
    let source = args.source.clone();
    let sink_options = |section: &crate::config::SinkSection| {
        let mut options = SinkOptions {
            http: section.http.clone(),
            qstash: section.qstash.clone(),
            ..SinkOptions::default()
        };
        if let Some(s) = source.clone().or_else(|| section.source.clone()) {
            options.source = s;
        }
        options
    };
    let router = if file.destinations.is_empty() {
        if !file.routes.is_empty() {
            return Err("routes: [[routes]] need [destinations.NAME] sections to send to".into());
        }
        let url = args
            .sink
            .clone()
            .or_else(|| file.sink.url.clone())
            .ok_or("no sink given: pass --sink (e.g. redis://127.0.0.1:6379 or stdout), set POSTBOX_SINK, set [sink] url, or define [destinations.NAME] and [[routes]] in the config file")?;
        Router::single(sinks::from_url(&url, &sink_options(&file.sink))?)
    } else {
        if args.sink.is_some() || file.sink.url.is_some() {
            return Err("give either a single sink (--sink, POSTBOX_SINK or [sink]) or [destinations.NAME] with [[routes]], not both".into());
        }
        let mut destinations = Vec::with_capacity(file.destinations.len());
        for (name, section) in &file.destinations {
            let url = section
                .url
                .as_deref()
                .ok_or_else(|| format!("destinations.{name}.url: missing"))?;
            let sink = sinks::from_url(url, &sink_options(section))
                .map_err(|e| format!("destinations.{name}: {e}"))?;
            destinations.push(Destination {
                name: name.clone(),
                sink,
            });
        }
        Router::new(destinations, &file.routes)?
    };
    let router = if args.ordered {
        router.all_ordered(args.poison.unwrap_or_default())
    } else {
        router
    };
    Ok((config, router))
}

async fn relay(settings: &Settings, args: RelayArgs) -> Result<ExitCode, AnyError> {
    let (config, router) = relay_config(settings, &args)?;
    let options = db::options(settings.database_url.as_deref(), "postbox-relay")?;
    let pool = db::lazy_pool(options, 6);
    check_schema(&pool, &settings.schema).await?;
    for d in router.destinations() {
        if let Err(e) = d.sink.check().await {
            tracing::warn!(destination = %d.name, error = %e, "the destination is not reachable yet; its events will be retried until it is");
        }
    }
    let sinks: Vec<_> = router
        .destinations()
        .iter()
        .map(|d| d.sink.clone())
        .collect();
    let store = Store::new(pool, settings.schema.clone());
    let mut relay = Relay::with_router(store.clone(), router, config)?;
    relay = relay.with_health(settings.file.health.clone())?;
    let retention = &settings.file.retention;
    if retention.enabled {
        relay = relay.with_retention(retention.clone())?;
        tracing::info!(
            older_than = %humantime::format_duration(retention.older_than),
            archive = retention.archive,
            inbox = retention.inbox,
            "retention is on"
        );
    }
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    let serving = CancellationToken::new();
    let _stop_serving = serving.clone().drop_guard();
    if let Some(addr) = &args.metrics_listen {
        let endpoint = crate::observe::Endpoint::bind(addr, store, sinks).await?;
        if let Some(bound) = endpoint.local_addr() {
            tracing::info!("serving /metrics, /healthz and /readyz on http://{bound}");
        }
        tokio::spawn(endpoint.serve(serving.clone()));
        relay = relay.with_gauges(GAUGE_INTERVAL)?;
    }
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

/// Refuse to relay from a schema that is missing or behind this binary's
/// migrations. An unreachable database is not an error here: the relay
/// retries it with backoff.
async fn check_schema(pool: &sqlx::PgPool, schema: &Schema) -> Result<(), AnyError> {
    let latest = postbox::MIGRATIONS.last().map_or(0, |m| m.version);
    let applied = async {
        let mut conn = pool.acquire().await?;
        postbox::sqlx::applied_version(&mut conn, schema).await
    };
    match applied.await {
        Ok(Some(v)) if v >= latest => Ok(()),
        Ok(Some(v)) => Err(format!(
            "schema {schema} is at migration {v}, this relay needs {latest}: run `postbox migrate` first"
        )
        .into()),
        Ok(None) => Err(format!(
            "schema {schema} has no postbox tables: run `postbox migrate` first (or pass the right --schema)"
        )
        .into()),
        Err(e) => {
            tracing::warn!(
                error = %postbox_harness::error_chain(&e),
                "cannot check the schema version yet; the relay will retry the database"
            );
            Ok(())
        }
    }
}

/// Cancel `token` on SIGINT or SIGTERM.
pub async fn cancel_on_signal(token: CancellationToken) {
    shutdown_signal().await;
    token.cancel();
}

/// Resolves on SIGINT or SIGTERM (saying so in the log); never, when the
/// signal handlers cannot be installed. The handlers are installed when it
/// is first polled.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!(
            "cannot install signal handlers; stop the relay with SIGKILL (leases will expire)"
        );
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("shutting down: no new claims; finishing in-flight batches");
}

/// `postbox status --json`: the original keys first, then the additions.
#[derive(serde::Serialize)]
struct StatusReport {
    #[serde(flatten)]
    counts: StatusCounts,
    oldest_pending_event_id: Option<uuid::Uuid>,
    dead_letters: i64,
    pending_attempts: Vec<AttemptsCount>,
    /// Fan-out events' retries and dead letters per destination.
    destinations: Vec<DestinationCounts>,
}

async fn status_report(store: &Store) -> Result<StatusReport, sqlx::Error> {
    let counts = store.status_counts().await?;
    let gauges = store.gauges().await?;
    let pending_attempts = store.pending_attempts().await?;
    let destinations = store.destination_counts().await?;
    Ok(StatusReport {
        dead_letters: counts.failed,
        counts,
        oldest_pending_event_id: gauges.oldest_pending_event_id,
        pending_attempts,
        destinations,
    })
}

fn format_age(secs: Option<f64>) -> String {
    secs.map(|s| {
        humantime::format_duration(Duration::from_secs(s.max(0.0).round() as u64)).to_string()
    })
    .unwrap_or_else(|| "-".to_owned())
}

fn render_status(schema: &Schema, r: &StatusReport) -> String {
    use std::fmt::Write;
    let c = &r.counts;
    let mut out = String::new();
    let _ = writeln!(out, "schema      {schema}");
    let _ = writeln!(out, "pending     {}", c.pending);
    let _ = writeln!(out, "processing  {}", c.processing);
    let _ = writeln!(out, "sent        {}", c.sent);
    let _ = writeln!(out, "failed      {}  (dead letters)", c.failed);
    let _ = writeln!(
        out,
        "oldest pending age  {}",
        format_age(c.oldest_pending_age_seconds)
    );
    if let Some(id) = r.oldest_pending_event_id {
        let _ = writeln!(out, "oldest pending event  {id}");
    }
    if !r.pending_attempts.is_empty() {
        let parts: Vec<String> = r
            .pending_attempts
            .iter()
            .map(|a| format!("{}: {}", a.attempts, a.count))
            .collect();
        let _ = writeln!(out, "pending by attempts  {}", parts.join(", "));
    }
    if !r.destinations.is_empty() {
        let _ = writeln!(out, "fan-out by destination  (retrying / dead letters / delivered after a retry / most attempts)");
        for d in &r.destinations {
            let _ = writeln!(
                out,
                "  {:<20} {} / {} / {} / {}",
                d.destination, d.retrying, d.dead_letters, d.delivered_after_retry, d.max_attempts
            );
        }
    }
    out
}

async fn status(settings: &Settings, args: StatusArgs) -> Result<ExitCode, AnyError> {
    let pool = settings.pool("postbox-status").await?;
    let store = Store::new(pool, settings.schema.clone());
    let Some(every) = args.watch else {
        let report = status_report(&store).await?;
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            print!("{}", render_status(&settings.schema, &report));
        }
        return Ok(ExitCode::SUCCESS);
    };
    if every.is_zero() {
        return Err("--watch: the interval must be greater than zero".into());
    }
    let stop = CancellationToken::new();
    tokio::spawn(cancel_on_signal(stop.clone()));
    while !stop.is_cancelled() {
        let shown = match status_report(&store).await {
            Ok(r) if args.json => serde_json::to_string(&r)?,
            Ok(r) => render_status(&settings.schema, &r),
            Err(e) => format!(
                "error: {}",
                postbox_relay::redact::sanitize_error(&e.to_string())
            ),
        };
        if args.json {
            println!("{shown}");
        } else {
            // Home the cursor and clear the screen, then redraw.
            print!(
                "\x1b[H\x1b[2J{}\n{shown}",
                chrono::Local::now().format("%Y-%m-%d %H:%M:%S")
            );
        }
        use std::io::Write;
        let _ = std::io::stdout().flush();
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.cancelled() => {}
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn purge(settings: &Settings, args: PurgeArgs) -> Result<ExitCode, AnyError> {
    let file = &settings.file.retention;
    let config = RetentionConfig {
        enabled: false,
        older_than: args.older_than,
        archive: args.archive || file.archive,
        inbox: args.inbox || file.inbox,
        batch_size: args.batch_size.unwrap_or(file.batch_size),
        pause: args.pause.unwrap_or(file.pause),
        interval: file.interval,
        vacuum: file.vacuum,
    };
    config.validate()?;
    let pool = settings.pool("postbox-purge").await?;
    let store = Store::new(pool, settings.schema.clone());
    let stop = CancellationToken::new();
    tokio::spawn(cancel_on_signal(stop.clone()));
    let verb = if config.archive {
        "archived"
    } else {
        "deleted"
    };
    let mut last_line = Instant::now();
    let report = retention::purge(&store, &config, &stop, |p: Progress| {
        if last_line.elapsed() >= PROGRESS_EVERY {
            last_line = Instant::now();
            let what = match p.table {
                Table::Outbox => format!("{} sent events {verb}", p.removed),
                Table::Inbox => format!("{} inbox records deleted", p.removed),
                Table::IdempotencyKeys => {
                    format!("{} expired idempotency keys deleted", p.removed)
                }
            };
            eprintln!(
                "purge: {what} so far ({})",
                humantime::format_duration(Duration::from_secs(p.elapsed.as_secs()))
            );
        }
    })
    .await?;
    let mut line = format!("purged: {} sent events {verb}", report.outbox);
    if config.inbox {
        line.push_str(&format!(", {} inbox records deleted", report.inbox));
    }
    if report.idempotency_keys > 0 {
        line.push_str(&format!(
            ", {} expired idempotency keys deleted",
            report.idempotency_keys
        ));
    }
    if report.interrupted {
        line.push_str(" (interrupted)");
    }
    println!("{line}");
    Ok(ExitCode::SUCCESS)
}

//! Many outboxes from one command: the `[[outboxes]]` and `[tenants]`
//! sections of the config file and the `--schemas` / `--databases` flags,
//! shared by `relay` (one process serving them all, see
//! `postbox_relay::tenants`), `migrate`, `status`, `dlq` and `console`.

use crate::context::{AnyError, Settings};
use crate::metrics_endpoint;
use clap::Args;
use postbox::Schema;
use postbox_relay::{
    OutboxSource, RelayConfig, RouteConfig, Router, RunMode, SinkError, Tenants, TenantsConfig,
};
use postbox_store::connect as db;
use postbox_store::directory::{self, NamePattern, Presence, Schemas, Source};
use sqlx::postgres::PgConnectOptions;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Builds an outbox's own router from its `routes`.
pub type RoutesFn<'a> = &'a dyn Fn(&[RouteConfig]) -> Result<Router, AnyError>;

/// `--schemas` and `--databases`: which outboxes a command works on.
#[derive(Args, Debug, Clone, Default)]
pub struct SelectArgs {
    /// Every schema of the database whose name matches GLOB (`*` any run,
    /// `?` one character), e.g. 'tenant_*'; with --databases, inside each
    /// matching database. `relay` serves (and `status` shows) those holding
    /// an outbox, `migrate` migrates them all
    #[arg(long, value_name = "GLOB")]
    pub schemas: Option<String>,
    /// Every database of the server whose name matches GLOB, e.g. 'app_*'
    /// (listed through --database-url's database); inside each, the schemas
    /// --schemas matches, or --schema
    #[arg(long, value_name = "GLOB")]
    pub databases: Option<String>,
}

/// Whether the command works on many outboxes rather than `--schema`.
pub fn many(settings: &Settings, select: &SelectArgs) -> bool {
    select.schemas.is_some() || select.databases.is_some() || !settings.file.outboxes.is_empty()
}

fn connect(settings: &Settings, url: Option<&str>) -> Result<PgConnectOptions, AnyError> {
    Ok(db::options(
        url.or(settings.database_url.as_deref()),
        "postbox-relay",
    )?)
}

fn pattern(flag: &str, glob: &str) -> Result<NamePattern, AnyError> {
    NamePattern::parse(glob).map_err(|e| format!("{flag} {glob:?}: {e}").into())
}

/// The outboxes the flags and `[[outboxes]]` name; `routes` builds an
/// outbox's own router from its `routes`.
pub fn sources(
    settings: &Settings,
    select: &SelectArgs,
    routes: Option<RoutesFn<'_>>,
) -> Result<Vec<OutboxSource>, AnyError> {
    let mut sources = Vec::new();
    if select.schemas.is_some() || select.databases.is_some() {
        let schemas = match &select.schemas {
            Some(glob) => pattern("--schemas", glob)?,
            None => pattern("--schema", settings.schema.name())?,
        };
        let databases = match &select.databases {
            Some(glob) => Some(pattern("--databases", glob)?),
            None => None,
        };
        sources.push(OutboxSource::Discover {
            connect: connect(settings, None)?,
            databases,
            schemas,
        });
    }
    for (i, o) in settings.file.outboxes.iter().enumerate() {
        let field = format!("outboxes[{i}]");
        let schema = Schema::new(&o.schema).map_err(|e| format!("{field}.schema: {e}"))?;
        let connect =
            connect(settings, o.url.as_deref()).map_err(|e| format!("{field}.url: {e}"))?;
        let router = match (&o.routes, routes) {
            (Some(r), Some(routes)) => Some(Arc::new(
                routes(r).map_err(|e| format!("{field}.routes: {e}"))?,
            )),
            _ => None,
        };
        sources.push(OutboxSource::Outbox {
            connect,
            schema,
            with: router,
        });
    }
    Ok(sources)
}

/// The outboxes the flags and `[[outboxes]]` name, as `postbox console`
/// serves them: the same selection, connecting as `postbox-console` (so the
/// console's connections are not counted among the relays).
pub fn console_sources(settings: &Settings, select: &SelectArgs) -> Result<Vec<Source>, AnyError> {
    Ok(sources(settings, select, None)?
        .into_iter()
        .map(|source| match source.map(drop) {
            Source::Outbox {
                connect, schema, ..
            } => Source::Outbox {
                connect: connect.application_name(CONSOLE_APPLICATION),
                schema,
                with: (),
            },
            Source::Discover {
                connect,
                databases,
                schemas,
            } => Source::Discover {
                connect: connect.application_name(CONSOLE_APPLICATION),
                databases,
                schemas,
            },
        })
        .collect())
}

const CONSOLE_APPLICATION: &str = "postbox-console";

/// One outbox as `migrate` and `status` see it.
pub struct Found {
    /// `<database>/<schema>`.
    pub name: String,
    pub pool: sqlx::PgPool,
    pub schema: Schema,
}

/// List the outboxes (`migrated`: only schemas holding an outbox; otherwise
/// every matching schema, for `migrate`), each with a small pool.
pub async fn list(
    settings: &Settings,
    select: &SelectArgs,
    migrated: bool,
) -> Result<Vec<Found>, AnyError> {
    let sources = sources(settings, select, None)?;
    let which = if migrated {
        Schemas::Migrated
    } else {
        Schemas::All
    };
    let mut pools: std::collections::HashMap<String, sqlx::PgPool> = Default::default();
    let mut pool = |key: &str, connect: &PgConnectOptions| {
        pools
            .entry(key.to_owned())
            .or_insert_with(|| db::lazy_pool(connect.clone(), 2))
            .clone()
    };
    let listing = directory::list(&sources, which, &mut pool).await;
    if let Some(unlisted) = listing.unlisted.into_iter().next() {
        return Err(format!(
            "cannot list the outboxes of {}: {}",
            unlisted.what,
            postbox_relay::redact::sanitize_error(&unlisted.error.to_string())
        )
        .into());
    }
    let found: Vec<Found> = listing
        .found
        .into_iter()
        // `migrate` creates a listed outbox's schema; the others show and
        // serve only what exists.
        .filter(|o| {
            o.presence == Presence::Present || (!migrated && o.presence == Presence::Missing)
        })
        .map(|o| Found {
            name: o.name(),
            pool: o.pool,
            schema: o.schema,
        })
        .collect();
    if found.is_empty() {
        return Err("no schema matches: check --schemas / --databases (and, for `relay` and `status`, that the schemas are migrated)".into());
    }
    Ok(found)
}

/// What `postbox relay` passes on when serving many outboxes.
pub struct RelayRun<'a> {
    pub config: RelayConfig,
    pub router: Router,
    pub routes: RoutesFn<'a>,
    pub source: Option<String>,
    pub drain: bool,
    pub metrics_listen: Option<String>,
    /// How often a single outbox's backlog gauges are refreshed.
    pub gauge_interval: std::time::Duration,
}

/// `postbox relay` over many outboxes: one process, shared pools and LISTEN
/// connections per database, a global cap on batches in flight.
pub async fn relay(
    settings: &Settings,
    select: &SelectArgs,
    run: RelayRun<'_>,
) -> Result<std::process::ExitCode, AnyError> {
    let section = &settings.file.tenants;
    let sources = sources(settings, select, Some(run.routes))?;
    // Per-outbox backlog gauges only make sense labelled by outbox; at most
    // one refresh per outbox every idle_poll (hundreds of outboxes).
    let gauges = (run.metrics_listen.is_some() && !section.aggregate_metrics)
        .then(|| section.idle_poll.max(run.gauge_interval));
    let retention = settings.file.retention.enabled.then(|| {
        let r = &settings.file.retention;
        tracing::info!(
            older_than = %humantime::format_duration(r.older_than),
            archive = r.archive,
            inbox = r.inbox,
            "retention is on, for every outbox"
        );
        r.clone()
    });
    let config = TenantsConfig {
        relay: run.config,
        max_in_flight_batches: section.max_in_flight_batches,
        pool_size: section.pool_size,
        rediscover_interval: section.rediscover_interval,
        idle_poll: section.idle_poll,
        source: run
            .source
            .or_else(|| settings.file.sink.source.clone())
            .unwrap_or_else(|| postbox_relay::cloudevents::DEFAULT_SOURCE.to_owned()),
        gauges,
        retention,
        health: settings
            .file
            .health
            .enabled
            .then(|| settings.file.health.clone()),
    };
    for d in run.router.destinations() {
        match d.sink.check().await.map_err(|e| e.masked(d.sink.secrets())) {
            Ok(()) => {}
            Err(e @ SinkError::Misconfigured { .. }) => {
                return Err(format!("destination {}: {e}", d.name).into());
            }
            Err(e) => {
                tracing::warn!(destination = %d.name, error = %e, "the destination is not reachable yet; its events will be retried until it is");
            }
        }
    }
    let sinks: Vec<_> = run
        .router
        .destinations()
        .iter()
        .map(|d| d.sink.clone())
        .collect();
    let tenants = Arc::new(Tenants::new(config, sources, run.router)?);
    let serving = CancellationToken::new();
    let _stop_serving = serving.clone().drop_guard();
    if let Some(addr) = &run.metrics_listen {
        // /readyz checks the database --database-url names.
        let options = db::options(settings.database_url.as_deref(), "postbox-relay")?;
        let store = postbox_relay::Store::new(db::lazy_pool(options, 1), settings.schema.clone());
        let endpoint = metrics_endpoint::Endpoint::bind_labelled(
            addr,
            store,
            sinks,
            section.aggregate_metrics,
        )
        .await?
        .with_outboxes(tenants.clone());
        if let Some(bound) = endpoint.local_addr() {
            tracing::info!("serving /metrics, /healthz, /readyz and /outboxes on http://{bound}");
        }
        tokio::spawn(endpoint.serve(serving.clone()));
    }
    let shutdown = CancellationToken::new();
    tokio::spawn(crate::context::cancel_on_signal(shutdown.clone()));
    let mode = if run.drain {
        RunMode::Drain
    } else {
        RunMode::Forever
    };
    let stats = tenants.run(mode, shutdown).await;
    if run.drain {
        crate::output::outln!(
            "drained {} outboxes: {} delivered, {} retried, {} dead-lettered, {} lost acknowledgements",
            tenants.status().len(),
            stats.delivered,
            stats.retried,
            stats.dead_lettered,
            stats.lost_acks
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}

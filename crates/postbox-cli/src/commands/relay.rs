//! `postbox relay`: deliver committed events to the configured destinations,
//! forever or until drained; optionally serving metrics and health.

use crate::config::SinkSection;
use crate::context::{cancel_on_signal, error_chain, name_the_flag, AnyError, Settings};
use crate::metrics_endpoint;
use crate::output::outln;
use clap::Args;
use postbox::Schema;
use postbox_relay::sinks;
use postbox_relay::{
    Destination, PoisonPolicy, ReadMode, Relay, RelayConfig, Router, RunMode, Sink, SinkError,
    StartError, Store,
};
use postbox_store::connect as db;
use std::process::ExitCode;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often the relay refreshes its backlog gauges when metrics are served.
const GAUGE_INTERVAL: Duration = Duration::from_secs(5);

#[derive(Args, Debug)]
pub struct RelayArgs {
    /// Where to deliver: a sink URL (--help lists every scheme)
    #[arg(long, env = "POSTBOX_SINK", hide_env_values = true, long_help = sink_help())]
    pub sink: Option<String>,
    /// How to read events: claim (the outbox table), log (the append-only
    /// log, for a schema migrated with --mode log) or logical (events emitted
    /// into the WAL, read from a replication slot; needs wal_level = logical)
    /// [default: relay.mode in the config file, or claim]
    #[arg(long, value_name = "MODE", value_parser = super::parse_mode)]
    pub mode: Option<ReadMode>,
    /// Logical mode: the replication slot to read, created on first start
    /// [default: relay.logical_slot in the config file, or postbox_<schema>]
    #[arg(long, value_name = "NAME")]
    pub slot: Option<String>,
    /// Log mode: into how many partitions each destination's cursor is
    /// split (1–1024, by a hash of the aggregate), so several relays share
    /// one destination [default: relay.log_partitions in the config file, or 1]
    #[arg(long, value_name = "N")]
    pub log_partitions: Option<u16>,
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

    /// Serve many outboxes from this one process (with `[[outboxes]]`)
    #[command(flatten)]
    pub select: crate::tenants::SelectArgs,
}

fn sink_help() -> String {
    format!(
        "Where to deliver, one of the sinks built into this binary:\n{}",
        postbox_relay::sinks::scheme_help()
    )
}

fn parse_poison(s: &str) -> Result<PoisonPolicy, String> {
    match s {
        "block" => Ok(PoisonPolicy::Block),
        "skip" => Ok(PoisonPolicy::Skip),
        other => Err(format!("expected block or skip, got {other:?}")),
    }
}

/// The relay settings after merging flags, environment and file, and the
/// destinations they name: `--sink` / `[sink]` (one destination, every event),
/// or `[destinations.*]` with `[[routes]]`.
pub fn resolve_relay(
    settings: &Settings,
    args: &RelayArgs,
) -> Result<(RelayConfig, Router), AnyError> {
    let file = &settings.file;
    let mut config = file.relay.clone();
    if let Some(b) = args.batch_size {
        config.batch_size = b;
    }
    if let Some(mode) = args.mode {
        config.mode = mode;
    }
    if let Some(slot) = &args.slot {
        config.logical_slot = Some(slot.clone());
    }
    if let Some(n) = args.log_partitions {
        config.log_partitions = n;
    }
    config.validate().map_err(|e| {
        name_the_flag(
            e,
            &[
                (
                    "relay.batch_size",
                    "--batch-size",
                    args.batch_size.is_some(),
                ),
                ("relay.logical_slot", "--slot", args.slot.is_some()),
                (
                    "relay.log_partitions",
                    "--log-partitions",
                    args.log_partitions.is_some(),
                ),
            ],
        )
    })?;
    let source = args.source.clone();
    let router = router_of(file, args.sink.as_deref(), &|owner, url, section| {
        sinks::from_url(url, &section.sink_options(source.clone())).map_err(|e| match owner {
            "sink" => e.into(),
            owner => format!("{owner}: {e}").into(),
        })
    })?;
    let router = if args.ordered {
        router.all_ordered(args.poison.unwrap_or_default())
    } else {
        router
    };
    // What [redact] hides wherever an event is shown is masked in what a
    // destination answers too.
    let redactor = file.redact.redactor().map_err(|e| format!("redact: {e}"))?;
    Ok((config, router.with_redactor(redactor)))
}

/// Makes the sink of one section: `owner` (`sink`, `destinations.NAME`),
/// its URL and the section.
pub(crate) type MakeSink<'a> =
    &'a dyn Fn(&str, &str, &SinkSection) -> Result<std::sync::Arc<dyn Sink>, AnyError>;

/// The destinations and routes of the configuration: `sink` (`--sink`) or
/// `[sink]` (one destination, every event), or `[destinations.*]` with
/// `[[routes]]`, each destination's sink made by `make`, every expression
/// compiled (an error names the field and the position).
pub(crate) fn router_of(
    file: &crate::config::FileConfig,
    sink: Option<&str>,
    make: MakeSink<'_>,
) -> Result<Router, AnyError> {
    if file.destinations.is_empty() {
        if !file.routes.is_empty() {
            return Err("routes: [[routes]] need [destinations.NAME] sections to send to".into());
        }
        let url = sink
            .or(file.sink.url.as_deref())
            .ok_or("no sink given: pass --sink (e.g. redis://127.0.0.1:6379 or stdout), set POSTBOX_SINK, set [sink] url, or define [destinations.NAME] and [[routes]] in the config file")?;
        let shape = shape_of("sink", &file.sink)?;
        return Ok(Router::single_shaped(make("sink", url, &file.sink)?, shape));
    }
    if sink.is_some() || file.sink.url.is_some() {
        return Err("give either a single sink (--sink, POSTBOX_SINK or [sink]) or [destinations.NAME] with [[routes]], not both".into());
    }
    let mut destinations = Vec::with_capacity(file.destinations.len());
    let starts = file.starts()?;
    for ((name, section), start) in file.destinations.iter().zip(starts) {
        let owner = format!("destinations.{name}");
        let url = section
            .url
            .as_deref()
            .ok_or_else(|| format!("{owner}.url: missing"))?;
        let sink = make(&owner, url, section)?;
        let shape = shape_of(&owner, section)?;
        destinations.push(
            Destination::new(name.clone(), sink)
                .with_shape(shape)
                .with_start(start),
        );
    }
    Ok(Router::new(destinations, &file.routes)?)
}

/// The expressions of a `[sink]` or `[destinations.NAME]` section, compiled;
/// an error names the field and the position.
pub(crate) fn shape_of(
    owner: &str,
    section: &SinkSection,
) -> Result<postbox_relay::shape::Shape, postbox_relay::ConfigError> {
    postbox_relay::shape::Shape::compile(
        owner,
        section.filter.as_deref(),
        section.transform.as_deref(),
        section.headers.as_deref(),
    )
}

pub async fn run(settings: &Settings, args: RelayArgs) -> Result<ExitCode, AnyError> {
    let (config, router) = resolve_relay(settings, &args)?;
    if crate::tenants::many(settings, &args.select) {
        // An outbox's own `routes` send to the relay's destinations.
        let destinations = router.destinations().to_vec();
        let redactor = router.redactor().cloned();
        let (ordered, poison) = (args.ordered, args.poison.unwrap_or_default());
        let routes = move |routes: &[postbox_relay::RouteConfig]| -> Result<Router, AnyError> {
            let router = Router::new(destinations.clone(), routes)?;
            let router = if ordered {
                router.all_ordered(poison)
            } else {
                router
            };
            Ok(match redactor.clone() {
                Some(r) => router.with_redactor(r),
                None => router,
            })
        };
        let run = crate::tenants::RelayRun {
            config,
            router,
            routes: &routes,
            source: args.source.clone(),
            drain: args.drain,
            metrics_listen: args.metrics_listen.clone(),
            gauge_interval: GAUGE_INTERVAL,
        };
        return crate::tenants::relay(settings, &args.select, run).await;
    }
    let options = db::options(settings.database_url.as_deref(), "postbox-relay")?;
    let pool = db::lazy_pool(options, 6);
    check_schema(&pool, &settings.schema).await?;
    for d in router.destinations() {
        match d.sink.check().await.map_err(|e| e.masked(d.sink.secrets())) {
            Ok(()) => {}
            // The broker answered and what the configuration names is not
            // there: say so and stop, rather than retry for ever. Events stay
            // in the outbox.
            Err(e @ SinkError::Misconfigured { .. }) => {
                return Err(format!("destination {}: {e}", d.name).into());
            }
            Err(e) => {
                tracing::warn!(destination = %d.name, error = %e, "the destination is not reachable yet; its events will be retried until it is");
            }
        }
    }
    let sinks: Vec<_> = router
        .destinations()
        .iter()
        .map(|d| d.sink.clone())
        .collect();
    let store = Store::new(pool, settings.schema.clone());
    let mut relay = Relay::with_router(store.clone(), router, config)?;
    match relay.check_start().await {
        Ok(()) => {}
        Err(e @ StartError::UnnumberedEmits { .. }) => return Err(e.into()),
        // Unreachable for now: the logical reader checks again before it
        // reads.
        Err(e) => {
            tracing::warn!(error = %error_chain(&e), "cannot check logical mode's settings yet; the relay will retry the database");
        }
    }
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
        let endpoint = metrics_endpoint::Endpoint::bind(addr, store, sinks)
            .await?
            .with_reader(relay.stats());
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
        outln!(
            "drained: {} delivered, {} retried, {} dead-lettered, {} lost acknowledgements",
            stats.delivered,
            stats.retried,
            stats.dead_lettered,
            stats.lost_acks
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
                error = %error_chain(&e),
                "cannot check the schema version yet; the relay will retry the database"
            );
            Ok(())
        }
    }
}

//! One relay process serving many outboxes: every schema matching a pattern
//! in a database, every matching database of a server, and outboxes listed
//! one by one — re-discovered periodically, so outboxes come and go without a
//! restart.
//!
//! This is a layer above the engine, not a second engine: each outbox runs
//! its own [`Relay`] (with every guarantee of one: leases, retries, dead
//! letters, ordering, fan-out), and the layer shares what 300 relay
//! processes would each hold:
//!
//! - **one pool per database** (not per schema), of `pool_size` connections,
//!   which closes idle connections after a few seconds;
//! - **one LISTEN connection per database** ([`listen`]), which wakes the
//!   outbox a notification names; an idle outbox costs no query until its slow
//!   poll (`idle_poll`), which catches what a lost notification missed;
//! - **one router** (so one set of sinks and broker connections) for every
//!   outbox that has no routes of its own;
//! - **a global cap on batches in flight** (`max_in_flight_batches`): each
//!   engine takes a permit ([`permits`]) before each batch (a claim, in
//!   log mode a round of one of its readers, in logical mode a batch read
//!   from its slot) and gives it back once the batch is settled.
//!
//! Every outbox runs in the relay's one mode (`relay.mode`). In logical
//! mode each reads its own replication slot, `postbox_<schema>` (a slot
//! name set in the configuration is refused: one slot cannot serve two
//! outboxes), on a connection of its own outside the pool (the slot's
//! lock) and, over the `stream` transport, a replication connection.
//!
//! **Fairness.** A quarter of the permits (at least one, when there are two
//! or more) is reserved for outboxes with no batch in flight; the rest are
//! shared, first come, first served, and an engine asks for one permit at a
//! time (all its log readers and its claimer together) and counts as having
//! nothing in flight only while it holds none. An outbox draining a backlog asks for its next batch while the
//! previous ones are still in flight, so it only ever waits on the shared
//! permits: busy outboxes take turns there, one batch per turn, and an event
//! committed in a quiet outbox finds a reserved permit free instead of
//! waiting for a busy batch to settle, however many busy outboxes there are
//! and however long their backlogs.
//!
//! **Isolation.** Every outbox runs in its own task, inside a span and a
//! metrics scope naming it ([`label`]): a database that is down, a schema that
//! is missing or dropped, or events a sink rejects affect that outbox only.
//! Its errors are logged with its name and counted (its engine's database
//! errors in `postbox_database_errors_total`, the layer's troubles in
//! `postbox_outbox_errors_total` and in [`OutboxStatus::errors`]). A database
//! that cannot be listed keeps its running outboxes (they retry on their own).
//!
//! Every event's CloudEvents `source` is `<source>/<database>/<schema>`, so a
//! consumer can tell outboxes apart.

mod listen;
mod watch;

use crate::config::{ConfigError, ReadMode, RelayConfig};
use crate::health::{HealthConfig, Problem};
use crate::label;
use crate::permits::BatchPermits;
use crate::redact::sanitize_error;
use crate::retention::RetentionConfig;
use crate::router::Router;
use crate::{metrics as m, Relay, RunMode, Stats, StatsSnapshot};
use postbox::Schema;
use postbox_store::directory::{self, Presence, Schemas, Source};
use postbox_store::Store;
use sqlx::postgres::PgConnectOptions;
use sqlx::PgPool;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;

/// Settings of a relay serving many outboxes (`[tenants]` in the config file).
#[derive(Clone, Debug)]
pub struct TenantsConfig {
    /// Every outbox's engine settings. `listen` says whether the shared
    /// LISTEN connections run; `poll_interval` and `rescue_interval` are
    /// raised to `idle_poll`.
    pub relay: RelayConfig,
    /// Batches claimed and not yet settled, across every outbox.
    pub max_in_flight_batches: usize,
    /// Connections of each database's pool (its LISTEN connection comes on top).
    pub pool_size: u32,
    /// How often the databases and schemas are listed again.
    pub rediscover_interval: Duration,
    /// How often an idle outbox looks for work a notification did not announce
    /// (and for expired leases).
    pub idle_poll: Duration,
    /// Prefix of every event's CloudEvents `source`: `<source>/<database>/<schema>`.
    pub source: String,
    /// Refresh every outbox's backlog gauges this often (each carries the
    /// outbox's label); `None`: no gauges.
    pub gauges: Option<Duration>,
    /// Relay-side retention, run by every outbox on its own.
    pub retention: Option<RetentionConfig>,
    /// The health watch over every served outbox ([`watch`]); `None`: off.
    pub health: Option<HealthConfig>,
}

impl Default for TenantsConfig {
    fn default() -> Self {
        Self {
            relay: RelayConfig::default(),
            max_in_flight_batches: 8,
            // A busy outbox claims on one connection while it settles on
            // another: the third serves the quiet outboxes of its database.
            pool_size: 3,
            rediscover_interval: Duration::from_secs(30),
            idle_poll: Duration::from_secs(30),
            source: crate::cloudevents::DEFAULT_SOURCE.to_owned(),
            gauges: None,
            retention: None,
            health: None,
        }
    }
}

impl TenantsConfig {
    /// Check every setting; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.relay.validate()?;
        if self.relay.mode == ReadMode::Logical && self.relay.logical_slot.is_some() {
            return Err(ConfigError::new(
                "relay.logical_slot",
                "a relay serving many outboxes reads one replication slot per outbox, named \
                 postbox_<schema>: leave relay.logical_slot (--slot) unset",
            ));
        }
        if !(1..=10_000).contains(&self.max_in_flight_batches) {
            return Err(ConfigError::new(
                "tenants.max_in_flight_batches",
                "must be between 1 and 10000",
            ));
        }
        if !(1..=100).contains(&self.pool_size) {
            return Err(ConfigError::new(
                "tenants.pool_size",
                "must be between 1 and 100",
            ));
        }
        if self.rediscover_interval.is_zero() {
            return Err(ConfigError::new(
                "tenants.rediscover_interval",
                "must be greater than zero",
            ));
        }
        if self.idle_poll.is_zero() {
            return Err(ConfigError::new(
                "tenants.idle_poll",
                "must be greater than zero",
            ));
        }
        if self.source.is_empty() {
            return Err(ConfigError::new("tenants.source", "must not be empty"));
        }
        if self.gauges.is_some_and(|g| g.is_zero()) {
            return Err(ConfigError::new(
                "metrics.refresh_interval",
                "must be greater than zero",
            ));
        }
        if let Some(retention) = &self.retention {
            retention.validate()?;
        }
        if let Some(health) = &self.health {
            health.validate()?;
        }
        Ok(())
    }

    /// The settings each outbox's engine runs with.
    fn engine(&self) -> RelayConfig {
        let mut relay = self.relay.clone();
        relay.poll_interval = relay.poll_interval.max(self.idle_poll);
        relay.rescue_interval = relay.rescue_interval.max(self.idle_poll);
        relay
    }
}

/// Where outboxes come from: the outbox directory's sources, a listed
/// outbox keeping its own router (`None`: the relay's).
pub type OutboxSource = Source<Option<Arc<Router>>>;

/// One outbox as `status` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct OutboxStatus {
    /// `<database>/<schema>`: the `outbox` label and the CloudEvents source's tail.
    pub name: String,
    pub database: String,
    pub schema: String,
    /// Served right now (false: missing, removed, or not started).
    pub serving: bool,
    /// Troubles counted for this outbox (missing schema, engine that stopped).
    pub errors: u64,
    /// Its engine's counters since it was (last) started.
    pub stats: StatsSnapshot,
    /// Served, and the health watch found nothing wrong last time it looked.
    pub healthy: bool,
    /// What the health watch found last (its database's conditions
    /// included); empty when all is well or the watch is off.
    pub health: Vec<Problem>,
}

#[derive(Default)]
struct OutboxState {
    database: String,
    schema: String,
    serving: AtomicBool,
    errors: AtomicU64,
    stats: Mutex<Arc<Stats>>,
    /// While served: its database's key and its store.
    served_on: Mutex<Option<(String, Store)>>,
    /// The health watch's last findings.
    health: Mutex<Vec<Problem>>,
}

impl OutboxState {
    /// Served on `on` (database key, store), or (`None`) no longer served.
    fn set_serving(&self, on: Option<(String, Store)>) {
        self.serving.store(on.is_some(), Ordering::Relaxed);
        if on.is_none() {
            lock(&self.health).clear();
        }
        *lock(&self.served_on) = on;
    }
}

/// The multi-outbox relay. Build it with [`Tenants::new`], then [`Tenants::run`].
pub struct Tenants {
    config: TenantsConfig,
    sources: Vec<OutboxSource>,
    router: Arc<Router>,
    permits: Arc<BatchPermits>,
    outboxes: Arc<Mutex<BTreeMap<String, Arc<OutboxState>>>>,
}

/// One database the relay talks to.
struct Database {
    name: String,
    pool: PgPool,
    channels: Arc<listen::Channels>,
    stop: CancellationToken,
    _listener: Option<AbortOnDropHandle<()>>,
}

/// A running outbox engine.
struct Engine {
    database: String,
    channel: String,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

/// What one discovery round found.
#[derive(Default)]
struct Found {
    /// Outbox name → (database key, schema, router).
    wanted: BTreeMap<String, (String, Schema, Arc<Router>)>,
    /// Databases whose outboxes could not be listed: keep what runs there.
    unseen: HashSet<String>,
    /// The server's database list failed: keep everything.
    keep_all: bool,
    /// Databases used this round.
    used: HashSet<String>,
}

impl Tenants {
    /// A relay serving the outboxes `sources` name, routing through `router`
    /// unless an outbox has routes of its own.
    pub fn new(
        config: TenantsConfig,
        sources: Vec<OutboxSource>,
        router: Router,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        if sources.is_empty() {
            return Err(ConfigError::new(
                "outboxes",
                "no outbox to serve: list [[outboxes]] or pass --schemas / --databases",
            ));
        }
        let permits = Arc::new(BatchPermits::new(config.max_in_flight_batches));
        Ok(Self {
            config,
            sources,
            router: Arc::new(router),
            permits,
            outboxes: Arc::default(),
        })
    }

    /// Every outbox seen so far (served or not), by name.
    pub fn status(&self) -> Vec<OutboxStatus> {
        let outboxes = lock(&self.outboxes);
        outboxes
            .iter()
            .map(|(name, s)| {
                let serving = s.serving.load(Ordering::Relaxed);
                let health = lock(&s.health).clone();
                OutboxStatus {
                    name: name.clone(),
                    database: s.database.clone(),
                    schema: s.schema.clone(),
                    serving,
                    errors: s.errors.load(Ordering::Relaxed),
                    stats: lock(&s.stats).snapshot(),
                    healthy: serving && health.is_empty(),
                    health,
                }
            })
            .collect()
    }

    /// The counters of every outbox, added up.
    pub fn total(&self) -> StatsSnapshot {
        self.status()
            .iter()
            .fold(StatsSnapshot::default(), |t, o| StatsSnapshot {
                delivered: t.delivered + o.stats.delivered,
                filtered: t.filtered + o.stats.filtered,
                retried: t.retried + o.stats.retried,
                dead_lettered: t.dead_lettered + o.stats.dead_lettered,
                lost_acks: t.lost_acks + o.stats.lost_acks,
                rescued: t.rescued + o.stats.rescued,
                claimed: t.claimed + o.stats.claimed,
            })
    }

    /// Serve until `shutdown` ([`RunMode::Forever`]: discovering again every
    /// `rediscover_interval`), or, in [`RunMode::Drain`], until every outbox
    /// found at start is drained. Returns the counters added up.
    pub async fn run(&self, mode: RunMode, shutdown: CancellationToken) -> StatsSnapshot {
        let watching = CancellationToken::new();
        let watch = async {
            if let Some(health) = &self.config.health {
                let gauges = self.config.gauges.is_some();
                watch::watch(&self.outboxes, health, gauges, &watching).await;
            }
        };
        let serve = async {
            let total = self.serve(mode, &shutdown).await;
            watching.cancel();
            total
        };
        tokio::join!(serve, watch).0
    }

    async fn serve(&self, mode: RunMode, shutdown: &CancellationToken) -> StatsSnapshot {
        let mut databases: HashMap<String, Database> = HashMap::new();
        let mut engines: BTreeMap<String, Engine> = BTreeMap::new();
        tracing::info!(
            sources = self.sources.len(),
            max_in_flight_batches = self.config.max_in_flight_batches,
            "multi-outbox relay started"
        );
        loop {
            let found = self.discover(&mut databases).await;
            if mode == RunMode::Forever {
                self.reap(&mut engines);
            }
            // Stop what is no longer there.
            let gone: Vec<String> = engines
                .iter()
                .filter(|(name, e)| {
                    !found.wanted.contains_key(*name)
                        && !found.keep_all
                        && !found.unseen.contains(&e.database)
                })
                .map(|(name, _)| name.clone())
                .collect();
            for name in gone {
                if let Some(engine) = engines.remove(&name) {
                    tracing::info!(outbox = %name, "outbox no longer found; stopping it");
                    self.stop(&databases, &name, engine);
                }
            }
            // Start what is new.
            for (name, (key, schema, router)) in &found.wanted {
                if engines.contains_key(name) {
                    continue;
                }
                if let Some(db) = databases.get(key) {
                    if let Some(engine) = self.start(name, key, db, schema, router, mode, shutdown)
                    {
                        engines.insert(name.clone(), engine);
                    }
                }
            }
            // Close databases nothing uses any more.
            let idle: Vec<String> = databases
                .keys()
                .filter(|k| {
                    !found.used.contains(*k) && !engines.values().any(|e| &e.database == *k)
                })
                .cloned()
                .collect();
            for key in idle {
                if let Some(db) = databases.remove(&key) {
                    db.stop.cancel();
                    drop(db._listener);
                    tokio::spawn(async move { db.pool.close().await });
                }
            }
            metrics::gauge!(m::OUTBOXES).set(engines.len() as f64);
            if mode == RunMode::Drain {
                break;
            }
            tokio::select! {
                _ = tokio::time::sleep(self.config.rediscover_interval) => {}
                _ = shutdown.cancelled() => break,
            }
        }
        // Drain: every engine returns once its outbox is empty; Forever: each
        // engine's token is a child of `shutdown`, so they are all stopping.
        for (name, engine) in engines {
            if engine.task.await.is_err() {
                tracing::error!(outbox = %name, "the outbox's engine panicked");
            }
            self.mark(&name, |s| s.set_serving(None));
        }
        for db in databases.into_values() {
            db.stop.cancel();
            // The listener ends before its pool closes under it.
            drop(db._listener);
            db.pool.close().await;
        }
        let total = self.total();
        tracing::info!(
            delivered = total.delivered,
            dead_lettered = total.dead_lettered,
            "multi-outbox relay stopped"
        );
        total
    }

    /// Engines that ended on their own (a panic): count it, so the next
    /// round starts them again.
    fn reap(&self, engines: &mut BTreeMap<String, Engine>) {
        let ended: Vec<String> = engines
            .iter()
            .filter(|(_, e)| e.task.is_finished() && !e.stop.is_cancelled())
            .map(|(n, _)| n.clone())
            .collect();
        for name in ended {
            engines.remove(&name);
            tracing::error!(outbox = %name, "the outbox's engine stopped unexpectedly; starting it again");
            self.error(&name, "start");
        }
    }

    fn stop(&self, databases: &HashMap<String, Database>, name: &str, engine: Engine) {
        engine.stop.cancel();
        if let Some(db) = databases.get(&engine.database) {
            db.channels.remove(&engine.channel);
        }
        self.mark(name, |s| s.set_serving(None));
        // It releases what it claimed and not published, within shutdown_timeout.
        tokio::spawn(engine.task);
    }

    #[allow(clippy::too_many_arguments)]
    fn start(
        &self,
        name: &str,
        key: &str,
        db: &Database,
        schema: &Schema,
        router: &Arc<Router>,
        mode: RunMode,
        shutdown: &CancellationToken,
    ) -> Option<Engine> {
        let state = self.state(name, &db.name, schema);
        let store = Store::new(db.pool.clone(), schema.clone());
        let served_on = (key.to_owned(), store.clone());
        let built = Relay::with_shared_router(store, router.clone(), self.config.engine())
            .and_then(|relay| match self.config.gauges {
                Some(every) => relay.with_gauges(every),
                None => Ok(relay),
            })
            .and_then(|relay| match &self.config.retention {
                Some(retention) => relay.with_retention(retention.clone()),
                None => Ok(relay),
            });
        let relay = match built {
            Ok(relay) => relay,
            Err(e) => {
                tracing::error!(outbox = %name, error = %e, "cannot serve this outbox");
                self.error(name, "start");
                return None;
            }
        };
        let wake = Arc::new(Notify::new());
        let channel = schema.notify_channel();
        let mut relay = relay
            .with_batch_permits(self.permits.clone())
            .with_source(format!("{}/{name}", self.config.source).into());
        if self.config.relay.listen {
            relay = relay.with_wake(wake.clone());
            db.channels.add(channel.clone(), wake);
        }
        *lock(&state.stats) = relay.stats();
        state.set_serving(Some(served_on));
        let stop = shutdown.child_token();
        let span = tracing::info_span!("outbox", outbox = %name);
        let run = {
            let stop = stop.clone();
            async move {
                relay.run(mode, stop).await;
            }
        };
        tracing::info!(outbox = %name, "serving outbox");
        let task = tokio::spawn(label::scope(name.into(), run.instrument(span)));
        Some(Engine {
            database: key.to_owned(),
            channel,
            stop,
            task,
        })
    }

    /// List every source's outboxes, opening the databases they live in.
    async fn discover(&self, databases: &mut HashMap<String, Database>) -> Found {
        let mut found = Found::default();
        let mut used = HashSet::new();
        let mut pool = |_: &str, connect: &PgConnectOptions| {
            let key = self.open(databases, connect);
            used.insert(key.clone());
            databases[&key].pool.clone()
        };
        let listing = directory::list(&self.sources, Schemas::Migrated, &mut pool).await;
        found.used = used;
        for unlisted in &listing.unlisted {
            let error = sanitize_error(&unlisted.error.to_string());
            let database = &unlisted.database;
            if unlisted.server {
                found.keep_all = true;
                tracing::warn!(%database, %error, "listing the server's databases failed; keeping the outboxes served");
            } else {
                found.unseen.insert(unlisted.key.clone());
                tracing::warn!(%database, %error, "listing the database's outboxes failed; its outboxes keep running and it is tried again next round");
            }
            // Labelled with the database's name, as before the directory.
            metrics::counter!(m::OUTBOX_ERRORS, "database" => database.clone(), "kind" => "discovery").increment(1);
        }

        for outbox in listing.found {
            let name = outbox.name();
            match outbox.presence {
                Presence::Present => {
                    let router = outbox
                        .with
                        .and_then(Option::clone)
                        .unwrap_or_else(|| self.router.clone());
                    found
                        .wanted
                        .entry(name)
                        .or_insert((outbox.key, outbox.schema, router));
                }
                Presence::Missing => {
                    self.state(&name, &outbox.database, &outbox.schema);
                    tracing::warn!(outbox = %name, "the outbox's schema does not exist or is not migrated (run `postbox migrate`); not serving it until it is");
                    self.error(&name, "missing");
                }
                Presence::Unknown => {
                    self.state(&name, &outbox.database, &outbox.schema);
                    self.error(&name, "discovery");
                }
            }
        }
        found
    }

    /// The database `connect` points to, opened if new; returns its key.
    fn open(
        &self,
        databases: &mut HashMap<String, Database>,
        connect: &PgConnectOptions,
    ) -> String {
        let name = directory::database_of(connect);
        let key = directory::key_of(connect);
        databases.entry(key.clone()).or_insert_with(|| {
            let pool = postbox_store::connect::pool_options(connect)
                // The LISTEN connection is taken from the pool, on top.
                .max_connections(self.config.pool_size + u32::from(self.config.relay.listen))
                .min_connections(0)
                .idle_timeout(Some(Duration::from_secs(10)))
                .acquire_timeout(Duration::from_secs(10))
                .connect_lazy_with(connect.clone());
            let channels = Arc::new(listen::Channels::default());
            let stop = CancellationToken::new();
            let listener = self.config.relay.listen.then(|| {
                AbortOnDropHandle::new(tokio::spawn(listen::listen_loop(
                    name.clone(),
                    pool.clone(),
                    channels.clone(),
                    stop.clone(),
                )))
            });
            Database {
                name,
                pool,
                channels,
                stop,
                _listener: listener,
            }
        });
        key
    }

    fn state(&self, name: &str, database: &str, schema: &Schema) -> Arc<OutboxState> {
        lock(&self.outboxes)
            .entry(name.to_owned())
            .or_insert_with(|| {
                Arc::new(OutboxState {
                    database: database.to_owned(),
                    schema: schema.name().to_owned(),
                    ..Default::default()
                })
            })
            .clone()
    }

    fn mark(&self, name: &str, f: impl FnOnce(&OutboxState)) {
        if let Some(state) = lock(&self.outboxes).get(name) {
            f(state);
        }
    }

    fn error(&self, name: &str, kind: &'static str) {
        self.mark(name, |s| {
            s.errors.fetch_add(1, Ordering::Relaxed);
        });
        metrics::counter!(m::OUTBOX_ERRORS, label::OUTBOX_LABEL => name.to_owned(), "kind" => kind)
            .increment(1);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

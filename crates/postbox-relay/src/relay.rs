//! The relay: its builder ([`Relay`]) and its lifecycle (`Relay::run`),
//! which starts the reading mode's tasks (`crate::modes`) and the
//! background tasks (`crate::tasks`) over one [`Shared`] state, and on
//! shutdown lets the batch in flight settle, releases what was not
//! published, and stops them all.
//!
//! Metrics (names in [`crate::metrics`]) are recorded where the counters in
//! [`Stats`] are; without an installed recorder they cost nothing.
//!
//! No transaction is ever open while a sink publishes.

use crate::config::{ConfigError, ReadMode, RelayConfig};
use crate::engine::permits::{BatchPermits, OutboxPermits};
use crate::engine::{spawn, Shared, Signals};
use crate::modes::{claim, log, logical};
use crate::router::Router;
use crate::sink::Sink;
use crate::tasks::gauges::gauge_loop;
use crate::tasks::health::{self, HealthConfig};
use crate::tasks::listen::{forward_wake, listen_loop};
use crate::tasks::replays::replay_loop;
use crate::tasks::rescue::rescue_loop;
use crate::tasks::retention::{retention_loop, RetentionConfig};
use crate::tasks::tally::tally_loop;
use crate::telemetry::metrics as m;
use postbox_store::{RelayCommit, Store};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

pub use crate::engine::{RunMode, Stats, StatsSnapshot};
pub use crate::modes::claim::Claim;
pub use crate::modes::logical::StartError;

/// One relay process's engine.
pub struct Relay {
    store: Store,
    router: Arc<Router>,
    config: RelayConfig,
    stats: Arc<Stats>,
    gauge_interval: Option<Duration>,
    retention: Option<RetentionConfig>,
    health: Option<HealthConfig>,
    /// Set when serving many outboxes: see [`Relay::with_wake`] and friends.
    wake: Option<Arc<Notify>>,
    permits: Option<Arc<BatchPermits>>,
    source: Option<Arc<str>>,
}

impl Relay {
    /// A relay over `store`, publishing every event through `sink`; fails if
    /// `config` is invalid.
    pub fn new(
        store: Store,
        sink: Arc<dyn Sink>,
        config: RelayConfig,
    ) -> Result<Self, ConfigError> {
        Self::with_router(store, Router::single(sink), config)
    }

    /// A relay over `store` that routes each event to its destinations.
    pub fn with_router(
        store: Store,
        router: Router,
        config: RelayConfig,
    ) -> Result<Self, ConfigError> {
        Self::with_shared_router(store, Arc::new(router), config)
    }

    /// A relay over `store` whose router (and so its sinks and their
    /// connections) is shared with other relays in the process.
    pub fn with_shared_router(
        store: Store,
        router: Arc<Router>,
        config: RelayConfig,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let store = store.with_relay_commit(if config.synchronous_commit {
            RelayCommit::Synchronous
        } else {
            RelayCommit::Asynchronous
        });
        Ok(Self {
            store,
            router,
            config,
            stats: Arc::default(),
            gauge_interval: None,
            retention: None,
            health: None,
            wake: None,
            permits: None,
            source: None,
        })
    }

    /// Wake the claimer when `signal` is notified instead of listening for
    /// notifications itself (one LISTEN connection then serves many relays).
    pub fn with_wake(mut self, signal: Arc<Notify>) -> Self {
        self.wake = Some(signal);
        self
    }

    /// Take a permit from `permits` before each batch — each claim, and in
    /// log mode each round of a log reader — and hold it until the batch is
    /// settled: relays sharing them share a cap on batches in flight, and
    /// one holding no permit may take a reserved one (see [`BatchPermits`]).
    pub fn with_batch_permits(mut self, permits: Arc<BatchPermits>) -> Self {
        self.permits = Some(permits);
        self
    }

    /// Give every claimed message this CloudEvents `source` (instead of the sink's).
    pub fn with_source(mut self, source: Arc<str>) -> Self {
        self.source = Some(source);
        self
    }

    /// Refresh the backlog gauges (pending, oldest pending age, processing,
    /// dead letters) every `interval` while running.
    pub fn with_gauges(mut self, interval: Duration) -> Result<Self, ConfigError> {
        if interval.is_zero() {
            return Err(ConfigError::new(
                "metrics.refresh_interval",
                "must be greater than zero",
            ));
        }
        self.gauge_interval = Some(interval);
        Ok(self)
    }

    /// Run a retention pass every `config.interval` while running.
    pub fn with_retention(mut self, config: RetentionConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        self.retention = Some(config);
        Ok(self)
    }

    /// Watch the database's health (long transactions, replication slots,
    /// dead tuples) while running; see [`crate::health`].
    pub fn with_health(mut self, config: HealthConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        self.health = config.enabled.then_some(config);
        Ok(self)
    }

    /// What the relay checks in the database before it starts: with
    /// ordered routes in logical mode, that the schema's emits are numbered
    /// (`postbox migrate --emit-sequence on`; without a sequence an emitted
    /// event is delivered unordered). `run` checks it too, each time its
    /// logical reader opens the slot, and reads nothing while it fails.
    pub async fn check_start(&self) -> Result<(), StartError> {
        logical::check_numbered_emits(&self.store, &self.router, self.config.mode).await
    }

    /// Live counters (for progress reports and metrics).
    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// Run until `shutdown` is cancelled (or, in [`RunMode::Drain`], until the
    /// outbox is empty). On shutdown, claiming stops, the batch being published
    /// finishes and is settled, claimed batches not yet published are released,
    /// and `run` returns within `shutdown_timeout`.
    pub async fn run(&self, mode: RunMode, shutdown: CancellationToken) -> StatsSnapshot {
        let shared = Arc::new(Shared {
            store: self.store.clone(),
            router: self.router.clone(),
            config: self.config.clone(),
            stats: self.stats.clone(),
            signals: Signals::default(),
            shutdown,
            trouble: self
                .router
                .destinations()
                .iter()
                .map(|_| Default::default())
                .collect(),
            permits: self.permits.clone().map(OutboxPermits::new),
            source: self.source.clone(),
            delivered: self
                .router
                .destinations()
                .iter()
                .map(|_| Default::default())
                .collect(),
            filtered: self
                .router
                .destinations()
                .iter()
                .map(|_| Default::default())
                .collect(),
        });
        for d in self.router.destinations() {
            m::init_destination(&d.name);
        }
        let background = CancellationToken::new();

        // Every task is aborted if `run`'s future is dropped before it ends.
        let pipeline = claim::Pipeline::start(shared.clone());
        let rescuer = spawn(rescue_loop(shared.clone(), background.clone()));
        let tally = spawn(tally_loop(shared.clone(), background.clone()));
        // Stopped by shutdown, not with the other background tasks: a
        // drain waits for the replay jobs of destinations added with a
        // start in the past.
        let replayer = spawn(replay_loop(
            shared.clone(),
            shared.shutdown.clone(),
            mode == RunMode::Drain,
        ));
        let listener = match self.wake.clone() {
            Some(signal) => Some(spawn(forward_wake(
                shared.clone(),
                signal,
                background.clone(),
            ))),
            None => shared
                .config
                .listen
                .then(|| spawn(listen_loop(shared.clone(), background.clone()))),
        };
        let gauges = self
            .gauge_interval
            .map(|every| spawn(gauge_loop(shared.clone(), every, background.clone())));
        let purger = self
            .retention
            .clone()
            .map(|r| spawn(retention_loop(shared.clone(), r, background.clone())));
        let watcher = self.health.clone().map(|h| {
            let (shared, stop) = (shared.clone(), background.clone());
            let slot = (shared.config.mode == ReadMode::Logical).then(|| health::SlotWatch {
                slot: shared.config.slot_name(shared.store.schema()),
                inactive_warn: shared.config.logical_inactive_warn,
            });
            spawn(async move { health::watch(&shared.store, &h, slot, &stop).await })
        });

        tracing::info!(
            destinations = %shared.router.describe(),
            schema = %shared.store.schema(),
            batch_size = shared.config.batch_size,
            ordered = pipeline.ordered(),
            read = ?shared.config.mode,
            ?mode,
            "relay started"
        );
        let readers = match shared.config.mode {
            ReadMode::Claim => Vec::new(),
            ReadMode::Log => {
                let archive = self
                    .retention
                    .as_ref()
                    .is_some_and(|r| r.enabled && r.archive);
                log::start(&shared, mode, archive).await
            }
            ReadMode::Logical => vec![spawn(logical::read_loop(shared.clone(), mode))],
        };
        let finishing = if mode == RunMode::Drain {
            // The readers hand what they could not deliver to the outbox:
            // drain the log first, then what was handed off.
            for reader in readers {
                let _ = reader.await;
            }
            pipeline.claim(mode).await
        } else {
            let finishing = pipeline.claim(mode).await;
            for reader in readers {
                let _ = reader.await;
            }
            finishing
        };

        // The claimer has stopped and dropped its sender: the publisher and the
        // settler finish what is in their channels, then end.
        let drained = finishing.done();
        tokio::pin!(drained);
        if shared.shutdown.is_cancelled() {
            if tokio::time::timeout(shared.config.shutdown_timeout, &mut drained)
                .await
                .is_err()
            {
                tracing::warn!(
                    timeout = %humantime::format_duration(shared.config.shutdown_timeout),
                    "in-flight batches did not finish in time; their leases will expire and other relays will redeliver them"
                );
            }
        } else {
            drained.await;
        }
        let _ = replayer.await;
        background.cancel();
        let _ = rescuer.await;
        let _ = tally.await;
        for task in [listener, gauges, purger, watcher].into_iter().flatten() {
            let _ = task.await;
        }
        let stats = self.stats.snapshot();
        tracing::info!(
            delivered = stats.delivered,
            retried = stats.retried,
            dead_lettered = stats.dead_lettered,
            lost_acks = stats.lost_acks,
            rescued = stats.rescued,
            "relay stopped"
        );
        stats
    }
}

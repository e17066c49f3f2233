//! The relay engine: claim → publish → settle, as three tasks joined by small
//! bounded channels, plus a rescuer for expired leases and a LISTEN task.
//!
//! - The **claimer** claims a batch under a fresh lease (one committed
//!   statement) and hands it on; while the publisher works it already claims
//!   the next batch. With a full batch it claims again at once; otherwise it
//!   waits for a notification, the next due retry, or the poll interval.
//! - The **publisher** gives each batch to its destinations' sinks (see
//!   [`crate::router`]), all at once, each bounded by `publish_timeout`; a sink
//!   that panics or overruns yields retries.
//! - The **settler** records per-destination results of fan-out events, then
//!   acknowledges delivered events and schedules retries or dead letters in
//!   one statement each, only where the lease token still
//!   matches; rows no longer held are counted as lost acknowledgements.
//! - The **rescuer** returns events with expired leases to `pending`.
//! - Optional background tasks: **gauges** (refreshes the backlog metrics),
//!   **retention** (purges old sent events in bounded batches) and the
//!   **health** watch (see [`crate::health`]).
//!
//! Metrics (names in [`crate::metrics`]) are recorded where the counters in
//! [`Stats`] are; without an installed recorder they cost nothing.
//!
//! No transaction is ever open while a sink publishes.

use crate::backoff;
use crate::config::{ConfigError, ReadMode, RelayConfig};
use crate::failpoint;
use crate::health::{self, HealthConfig};
use crate::metrics as m;
use crate::redact::sanitize_error;
use crate::retention::{self, RetentionConfig};
use crate::router::{RetryPolicy, Round, Router};
use crate::sink::{Message, Outcome, Sink};
use crate::tenants::permits::{BatchPermit, BatchPermits, OutboxPermits};
use crate::trouble::{whole_seconds, Report};
use futures::FutureExt;
use postbox_store::{ClaimOrder, DeliveryUpdate, Failure, RelayCommit, Store};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;

/// Whether `run` returns when the outbox is empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunMode {
    /// Run until cancelled.
    Forever,
    /// Return once nothing is pending or in flight (events waiting for a retry
    /// or for an expired lease are waited for; dead letters are not, nor, in
    /// ordered mode, events held back behind a blocking dead letter), or when
    /// cancelled.
    Drain,
}

/// Counters since the relay started.
#[derive(Debug, Default)]
pub struct Stats {
    pub delivered: AtomicU64,
    pub retried: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub lost_acks: AtomicU64,
    pub rescued: AtomicU64,
    pub claimed: AtomicU64,
}

/// A copy of [`Stats`] at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StatsSnapshot {
    pub delivered: u64,
    pub retried: u64,
    pub dead_lettered: u64,
    pub lost_acks: u64,
    pub rescued: u64,
    pub claimed: u64,
}

impl Stats {
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            delivered: self.delivered.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            lost_acks: self.lost_acks.load(Ordering::Relaxed),
            rescued: self.rescued.load(Ordering::Relaxed),
            claimed: self.claimed.load(Ordering::Relaxed),
        }
    }
}

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

/// The payload of the notification an insert into the log sends (the log's
/// trigger, migration 18).
const LOG_NOTIFY_PAYLOAD: &str = "log";

/// The payload of the notification a log cursor's lease sends when a reader
/// joins a destination or gives a partition back (`cursors_acquire`).
const LOG_LEASE_PAYLOAD: &str = "log-lease";

/// Shared between the relay's tasks for one `run`.
pub(crate) struct Shared {
    pub(crate) store: Store,
    pub(crate) router: Arc<Router>,
    /// The ordered claim's patterns; `None`: the plain claim.
    order: Option<ClaimOrder>,
    pub(crate) config: RelayConfig,
    pub(crate) stats: Arc<Stats>,
    /// Woken by notifications and by the settler.
    wake: Notify,
    /// Bumped by every notification, for log mode's readers (one per destination).
    pub(crate) log_wake: tokio::sync::watch::Sender<u64>,
    /// Bumped when another reader joined a destination or a partition was
    /// given back: log readers check their lease (and share) at their next
    /// round instead of at the next renewal.
    pub(crate) log_leases: AtomicU64,
    /// Batches claimed and not yet settled by this process.
    in_flight: AtomicUsize,
    /// Cancelled on SIGTERM: stop claiming, release what was not published.
    pub(crate) shutdown: CancellationToken,
    /// Per destination (by index): its current run of failures, if any.
    trouble: Vec<crate::trouble::Trouble>,
    /// A permit per batch (claimed, or read from the log), shared by many
    /// relays (see [`Relay::with_batch_permits`]).
    permits: Option<OutboxPermits>,
    /// The CloudEvents `source` given to every claimed message, if any.
    source: Option<Arc<str>>,
}

impl Shared {
    /// A notification came (or may have been missed): wake the claimer and
    /// every log reader.
    fn wake_all(&self) {
        self.wake.notify_one();
        self.log_wake.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Notifications may have gone unheard (LISTEN began, or its connection
    /// was lost): wake everyone, and have log readers check their leases.
    fn missed_notifications(&self) {
        self.log_leases.fetch_add(1, Ordering::Relaxed);
        self.wake_all();
    }

    /// A notification with `payload` came on the schema's channel: an insert
    /// into the log (payload `log`, migration 18) wakes only the log readers
    /// — the claimer reads the outbox, which it did not touch — and anything
    /// else (an outbox insert, an older schema's log) wakes everyone.
    fn notified(&self, payload: &str) {
        if payload == LOG_NOTIFY_PAYLOAD {
            self.log_wake.send_modify(|n| *n = n.wrapping_add(1));
        } else if payload == LOG_LEASE_PAYLOAD {
            // Leases moved: readers holding a partition check their share,
            // readers waiting for one try it now.
            self.log_leases.fetch_add(1, Ordering::Relaxed);
            self.log_wake.send_modify(|n| *n = n.wrapping_add(1));
        } else {
            self.wake_all();
        }
    }

    /// Before a batch (a claim, or a round of a log reader): the shared
    /// batch permit to hold until it is settled, if permits are shared
    /// (`Ok(None)` when they are not); `Err(Stopped)` when shutdown came first.
    pub(crate) async fn batch_permit(&self) -> Result<Option<BatchPermit>, Stopped> {
        let Some(permits) = &self.permits else {
            return Ok(None);
        };
        tokio::select! {
            p = permits.acquire() => Ok(p),
            _ = self.shutdown.cancelled() => Err(Stopped),
        }
    }
}

/// Shutdown came while waiting.
#[derive(Debug)]
pub(crate) struct Stopped;

/// Why a relay refuses to start (see [`Relay::check_start`]).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Ordered routes in logical mode, and the schema's emits carry no
    /// sequence to order by.
    #[error(
        "schema {schema}: ordered routes in logical mode need numbered emits: run `postbox \
         migrate --emit-sequence on` (each emit then updates its aggregate's counter row)"
    )]
    UnnumberedEmits { schema: String },
    /// The database could not be asked.
    #[error("schema {schema}: cannot read logical mode's settings (is the schema migrated?)")]
    Settings {
        schema: String,
        #[source]
        source: sqlx::Error,
    },
}

/// Ordered routes in logical mode need the schema's emits numbered
/// (migration 17): `Ok` when they are, or when the relay has no ordered
/// routes or does not read in logical mode.
pub(crate) async fn check_numbered_emits(
    store: &Store,
    router: &Router,
    mode: ReadMode,
) -> Result<(), StartError> {
    if mode != ReadMode::Logical || router.claim_order().is_none() {
        return Ok(());
    }
    let schema = || store.schema().name().to_owned();
    let numbered =
        store
            .logical()
            .numbered_emits()
            .await
            .map_err(|source| StartError::Settings {
                schema: schema(),
                source,
            })?;
    if numbered {
        Ok(())
    } else {
        Err(StartError::UnnumberedEmits { schema: schema() })
    }
}

const DB_RETRY_BASE: Duration = Duration::from_millis(100);
const DB_RETRY_MAX: Duration = Duration::from_secs(10);
const RESCUE_LIMIT: i64 = 1000;

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
        check_numbered_emits(&self.store, &self.router, self.config.mode).await
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
            order: self.router.claim_order(),
            config: self.config.clone(),
            stats: self.stats.clone(),
            wake: Notify::new(),
            log_wake: tokio::sync::watch::channel(0).0,
            log_leases: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            shutdown,
            trouble: self
                .router
                .destinations()
                .iter()
                .map(|_| Default::default())
                .collect(),
            permits: self.permits.clone().map(OutboxPermits::new),
            source: self.source.clone(),
        });
        for d in self.router.destinations() {
            m::init_destination(&d.name);
        }
        let background = CancellationToken::new();
        let (to_publish, publish_rx) = mpsc::channel::<Claim>(1);
        let (to_settle, settle_rx) = mpsc::channel(4);

        // Every task is aborted if `run`'s future is dropped before it ends.
        let publisher = spawn(publish_loop(shared.clone(), publish_rx, to_settle));
        let settler = spawn(settle_loop(shared.clone(), settle_rx));
        let rescuer = spawn(rescue_loop(shared.clone(), background.clone()));
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
            ordered = shared.order.is_some(),
            read = ?shared.config.mode,
            ?mode,
            "relay started"
        );
        let readers = match shared.config.mode {
            ReadMode::Claim => Vec::new(),
            ReadMode::Log => self.start_log_readers(&shared, mode).await,
            ReadMode::Logical => vec![spawn(crate::logical_mode::read_loop(shared.clone(), mode))],
        };
        if mode == RunMode::Drain {
            // The readers hand what they could not deliver to the outbox:
            // drain the log first, then what was handed off.
            for reader in readers {
                let _ = reader.await;
            }
            claim_loop(&shared, mode, to_publish).await;
        } else {
            claim_loop(&shared, mode, to_publish).await;
            for reader in readers {
                let _ = reader.await;
            }
        }

        // The claimer has stopped and dropped its sender: the publisher and the
        // settler finish what is in their channels, then end.
        let drained = async {
            let _ = publisher.await;
            let _ = settler.await;
        };
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
        background.cancel();
        let _ = rescuer.await;
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

impl Relay {
    /// Log mode: a cursor per destination (split into partitions), and a
    /// reader task for each partition.
    async fn start_log_readers(
        &self,
        shared: &Arc<Shared>,
        mode: RunMode,
    ) -> Vec<AbortOnDropHandle<()>> {
        let names: Vec<String> = self
            .router
            .destinations()
            .iter()
            .map(|d| d.name.clone())
            .collect();
        let wanted = i32::from(shared.config.log_partitions);
        let mut failures = 0;
        let split = loop {
            match shared.store.log().ensure_split(&names, wanted).await {
                Ok(split) => break split,
                Err(e) => {
                    failures += 1;
                    let delay = backoff::full_jitter(failures, DB_RETRY_BASE, DB_RETRY_MAX);
                    tracing::warn!(error = %sanitize_error(&e.to_string()), retry_in = ?delay, "creating the log cursors failed");
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = shared.shutdown.cancelled() => return Vec::new(),
                    }
                }
            }
        };
        let owner = uuid::Uuid::new_v4();
        let mut tasks = Vec::new();
        for (d, name) in names.iter().enumerate() {
            let parts = split
                .iter()
                .find(|(n, _)| n == name)
                .map_or(wanted, |&(_, p)| p);
            if parts != wanted {
                tracing::warn!(destination = %name, partitions = parts, log_partitions = wanted, "the destination's log cursor is split differently and a relay reads it: reading the existing partitions (stop every relay reading it to re-split)");
            }
            for part in 0..parts {
                tasks.push(spawn(crate::log_mode::read_loop(
                    shared.clone(),
                    d,
                    part,
                    owner,
                    mode,
                )));
            }
        }
        let archive = self
            .retention
            .as_ref()
            .is_some_and(|r| r.enabled && r.archive);
        if mode == RunMode::Forever {
            tasks.push(spawn(crate::log_mode::maintain_loop(
                shared.clone(),
                archive,
            )));
        }
        tasks
    }
}

fn spawn<F>(task: F) -> AbortOnDropHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    // A task keeps its parent's span and outbox label (see `crate::tenants`).
    AbortOnDropHandle::new(tokio::spawn(crate::tenants::label::inherit(
        task.in_current_span(),
    )))
}

/// Events claimed under one lease, as the sinks take them.
#[derive(Debug)]
pub struct Claim {
    pub token: uuid::Uuid,
    /// Outbox row ids, parallel to `messages`.
    pub ids: Vec<i64>,
    pub messages: Vec<Message>,
    /// Held until the batch is settled (see [`Relay::with_batch_permits`]).
    permit: Option<BatchPermit>,
}

impl From<postbox_store::Claim> for Claim {
    fn from(claim: postbox_store::Claim) -> Self {
        Self {
            token: claim.token,
            ids: claim.ids,
            messages: claim.events.into_iter().map(Message::from).collect(),
            permit: None,
        }
    }
}

async fn claim_loop(shared: &Shared, mode: RunMode, to_publish: mpsc::Sender<Claim>) {
    let config = &shared.config;
    let mut db_failures = 0;
    // Ordered drain: consecutive idle looks at due events that no claim takes.
    let mut only_blocked = 0;
    while !shared.shutdown.is_cancelled() {
        let Ok(permit) = shared.batch_permit().await else {
            break;
        };
        let claimed = shared
            .store
            .claim(
                i64::from(config.batch_size),
                config.lease,
                shared.order.as_ref(),
            )
            .await;
        let claim = match claimed {
            Ok(c) => {
                db_failures = 0;
                let mut claim = Claim::from(c);
                claim.permit = permit;
                if let Some(source) = &shared.source {
                    for m in &mut claim.messages {
                        m.source = Some(source.clone());
                    }
                }
                claim
            }
            Err(e) => {
                drop(permit);
                db_failures += 1;
                metrics::counter!(m::DB_ERRORS, "operation" => "claim").increment(1);
                let delay = backoff::full_jitter(db_failures, DB_RETRY_BASE, DB_RETRY_MAX);
                tracing::warn!(error = %sanitize_error(&e.to_string()), retry_in = ?delay, "claim failed");
                wait(shared, delay).await;
                continue;
            }
        };
        let n = claim.ids.len();
        if n > 0 {
            crate::otel::claimed(
                &shared.store.schema(),
                claim.messages.iter().map(|m| &m.headers),
            );
            failpoint::hit(failpoint::points::AFTER_CLAIM_COMMIT).await;
            only_blocked = 0;
            shared.stats.claimed.fetch_add(n as u64, Ordering::Relaxed);
            shared.in_flight.fetch_add(1, Ordering::SeqCst);
            if let Err(mpsc::error::SendError(claim)) = to_publish.send(claim).await {
                // The publisher is gone (it only ends after we do): give the batch back.
                release(shared, &claim).await;
                shared.in_flight.fetch_sub(1, Ordering::SeqCst);
                return;
            }
            if n == config.batch_size as usize {
                continue;
            }
        } else {
            // Nothing claimed: give the batch permit back before waiting.
            drop(claim);
        }
        // A partial or empty batch: nothing more is due right now.
        let mut delay = config.poll_interval;
        if n == 0 {
            match shared.store.next_due().await {
                Ok(next) => {
                    let idle = shared.in_flight.load(Ordering::SeqCst) == 0;
                    if mode == RunMode::Drain
                        && idle
                        && next.pending_in.is_none()
                        && !next.in_flight
                    {
                        tracing::info!("outbox drained: nothing pending or in flight");
                        return;
                    }
                    // No retry of ours is due later than backoff_max: events
                    // due beyond it were scheduled (by hand or by a producer
                    // with the rights to): report them rather than wait.
                    let horizon = config.backoff_max + Duration::from_secs(1);
                    if mode == RunMode::Drain
                        && idle
                        && !next.in_flight
                        && next.pending_in.is_some_and(|d| d > horizon)
                    {
                        if let Ok(later) = shared.store.scheduled_later(horizon).await {
                            tracing::warn!(
                                events = later.events,
                                first_due = %later.first_due.map_or_else(String::new, |t| t.to_rfc3339()),
                                "outbox drained, except events scheduled later than the longest retry delay (relay.backoff_max); not waiting for them"
                            );
                            return;
                        }
                    }
                    if mode == RunMode::Drain
                        && idle
                        && !next.in_flight
                        && shared.order.is_some()
                        && next.pending_in.is_some_and(|d| d.is_zero())
                    {
                        // Due events, nothing in flight anywhere, and the ordered
                        // claim takes none: they wait behind blocking dead letters
                        // or events of their aggregate scheduled for later.
                        // Look a few times to let other relays' claims settle.
                        only_blocked += 1;
                        if only_blocked >= 3 {
                            tracing::info!(
                                "outbox drained: only aggregates held back by dead letters or scheduled events remain"
                            );
                            return;
                        }
                    } else {
                        only_blocked = 0;
                    }
                    match next.pending_in {
                        // Ordered: due events the claim did not take are held
                        // back by their aggregate; poll for the rest.
                        Some(due) if due.is_zero() && shared.order.is_some() => {}
                        Some(due) => delay = delay.min(due.max(Duration::from_millis(1))),
                        None => {}
                    }
                    if mode == RunMode::Drain && next.in_flight && idle {
                        // Another relay's lease, or an expired one: check back at the rescue pace.
                        delay = delay.min(config.rescue_interval);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %sanitize_error(&e.to_string()), "checking for due events failed");
                }
            }
        }
        wait(shared, delay).await;
    }
}

/// Sleep for `delay`, or less if woken by a notification or shutdown.
async fn wait(shared: &Shared, delay: Duration) {
    tokio::select! {
        _ = tokio::time::sleep(delay) => {}
        _ = shared.wake.notified() => {}
        _ = shared.shutdown.cancelled() => {}
    }
}

/// A published batch on its way to the settler.
struct Published {
    claim: Claim,
    /// One per event.
    outcomes: Vec<Outcome>,
    /// Per event: attempts after which a retry becomes a dead letter.
    budgets: Vec<i32>,
    /// Per-destination results of fan-out events, recorded before settling.
    updates: Vec<DeliveryUpdate>,
}

async fn publish_loop(
    shared: Arc<Shared>,
    mut batches: mpsc::Receiver<Claim>,
    to_settle: mpsc::Sender<Published>,
) {
    while let Some(claim) = batches.recv().await {
        if shared.shutdown.is_cancelled() {
            release(&shared, &claim).await;
            shared.in_flight.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        #[cfg(feature = "failpoints")]
        if failpoint::hit(failpoint::points::ACK_BEFORE_PUBLISH).await {
            failpoint::ack_without_publishing(&shared.store, &claim).await;
            shared.in_flight.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        let started = Instant::now();
        let span = batch_span(&claim);
        let published = publish_round(&shared, claim).instrument(span).await;
        let elapsed = started.elapsed();
        metrics::histogram!(m::PUBLISH_LATENCY).record(elapsed.as_secs_f64());
        let attempts = metrics::histogram!(m::ATTEMPTS);
        for message in &published.claim.messages {
            attempts.record(f64::from(message.attempt));
        }
        tracing::debug!(
            events = published.claim.ids.len(),
            ?elapsed,
            "published batch"
        );
        if to_settle.send(published).await.is_err() {
            return;
        }
    }
}

/// A span per published batch naming the trace ids its events carry (from
/// the producers' `traceparent`), so a trace can be followed into the relay.
/// Built only when debug spans are on.
fn batch_span(claim: &Claim) -> tracing::Span {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return tracing::Span::none();
    }
    let mut trace_ids: Vec<&str> = claim
        .messages
        .iter()
        .filter_map(|m| m.headers.get("traceparent"))
        .filter_map(|tp| tp.get(3..35))
        .collect();
    trace_ids.sort_unstable();
    trace_ids.dedup();
    trace_ids.truncate(20);
    tracing::debug_span!(
        "publish_batch",
        events = claim.ids.len(),
        lease = %claim.token,
        trace_ids = %trace_ids.join(",")
    )
}

/// Publish one claimed batch to every destination its events route to (all
/// destinations at once), and combine the answers into one outcome per event.
async fn publish_round(shared: &Shared, claim: Claim) -> Published {
    let router = &shared.router;
    let config = &shared.config;
    let types: Vec<&str> = claim
        .messages
        .iter()
        .map(|m| m.event_type.as_str())
        .collect();
    let need = Round::needs_state(router, &types);
    let states = if need.is_empty() {
        Vec::new()
    } else {
        let ids: Vec<i64> = need.iter().map(|&i| claim.ids[i]).collect();
        match shared.store.delivery_states(&ids).await {
            Ok(states) => states,
            Err(e) => {
                // Without the state we cannot tell which destinations are done:
                // publish nothing, try the batch again shortly.
                let error = format!(
                    "reading per-destination state failed: {}",
                    sanitize_error(&e.to_string())
                );
                tracing::warn!("{error}");
                let n = claim.ids.len();
                let outcomes = vec![
                    Outcome::Retry {
                        error,
                        after: Some(config.backoff_base),
                    };
                    n
                ];
                return Published {
                    claim,
                    outcomes,
                    budgets: vec![i32::MAX; n],
                    updates: Vec::new(),
                };
            }
        }
    };
    let round = Round::plan(router, &claim.ids, &types, states);
    let publishes = round.batches.iter().enumerate().map(|(d, batch)| {
        let messages: std::borrow::Cow<'_, [Message]> = if batch.len() == claim.messages.len() {
            // Every event goes here (the common case): no copies.
            std::borrow::Cow::Borrowed(&claim.messages)
        } else {
            batch.iter().map(|&i| claim.messages[i].clone()).collect()
        };
        async move {
            if messages.is_empty() {
                Vec::new()
            } else {
                publish_to(shared, d, &messages).await
            }
        }
    });
    let results = futures::future::join_all(publishes).await;
    let policy = RetryPolicy {
        max_attempts: config.max_attempts,
        backoff_base: config.backoff_base,
        backoff_max: config.backoff_max,
    };
    let (outcomes, budgets, updates) = round.combine(router, &claim.ids, &types, results, &policy);
    drop(types);
    Published {
        claim,
        outcomes,
        budgets,
        updates,
    }
}

/// Publish `messages` to destination `d`, bounded by `publish_timeout`; a sink
/// that panics, overruns or miscounts yields retries.
pub(crate) async fn publish_to(shared: &Shared, d: usize, messages: &[Message]) -> Vec<Outcome> {
    let destination = &shared.router.destinations()[d];
    let sink = &destination.sink;
    let traced = crate::otel::Publish::start(&destination.name, messages);
    let publish = AssertUnwindSafe(sink.publish(traced.messages(messages))).catch_unwind();
    let publish = tokio::time::timeout(shared.config.publish_timeout, publish);
    let outcomes = match publish.instrument(traced.span()).await {
        Ok(Ok(outcomes)) if outcomes.len() == messages.len() => outcomes,
        Ok(Ok(outcomes)) => {
            let error = format!(
                "sink returned {} outcomes for {} events",
                outcomes.len(),
                messages.len()
            );
            tracing::error!(destination = %destination.name, sink = %sink.describe(), "{error}; retrying the batch");
            vec![Outcome::retry(error); messages.len()]
        }
        Ok(Err(_panic)) => {
            tracing::error!(destination = %destination.name, sink = %sink.describe(), "sink panicked; retrying the batch");
            vec![Outcome::retry("sink panicked while publishing"); messages.len()]
        }
        Err(_elapsed) => {
            let error = format!(
                "publish timed out after {}",
                humantime::format_duration(shared.config.publish_timeout)
            );
            tracing::warn!(destination = %destination.name, sink = %sink.describe(), "{error}");
            vec![Outcome::retry(error); messages.len()]
        }
    };
    // Whatever the endpoint echoed, the sink's own secrets never go further.
    let secrets = sink.secrets();
    let outcomes: Vec<Outcome> = outcomes.into_iter().map(|o| o.masked(secrets)).collect();
    traced.end(&outcomes);
    let mut by_outcome = [0u64; 4];
    for outcome in &outcomes {
        by_outcome[match outcome {
            Outcome::Delivered => 0,
            Outcome::Retry { .. } => 1,
            Outcome::Reject { .. } => 2,
            Outcome::Deferred { .. } => 3,
        }] += 1;
    }
    for (label, n) in m::OUTCOME_LABELS.into_iter().zip(by_outcome) {
        if n > 0 {
            metrics::counter!(m::PUBLISH_OUTCOMES, "outcome" => label, "destination" => destination.name.clone())
                .increment(n);
        }
    }
    let report = shared.trouble[d].observe(
        Instant::now(),
        by_outcome[0] as usize,
        by_outcome[1] as usize,
    );
    speak_up(shared, d, report, &outcomes).await;
    outcomes
}

/// Say that destination `d` keeps failing (rate-limited by [`Trouble`]) or
/// that it delivers again.
///
/// [`Trouble`]: crate::trouble::Trouble
async fn speak_up(shared: &Shared, d: usize, report: Report, outcomes: &[Outcome]) {
    let destination = &shared.router.destinations()[d];
    match report {
        Report::Nothing => {}
        Report::Failing {
            since,
            lasting,
            failed,
        } => {
            let error = outcomes
                .iter()
                .find_map(|o| match o {
                    Outcome::Retry { error, .. } => Some(error.as_str()),
                    _ => None,
                })
                .unwrap_or_default();
            // What waits: the outbox's backlog (claim mode), or this
            // destination's unread log events (log mode).
            let waiting = match shared.config.mode {
                ReadMode::Claim => shared
                    .store
                    .gauges()
                    .await
                    .ok()
                    .map(|g| g.pending + g.processing),
                ReadMode::Log => shared.store.log().cursor_lag().await.ok().and_then(|lags| {
                    lags.into_iter()
                        .find(|l| l.destination == destination.name)
                        .map(|l| l.lag_events)
                }),
                // The slot's lag is in bytes, not events.
                ReadMode::Logical => None,
            };
            tracing::warn!(
                destination = %destination.name,
                since = %humantime::format_rfc3339_seconds(since),
                failing_for = %whole_seconds(lasting),
                failed_attempts = failed,
                events_waiting = %waiting.map_or_else(|| "unknown".to_owned(), |n| n.to_string()),
                error = %sanitize_error(error),
                "destination keeps failing; its events wait and are retried (said again every minute while it lasts)"
            );
        }
        Report::Recovered { lasted, failed } => {
            tracing::info!(
                destination = %destination.name,
                failing_for = %whole_seconds(lasted),
                failed_attempts = failed,
                "destination delivers again"
            );
        }
    }
}

async fn settle_loop(shared: Arc<Shared>, mut settled: mpsc::Receiver<Published>) {
    while let Some(published) = settled.recv().await {
        let Published {
            claim,
            outcomes,
            budgets,
            updates,
        } = published;
        if !updates.is_empty() {
            // Destination facts first: even if the lease was lost meanwhile, a
            // destination that took the event is never published to again.
            retry_db(&shared, &claim, "recording per-destination results", || {
                shared.store.record_deliveries(&updates)
            })
            .await;
        }
        failpoint::hit(failpoint::points::AFTER_PUBLISH_BEFORE_ACK).await;
        let span = crate::otel::settle_span(
            &shared.store.schema(),
            claim.messages.iter().map(|m| &m.headers),
        );
        settle(&shared, &claim, outcomes, &budgets)
            .instrument(span)
            .await;
        shared.in_flight.fetch_sub(1, Ordering::SeqCst);
        shared.wake.notify_one();
    }
}

async fn settle(shared: &Shared, claim: &Claim, outcomes: Vec<Outcome>, budgets: &[i32]) {
    let config = &shared.config;
    let mut delivered = Vec::new();
    let mut failures = Vec::new();
    for (((id, message), outcome), &budget) in claim
        .ids
        .iter()
        .zip(&claim.messages)
        .zip(outcomes)
        .zip(budgets)
    {
        match outcome {
            Outcome::Delivered => delivered.push(*id),
            Outcome::Retry { error, after } => {
                let delay = after
                    .unwrap_or_else(|| {
                        backoff::full_jitter(
                            message.attempt,
                            config.backoff_base,
                            config.backoff_max,
                        )
                    })
                    .min(config.backoff_max);
                failures.push(Failure {
                    id: *id,
                    reject: false,
                    counted: true,
                    budget,
                    delay,
                    error: sanitize_error(&error),
                });
            }
            Outcome::Deferred { reason, after } => failures.push(Failure {
                id: *id,
                reject: false,
                counted: false,
                budget,
                delay: after.unwrap_or(config.backoff_base).min(config.backoff_max),
                error: sanitize_error(&reason),
            }),
            Outcome::Reject { error } => {
                let error = sanitize_error(&error);
                tracing::warn!(event_id = %message.event_id, event_type = %message.event_type, %error, "rejected by the sink; dead-lettered");
                failures.push(Failure {
                    id: *id,
                    reject: true,
                    counted: true,
                    budget,
                    delay: Duration::ZERO,
                    error,
                });
            }
        }
    }

    let (store, token, ids) = (&shared.store, claim.token, &delivered);
    let acked = retry_db(
        shared,
        claim,
        "acknowledging delivered events",
        move || async move {
            let acked = store.ack_delivered(token, ids).await?;
            if failpoint::hit(failpoint::points::DURING_ACK).await {
                return Err(sqlx::Error::Protocol("failpoint during_ack".into()));
            }
            Ok(acked)
        },
    )
    .await;
    if let Some(acked) = acked {
        shared
            .stats
            .delivered
            .fetch_add(acked.len() as u64, Ordering::Relaxed);
        record_delivery_latency(claim, &acked);
        lost(shared, claim, delivered.len() - acked.len(), "delivered");
    }

    if failures.is_empty() {
        return;
    }
    let settled = retry_db(shared, claim, "scheduling retries", || {
        shared.store.settle_failed(claim.token, &failures)
    })
    .await;
    if let Some(s) = settled {
        let rejected = failures.iter().filter(|f| f.reject).count();
        let retried = s.updated.saturating_sub(s.dead_lettered);
        shared
            .stats
            .retried
            .fetch_add(retried as u64, Ordering::Relaxed);
        shared
            .stats
            .dead_lettered
            .fetch_add(s.dead_lettered as u64, Ordering::Relaxed);
        metrics::counter!(m::DEAD_LETTERED).increment(s.dead_lettered as u64);
        if s.dead_lettered > rejected {
            tracing::warn!(
                count = s.dead_lettered - rejected,
                max_attempts = config.max_attempts,
                "events exhausted their retry budget and were dead-lettered"
            );
        }
        if retried > 0 {
            tracing::debug!(count = retried, error = %failures[0].error, "scheduled retries");
        }
        lost(shared, claim, failures.len() - s.updated, "failed");
    }
}

/// Commit-to-delivery latency of the acknowledged events: now − `created_at`.
fn record_delivery_latency(claim: &Claim, acked: &[i64]) {
    if acked.is_empty() {
        return;
    }
    // `acked` comes back in any order; both lists are short (one batch).
    let mut acked = acked.to_vec();
    acked.sort_unstable();
    m::record_commit_to_delivery(
        claim
            .ids
            .iter()
            .zip(&claim.messages)
            .filter(|(id, _)| acked.binary_search(id).is_ok())
            .map(|(_, message)| message.created_at),
    );
}

fn lost(shared: &Shared, claim: &Claim, count: usize, what: &str) {
    if count > 0 {
        shared
            .stats
            .lost_acks
            .fetch_add(count as u64, Ordering::Relaxed);
        metrics::counter!(m::ACKS_LOST).increment(count as u64);
        tracing::warn!(
            count,
            lease = %claim.token,
            "{what} events were no longer held by this relay's lease (it expired and another claim took them); their state was left to the newer claim"
        );
    }
}

/// Run a settling statement until it succeeds. Gives up when the lease has
/// surely expired: the rows are then another claim's business (and the events
/// will be delivered again, which consumers tolerate).
async fn retry_db<T, F, Fut>(shared: &Shared, claim: &Claim, what: &str, op: F) -> Option<T>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let give_up = Instant::now() + shared.config.lease;
    let mut failures = 0;
    loop {
        match op().await {
            Ok(v) => return Some(v),
            Err(e) => {
                failures += 1;
                let error = sanitize_error(&e.to_string());
                if Instant::now() >= give_up {
                    tracing::error!(%error, lease = %claim.token, "{what} failed until the lease expired; these events will be delivered again");
                    return None;
                }
                let delay = backoff::full_jitter(failures, DB_RETRY_BASE, DB_RETRY_MAX);
                tracing::warn!(%error, retry_in = ?delay, "{what} failed");
                tokio::time::sleep(delay).await;
            }
        }
    }
}

async fn release(shared: &Shared, claim: &Claim) {
    match shared.store.release(claim.token, &claim.ids).await {
        Ok(n) => tracing::info!(
            released = n,
            "released a claimed batch that was not published"
        ),
        Err(e) => tracing::warn!(
            error = %sanitize_error(&e.to_string()),
            "could not release a claimed batch; its lease will expire and it will be redelivered"
        ),
    }
}

async fn rescue_loop(shared: Arc<Shared>, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(shared.config.rescue_interval) => {}
            _ = stop.cancelled() => return,
        }
        loop {
            match shared
                .store
                .rescue_expired(shared.config.max_attempts, RESCUE_LIMIT)
                .await
            {
                Ok(r) => {
                    let n = r.requeued.len() + r.dead_lettered.len();
                    if n == 0 {
                        break;
                    }
                    shared
                        .stats
                        .rescued
                        .fetch_add(r.requeued.len() as u64, Ordering::Relaxed);
                    shared
                        .stats
                        .dead_lettered
                        .fetch_add(r.dead_lettered.len() as u64, Ordering::Relaxed);
                    metrics::counter!(m::LEASES_RECLAIMED).increment(n as u64);
                    metrics::counter!(m::DEAD_LETTERED).increment(r.dead_lettered.len() as u64);
                    tracing::warn!(
                        requeued = r.requeued.len(),
                        dead_lettered = r.dead_lettered.len(),
                        "reclaimed events whose lease expired"
                    );
                    shared.wake.notify_one();
                    if (n as i64) < RESCUE_LIMIT {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %sanitize_error(&e.to_string()), "looking for expired leases failed");
                    break;
                }
            }
        }
    }
}

/// Refresh the backlog gauges every `every` (the first reading at once).
async fn gauge_loop(shared: Arc<Shared>, every: Duration, stop: CancellationToken) {
    let mut failing = false;
    loop {
        let refreshed = match m::refresh_gauges(&shared.store).await {
            Ok(_) if shared.config.mode == ReadMode::Log => m::refresh_log_lag(&shared.store).await,
            other => other.map(|_| ()),
        };
        match refreshed {
            Ok(()) => failing = false,
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(error = %sanitize_error(&e.to_string()), "reading the backlog gauges failed; they keep their last value");
            }
            Err(_) => {}
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// Run a retention pass every `config.interval` (the first one after one interval).
async fn retention_loop(shared: Arc<Shared>, config: RetentionConfig, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(config.interval) => {}
            _ = stop.cancelled() => return,
        }
        match retention::purge(&shared.store, &config, &stop, |_| {}).await {
            Ok(r) if r.outbox + r.inbox + r.idempotency_keys > 0 => {
                tracing::info!(
                    outbox = r.outbox,
                    inbox = r.inbox,
                    idempotency_keys = r.idempotency_keys,
                    archived = config.archive,
                    "retention removed old rows"
                );
                if config.vacuum && r.outbox > 0 {
                    if let Err(e) = shared.store.vacuum_outbox().await {
                        tracing::warn!(error = %sanitize_error(&e.to_string()), "VACUUM of the outbox after retention failed (retention.vacuum needs the table's owner)");
                    }
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %sanitize_error(&crate::redact::error_chain(&e)), "retention pass failed; trying again next interval")
            }
        }
    }
}

/// How long the LISTEN probe waits for its own notification.
const LISTEN_PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Send a notification on the relays' channel and wait for it to come back.
/// It does not when the connection goes through a pooler in transaction mode
/// (PgBouncer), which accepts LISTEN but never delivers notifications.
async fn probe_listen(
    shared: &Shared,
    listener: &mut sqlx::postgres::PgListener,
    stop: &CancellationToken,
) -> Result<(), String> {
    let payload = format!("postbox-probe:{}", uuid::Uuid::new_v4());
    if let Err(e) = shared.store.notify_probe(&payload).await {
        // Not a verdict on LISTEN: try again on the next connection.
        return Err(format!(
            "could not send the LISTEN probe ({})",
            sanitize_error(&e.to_string())
        ));
    }
    let deadline = tokio::time::Instant::now() + LISTEN_PROBE_TIMEOUT;
    loop {
        tokio::select! {
            n = listener.try_recv() => match n {
                Ok(Some(n)) if n.payload() == payload => {
                    metrics::gauge!(health::LISTEN_WORKING).set(1.0);
                    tracing::debug!("LISTEN probe came back: notifications work");
                    return Ok(());
                }
                // Another relay's probe or a new event: wake who reads it, keep waiting.
                Ok(Some(n)) => shared.notified(n.payload()),
                Ok(None) | Err(_) => return Err("the LISTEN connection dropped during the probe".into()),
            },
            _ = tokio::time::sleep_until(deadline) => {
                metrics::gauge!(health::LISTEN_WORKING).set(0.0);
                return Err(format!(
                    "LISTEN is connected but its probe notification did not come back within {}s: \
                     the connection probably goes through a pooler in transaction mode (e.g. PgBouncer), \
                     which drops notifications; point the relay at Postgres directly or a session-mode pool",
                    LISTEN_PROBE_TIMEOUT.as_secs()
                ));
            }
            _ = stop.cancelled() => return Ok(()),
        }
    }
}

/// Wake the claimer (and log readers) whenever `signal` is notified.
async fn forward_wake(shared: Arc<Shared>, signal: Arc<Notify>, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = signal.notified() => shared.wake_all(),
            _ = stop.cancelled() => return,
        }
    }
}

async fn listen_loop(shared: Arc<Shared>, stop: CancellationToken) {
    let channel = shared.store.schema().notify_channel();
    let mut failures = 0;
    // The probe runs once per process: its verdict does not change on reconnects.
    let mut probed = false;
    while !stop.is_cancelled() {
        let listener = async {
            let mut l = sqlx::postgres::PgListener::connect_with(shared.store.pool()).await?;
            l.listen(&channel).await?;
            Ok::<_, sqlx::Error>(l)
        };
        let mut listener = match listener.await {
            Ok(l) => l,
            Err(e) => {
                failures += 1;
                let delay = backoff::full_jitter(
                    failures,
                    Duration::from_millis(500),
                    Duration::from_secs(30),
                );
                tracing::warn!(error = %sanitize_error(&e.to_string()), retry_in = ?delay, "LISTEN failed; polling meanwhile");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => continue,
                    _ = stop.cancelled() => return,
                }
            }
        };
        failures = 0;
        tracing::debug!(%channel, "listening for new events");
        // What was committed, and any lease given back, before LISTEN began
        // notified nobody here: look once now.
        shared.missed_notifications();
        if !probed {
            probed = true;
            if let Err(e) = probe_listen(&shared, &mut listener, &stop).await {
                tracing::warn!(
                    poll_interval = %humantime::format_duration(shared.config.poll_interval),
                    "{e}; relying on polling"
                );
            }
        }
        loop {
            tokio::select! {
                n = listener.try_recv() => match n {
                    Ok(Some(n)) => shared.notified(n.payload()),
                    Ok(None) => {
                        // Connection lost: notifications may have been missed.
                        shared.missed_notifications();
                        tracing::warn!("LISTEN connection lost; reconnecting");
                        break;
                    }
                    Err(e) => {
                        shared.missed_notifications();
                        tracing::warn!(error = %sanitize_error(&e.to_string()), "LISTEN failed; reconnecting");
                        break;
                    }
                },
                _ = stop.cancelled() => return,
            }
        }
    }
}

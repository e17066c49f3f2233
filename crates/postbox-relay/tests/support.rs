//! Sinks and helpers for the relay's tests.

use async_trait::async_trait;
use postbox::NewEvent;
use postbox_relay::{
    Message, Outcome, Relay, RelayConfig, RunMode, Sink, SinkError, StatsSnapshot, Store,
};
use postbox_testkit::TestDb;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Fast settings for tests: short polls, tiny backoff.
pub fn fast_config() -> RelayConfig {
    RelayConfig {
        mode: postbox_relay::ReadMode::Claim,
        log_segment_age: Duration::from_secs(60),
        log_partitions: 1,
        batch_size: 100,
        poll_interval: Duration::from_millis(50),
        lease: Duration::from_secs(30),
        publish_timeout: Duration::from_secs(10),
        max_attempts: 5,
        backoff_base: Duration::from_millis(5),
        backoff_max: Duration::from_millis(50),
        rescue_interval: Duration::from_millis(100),
        listen: true,
        shutdown_timeout: Duration::from_secs(10),
        synchronous_commit: true,
        logical_slot: None,
        logical_transport: postbox_relay::LogicalTransport::Stream,
        logical_poll_interval: Duration::from_millis(10),
        logical_inactive_warn: Duration::from_secs(300),
        expression_steps: 100_000,
        replay_rate: 0,
    }
}

/// Enqueue `n` committed events (`order.created`, aggregate `order`/`i`), returning their ids.
pub async fn enqueue(db: &TestDb, n: usize) -> Vec<Uuid> {
    enqueue_with(db, n, |i| serde_json::json!({"order_id": i})).await
}

pub async fn enqueue_with(
    db: &TestDb,
    n: usize,
    payload: impl Fn(usize) -> serde_json::Value,
) -> Vec<Uuid> {
    let events: Vec<NewEvent> = (0..n)
        .map(|i| NewEvent::new("order.created", "order", i.to_string(), &payload(i)).unwrap())
        .collect();
    db.enqueue_events(&events).await
}

/// Drain with one relay over `router` (two minutes at most).
pub async fn drain_with(
    db: &TestDb,
    router: postbox_relay::Router,
    config: RelayConfig,
) -> StatsSnapshot {
    let relay = Relay::with_router(store(db), router, config).unwrap();
    tokio::time::timeout(
        Duration::from_secs(120),
        relay.run(RunMode::Drain, CancellationToken::new()),
    )
    .await
    .expect("the relay drains within the timeout")
}

pub fn store(db: &TestDb) -> Store {
    Store::new(db.pool.clone(), db.schema.clone())
}

/// Run a relay to completion in drain mode (bounded by a generous timeout).
pub async fn drain(db: &TestDb, sink: Arc<dyn Sink>, config: RelayConfig) -> StatsSnapshot {
    let relay = Relay::new(store(db), sink, config).unwrap();
    tokio::time::timeout(
        Duration::from_secs(120),
        relay.run(RunMode::Drain, CancellationToken::new()),
    )
    .await
    .expect("the relay drains within the timeout")
}

/// What one test sink saw.
#[derive(Default)]
pub struct Seen {
    /// Every message received, in order.
    pub messages: Vec<Message>,
    /// Event ids in some publish call right now (to detect overlapping claims).
    pub in_flight: HashSet<Uuid>,
    /// Event ids seen in two publish calls at the same time.
    pub overlaps: Vec<Uuid>,
    /// Publish calls in progress right now.
    pub calls: usize,
    /// The most publish calls ever in progress at once.
    pub most_calls: usize,
}

type Script = dyn Fn(&Message, usize) -> Outcome + Send + Sync;

/// A sink that records everything and answers by a script `(message, times seen before) -> outcome`.
pub struct ScriptedSink {
    pub seen: Mutex<Seen>,
    script: Box<Script>,
    /// Optional pause inside publish, released by `release`.
    hold: Option<Arc<Notify>>,
    pub entered: Notify,
}

impl ScriptedSink {
    pub fn new(script: impl Fn(&Message, usize) -> Outcome + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(Self {
            seen: Mutex::default(),
            script: Box::new(script),
            hold: None,
            entered: Notify::new(),
        })
    }

    pub fn delivering() -> Arc<Self> {
        Self::new(|_, _| Outcome::Delivered)
    }

    /// A delivering sink whose publish calls wait for `gate` before answering.
    pub fn held(gate: Arc<Notify>) -> Arc<Self> {
        Arc::new(Self {
            seen: Mutex::default(),
            script: Box::new(|_, _| Outcome::Delivered),
            hold: Some(gate),
            entered: Notify::new(),
        })
    }

    pub fn count(&self) -> usize {
        self.seen.lock().unwrap().messages.len()
    }

    pub fn ids(&self) -> Vec<Uuid> {
        self.seen
            .lock()
            .unwrap()
            .messages
            .iter()
            .map(|m| m.event_id)
            .collect()
    }
}

#[async_trait]
impl Sink for ScriptedSink {
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        let outcomes: Vec<Outcome> = {
            let mut seen = self.seen.lock().unwrap();
            seen.calls += 1;
            seen.most_calls = seen.most_calls.max(seen.calls);
            let mut outcomes = Vec::new();
            for m in batch {
                if !seen.in_flight.insert(m.event_id) {
                    seen.overlaps.push(m.event_id);
                }
                let before = seen
                    .messages
                    .iter()
                    .filter(|s| s.event_id == m.event_id)
                    .count();
                outcomes.push((self.script)(m, before));
                seen.messages.push(m.clone());
            }
            outcomes
        };
        self.entered.notify_one();
        if let Some(gate) = &self.hold {
            gate.notified().await;
        }
        let mut seen = self.seen.lock().unwrap();
        seen.calls -= 1;
        for m in batch {
            seen.in_flight.remove(&m.event_id);
        }
        outcomes
    }

    async fn check(&self) -> Result<(), SinkError> {
        Ok(())
    }

    fn describe(&self) -> String {
        "scripted test sink".into()
    }
}

/// Everything the relay logs on this thread while a test runs ([`Logs::capture`]).
///
/// One global subscriber serves every test of the binary: it writes a line
/// only on a thread that is capturing, into that thread's [`Logs`] (tests run
/// on current-thread runtimes, so the relay's tasks log on the test's
/// thread). A scoped subscriber per test would lose lines: tracing caches
/// whether anyone listens to a log line when the line is first reached, and
/// with one scoped subscriber alive it asks the thread that reached it —
/// another test's, where nobody does.
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

thread_local! {
    static CAPTURING: std::cell::RefCell<Option<(Logs, tracing::Level)>> =
        const { std::cell::RefCell::new(None) };
}

/// Stops capturing this thread's lines when dropped.
pub struct Capturing(());

impl Drop for Capturing {
    fn drop(&mut self) {
        CAPTURING.with(|c| c.borrow_mut().take());
    }
}

impl Logs {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// Capture this thread's lines up to `level` until the guard is dropped.
    pub fn capture(&self, level: tracing::Level) -> Capturing {
        use tracing_subscriber::layer::SubscriberExt;
        use tracing_subscriber::Layer;
        static GLOBAL: std::sync::Once = std::sync::Once::new();
        GLOBAL.call_once(|| {
            // Dynamic: asked at every line (a plain filter_fn's answer would be
            // cached per call site, for all threads, by whichever reached it first).
            let capturing = tracing_subscriber::filter::dynamic_filter_fn(|meta, _| {
                CAPTURING.with(|c| {
                    c.borrow()
                        .as_ref()
                        .is_some_and(|(_, level)| meta.level() <= level)
                })
            });
            let layer = tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .with_writer(|| ThisThread)
                .with_filter(capturing);
            let _ =
                tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer));
        });
        CAPTURING.with(|c| *c.borrow_mut() = Some((self.clone(), level)));
        Capturing(())
    }
}

/// Writes into the capturing thread's [`Logs`] (nowhere on other threads).
struct ThisThread;

impl std::io::Write for ThisThread {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        CAPTURING.with(|c| {
            if let Some((logs, _)) = c.borrow().as_ref() {
                logs.0.lock().unwrap().extend_from_slice(buf);
            }
        });
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

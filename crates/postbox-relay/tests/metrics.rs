//! The counters operators alert on move when their events happen: a lease
//! that expires under a slow publish is reclaimed, and the stale holder's
//! acknowledgement is lost to the newer claim.

use crate::support::{enqueue, fast_config, store};
use async_trait::async_trait;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use postbox_relay::{metrics as m, Message, Outcome, Relay, RunMode, Sink, SinkError};
use postbox_testkit::{wait_for, TestDb};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Delivers everything; its first publish waits for `gate`.
struct FirstCallHeld {
    calls: AtomicUsize,
    entered: Notify,
    gate: Notify,
}

#[async_trait]
impl Sink for FirstCallHeld {
    fn describe(&self) -> String {
        "first-call-held".into()
    }

    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            self.entered.notify_one();
            self.gate.notified().await;
        }
        vec![Outcome::Delivered; batch.len()]
    }

    async fn check(&self) -> Result<(), SinkError> {
        Ok(())
    }
}

/// Counter totals: the debugging recorder's snapshots reset counters, so
/// every reading is added up here.
struct Counters {
    snapshotter: Snapshotter,
    totals: Mutex<HashMap<String, u64>>,
}

impl Counters {
    fn get(&self, name: &str) -> u64 {
        let mut totals = self.totals.lock().unwrap();
        for (key, _, _, value) in self.snapshotter.snapshot().into_vec() {
            if let DebugValue::Counter(n) = value {
                *totals.entry(key.key().name().to_owned()).or_default() += n;
            }
        }
        totals.get(name).copied().unwrap_or(0)
    }
}

#[test]
fn a_reclaimed_lease_and_a_lost_ack_are_counted() {
    let recorder = DebuggingRecorder::new();
    let counters = Counters {
        snapshotter: recorder.snapshotter(),
        totals: Mutex::default(),
    };
    // A local recorder sees what this thread records; a current-thread runtime
    // keeps the relay's tasks on it.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let stats = metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let db = TestDb::new().await;
            enqueue(&db, 10).await;
            let sink = Arc::new(FirstCallHeld {
                calls: AtomicUsize::new(0),
                entered: Notify::new(),
                gate: Notify::new(),
            });
            let relay = Relay::new(store(&db), sink.clone(), fast_config()).unwrap();
            let stop = CancellationToken::new();
            let run = tokio::spawn({
                let stop = stop.clone();
                async move { relay.run(RunMode::Forever, stop).await }
            });
            sink.entered.notified().await;

            // The publish outlives the lease: the rescuer hands the events back.
            db.exec("UPDATE {schema}.outbox SET lease_expires_at = now() - interval '1 second'")
                .await;
            wait_for(
                "the expired lease to be reclaimed",
                Duration::from_secs(30),
                || async { counters.get(m::LEASES_RECLAIMED) == 10 },
            )
            .await;
            // The stale publish returns: its acknowledgement is refused, and a
            // newer claim delivers the events.
            sink.gate.notify_one();
            wait_for(
                "the stale acknowledgement to be lost",
                Duration::from_secs(30),
                || async { counters.get(m::ACKS_LOST) == 10 },
            )
            .await;
            wait_for(
                "the newer claim to deliver",
                Duration::from_secs(30),
                || async {
                    db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'sent'")
                        .await
                        == 10
                },
            )
            .await;
            stop.cancel();
            let stats = run.await.unwrap();
            db.drop_schema().await;
            stats
        })
    });
    assert_eq!((stats.rescued, stats.lost_acks), (10, 10));
    assert_eq!(counters.get(m::LEASES_RECLAIMED), 10);
    assert_eq!(counters.get(m::ACKS_LOST), 10);
}

/// Each consumer group's gauges follow what it holds: unread, in flight,
/// waiting, dead letters, readers, lag.
#[test]
fn consumer_groups_have_gauges() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let db = TestDb::new().await;
            let store = store(&db);
            let groups = store.groups();
            groups
                .create(&postbox_store::NewGroup::new("billing"))
                .await
                .unwrap();
            db.exec(
                "INSERT INTO {schema}.log (event_id, event_type, aggregate_type, aggregate_id, payload) \
                 SELECT gen_random_uuid(), 't', 'a', i::text, '{}' FROM generate_series(1, 5) AS i",
            )
            .await;
            let got = groups
                .receive("billing", 2, Duration::from_secs(60), Duration::ZERO)
                .await
                .unwrap();
            groups
                .nack("billing", &got[0].receipt, Duration::from_secs(60), None)
                .await
                .unwrap();
            m::refresh_log_lag(&store).await.unwrap();
            let gauges: HashMap<String, f64> = snapshotter
                .snapshot()
                .into_vec()
                .into_iter()
                .filter(|(key, ..)| {
                    key.key()
                        .labels()
                        .any(|l| l.key() == "group" && l.value() == "billing")
                })
                .filter_map(|(key, _, _, value)| match value {
                    DebugValue::Gauge(g) => Some((key.key().name().to_owned(), g.into_inner())),
                    _ => None,
                })
                .collect();
            assert_eq!(gauges[m::GROUP_UNREAD], 3.0, "{gauges:?}");
            assert_eq!(gauges[m::GROUP_IN_FLIGHT], 1.0);
            assert_eq!(gauges[m::GROUP_WAITING], 1.0);
            assert_eq!(gauges[m::GROUP_DEAD_LETTERS], 0.0);
            assert_eq!(gauges[m::GROUP_READERS], 1.0);
            assert!(gauges[m::GROUP_LAG_SECONDS] >= 0.0);
            db.drop_schema().await;
        })
    });
}

/// The open replay jobs have gauges: how many, and the events each
/// destination's jobs still have to go through; a destination whose jobs
/// all ended goes back to 0.
#[test]
fn open_replay_jobs_have_gauges() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let gauges = || -> HashMap<String, f64> {
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter_map(|(key, _, _, value)| {
                let label: Vec<String> = key.key().labels().map(|l| l.value().to_owned()).collect();
                match value {
                    DebugValue::Gauge(g) => {
                        Some((format!("{}{:?}", key.key().name(), label), g.into_inner()))
                    }
                    _ => None,
                }
            })
            .collect()
    };
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let db = TestDb::new().await;
            let store = store(&db);
            db.exec(
                "INSERT INTO {schema}.replay_jobs \
                 (destination, source, from_at, to_at, after_id, hi, total, delivered, filtered, \
                  rejected, state, created_by) VALUES \
                 ('billing', 'outbox', now() - interval '1 hour', now(), 0, 100, 100, 30, 10, 0, 'running', 't'), \
                 ('billing', 'outbox', now() - interval '1 hour', now(), 0, 100, 50, 0, 0, 5, 'paused', 't'), \
                 ('audit', 'outbox', now() - interval '1 hour', now(), 0, 100, 70, 70, 0, 0, 'done', 't')",
            )
            .await;
            let known = m::refresh_replays(&store, &Default::default()).await.unwrap();
            let g = gauges();
            assert_eq!(g["postbox_replay_jobs_open[]"], 2.0, "{g:?}");
            assert_eq!(g["postbox_replay_events_left[\"billing\"]"], 105.0, "{g:?}");
            assert!(!g.contains_key("postbox_replay_events_left[\"audit\"]"), "{g:?}");

            // A snapshot reads each gauge and sets it to 0: set them again.
            let known = m::refresh_replays(&store, &known).await.unwrap();
            db.exec("UPDATE {schema}.replay_jobs SET state = 'cancelled'").await;
            m::refresh_replays(&store, &known).await.unwrap();
            let g = gauges();
            assert_eq!(g["postbox_replay_jobs_open[]"], 0.0, "{g:?}");
            assert_eq!(g["postbox_replay_events_left[\"billing\"]"], 0.0, "{g:?}");
            db.drop_schema().await;
        })
    });
}

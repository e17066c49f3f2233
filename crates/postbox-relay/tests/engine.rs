use crate::support::*;
use postbox::statements::trusted;
use postbox_relay::{Outcome, Relay, RelayConfig, RunMode, Store};
use postbox_testkit::{wait_for, TestDb};
use sqlx::Row;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn drains_every_committed_event_once() {
    let db = TestDb::new().await;
    let ids = enqueue(&db, 1000).await;
    let sink = ScriptedSink::delivering();
    let stats = drain(&db, sink.clone(), fast_config()).await;
    assert_eq!(stats.delivered, 1000);
    let mut seen = sink.ids();
    seen.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(seen, want, "each event exactly once when nothing fails");
    assert_eq!(db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'sent' AND sent_at IS NOT NULL AND lease_token IS NULL").await, 1000);
    {
        let seen = sink.seen.lock().unwrap();
        assert_eq!(seen.messages[0].attempt, 1);
        assert_eq!(seen.messages[0].event_type, "order.created");
    }
    db.drop_schema().await;
}

#[tokio::test]
async fn two_relays_never_hold_the_same_row() {
    let db = TestDb::new().await;
    enqueue(&db, 3000).await;
    let sink = ScriptedSink::delivering();
    let config = RelayConfig {
        batch_size: 50,
        ..fast_config()
    };
    let other_pool = db.another_pool(5).await;
    let a = Relay::new(store(&db), sink.clone(), config.clone()).unwrap();
    let b = Relay::new(
        Store::new(other_pool, db.schema.clone()),
        sink.clone(),
        config,
    )
    .unwrap();
    let (sa, sb) = tokio::join!(
        a.run(RunMode::Drain, CancellationToken::new()),
        b.run(RunMode::Drain, CancellationToken::new())
    );
    assert_eq!(sa.delivered + sb.delivered, 3000);
    assert!(
        sa.delivered > 0 && sb.delivered > 0,
        "both relays took part: {sa:?} {sb:?}"
    );
    {
        let seen = sink.seen.lock().unwrap();
        assert!(
            seen.overlaps.is_empty(),
            "events held by two relays at once: {:?}",
            seen.overlaps
        );
        let distinct: HashSet<_> = seen.messages.iter().map(|m| m.event_id).collect();
        assert_eq!((distinct.len(), seen.messages.len()), (3000, 3000));
    }
    db.drop_schema().await;
}

#[tokio::test]
async fn concurrent_claims_are_disjoint() {
    let db = TestDb::new().await;
    enqueue(&db, 2000).await;
    let stores: Vec<Store> = (0..4).map(|_| store(&db)).collect();
    let claims = futures::future::join_all(stores.iter().map(|s| async move {
        let mut mine = Vec::new();
        loop {
            let c = s.claim(37, Duration::from_secs(30), None).await.unwrap();
            if c.ids.is_empty() {
                return mine;
            }
            mine.extend(c.ids);
        }
    }))
    .await;
    let all: Vec<i64> = claims.iter().flatten().copied().collect();
    let distinct: HashSet<i64> = all.iter().copied().collect();
    assert_eq!(all.len(), 2000);
    assert_eq!(distinct.len(), 2000, "no row claimed twice");
    db.drop_schema().await;
}

#[tokio::test]
async fn an_expired_lease_is_reclaimed_and_the_stale_ack_changes_nothing() {
    let db = TestDb::new().await;
    enqueue(&db, 3).await;
    let old = store(&db);
    let new = store(&db);
    let stale = old.claim(10, Duration::from_secs(30), None).await.unwrap();
    assert_eq!(stale.ids.len(), 3);
    // Nothing else can claim them while the lease holds.
    assert!(new
        .claim(10, Duration::from_secs(30), None)
        .await
        .unwrap()
        .ids
        .is_empty());
    assert_eq!(new.rescue_expired(5, 100).await.unwrap().requeued.len(), 0);

    // The lease runs out (the holder stalled).
    db.exec("UPDATE {schema}.outbox SET lease_expires_at = now() - interval '1 second'")
        .await;
    let rescued = new.rescue_expired(5, 100).await.unwrap();
    assert_eq!(rescued.requeued.len(), 3);
    let fresh = new.claim(10, Duration::from_secs(30), None).await.unwrap();
    assert_eq!(fresh.ids.len(), 3);
    assert_eq!(
        fresh.events[0].attempt, 2,
        "the reclaimed delivery is the second attempt"
    );
    assert_eq!(
        fresh.events[0].event_id, stale.events[0].event_id,
        "same event id"
    );

    // The stale holder wakes up and acknowledges: nothing changes.
    assert!(old
        .ack_delivered(stale.token, &stale.ids)
        .await
        .unwrap()
        .is_empty());
    let failures: Vec<_> = stale
        .ids
        .iter()
        .map(|&id| postbox_store::Failure {
            id,
            reject: true,
            counted: true,
            budget: 5,
            delay: Duration::ZERO,
            error: "stale".into(),
        })
        .collect();
    assert_eq!(
        old.settle_failed(stale.token, &failures)
            .await
            .unwrap()
            .updated,
        0
    );
    assert_eq!(old.release(stale.token, &stale.ids).await.unwrap(), 0);
    let held = db
        .count(&format!(
            "SELECT count(*) FROM {{schema}}.outbox WHERE status = 'processing' AND lease_token = '{}'",
            fresh.token
        ))
        .await;
    assert_eq!(held, 3, "the newer claim still owns every row");

    // The new holder's ack works.
    assert_eq!(
        new.ack_delivered(fresh.token, &fresh.ids)
            .await
            .unwrap()
            .len(),
        3
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn retries_back_off_and_end_in_failed_after_the_budget() {
    let db = TestDb::new().await;
    enqueue(&db, 20).await;
    let sink = ScriptedSink::new(|_, _| Outcome::retry("broker unavailable"));
    let config = RelayConfig {
        max_attempts: 4,
        ..fast_config()
    };
    let stats = drain(&db, sink.clone(), config).await;
    assert_eq!(stats.delivered, 0);
    assert_eq!(stats.dead_lettered, 20);
    assert_eq!(stats.retried, 20 * 3);
    assert_eq!(
        sink.count(),
        20 * 4,
        "every event tried exactly max_attempts times"
    );
    let rows = sqlx::query(trusted(&db.sql(
        "SELECT status::text, attempts, last_error, lease_token IS NULL FROM {schema}.outbox",
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    for r in rows {
        assert_eq!(r.get::<String, _>(0), "failed");
        assert_eq!(r.get::<i32, _>(1), 4);
        assert_eq!(r.get::<String, _>(2), "broker unavailable");
        assert!(r.get::<bool, _>(3));
    }
    // Attempt numbers seen by the sink rise 1..=4 for each event.
    let mut attempts: HashMap<uuid::Uuid, Vec<i32>> = HashMap::new();
    for m in &sink.seen.lock().unwrap().messages {
        attempts.entry(m.event_id).or_default().push(m.attempt);
    }
    assert!(
        attempts.values().all(|a| a == &vec![1, 2, 3, 4]),
        "{attempts:?}"
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn a_retry_waits_for_its_delay() {
    let db = TestDb::new().await;
    enqueue(&db, 1).await;
    let s = store(&db);
    let claim = s.claim(10, Duration::from_secs(30), None).await.unwrap();
    let failure = postbox_store::Failure {
        id: claim.ids[0],
        reject: false,
        counted: true,
        budget: 5,
        delay: Duration::from_secs(60),
        error: "later".into(),
    };
    let settled = s.settle_failed(claim.token, &[failure]).await.unwrap();
    assert_eq!((settled.updated, settled.dead_lettered), (1, 0));
    assert!(
        s.claim(10, Duration::from_secs(30), None)
            .await
            .unwrap()
            .ids
            .is_empty(),
        "not due yet"
    );
    let wait = db
        .count("SELECT extract(epoch FROM available_at - now())::bigint FROM {schema}.outbox")
        .await;
    assert!((58..=60).contains(&wait), "available in ~60 s, got {wait}");
    let next = s.next_due().await.unwrap();
    assert!(next.pending_in.unwrap() > Duration::from_secs(55));
    assert!(!next.in_flight);
    db.drop_schema().await;
}

/// An event scheduled far in the future (here year 9999, written by the
/// schema owner) does not keep `--drain` running: the drain delivers the
/// rest, reports it and ends; a retry within `backoff_max` is still waited for.
#[tokio::test]
async fn a_drain_ends_with_events_scheduled_beyond_the_longest_retry() {
    let db = TestDb::new().await;
    let ids = enqueue(&db, 3).await;
    db.exec("UPDATE {schema}.outbox SET available_at = '9999-01-01' WHERE id = (SELECT min(id) FROM {schema}.outbox)")
        .await;
    let sink = ScriptedSink::new(|_, before| {
        if before == 0 {
            Outcome::retry("503 once")
        } else {
            Outcome::Delivered
        }
    });
    let stats = drain(&db, sink.clone(), fast_config()).await;
    assert_eq!(stats.delivered, 2, "the two due events, after their retry");
    assert!(
        !sink.ids().contains(&ids[0]),
        "the far-future event is not sent"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'pending' AND available_at > '9000-01-01'")
            .await,
        1,
        "it stays pending for its time"
    );
    let later = store(&db)
        .scheduled_later(Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(later.events, 1);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_relay_killed_between_publish_and_ack_leads_to_redelivery() {
    let db = TestDb::new().await;
    let ids = enqueue(&db, 10).await;
    // Relay A publishes, then never gets to acknowledge: it is killed.
    let gate = Arc::new(Notify::new());
    let doomed = ScriptedSink::held(gate);
    let a_config = RelayConfig {
        lease: Duration::from_secs(2),
        publish_timeout: Duration::from_millis(900),
        ..fast_config()
    };
    let a = Relay::new(store(&db), doomed.clone(), a_config).unwrap();
    let a_task =
        tokio::spawn(async move { a.run(RunMode::Forever, CancellationToken::new()).await });
    doomed.entered.notified().await;
    a_task.abort(); // SIGKILL: no release, no ack.
    let _ = a_task.await;
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'processing'")
            .await,
        10
    );

    // Relay B reclaims once A's lease expires and delivers again, same ids.
    let survivor = ScriptedSink::delivering();
    let stats = drain(&db, survivor.clone(), fast_config()).await;
    assert_eq!(stats.delivered, 10);
    assert_eq!(stats.rescued, 10);
    let mut first = doomed.ids();
    let mut second = survivor.ids();
    first.sort();
    second.sort();
    let mut want = ids;
    want.sort();
    assert_eq!(first, want);
    assert_eq!(second, want, "redelivered with the same event ids");
    assert!(survivor
        .seen
        .lock()
        .unwrap()
        .messages
        .iter()
        .all(|m| m.attempt == 2));
    db.drop_schema().await;
}

#[tokio::test]
async fn a_rejection_dead_letters_only_that_event() {
    let db = TestDb::new().await;
    enqueue(&db, 50).await;
    let sink = ScriptedSink::new(|m, _| {
        if m.aggregate_id == "13" {
            Outcome::reject("schema mismatch: field total missing")
        } else {
            Outcome::Delivered
        }
    });
    let stats = drain(&db, sink, fast_config()).await;
    assert_eq!((stats.delivered, stats.dead_lettered), (49, 1));
    let failed: (String, i32, String) = sqlx::query_as(trusted(&db.sql(
        "SELECT aggregate_id, attempts, last_error FROM {schema}.outbox WHERE status = 'failed'",
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        failed,
        (
            "13".into(),
            1,
            "schema mismatch: field total missing".into()
        )
    );
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'sent'")
            .await,
        49
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn secrets_never_reach_last_error() {
    let db = TestDb::new().await;
    enqueue(&db, 1).await;
    let sink = ScriptedSink::new(|_, _| {
        Outcome::reject("connect amqp://relay:s3cr3t@rabbit:5672/%2f refused; got 401 for Authorization: Bearer eyJhbGciOi.abc")
    });
    drain(&db, sink, fast_config()).await;
    let error: String =
        sqlx::query_scalar(trusted(&db.sql("SELECT last_error FROM {schema}.outbox")))
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(
        !error.contains("s3cr3t") && !error.contains("eyJhbGciOi"),
        "{error}"
    );
    assert!(error.contains("amqp://***@rabbit:5672"), "{error}");
    db.drop_schema().await;
}

struct Misbehaving(bool);

#[async_trait::async_trait]
impl postbox_relay::Sink for Misbehaving {
    async fn publish(&self, batch: &[postbox_relay::Message]) -> Vec<Outcome> {
        if self.0 {
            panic!("a bug in a sink");
        }
        vec![Outcome::Delivered; batch.len().saturating_sub(1)]
    }
    async fn check(&self) -> Result<(), postbox_relay::SinkError> {
        Ok(())
    }
    fn describe(&self) -> String {
        "misbehaving".into()
    }
}

#[tokio::test]
async fn a_panicking_or_miscounting_sink_means_retries_not_losses() {
    for panics in [true, false] {
        let db = TestDb::new().await;
        enqueue(&db, 5).await;
        let config = RelayConfig {
            max_attempts: 2,
            ..fast_config()
        };
        let stats = drain(&db, Arc::new(Misbehaving(panics)), config).await;
        assert_eq!(
            (stats.delivered, stats.dead_lettered),
            (0, 5),
            "panics={panics}"
        );
        // Retries may come back in smaller batches, so the counts vary.
        let errors: Vec<String> = sqlx::query_scalar(trusted(
            &db.sql("SELECT DISTINCT last_error FROM {schema}.outbox"),
        ))
        .fetch_all(&db.pool)
        .await
        .unwrap();
        let want = if panics {
            "sink panicked while publishing"
        } else {
            "sink returned "
        };
        assert!(!errors.is_empty());
        for error in errors {
            assert!(error.starts_with(want), "{error}");
            if !panics {
                let (got, of) = error
                    .trim_start_matches("sink returned ")
                    .trim_end_matches(" events")
                    .split_once(" outcomes for ")
                    .unwrap();
                assert_eq!(got.parse::<u32>().unwrap() + 1, of.parse::<u32>().unwrap());
            }
        }
        db.drop_schema().await;
    }
}

#[tokio::test]
async fn graceful_shutdown_finishes_the_batch_in_hand_and_releases_the_rest() {
    let db = TestDb::new().await;
    enqueue(&db, 300).await;
    let gate = Arc::new(Notify::new());
    let sink = ScriptedSink::held(gate.clone());
    // A publish timeout far beyond the test, so the held batch cannot time out
    // on a loaded machine and let the publisher move on before the signal.
    let config = RelayConfig {
        lease: Duration::from_secs(600),
        publish_timeout: Duration::from_secs(290),
        ..fast_config()
    };
    let relay = Relay::new(store(&db), sink.clone(), config).unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(RunMode::Forever, shutdown).await }
    });
    sink.entered.notified().await;
    // The claimer has claimed ahead while the first batch is held (one batch
    // waits in the channel, possibly a third waits to be sent).
    wait_for(
        "a second batch to be claimed ahead",
        Duration::from_secs(30),
        || async {
            db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'processing'")
                .await
                >= 200
        },
    )
    .await;
    shutdown.cancel();
    gate.notify_one();
    let stats = tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stats.delivered, 100, "the batch being published finished");
    assert_eq!(sink.count(), 100, "nothing was published after the signal");
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'processing'")
            .await,
        0
    );
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'pending' AND attempts = 0")
            .await,
        200,
        "unpublished claims went back without using an attempt"
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn a_notification_wakes_the_relay_before_the_next_poll() {
    let db = TestDb::new().await;
    let sink = ScriptedSink::delivering();
    let config = RelayConfig {
        poll_interval: Duration::from_secs(30),
        ..fast_config()
    };
    let relay = Relay::new(store(&db), sink.clone(), config).unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(RunMode::Forever, shutdown).await }
    });
    // Let the relay make its first (empty) claim and start waiting on LISTEN.
    wait_for("the relay to listen", Duration::from_secs(10), || async {
        db.count("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'ClientRead' AND query LIKE 'LISTEN%'").await > 0
    })
    .await;
    enqueue(&db, 1).await;
    wait_for(
        "delivery well before the 30 s poll",
        Duration::from_secs(10),
        || async { sink.count() == 1 },
    )
    .await;
    shutdown.cancel();
    run.await.unwrap();
    db.drop_schema().await;
}

#[tokio::test]
async fn the_relay_survives_its_database_connections_being_killed() {
    let db = TestDb::new().await;
    enqueue(&db, 3000).await;
    let app = postbox_testkit::unique("relay_");
    let options: sqlx::postgres::PgConnectOptions = db
        .url
        .parse::<sqlx::postgres::PgConnectOptions>()
        .unwrap()
        .application_name(&app);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy_with(options);
    let sink = ScriptedSink::new(|_, _| Outcome::Delivered);
    let config = RelayConfig {
        batch_size: 20,
        ..fast_config()
    };
    let relay = Relay::new(Store::new(pool, db.schema.clone()), sink.clone(), config).unwrap();
    let run =
        tokio::spawn(async move { relay.run(RunMode::Drain, CancellationToken::new()).await });
    let kill = format!("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = '{app}'");
    let mut kills = 0;
    for threshold in [300, 1200, 2000] {
        wait_for("progress", Duration::from_secs(30), || async {
            sink.count() >= threshold
        })
        .await;
        kills += db.count(&kill).await;
    }
    let stats = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .unwrap()
        .unwrap();
    assert!(kills > 0, "connections were killed");
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'sent'")
            .await,
        3000
    );
    let distinct: HashSet<_> = sink.ids().into_iter().collect();
    assert_eq!(distinct.len(), 3000, "every event delivered at least once");
    assert!(stats.delivered <= 3000);
    db.drop_schema().await;
}

/// The relay's statements relax `synchronous_commit` for their own implicit
/// transaction only: the connection goes back to the pool (and to whatever
/// the application runs on it next) with the server's setting. Both commit
/// modes drain.
#[tokio::test]
async fn relay_commit_mode_stays_inside_each_statement() {
    let db = TestDb::new().await;
    enqueue(&db, 30).await;
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .unwrap();
    let setting = || async {
        sqlx::query_scalar::<_, String>("SHOW synchronous_commit")
            .fetch_one(&one)
            .await
            .unwrap()
    };
    let before = setting().await;
    let store = Store::new(one.clone(), db.schema.clone())
        .with_relay_commit(postbox_store::RelayCommit::Asynchronous);
    let claim = store
        .claim(10, Duration::from_secs(30), None)
        .await
        .unwrap();
    assert_eq!(claim.ids.len(), 10);
    assert_eq!(setting().await, before, "not left on the pooled connection");
    store.ack_delivered(claim.token, &claim.ids).await.unwrap();
    assert_eq!(setting().await, before);

    let relaxed = RelayConfig {
        synchronous_commit: false,
        ..fast_config()
    };
    let stats = drain(&db, ScriptedSink::delivering(), relaxed).await;
    assert_eq!(stats.delivered, 20);
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'sent'")
            .await,
        30
    );
    one.close().await;
    db.drop_schema().await;
}

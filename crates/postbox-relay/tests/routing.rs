//! Routing and fan-out: events go to the destinations their type routes to;
//! each destination keeps its own attempts, retries and dead letter; a
//! destination that took an event is never published to again.

use crate::support::*;
use postbox::NewEvent;
use postbox_relay::{Destination, Outcome, RelayConfig, RouteConfig, Router, RunMode};
use postbox_store::{Action, Selection};
use postbox_testkit::TestDb;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

fn destination(name: &str, sink: Arc<ScriptedSink>) -> Destination {
    Destination::new(name, sink)
}

fn route(matches: &[&str], to: &[&str]) -> RouteConfig {
    RouteConfig {
        matches: matches.iter().map(|s| s.to_string()).collect(),
        to: to.iter().map(|s| s.to_string()).collect(),
        ordered: false,
        poison: Default::default(),
        ..RouteConfig::default()
    }
}

async fn drain_router(db: &TestDb, router: Router, config: RelayConfig) {
    let relay = postbox_relay::Relay::with_router(store(db), router, config).unwrap();
    tokio::time::timeout(
        Duration::from_secs(120),
        relay.run(RunMode::Drain, CancellationToken::new()),
    )
    .await
    .expect("the relay drains within the timeout");
}

/// How many times each event id was published to `sink`.
fn times(sink: &ScriptedSink) -> HashMap<Uuid, usize> {
    let mut m = HashMap::new();
    for id in sink.ids() {
        *m.entry(id).or_default() += 1;
    }
    m
}

async fn enqueue_types(db: &TestDb, types: &[&str]) -> Vec<Uuid> {
    let events: Vec<NewEvent> = types
        .iter()
        .enumerate()
        .map(|(i, t)| {
            NewEvent::new(*t, "order", i.to_string(), &serde_json::json!({ "i": i })).unwrap()
        })
        .collect();
    db.enqueue_events(&events).await
}

#[tokio::test]
async fn fan_out_delivers_to_each_destination_once_while_one_keeps_failing() {
    let db = TestDb::new().await;
    let ids = enqueue(&db, 300).await;
    let a = ScriptedSink::delivering();
    let c = ScriptedSink::delivering();
    // b fails each event's first two attempts.
    let b = ScriptedSink::new(|_, before| {
        if before < 2 {
            Outcome::retry("503 from b")
        } else {
            Outcome::Delivered
        }
    });
    let router = Router::new(
        vec![
            destination("a", a.clone()),
            destination("b", b.clone()),
            destination("c", c.clone()),
        ],
        &[
            route(&["order.*"], &["a", "b"]),
            route(&["order.created"], &["c"]),
        ],
    )
    .unwrap();
    drain_router(&db, router, fast_config()).await;

    for id in &ids {
        assert_eq!(times(&a).get(id), Some(&1), "a took each event once");
        assert_eq!(times(&c).get(id), Some(&1), "c took each event once");
        assert_eq!(
            times(&b).get(id),
            Some(&3),
            "b: two failures, then delivered"
        );
    }
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'sent'")
            .await,
        300
    );
    // Per-destination rows say what happened where.
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.deliveries WHERE destination = 'b' AND status = 'sent' AND attempts = 3").await,
        300
    );
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.deliveries WHERE destination IN ('a', 'c') AND status = 'sent' AND attempts = 1").await,
        600
    );
    let counts = store(&db).destination_counts().await.unwrap();
    let b_counts = counts.iter().find(|d| d.destination == "b").unwrap();
    assert_eq!(
        (
            b_counts.retrying,
            b_counts.dead_letters,
            b_counts.delivered_after_retry
        ),
        (0, 0, 300)
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn a_fan_out_that_succeeds_at_once_writes_no_delivery_rows() {
    let db = TestDb::new().await;
    enqueue(&db, 200).await;
    let (a, b) = (ScriptedSink::delivering(), ScriptedSink::delivering());
    let router = Router::new(
        vec![destination("a", a.clone()), destination("b", b.clone())],
        &[route(&["*"], &["a", "b"])],
    )
    .unwrap();
    drain_router(&db, router, fast_config()).await;
    assert_eq!((a.count(), b.count()), (200, 200));
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.deliveries").await,
        0
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn a_destination_that_rejects_dead_letters_the_event_for_that_destination_only() {
    let db = TestDb::new().await;
    let ids = enqueue(&db, 20).await;
    let rejecting = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let r = rejecting.clone();
    let good = ScriptedSink::delivering();
    let gone = ScriptedSink::new(move |_, _| {
        if r.load(std::sync::atomic::Ordering::SeqCst) {
            Outcome::reject("HTTP 410: endpoint removed")
        } else {
            Outcome::Delivered
        }
    });
    let router = || {
        Router::new(
            vec![
                destination("good", good.clone()),
                destination("gone", gone.clone()),
            ],
            &[route(&["*"], &["good", "gone"])],
        )
        .unwrap()
    };
    drain_router(&db, router(), fast_config()).await;
    assert_eq!(good.count(), 20);
    assert_eq!(gone.count(), 20);
    assert_eq!(db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'failed' AND last_error LIKE 'gone: HTTP 410%'").await, 20);
    let counts = store(&db).destination_counts().await.unwrap();
    let gone_counts = counts.iter().find(|d| d.destination == "gone").unwrap();
    assert_eq!(gone_counts.dead_letters, 20);

    // Replaying the dead letters publishes to the failed destination only.
    rejecting.store(false, std::sync::atomic::Ordering::SeqCst);
    store(&db)
        .dead_letters()
        .apply(
            &Selection::Ids(ids.clone()),
            &Action::Replay,
            "test",
            100,
            |_| {},
        )
        .await
        .unwrap();
    drain_router(&db, router(), fast_config()).await;
    assert_eq!(good.count(), 20, "good is not published to again");
    assert_eq!(gone.count(), 40);
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'sent'")
            .await,
        20
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn each_destination_has_its_own_retry_budget() {
    let db = TestDb::new().await;
    enqueue(&db, 10).await;
    let flaky = ScriptedSink::new(|_, before| {
        if before < 4 {
            Outcome::retry("flaky")
        } else {
            Outcome::Delivered
        }
    });
    let broken = ScriptedSink::new(|_, _| Outcome::retry("always down"));
    let router = Router::new(
        vec![
            destination("flaky", flaky.clone()),
            destination("broken", broken.clone()),
        ],
        &[route(&["*"], &["flaky", "broken"])],
    )
    .unwrap();
    let config = RelayConfig {
        max_attempts: 5,
        ..fast_config()
    };
    drain_router(&db, router, config).await;
    // flaky made it on its fifth attempt; broken used its five and is dead.
    assert_eq!(flaky.count(), 50);
    assert_eq!(broken.count(), 50);
    assert_eq!(db.count("SELECT count(*) FROM {schema}.deliveries WHERE destination = 'flaky' AND status = 'sent'").await, 10);
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.deliveries WHERE destination = 'broken' AND status = 'failed' AND attempts = 5").await,
        10
    );
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'failed'")
            .await,
        10
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn events_no_route_matches_are_dead_lettered_with_the_reason() {
    let db = TestDb::new().await;
    enqueue_types(&db, &["order.created", "user.signed_up", "order.paid"]).await;
    let orders = ScriptedSink::delivering();
    let router = Router::new(
        vec![destination("orders", orders.clone())],
        &[route(&["order.*"], &["orders"])],
    )
    .unwrap();
    drain_router(&db, router, fast_config()).await;
    assert_eq!(orders.count(), 2);
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'failed' AND event_type = 'user.signed_up' AND last_error LIKE 'no route matches%'").await,
        1
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn deferred_events_do_not_use_up_their_attempts() {
    let db = TestDb::new().await;
    enqueue(&db, 30).await;
    // A throttled sink: each event is deferred six times before it is sent.
    let throttled = ScriptedSink::new(|_, before| {
        if before < 6 {
            Outcome::Deferred {
                reason: "rate limit reached".into(),
                after: Some(Duration::from_millis(1)),
            }
        } else {
            Outcome::Delivered
        }
    });
    let config = RelayConfig {
        max_attempts: 2,
        ..fast_config()
    };
    let stats = drain(&db, throttled.clone(), config).await;
    assert_eq!(stats.delivered, 30);
    assert_eq!(stats.dead_lettered, 0, "deferrals are not attempts");
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'sent' AND attempts = 1")
            .await,
        30
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn a_trace_context_given_at_enqueue_travels_with_the_event() {
    let db = TestDb::new().await;
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let event = NewEvent::new("order.created", "order", "1", &serde_json::json!({}))
        .unwrap()
        .trace_context(tp, Some("vendor=abc"))
        .unwrap();
    db.enqueue_events(&[event]).await;
    let sink = ScriptedSink::delivering();
    drain(&db, sink.clone(), fast_config()).await;
    let m = sink.seen.lock().unwrap().messages[0].clone();
    assert_eq!(m.headers.get("traceparent").map(String::as_str), Some(tp));
    let body: serde_json::Value =
        serde_json::from_str(&postbox_relay::cloudevents::to_json(&m, "shop")).unwrap();
    assert_eq!(body["traceparent"], tp);
    assert_eq!(body["tracestate"], "vendor=abc");
    assert_eq!(body["sequence"], 1);
    db.drop_schema().await;
}

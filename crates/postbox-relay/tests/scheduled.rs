//! Scheduled delivery: an event with a `deliver_at` is invisible to relays
//! until then, in claim mode and in log mode (where the cursor hands it to
//! the outbox and moves on); in ordered routes it holds back the later
//! events of its aggregate; a drain does not wait for events scheduled far
//! ahead; status counts them apart from pending ones.

use crate::support::*;
use chrono::{DateTime, Utc};
use postbox::statements::trusted;
use postbox::NewEvent;
use postbox_relay::{Outcome, PoisonPolicy, ReadMode, Relay, RelayConfig, Router, RunMode, Sink};
use postbox_testkit::{wait_for, TestDb};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

type Times = Arc<Mutex<HashMap<Uuid, DateTime<Utc>>>>;

/// A delivering sink that notes when it first saw each event.
fn timed_sink() -> (Arc<ScriptedSink>, Times) {
    let times: Times = Arc::default();
    let noted = times.clone();
    let sink = ScriptedSink::new(move |m, _| {
        noted
            .lock()
            .unwrap()
            .entry(m.event_id)
            .or_insert_with(Utc::now);
        Outcome::Delivered
    });
    (sink, times)
}

fn seen(times: &Times, id: Uuid) -> Option<DateTime<Utc>> {
    times.lock().unwrap().get(&id).copied()
}

fn event(aggregate: &str, n: i64) -> NewEvent {
    NewEvent::new(
        "order.created",
        "order",
        aggregate,
        &serde_json::json!({ "n": n }),
    )
    .unwrap()
}

/// The delivery time stored for `id` in `table` (outbox or log).
async fn deliver_at(db: &TestDb, table: &str, id: Uuid) -> DateTime<Utc> {
    sqlx::query_scalar(trusted(&db.sql(&format!(
        "SELECT deliver_at FROM {{schema}}.{table} WHERE event_id = $1"
    ))))
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

fn log_config() -> RelayConfig {
    RelayConfig {
        mode: ReadMode::Log,
        ..fast_config()
    }
}

async fn into_log_mode(db: &TestDb) {
    store(db)
        .log()
        .set_producer_target(postbox_store::ProducerTarget::Log)
        .await
        .unwrap();
}

/// Enqueue an event scheduled 2 s ahead and then a plain one; run a relay
/// until both are delivered. The plain one goes first, the scheduled one
/// not before its time. Returns (scheduled, plain) ids and the sink's times.
async fn scheduled_then_plain(db: &TestDb, config: RelayConfig) -> (Uuid, Uuid, Times) {
    let later = db
        .enqueue_events(&[event("a", 1).deliver_after(Duration::from_secs(2)).unwrap()])
        .await[0];
    let now = db.enqueue_events(&[event("b", 1)]).await[0];
    let (sink, times) = timed_sink();
    let relay = Relay::with_router(store(db), Router::single(sink.clone()), config).unwrap();
    let stop = CancellationToken::new();
    let run = relay.run(RunMode::Forever, stop.clone());
    let check = async {
        wait_for("both delivered", Duration::from_secs(30), || async {
            seen(&times, later).is_some() && seen(&times, now).is_some()
        })
        .await;
        stop.cancel();
    };
    tokio::join!(run, check);
    assert_eq!(sink.count(), 2, "each once");
    (later, now, times)
}

#[tokio::test]
async fn a_scheduled_event_waits_for_its_time_in_claim_mode() {
    let db = TestDb::new().await;
    let (later, now, times) = scheduled_then_plain(&db, fast_config()).await;
    let due = deliver_at(&db, "outbox", later).await;
    let (later_at, now_at) = (seen(&times, later).unwrap(), seen(&times, now).unwrap());
    assert!(later_at >= due, "delivered at {later_at}, due at {due}");
    assert!(
        now_at < due,
        "the plain event did not wait: {now_at} vs {due}"
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn a_scheduled_event_waits_for_its_time_in_log_mode_and_the_cursor_does_not() {
    let db = TestDb::new().await;
    into_log_mode(&db).await;
    let (later, now, times) = scheduled_then_plain(&db, log_config()).await;
    let due = deliver_at(&db, "log", later).await;
    let (later_at, now_at) = (seen(&times, later).unwrap(), seen(&times, now).unwrap());
    assert!(later_at >= due, "delivered at {later_at}, due at {due}");
    // Enqueued after the scheduled one, read behind it by the same cursor,
    // and delivered before its time: the cursor moved on.
    assert!(now_at < due, "the cursor waited: {now_at} vs {due}");
    // The scheduled event went through the outbox, untried and with no error
    // until its one delivery.
    let row: (String, i32, Option<String>, DateTime<Utc>) = sqlx::query_as(trusted(&db.sql(
        "SELECT status::text, attempts, last_error, deliver_at FROM {schema}.outbox WHERE event_id = $1",
    )))
    .bind(later)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (row.0.as_str(), row.1, row.2, row.3),
        ("sent", 1, None, due)
    );
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox").await,
        1,
        "the plain event was delivered from the log"
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn in_ordered_routes_a_scheduled_event_holds_back_its_aggregate_only() {
    let db = TestDb::new().await;
    let ids = db
        .enqueue_events(&[
            event("x", 1).deliver_after(Duration::from_secs(2)).unwrap(),
            event("x", 2),
            event("y", 1),
        ])
        .await;
    let (x1, x2, y1) = (ids[0], ids[1], ids[2]);
    let (sink, times) = timed_sink();
    let router = Router::single(sink.clone() as Arc<dyn Sink>).all_ordered(PoisonPolicy::Block);
    let relay = Relay::with_router(store(&db), router, fast_config()).unwrap();
    let stop = CancellationToken::new();
    let run = relay.run(RunMode::Forever, stop.clone());
    let check = async {
        wait_for("all three delivered", Duration::from_secs(30), || async {
            [x1, x2, y1].iter().all(|&id| seen(&times, id).is_some())
        })
        .await;
        stop.cancel();
    };
    tokio::join!(run, check);
    let due = deliver_at(&db, "outbox", x1).await;
    let at = |id| seen(&times, id).unwrap();
    assert!(at(y1) < due, "another aggregate is not held back");
    assert!(at(x1) >= due, "the scheduled event waited for its time");
    assert!(
        at(x2) >= at(x1),
        "x2 waited behind the scheduled x1: {} vs {}",
        at(x2),
        at(x1)
    );
    let order: Vec<Uuid> = sink.ids();
    let pos = |id| order.iter().position(|&o| o == id).unwrap();
    assert!(pos(x1) < pos(x2), "x1 before x2: {order:?}");
    db.drop_schema().await;
}

async fn drain_skips_the_far_future(db: &TestDb, config: RelayConfig) -> (Uuid, Uuid) {
    let config_mode_is_claim = config.mode == ReadMode::Claim;
    let far = db
        .enqueue_events(&[event("a", 1)
            .deliver_after(Duration::from_secs(3600))
            .unwrap()])
        .await[0];
    let now = db.enqueue_events(&[event("b", 1)]).await[0];
    let (sink, _) = timed_sink();
    let relay = Relay::with_router(store(db), Router::single(sink.clone()), config).unwrap();
    let stats = tokio::time::timeout(
        Duration::from_secs(60),
        relay.run(RunMode::Drain, CancellationToken::new()),
    )
    .await
    .expect("the drain does not wait an hour");
    assert_eq!(stats.delivered, 1);
    assert_eq!(sink.ids(), vec![now]);
    let counts = store(db).status_counts().await.unwrap();
    // (In log mode the plain event was delivered from the log: never in the outbox.)
    let sent = i64::from(config_mode_is_claim);
    assert_eq!(
        (counts.pending, counts.scheduled, counts.sent),
        (0, 1, sent)
    );
    let next = counts.next_scheduled_in_seconds.unwrap();
    assert!((3000.0..=3600.0).contains(&next), "{next}");
    assert_eq!(counts.oldest_pending_age_seconds, None);
    let gauges = store(db).gauges().await.unwrap();
    assert_eq!(
        gauges.oldest_pending_event_id, None,
        "a scheduled event is not a late one"
    );
    (far, now)
}

#[tokio::test]
async fn a_drain_does_not_wait_for_events_scheduled_far_ahead_and_status_counts_them_apart() {
    let db = TestDb::new().await;
    drain_skips_the_far_future(&db, fast_config()).await;
    // Once due, an event scheduled for later is pending like any other.
    db.enqueue_events(&[event("c", 1)
        .deliver_at(Utc::now() - chrono::Duration::seconds(5))
        .unwrap()])
        .await;
    let counts = store(&db).status_counts().await.unwrap();
    assert_eq!((counts.pending, counts.scheduled), (1, 1));
    db.drop_schema().await;
}

#[tokio::test]
async fn a_drain_in_log_mode_hands_far_scheduled_events_to_the_outbox_and_ends() {
    let db = TestDb::new().await;
    into_log_mode(&db).await;
    let (far, _) = drain_skips_the_far_future(&db, log_config()).await;
    let (status, attempts): (String, i32) = sqlx::query_as(trusted(
        &db.sql("SELECT status::text, attempts FROM {schema}.outbox WHERE event_id = $1"),
    ))
    .bind(far)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), attempts), ("pending", 0));
    db.drop_schema().await;
}

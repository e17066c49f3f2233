//! Filters and transforms (jq) per route and per destination, in claim and
//! log mode (logical mode's case is in `logical.rs`, beside its slot
//! helpers): a filtered-out event is not sent and is counted, a transformed
//! one carries the transform's payload and headers, and an expression that
//! fails on one event makes it a dead letter of that destination only.

use crate::support::*;
use postbox::statements::trusted;
use postbox::NewEvent;
use postbox_relay::shape::Shape;
use postbox_relay::{Destination, ReadMode, RelayConfig, RouteConfig, Router};
use postbox_testkit::TestDb;
use std::collections::HashMap;
use std::sync::Arc;
use uuid::Uuid;

/// billing: only orders of at least 100, slimmed to what it needs, with a
/// header of its own; audit: everything as it was committed. A total that
/// is not a number passes billing's filter (strings sort above numbers in
/// jq) and fails its transform.
pub(crate) fn billing_and_audit(billing: Arc<ScriptedSink>, audit: Arc<ScriptedSink>) -> Router {
    let shape = Shape::compile(
        "destinations.billing",
        Some(".payload.total >= 100"),
        None,
        Some(r#"{"x-customer": .payload.customer}"#),
    )
    .unwrap();
    Router::new(
        vec![
            Destination::new("billing", billing).with_shape(shape),
            Destination::new("audit", audit),
        ],
        &[
            RouteConfig {
                matches: vec!["order.*".into()],
                to: vec!["billing".into()],
                transform: Some("{order: .aggregate_id, total: (.payload.total + 0)}".into()),
                ..RouteConfig::default()
            },
            RouteConfig {
                matches: vec!["*".into()],
                to: vec!["audit".into()],
                ..RouteConfig::default()
            },
        ],
    )
    .unwrap()
}

/// The totals the events carry: 20 under 100, 80 at or above, one "lots".
pub(crate) fn totals() -> Vec<serde_json::Value> {
    let mut t: Vec<serde_json::Value> = (0..100).map(|i| serde_json::json!(i * 5)).collect();
    t.push(serde_json::json!("lots"));
    t
}

pub(crate) fn order(i: usize, total: &serde_json::Value) -> NewEvent {
    NewEvent::new(
        "order.placed",
        "order",
        format!("o{i}"),
        &serde_json::json!({"total": total, "customer": format!("c{i}"), "card": "4111"}),
    )
    .unwrap()
}

/// What billing and audit must have seen of `ids` (parallel to [`totals`]).
pub(crate) fn check_deliveries(ids: &[Uuid], billing: &ScriptedSink, audit: &ScriptedSink) {
    let totals = totals();
    let seen = billing.seen.lock().unwrap();
    let by_id: HashMap<Uuid, &postbox_relay::Message> =
        seen.messages.iter().map(|m| (m.event_id, m)).collect();
    for (i, (id, total)) in ids.iter().zip(&totals).enumerate() {
        let n = total.as_i64();
        match n {
            Some(n) if n >= 100 => {
                let m = by_id
                    .get(id)
                    .unwrap_or_else(|| panic!("billing got order {i}"));
                let payload: serde_json::Value = serde_json::from_str(m.payload.get()).unwrap();
                assert_eq!(
                    payload,
                    serde_json::json!({"order": format!("o{i}"), "total": n})
                );
                assert_eq!(m.headers.get("x-customer"), Some(&format!("c{i}")));
                assert_eq!(m.headers.len(), 1, "the headers expression's set only");
            }
            Some(_) => assert!(!by_id.contains_key(id), "order {i} is filtered out"),
            None => assert!(
                !by_id.contains_key(id),
                "the failing transform sends nothing"
            ),
        }
    }
    assert_eq!(
        seen.messages.len(),
        80,
        "billing: 80 events of at least 100"
    );
    drop(seen);
    let audit = audit.seen.lock().unwrap();
    assert_eq!(
        audit.messages.len(),
        ids.len(),
        "audit got every event once"
    );
    for m in &audit.messages {
        let payload: serde_json::Value = serde_json::from_str(m.payload.get()).unwrap();
        assert_eq!(payload["card"], "4111", "audit's events are as committed");
    }
}

/// The one failing event: a dead letter for billing only, with the error.
pub(crate) async fn check_the_dead_letter(pool: &sqlx::PgPool, schema: &postbox::Schema, id: Uuid) {
    let error: String = sqlx::query_scalar(trusted(&schema.render(
        "SELECT d.last_error FROM {schema}.deliveries d JOIN {schema}.outbox o ON o.id = d.outbox_id \
         WHERE o.event_id = $1 AND d.destination = 'billing' AND d.status = 'failed'",
    )))
    .bind(id)
    .fetch_one(pool)
    .await
    .expect("billing's dead letter is recorded");
    assert!(
        error.starts_with("transform of routes[0] failed: "),
        "{error}"
    );
    assert!(!error.contains("4111"), "{error}");
    let audit_not_sent: i64 = sqlx::query_scalar(trusted(&schema.render(
        "SELECT count(*) FROM {schema}.deliveries d JOIN {schema}.outbox o ON o.id = d.outbox_id \
         WHERE o.event_id = $1 AND d.destination = 'audit' AND d.status <> 'sent'",
    )))
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        audit_not_sent, 0,
        "audit is not held up by billing's dead letter"
    );
}

async fn filtered_counted(db: &TestDb) -> i64 {
    db.count("SELECT coalesce(sum(filtered), 0)::bigint FROM {schema}.deliveries_by_minute WHERE destination = 'billing'")
        .await
}

#[tokio::test]
async fn claim_mode_filters_transforms_and_dead_letters_per_destination() {
    let db = TestDb::new().await;
    let events: Vec<NewEvent> = totals()
        .iter()
        .enumerate()
        .map(|(i, t)| order(i, t))
        .collect();
    let ids = db.enqueue_events(&events).await;
    let (billing, audit) = (ScriptedSink::delivering(), ScriptedSink::delivering());
    let stats = drain_with(
        &db,
        billing_and_audit(billing.clone(), audit.clone()),
        fast_config(),
    )
    .await;
    check_deliveries(&ids, &billing, &audit);
    check_the_dead_letter(&db.pool, &db.schema, ids[100]).await;
    assert_eq!(stats.filtered, 20);
    assert_eq!(
        filtered_counted(&db).await,
        20,
        "counted for status and the console"
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn log_mode_filters_transforms_and_dead_letters_per_destination() {
    let db = TestDb::new().await;
    store(&db)
        .log()
        .set_producer_target(postbox_store::ProducerTarget::Log)
        .await
        .unwrap();
    let events: Vec<NewEvent> = totals()
        .iter()
        .enumerate()
        .map(|(i, t)| order(i, t))
        .collect();
    let ids = db.enqueue_events(&events).await;
    let (billing, audit) = (ScriptedSink::delivering(), ScriptedSink::delivering());
    let config = RelayConfig {
        mode: ReadMode::Log,
        batch_size: 30,
        ..fast_config()
    };
    let stats = drain_with(
        &db,
        billing_and_audit(billing.clone(), audit.clone()),
        config,
    )
    .await;
    check_deliveries(&ids, &billing, &audit);
    check_the_dead_letter(&db.pool, &db.schema, ids[100]).await;
    assert_eq!(stats.filtered, 20);
    assert_eq!(filtered_counted(&db).await, 20);
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox").await,
        1,
        "only the failing event was handed to the outbox"
    );
    db.drop_schema().await;
}

/// In log mode, an ordered route whose transform fails on an aggregate's
/// second event holds that aggregate's later events back (poison `block`)
/// at that destination only; other aggregates, and the other destination,
/// go on. (Claim mode orders whole outbox rows: there the aggregate waits at
/// every destination, as for any dead letter.)
#[tokio::test]
async fn an_ordered_route_blocks_behind_a_failing_transform() {
    let db = TestDb::new().await;
    store(&db)
        .log()
        .set_producer_target(postbox_store::ProducerTarget::Log)
        .await
        .unwrap();
    let mut events = Vec::new();
    for a in 0..3 {
        for k in 0..4 {
            let total = if a == 1 && k == 1 {
                serde_json::json!("lots")
            } else {
                serde_json::json!(100 + k)
            };
            events.push(
                NewEvent::new(
                    "order.placed",
                    "order",
                    format!("o{a}"),
                    &serde_json::json!({"total": total}),
                )
                .unwrap(),
            );
        }
    }
    let ids = db.enqueue_events(&events).await;
    let (billing, audit) = (ScriptedSink::delivering(), ScriptedSink::delivering());
    // The transform is billing's own.
    let shape = Shape::compile(
        "destinations.billing",
        None,
        Some(".payload.total + 0"),
        None,
    )
    .unwrap();
    let router = Router::new(
        vec![
            Destination::new("billing", billing.clone()).with_shape(shape),
            Destination::new("audit", audit.clone()),
        ],
        &[RouteConfig {
            matches: vec!["order.*".into()],
            to: vec!["billing".into(), "audit".into()],
            ordered: true,
            ..RouteConfig::default()
        }],
    )
    .unwrap();
    let config = RelayConfig {
        mode: ReadMode::Log,
        ..fast_config()
    };
    drain_with(&db, router, config).await;
    let billed: Vec<Uuid> = billing.ids();
    // o0 and o2: all four; o1: only its first, then the dead letter blocks.
    let expected: Vec<Uuid> = [0, 1, 2, 3, 4, 8, 9, 10, 11]
        .iter()
        .map(|&i| ids[i])
        .collect();
    let mut got = billed.clone();
    got.sort();
    let mut want = expected.clone();
    want.sort();
    assert_eq!(
        got, want,
        "billing took o0 and o2 whole and o1 up to its dead letter"
    );
    assert_eq!(audit.count(), 12, "audit took every event");
    db.drop_schema().await;
}

//! The whole flow: order → outbox → relay → Redis stream → consumer → effect, once.

use crate::support::*;
use axum::http::StatusCode;
use postbox_testkit::wait_for;
use redis::streams::{StreamId, StreamRangeReply};
use redis::AsyncCommands;
use serde_json::{json, Value};
use shop::consumer::GROUP;
use std::sync::atomic::Ordering;
use uuid::Uuid;

async fn entries(stream: &str) -> Vec<StreamId> {
    let mut redis = postbox_testkit::redis().await;
    let reply: StreamRangeReply = redis.xrange_all(stream).await.unwrap();
    reply.ids
}

/// Entries of the group read and not acknowledged.
async fn pending(stream: &str) -> usize {
    let mut redis = postbox_testkit::redis().await;
    let reply: redis::streams::StreamPendingReply = redis.xpending(stream, GROUP).await.unwrap();
    reply.count()
}

fn field(entry: &StreamId, name: &str) -> String {
    entry
        .get(name)
        .unwrap_or_else(|| panic!("entry has {name}"))
}

#[tokio::test]
async fn an_order_is_applied_once_even_when_redis_delivers_it_twice() {
    let shop = TestShop::new().await;
    let order = json!({ "customer": "bob", "items": ["lamp"], "total_cents": 4200 });
    let placed = shop.post_order(Some("order-1"), &order).await;
    assert_eq!(placed.status, StatusCode::CREATED);

    let running = shop.start().await;
    wait_for("the consumer applied the order", WAIT, || async {
        shop.customer_orders("bob").await == 1
    })
    .await;
    wait_for("the entry is acknowledged", WAIT, || async {
        pending(&shop.stream).await == 0
    })
    .await;
    let stats = shop.get("/customers/bob").await;
    assert_eq!(
        stats.body,
        json!({ "customer": "bob", "orders": 1, "spent_cents": 4200 })
    );

    // On the wire: the outbox row's event id, in the entry and in the CloudEvents body.
    let outbox_id: Uuid = sqlx::query_scalar(sqlx::AssertSqlSafe(
        shop.db.sql("SELECT event_id FROM {schema}.outbox"),
    ))
    .fetch_one(&shop.db.pool)
    .await
    .unwrap();
    let sent = entries(&shop.stream).await;
    assert_eq!(sent.len(), 1);
    assert_eq!(field(&sent[0], "id"), outbox_id.to_string());
    let body: Value = serde_json::from_str(&field(&sent[0], "body")).unwrap();
    assert_eq!(body["id"], outbox_id.to_string());
    assert_eq!(body["type"], "order.placed");
    assert_eq!(body["schemaversion"], 1);
    assert_eq!(body["data"]["order_id"], placed.body["id"]);
    // The relay settles after Redis acknowledged: maybe after the consumer was done.
    wait_for("the relay marked the event sent", WAIT, || async {
        shop.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'sent'")
            .await
            == 1
    })
    .await;

    // Redis delivers the same message again (a relay that published twice).
    let mut redis = postbox_testkit::redis().await;
    let fields: Vec<(String, String)> = ["id", "type", "body"]
        .iter()
        .map(|f| (f.to_string(), field(&sent[0], f)))
        .collect();
    let _: String = redis.xadd(&shop.stream, "*", &fields).await.unwrap();
    wait_for("the consumer saw the duplicate", WAIT, || async {
        running.stats.duplicates.load(Ordering::Relaxed) == 1
    })
    .await;
    wait_for("the duplicate is acknowledged", WAIT, || async {
        pending(&shop.stream).await == 0
    })
    .await;
    assert_eq!(shop.customer_orders("bob").await, 1, "applied once");
    assert_eq!(running.stats.applied.load(Ordering::Relaxed), 1);
    assert_eq!(
        shop.count("SELECT count(*) FROM {schema}.inbox").await,
        1,
        "one inbox record"
    );
    running.stop().await;
    shop.finish().await;
}

#[tokio::test]
async fn an_entry_read_but_never_acknowledged_is_applied_after_a_restart() {
    let shop = TestShop::new().await;
    let order = json!({ "customer": "carol", "items": ["tea"], "total_cents": 300 });
    assert_eq!(
        shop.post_order(Some("order-1"), &order).await.status,
        StatusCode::CREATED
    );
    let consumer = shop.consumer("shop-1").await; // creates the group
    let running = shop.start_relay();
    wait_for("the relay published", WAIT, || async {
        entries(&shop.stream).await.len() == 1
    })
    .await;

    // A first run of `shop-1` read the entry, then crashed before acknowledging it.
    let mut redis = postbox_testkit::redis().await;
    let read: redis::streams::StreamReadReply = redis
        .xread_options(
            &[&shop.stream],
            &[">"],
            &redis::streams::StreamReadOptions::default().group(GROUP, "shop-1"),
        )
        .await
        .unwrap();
    assert_eq!(read.keys[0].ids.len(), 1);
    assert_eq!(pending(&shop.stream).await, 1);

    // Restarted under the same name, it finds its pending entry first.
    let running = running.with_consumer(consumer);
    wait_for("the pending entry was applied", WAIT, || async {
        shop.customer_orders("carol").await == 1
    })
    .await;
    wait_for("and acknowledged", WAIT, || async {
        pending(&shop.stream).await == 0
    })
    .await;
    running.stop().await;
    shop.finish().await;
}

#[tokio::test]
async fn an_undecodable_entry_is_dead_lettered_and_the_next_one_applied() {
    let shop = TestShop::new().await;
    let running = shop.start().await;
    // An order.placed of a version this consumer does not know, then garbage.
    let mut redis = postbox_testkit::redis().await;
    let v2 = json!({
        "specversion": "1.0", "id": Uuid::now_v7(), "source": "test", "type": "order.placed",
        "schemaversion": 2, "data": { "order_id": 1 }
    });
    let _: String = redis
        .xadd(&shop.stream, "*", &[("body", v2.to_string())])
        .await
        .unwrap();
    let _: String = redis
        .xadd(&shop.stream, "*", &[("body", "not json")])
        .await
        .unwrap();
    let order = json!({ "customer": "dave", "items": ["pen"], "total_cents": 150 });
    shop.post_order(Some("order-1"), &order).await;

    wait_for("the valid order was applied", WAIT, || async {
        shop.customer_orders("dave").await == 1
    })
    .await;
    let dead = entries(&format!("{}:dead", shop.stream)).await;
    assert_eq!(dead.len(), 2);
    let reason = field(&dead[0], "reason");
    assert!(
        reason.contains("has no decoder for schema version 2"),
        "{reason}"
    );
    assert!(field(&dead[1], "reason").contains("not a CloudEvents JSON document"));
    assert_eq!(field(&dead[1], "body"), "not json");
    assert_eq!(running.stats.dead_lettered.load(Ordering::Relaxed), 2);
    wait_for("everything acknowledged", WAIT, || async {
        pending(&shop.stream).await == 0
    })
    .await;
    running.stop().await;
    shop.finish().await;
}

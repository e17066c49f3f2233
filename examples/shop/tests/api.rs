//! `POST /orders` behind the Idempotency-Key header, and the reads.

use crate::support::*;
use axum::http::StatusCode;
use postbox::idempotency::{self, Begin, Fingerprint, IdempotencyKey};
use postbox::Outbox;
use serde_json::json;
use std::time::Duration;

fn alice() -> serde_json::Value {
    json!({ "customer": "alice", "items": ["book", "pen"], "total_cents": 2500 })
}

#[tokio::test]
async fn a_retry_with_the_same_key_replays_the_response_without_a_second_order() {
    let shop = TestShop::new().await;
    let first = shop.post_order(Some("order-1"), &alice()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    assert_eq!(first.body["customer"], "alice");
    assert_eq!(first.body["items"], json!(["book", "pen"]));
    assert!(first.body["id"].is_i64());
    assert!(!first.headers.contains_key("idempotent-replayed"));

    let retry = shop.post_order(Some("order-1"), &alice()).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.body, first.body, "the stored response, byte for byte");
    assert_eq!(retry.headers["idempotent-replayed"], "true");

    assert_eq!(shop.count("SELECT count(*) FROM {schema}.orders").await, 1);
    assert_eq!(shop.count("SELECT count(*) FROM {schema}.outbox").await, 1);
    let event = shop
        .count(
            "SELECT count(*) FROM {schema}.outbox WHERE event_type = 'order.placed' \
             AND schema_version = 1 AND aggregate_type = 'order' \
             AND aggregate_id = (SELECT id::text FROM {schema}.orders) \
             AND payload->>'customer' = 'alice' AND (payload->>'total_cents')::bigint = 2500",
        )
        .await;
    assert_eq!(event, 1, "the typed event describes the order");

    // Another key is another order.
    let second = shop.post_order(Some("order-2"), &alice()).await;
    assert_eq!(second.status, StatusCode::CREATED);
    assert_ne!(second.body["id"], first.body["id"]);
    assert_eq!(shop.count("SELECT count(*) FROM {schema}.outbox").await, 2);
    shop.finish().await;
}

#[tokio::test]
async fn the_same_key_with_another_body_is_refused() {
    let shop = TestShop::new().await;
    let first = shop.post_order(Some("order-1"), &alice()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other = json!({ "customer": "alice", "items": ["book"], "total_cents": 1000 });
    let refused = shop.post_order(Some("order-1"), &other).await;
    assert_eq!(refused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(shop.count("SELECT count(*) FROM {schema}.orders").await, 1);
    assert_eq!(shop.count("SELECT count(*) FROM {schema}.outbox").await, 1);
    shop.finish().await;
}

#[tokio::test]
async fn a_request_without_a_key_or_with_an_invalid_order_writes_nothing() {
    let shop = TestShop::new().await;
    let no_key = shop.post_order(None, &alice()).await;
    assert_eq!(no_key.status, StatusCode::BAD_REQUEST);

    let empty = json!({ "customer": "alice", "items": [], "total_cents": 0 });
    let invalid = shop.post_order(Some("order-1"), &empty).await;
    assert_eq!(invalid.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        invalid.body["error"], "an order needs at least one item",
        "{}",
        invalid.body
    );
    let garbled = shop
        .post_order(Some("order-2"), &json!({ "customer": 7 }))
        .await;
    assert_eq!(garbled.status, StatusCode::BAD_REQUEST);

    assert_eq!(shop.count("SELECT count(*) FROM {schema}.orders").await, 0);
    assert_eq!(shop.count("SELECT count(*) FROM {schema}.outbox").await, 0);
    assert_eq!(
        shop.count("SELECT count(*) FROM {schema}.idempotency_keys")
            .await,
        0,
        "a refused request does not keep its key"
    );
    shop.finish().await;
}

#[tokio::test]
async fn a_duplicate_while_the_first_is_in_flight_gets_409() {
    let shop = TestShop::new().await;
    // The first request: its transaction holds the key and has not committed.
    let outbox = Outbox::new(shop.db.schema.clone());
    let key = IdempotencyKey::new("orders", "order-1").unwrap();
    let mut first = shop.pool.begin().await.unwrap();
    let begun = idempotency::begin(
        &outbox,
        &mut first,
        &key,
        &Fingerprint::of_parts(&[b"first"]),
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    assert!(matches!(begun, Begin::Execute(_)));

    let duplicate = shop.post_order(Some("order-1"), &alice()).await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT);

    // The first one gave up: the key is free again.
    first.rollback().await.unwrap();
    let retry = shop.post_order(Some("order-1"), &alice()).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(shop.count("SELECT count(*) FROM {schema}.orders").await, 1);
    shop.finish().await;
}

#[tokio::test]
async fn orders_are_read_back_by_id() {
    let shop = TestShop::new().await;
    let created = shop.post_order(Some("order-1"), &alice()).await;
    let id = created.body["id"].as_i64().unwrap();
    let read = shop.get(&format!("/orders/{id}")).await;
    assert_eq!(read.status, StatusCode::OK);
    assert_eq!(read.body, created.body);
    assert_eq!(
        shop.get(&format!("/orders/{}", id + 1)).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        shop.get("/customers/alice").await.status,
        StatusCode::NOT_FOUND,
        "no event applied yet"
    );
    shop.finish().await;
}

//! Typed consumers: a payload that no longer decodes becomes a dead letter with
//! a clear reason, and the events around it are delivered.

use crate::support::*;
use postbox::statements::trusted;
use postbox::typed::{Decoder, Event};
use postbox::{NewEvent, Outbox};
use postbox_relay::Outcome;
use postbox_testkit::TestDb;
use serde::{Deserialize, Serialize};
use sqlx::Row;

#[derive(Debug, Serialize, Deserialize)]
struct OrderPlaced {
    order_id: u64,
    total_cents: i64,
}

impl Event for OrderPlaced {
    const TYPE: &'static str = "order.placed";
    const VERSION: i32 = 2;
    fn aggregate(&self) -> (&str, String) {
        ("order", self.order_id.to_string())
    }
}

#[tokio::test]
async fn undecodable_payloads_are_dead_lettered_with_their_reason() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let good: Vec<NewEvent> = (0..10)
        .map(|i| {
            NewEvent::typed(&OrderPlaced {
                order_id: i,
                total_cents: 100,
            })
            .unwrap()
        })
        .collect();
    // A payload the consumer can no longer read, and a version it never knew.
    let broken = NewEvent::from_json("order.placed", "order", "x", r#"{"order_id": "x"}"#)
        .unwrap()
        .schema_version(2)
        .unwrap();
    let future = NewEvent::from_json("order.placed", "order", "y", r#"{"order_id": 1}"#)
        .unwrap()
        .schema_version(9)
        .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    postbox::sqlx::enqueue_batch(&outbox, &mut tx, &good[..5])
        .await
        .unwrap();
    postbox::sqlx::enqueue(&outbox, &mut tx, &broken)
        .await
        .unwrap();
    postbox::sqlx::enqueue(&outbox, &mut tx, &future)
        .await
        .unwrap();
    postbox::sqlx::enqueue_batch(&outbox, &mut tx, &good[5..])
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let decoder = Decoder::new().register(|e: OrderPlaced| e);
    let sink = ScriptedSink::new(move |m, _| {
        match decoder.decode(&m.event_type, m.schema_version, m.payload.get()) {
            Ok(_) => Outcome::Delivered,
            Err(e) => Outcome::reject(e.reason()),
        }
    });
    let stats = drain(&db, sink.clone(), fast_config()).await;
    assert_eq!((stats.delivered, stats.dead_lettered), (10, 2), "{stats:?}");
    assert_eq!(sink.count(), 12, "rejections are not retried");

    let rows = sqlx::query(trusted(&db.sql(
        "SELECT event_id, last_error FROM {schema}.outbox WHERE status = 'failed' ORDER BY id",
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].get::<uuid::Uuid, _>(0), broken.event_id());
    let reason: String = rows[0].get(1);
    assert!(
        reason.starts_with(
            r#"payload of "order.placed" version 2 does not decode: invalid type: string"#
        ),
        "{reason}"
    );
    let reason: String = rows[1].get(1);
    assert_eq!(
        reason,
        r#"event type "order.placed" has no decoder for schema version 9 (known versions: [2])"#
    );
    db.drop_schema().await;
}

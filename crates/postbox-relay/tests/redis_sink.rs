use crate::support::*;
use postbox::statements::trusted;
use postbox::{NewEvent, Outbox};
use postbox_relay::sinks::{self, SinkOptions};
use postbox_relay::{Outcome, RelayConfig};
use postbox_testkit::{redis, redis_url, unique, TestDb};
use redis::AsyncCommands;
use std::collections::HashSet;
use uuid::Uuid;

/// Commit `n` events and roll back `m`, returning (committed, rolled back) ids.
async fn committed_and_rolled_back(db: &TestDb, n: usize, m: usize) -> (Vec<Uuid>, Vec<Uuid>) {
    let outbox = Outbox::new(db.schema.clone());
    let mut kept = Vec::new();
    let mut dropped = Vec::new();
    for i in 0..n + m {
        let event = NewEvent::new(
            "order.created",
            "order",
            format!("o-{i}"),
            &serde_json::json!({"i": i}),
        )
        .unwrap();
        let mut tx = db.pool.begin().await.unwrap();
        let id = postbox::sqlx::enqueue(&outbox, &mut tx, &event)
            .await
            .unwrap();
        if i % 4 == 3 && dropped.len() < m {
            tx.rollback().await.unwrap();
            dropped.push(id);
        } else {
            tx.commit().await.unwrap();
            kept.push(id);
        }
    }
    (kept, dropped)
}

#[tokio::test]
async fn list_mode_delivers_cloudevents_for_committed_events_only() {
    let db = TestDb::new().await;
    let (kept, dropped) = committed_and_rolled_back(&db, 150, 30).await;
    let prefix = unique("test:");
    let url = format!("{}?key={prefix}:{{event_type}}", redis_url());
    let options = SinkOptions {
        source: "shop".into(),
        ..SinkOptions::default()
    };
    let sink = sinks::from_url(&url, &options).unwrap();
    let stats = drain(&db, sink, fast_config()).await;
    assert_eq!(stats.delivered as usize, kept.len());

    let mut conn = redis().await;
    let key = format!("{prefix}:order.created");
    let bodies: Vec<String> = conn.lrange(&key, 0, -1).await.unwrap();
    assert_eq!(bodies.len(), kept.len());
    let mut ids = HashSet::new();
    for body in &bodies {
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["specversion"], "1.0");
        assert_eq!(v["source"], "shop");
        assert_eq!(v["type"], "order.created");
        assert_eq!(v["datacontenttype"], "application/json");
        assert_eq!(v["aggregatetype"], "order");
        assert_eq!(v["schemaversion"], 1);
        assert!(v["subject"].as_str().unwrap().starts_with("o-"));
        assert!(v["data"]["i"].is_number());
        ids.insert(v["id"].as_str().unwrap().parse::<Uuid>().unwrap());
    }
    assert_eq!(ids, kept.iter().copied().collect::<HashSet<_>>());
    assert!(
        dropped.iter().all(|d| !ids.contains(d)),
        "no rolled-back event delivered"
    );
    let _: () = conn.del(&key).await.unwrap();
    db.drop_schema().await;
}

#[tokio::test]
async fn stream_mode_adds_entries_with_id_type_and_body() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let event = NewEvent::new(
        "invoice.issued",
        "invoice",
        "i-1",
        &serde_json::json!({"n": 1}),
    )
    .unwrap()
    .headers([(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    )])
    .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let id = postbox::sqlx::enqueue(&outbox, &mut conn, &event)
        .await
        .unwrap();
    drop(conn);
    let key = unique("test:stream:");
    let url = format!("{}?mode=stream&key={key}&maxlen=1000", redis_url());
    drain(
        &db,
        sinks::from_url(&url, &SinkOptions::default()).unwrap(),
        fast_config(),
    )
    .await;

    let mut r = redis().await;
    let entries: redis::streams::StreamRangeReply = r.xrange_all(&key).await.unwrap();
    assert_eq!(entries.ids.len(), 1);
    let e = &entries.ids[0];
    let field = |name: &str| -> String { e.get(name).unwrap() };
    assert_eq!(field("id"), id.to_string());
    assert_eq!(field("type"), "invoice.issued");
    assert_eq!(
        field("h:traceparent"),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    );
    let body: serde_json::Value = serde_json::from_str(&field("body")).unwrap();
    assert_eq!(body["id"], id.to_string());
    let _: () = r.del(&key).await.unwrap();
    db.drop_schema().await;
}

#[tokio::test]
async fn an_unreachable_redis_means_retries_and_nothing_acknowledged() {
    let db = TestDb::new().await;
    enqueue(&db, 5).await;
    // A port nothing listens on, with a password that must not leak.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("redis://:hunter2@127.0.0.1:{closed}");
    let sink = sinks::from_url(&url, &SinkOptions::default()).unwrap();
    let err = sink.check().await.unwrap_err().to_string();
    assert!(!err.contains("hunter2"), "{err}");
    assert!(
        sink.describe().contains(&format!("127.0.0.1:{closed}"))
            && !sink.describe().contains("hunter2")
    );
    let config = RelayConfig {
        max_attempts: 2,
        ..fast_config()
    };
    let stats = drain(&db, sink, config).await;
    assert_eq!((stats.delivered, stats.dead_lettered), (0, 5));
    let errors: Vec<String> =
        sqlx::query_scalar(trusted(&db.sql("SELECT last_error FROM {schema}.outbox")))
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert!(
        errors
            .iter()
            .all(|e| e.starts_with("redis: ") && !e.contains("hunter2")),
        "{errors:?}"
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn publish_answers_one_outcome_per_message() {
    let prefix = unique("test:");
    let url = format!("{}?key={prefix}:{{aggregate_id}}", redis_url());
    let sink = sinks::from_url(&url, &SinkOptions::default()).unwrap();
    let db = TestDb::new().await;
    enqueue(&db, 7).await;
    let claim = store(&db)
        .claim(100, std::time::Duration::from_secs(30), None)
        .await
        .unwrap();
    let claim = postbox_relay::relay::Claim::from(claim);
    let outcomes = sink.publish(&claim.messages).await;
    assert_eq!(outcomes, vec![Outcome::Delivered; 7]);
    let mut r = redis().await;
    for m in &claim.messages {
        let key = format!("{prefix}:{}", m.aggregate_id);
        let n: i64 = r.llen(&key).await.unwrap();
        assert_eq!(n, 1, "{key}");
        let _: () = r.del(&key).await.unwrap();
    }
    let _ = RelayConfig::default();
    db.drop_schema().await;
}

/// A batch whose messages go to several keys, interleaved: each list gets
/// its messages in the batch's order (runs bound for one key go out as one
/// LPUSH of many bodies).
#[tokio::test]
async fn interleaved_keys_keep_the_batch_order_in_each_list() {
    let prefix = unique("test:");
    let url = format!("{}?key={prefix}:{{aggregate_id}}", redis_url());
    let sink = sinks::from_url(&url, &SinkOptions::default()).unwrap();
    let aggregates = ["a", "a", "b", "a", "b", "b", "b", "a"];
    let batch: Vec<postbox_relay::Message> = aggregates
        .iter()
        .map(|aggregate| postbox_relay::Message {
            event_id: Uuid::now_v7(),
            event_type: "order.created".into(),
            aggregate_type: "order".into(),
            aggregate_id: (*aggregate).into(),
            schema_version: 1,
            payload: serde_json::value::RawValue::from_string("{}".into()).unwrap(),
            headers: Default::default(),
            created_at: chrono::Utc::now(),
            attempt: 1,
            sequence: None,
            source: None,
        })
        .collect();
    assert_eq!(
        sink.publish(&batch).await,
        vec![Outcome::Delivered; batch.len()]
    );
    let mut r = redis().await;
    for key in ["a", "b"] {
        let list = format!("{prefix}:{key}");
        // LPUSH puts the newest at the head: read from the tail.
        let mut bodies: Vec<String> = r.lrange(&list, 0, -1).await.unwrap();
        bodies.reverse();
        let got: Vec<String> = bodies
            .iter()
            .map(|b| {
                serde_json::from_str::<serde_json::Value>(b).unwrap()["id"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        let want: Vec<String> = batch
            .iter()
            .filter(|m| m.aggregate_id == key)
            .map(|m| m.event_id.to_string())
            .collect();
        assert_eq!(got, want, "{list}");
        let _: () = r.del(&list).await.unwrap();
    }
}

/// A broker URL carrying a password, unreachable: the stored `last_error`
/// says what failed and never repeats the password.
#[tokio::test]
async fn last_error_never_holds_the_broker_password() {
    let db = TestDb::new().await;
    enqueue(&db, 3).await;
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let url = format!("redis://relay:pw-s3cret@{closed}/0?mode=stream");
    let sink = sinks::from_url(&url, &SinkOptions::default()).unwrap();
    assert!(
        !sink.describe().contains("pw-s3cret"),
        "{}",
        sink.describe()
    );
    let checked = sink.check().await.unwrap_err().to_string();
    assert!(
        checked.contains("unreachable") && !checked.contains("pw-s3cret"),
        "{checked}"
    );
    let config = RelayConfig {
        max_attempts: 1,
        publish_timeout: std::time::Duration::from_secs(2),
        ..fast_config()
    };
    let stats = drain(&db, sink, config).await;
    assert_eq!(stats.dead_lettered, 3);
    let errors: Vec<String> = sqlx::query_scalar(trusted(
        &db.sql("SELECT last_error FROM {schema}.outbox WHERE status = 'failed'"),
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(errors.len(), 3);
    for e in &errors {
        assert!(!e.is_empty());
        assert!(!e.contains("pw-s3cret"), "{e}");
    }
    db.drop_schema().await;
}

//! Retention removes expired request idempotency keys, in bounded batches, and
//! keeps live ones.

use crate::support::*;
use postbox::idempotency::{self, Begin, Fingerprint, IdempotencyKey, StoredResponse};
use postbox::Outbox;
use postbox_relay::retention::{self, Table};
use postbox_relay::{Relay, RetentionConfig, RunMode};
use postbox_testkit::{wait_for, TestDb};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const HOUR: Duration = Duration::from_secs(3600);

/// Commit `n` keys `<prefix>-<i>` through the library; `completed` ones carry a response.
async fn keys(db: &TestDb, prefix: &str, n: usize, completed: bool) {
    let outbox = Outbox::new(db.schema.clone());
    for i in 0..n {
        let key = IdempotencyKey::new("orders", format!("{prefix}-{i}")).unwrap();
        let fingerprint = Fingerprint::of_parts(&[prefix.as_bytes()]);
        let mut tx = db.pool.begin().await.unwrap();
        let Begin::Execute(pending) =
            idempotency::begin(&outbox, &mut tx, &key, &fingerprint, HOUR)
                .await
                .unwrap()
        else {
            panic!("{prefix}-{i} is new");
        };
        if completed {
            let response = StoredResponse::json(201, &serde_json::json!({ "i": i })).unwrap();
            idempotency::complete(&outbox, &mut tx, pending, &response)
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
    }
}

/// Move the expiry of the keys starting with `prefix` into the past.
async fn expire(db: &TestDb, prefix: &str) {
    db.exec(&format!(
        "UPDATE {{schema}}.idempotency_keys SET expires_at = now() - interval '1 second' \
         WHERE key LIKE '{prefix}-%'"
    ))
    .await;
}

async fn count(db: &TestDb, prefix: &str) -> i64 {
    db.count(&format!(
        "SELECT count(*) FROM {{schema}}.idempotency_keys WHERE key LIKE '{prefix}-%'"
    ))
    .await
}

#[tokio::test]
async fn purge_deletes_expired_keys_in_batches_and_keeps_live_ones() {
    let db = TestDb::new().await;
    keys(&db, "old", 23, true).await;
    keys(&db, "old-open", 2, false).await; // committed without a response, then expired
    keys(&db, "live", 7, true).await;
    keys(&db, "live-open", 3, false).await;
    expire(&db, "old").await; // also matches old-open-*

    let config = RetentionConfig {
        batch_size: 10,
        pause: Duration::from_millis(1),
        ..RetentionConfig::default()
    };
    let mut batches = Vec::new();
    let report = retention::purge(&store(&db), &config, &CancellationToken::new(), |p| {
        if p.table == Table::IdempotencyKeys {
            batches.push(p.removed);
        }
    })
    .await
    .unwrap();

    assert_eq!(report.idempotency_keys, 25);
    assert_eq!((report.outbox, report.inbox), (0, 0));
    assert_eq!(batches, [10, 20, 25], "bounded batches, running totals");
    assert_eq!(count(&db, "old").await, 0);
    assert_eq!(
        count(&db, "live").await,
        10,
        "live keys (completed or not) stay"
    );

    // A live key still replays its response after the pass.
    let outbox = Outbox::new(db.schema.clone());
    let mut tx = db.pool.begin().await.unwrap();
    let key = IdempotencyKey::new("orders", "live-3").unwrap();
    let begun = idempotency::begin(
        &outbox,
        &mut tx,
        &key,
        &Fingerprint::of_parts(&[b"live"]),
        HOUR,
    )
    .await
    .unwrap();
    assert!(matches!(begun, Begin::Replay(r) if r.status == 201));
    tx.rollback().await.unwrap();

    // Nothing left to do: a second pass removes nothing.
    let again = retention::purge(&store(&db), &config, &CancellationToken::new(), |_| {})
        .await
        .unwrap();
    assert_eq!(again.idempotency_keys, 0);
    db.drop_schema().await;
}

#[tokio::test]
async fn the_relays_retention_task_purges_expired_keys() {
    let db = TestDb::new().await;
    keys(&db, "old", 12, true).await;
    keys(&db, "live", 4, true).await;
    expire(&db, "old").await;

    let retention = RetentionConfig {
        enabled: true,
        batch_size: 5,
        pause: Duration::from_millis(1),
        interval: Duration::from_millis(50),
        ..RetentionConfig::default()
    };
    let relay = Relay::new(store(&db), ScriptedSink::delivering(), fast_config())
        .unwrap()
        .with_retention(retention)
        .unwrap();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(RunMode::Forever, shutdown).await }
    });
    wait_for(
        "the relay's retention pass",
        Duration::from_secs(30),
        || async { count(&db, "old").await == 0 },
    )
    .await;
    shutdown.cancel();
    running.await.unwrap();
    assert_eq!(count(&db, "live").await, 4);
    db.drop_schema().await;
}

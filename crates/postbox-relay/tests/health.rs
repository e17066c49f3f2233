//! The database health watch reads what holds back vacuum, for real.

use crate::support::*;
use postbox_relay::health::{findings, Finding, HealthConfig};
use postbox_testkit::{wait_for, TestDb};
use std::time::Duration;

#[tokio::test]
async fn a_long_transaction_and_dead_tuples_are_seen() {
    let db = TestDb::new().await;
    let s = store(&db);
    // A session that holds a snapshot open, as a forgotten `BEGIN` in psql does.
    let mut holder = db.pool.acquire().await.unwrap();
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *holder)
        .await
        .unwrap();
    sqlx::query("SELECT count(*) FROM pg_class")
        .execute(&mut *holder)
        .await
        .unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *holder)
        .await
        .unwrap();

    let config = HealthConfig {
        max_transaction_age: Duration::from_millis(200),
        ..HealthConfig::default()
    };
    wait_for(
        "the held transaction is older than the threshold",
        Duration::from_secs(30),
        || async {
            let h = s.db_health().await.unwrap();
            findings(&h, &config)
                .iter()
                .any(|f| matches!(f, Finding::OldTransaction { .. }))
        },
    )
    .await;
    let h = s.db_health().await.unwrap();
    // Ours, or an older one of a test running beside us: either way at least as old.
    assert!(h.oldest_xact_pid.is_some());
    let ours: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - xact_start)::float8 FROM pg_stat_activity WHERE pid = $1",
    )
    .bind(pid)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        h.oldest_xact_age_seconds.unwrap() + 0.5 >= ours,
        "{h:?} vs {ours}"
    );
    sqlx::query("ROLLBACK").execute(&mut *holder).await.unwrap();
    drop(holder);

    // Dead tuples: drain and delete, then let the statistics catch up.
    enqueue(&db, 500).await;
    db.exec("DELETE FROM {schema}.outbox").await;
    wait_for(
        "the statistics count the dead tuples",
        Duration::from_secs(30),
        || async { s.db_health().await.unwrap().dead_tuples.unwrap_or(0) >= 500 },
    )
    .await;
    let h = s.db_health().await.unwrap();
    assert!(h.dead_tuple_ratio().unwrap() > 0.9, "{h:?}");
    let strict = HealthConfig {
        min_dead_tuples: 100,
        ..HealthConfig::default()
    };
    assert!(findings(&h, &strict)
        .iter()
        .any(|f| matches!(f, Finding::DeadTuples { .. })));
    db.drop_schema().await;
}

#[tokio::test]
async fn retention_with_vacuum_vacuums_the_outbox_after_removing_events() {
    let db = TestDb::new().await;
    enqueue(&db, 50).await;
    let retention = postbox_relay::RetentionConfig {
        enabled: true,
        older_than: Duration::from_millis(1),
        interval: Duration::from_millis(200),
        pause: Duration::from_millis(1),
        vacuum: true,
        ..Default::default()
    };
    let relay = postbox_relay::Relay::new(store(&db), ScriptedSink::delivering(), fast_config())
        .unwrap()
        .with_retention(retention)
        .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let run = relay.run(postbox_relay::RunMode::Forever, stop.clone());
    let check = async {
        wait_for(
            "the outbox vacuumed by retention",
            Duration::from_secs(30),
            || async {
                let vacuumed: Option<bool> = sqlx::query_scalar(
                    "SELECT last_vacuum IS NOT NULL FROM pg_stat_user_tables \
                 WHERE schemaname = $1 AND relname = 'outbox'",
                )
                .bind(db.schema.name())
                .fetch_optional(&db.pool)
                .await
                .unwrap();
                vacuumed == Some(true)
            },
        )
        .await;
        assert_eq!(db.count("SELECT count(*) FROM {schema}.outbox").await, 0);
        stop.cancel();
    };
    tokio::join!(run, check);
    db.drop_schema().await;
}

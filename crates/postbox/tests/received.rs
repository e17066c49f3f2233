//! The store behind `postbox receive`: store once, take with SKIP LOCKED in the
//! caller's transaction, mark processed in that transaction, purge by age.

use postbox::received::{self, NewDelivery};
use postbox::statements::trusted;
use postbox::{Error, InboxOutcome, Outbox};
use postbox_testkit::TestDb;
use std::time::Duration;

fn delivery(id: &str, body: &[u8]) -> NewDelivery {
    NewDelivery::new("billing", id, body.to_vec())
        .unwrap()
        .headers([("Content-Type", "application/json"), ("webhook-id", id)])
        .unwrap()
}

async fn store_all(db: &TestDb, outbox: &Outbox, ids: &[&str]) {
    let mut conn = db.pool.acquire().await.unwrap();
    for id in ids {
        let outcome = received::store(outbox, &mut conn, &delivery(id, id.as_bytes()))
            .await
            .unwrap();
        assert_eq!(outcome, InboxOutcome::New);
    }
}

#[tokio::test]
async fn a_delivery_is_stored_once_with_its_exact_bytes() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let mut conn = db.pool.acquire().await.unwrap();
    // Not UTF-8: the body is kept as bytes.
    let body = [0xff, 0x00, b'{', 0xfe];
    let first = received::store(&outbox, &mut conn, &delivery("msg_1", &body))
        .await
        .unwrap();
    let again = received::store(&outbox, &mut conn, &delivery("msg_1", b"other"))
        .await
        .unwrap();
    assert_eq!((first, again), (InboxOutcome::New, InboxOutcome::Duplicate));
    // The same event id for another consumer is another delivery.
    let other = NewDelivery::new("shipping", "msg_1", b"x".to_vec()).unwrap();
    assert_eq!(
        received::store(&outbox, &mut conn, &other).await.unwrap(),
        InboxOutcome::New
    );

    let mut tx = db.pool.begin().await.unwrap();
    let taken = received::take(&outbox, &mut tx, "billing", 10)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(taken.len(), 1);
    let d = &taken[0];
    assert_eq!(d.event_id, "msg_1");
    assert_eq!(d.consumer, "billing");
    assert_eq!(d.body, body, "the first copy is kept, byte for byte");
    assert_eq!(d.header("content-type"), Some("application/json"));
    assert_eq!(d.header("Webhook-Id"), Some("msg_1"));
    assert_eq!(d.header("missing"), None);
    drop(conn);
    db.drop_schema().await;
}

#[tokio::test]
async fn take_skips_rows_another_transaction_holds() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    store_all(&db, &outbox, &["a", "b", "c", "d", "e"]).await;

    let mut first = db.pool.begin().await.unwrap();
    let mut second = db.pool.begin().await.unwrap();
    let a = received::take(&outbox, &mut first, "billing", 3)
        .await
        .unwrap();
    let b = received::take(&outbox, &mut second, "billing", 3)
        .await
        .unwrap();
    let ids =
        |v: &[received::ReceivedDelivery]| v.iter().map(|d| d.event_id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&a), ["a", "b", "c"], "oldest first");
    assert_eq!(
        ids(&b),
        ["d", "e"],
        "the locked rows are skipped, not waited for"
    );
    // Other consumers' rows are never taken.
    let none = received::take(&outbox, &mut second, "shipping", 10)
        .await
        .unwrap();
    assert!(none.is_empty());
    first.rollback().await.unwrap();
    second.rollback().await.unwrap();
    db.drop_schema().await;
}

#[tokio::test]
async fn marking_processed_commits_with_the_effect_or_not_at_all() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    store_all(&db, &outbox, &["a", "b", "c"]).await;
    db.exec("CREATE TABLE {schema}.effects (event_id text PRIMARY KEY)")
        .await;
    let effect = db.sql("INSERT INTO {schema}.effects VALUES ($1)");

    // A worker that fails: effect and mark roll back together.
    let mut tx = db.pool.begin().await.unwrap();
    let batch = received::take(&outbox, &mut tx, "billing", 2)
        .await
        .unwrap();
    for d in &batch {
        sqlx::query(trusted(&effect))
            .bind(&d.event_id)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    let ids: Vec<i64> = batch.iter().map(|d| d.id).collect();
    let marked = received::mark_processed(&outbox, &mut tx, "billing", &ids)
        .await
        .unwrap();
    assert_eq!(marked, 2);
    tx.rollback().await.unwrap();
    assert_eq!(db.count("SELECT count(*) FROM {schema}.effects").await, 0);

    // A worker that succeeds takes the same rows again and commits.
    let mut tx = db.pool.begin().await.unwrap();
    let again = received::take(&outbox, &mut tx, "billing", 2)
        .await
        .unwrap();
    assert_eq!(again.iter().map(|d| d.id).collect::<Vec<_>>(), ids);
    for d in &again {
        sqlx::query(trusted(&effect))
            .bind(&d.event_id)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    received::mark_processed(&outbox, &mut tx, "billing", &ids)
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // Processed rows are not taken again, and marking them twice changes nothing.
    let mut tx = db.pool.begin().await.unwrap();
    let rest = received::take(&outbox, &mut tx, "billing", 10)
        .await
        .unwrap();
    assert_eq!(
        rest.iter().map(|d| d.event_id.as_str()).collect::<Vec<_>>(),
        ["c"]
    );
    let twice = received::mark_processed(&outbox, &mut tx, "billing", &ids)
        .await
        .unwrap();
    assert_eq!(twice, 0);
    assert_eq!(
        received::mark_processed(&outbox, &mut tx, "billing", &[])
            .await
            .unwrap(),
        0
    );
    tx.commit().await.unwrap();
    assert_eq!(db.count("SELECT count(*) FROM {schema}.effects").await, 2);
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.received WHERE processed_at IS NOT NULL")
            .await,
        2
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn purge_deletes_only_old_processed_deliveries() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    store_all(&db, &outbox, &["a", "b", "c", "d"]).await;
    // a, b: processed long ago; c: processed just now; d: never processed (but old).
    db.exec(
        "UPDATE {schema}.received SET processed_at = now() - interval '2 days' WHERE event_id IN ('a', 'b');
         UPDATE {schema}.received SET processed_at = now() WHERE event_id = 'c';
         UPDATE {schema}.received SET received_at = now() - interval '9 days' WHERE event_id = 'd';",
    )
    .await;
    let mut conn = db.pool.acquire().await.unwrap();
    let day = Duration::from_secs(86_400);
    assert_eq!(
        received::purge(&outbox, &mut conn, day, 1).await.unwrap(),
        1
    );
    assert_eq!(
        received::purge(&outbox, &mut conn, day, 10).await.unwrap(),
        1
    );
    assert_eq!(
        received::purge(&outbox, &mut conn, day, 10).await.unwrap(),
        0
    );
    let left: Vec<String> = sqlx::query_scalar(trusted(
        &db.sql("SELECT event_id FROM {schema}.received ORDER BY event_id"),
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(left, ["c", "d"]);
    drop(conn);
    db.drop_schema().await;
}

#[tokio::test]
async fn invalid_input_is_refused_before_the_database() {
    for (consumer, id) in [("", "x"), ("c", ""), ("c", "a\0")] {
        let err = NewDelivery::new(consumer, id, Vec::new()).unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidConsumer { .. } | Error::InvalidEvent { .. }
            ),
            "{err}"
        );
    }
    let long = "x".repeat(received::MAX_EVENT_ID_BYTES + 1);
    assert!(NewDelivery::new("c", long, Vec::new()).is_err());
}

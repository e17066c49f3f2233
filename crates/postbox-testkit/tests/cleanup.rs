//! A test that fails leaves nothing behind: its schema, and the replication
//! slot and publication named after it (logical mode's defaults), are
//! dropped when its `TestDb` is dropped while it unwinds.

use postbox_testkit::TestDb;

async fn exists(pool: &sqlx::PgPool, sql: &'static str, name: &str) -> bool {
    sqlx::query_scalar(sql)
        .bind(name)
        .fetch_one(pool)
        .await
        .expect("look it up")
}

#[tokio::test]
async fn a_failing_test_leaves_no_schema_slot_or_publication() {
    let watcher = TestDb::empty().await;
    let (names, failing) = tokio::sync::oneshot::channel();
    let failed = tokio::spawn(async move {
        let db = TestDb::new().await;
        let slot = format!("postbox_{}", db.schema.name());
        // A relay's stream would hold the slot; this connection holds a lock
        // in the schema, as a test stopped mid-transaction does.
        sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
            .bind(&slot)
            .execute(&db.pool)
            .await
            .expect("create a logical slot (wal_level = logical)");
        sqlx::raw_sql(postbox::statements::trusted(&format!(
            "CREATE PUBLICATION \"{slot}\""
        )))
        .execute(&db.pool)
        .await
        .expect("create the publication");
        let mut tx = db.pool.begin().await.expect("begin");
        sqlx::raw_sql(postbox::statements::trusted(
            &db.sql("LOCK TABLE {schema}.outbox IN ACCESS EXCLUSIVE MODE"),
        ))
        .execute(&mut *tx)
        .await
        .expect("lock the outbox");
        let _ = names.send((db.schema.name().to_owned(), slot));
        panic!("this test fails on purpose");
    })
    .await;
    assert!(failed.is_err_and(|e| e.is_panic()), "the test failed");
    let (schema, slot) = failing.await.expect("the failing test named its schema");

    let pool = &watcher.pool;
    let schema_left = "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)";
    let slot_left = "SELECT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = $1)";
    let publication_left = "SELECT EXISTS (SELECT FROM pg_publication WHERE pubname = $1)";
    assert!(
        !exists(pool, schema_left, &schema).await,
        "schema {schema} was left"
    );
    assert!(
        !exists(pool, slot_left, &slot).await,
        "slot {slot} was left"
    );
    assert!(
        !exists(pool, publication_left, &slot).await,
        "publication {slot} was left"
    );
    watcher.drop_schema().await;
}

use postbox::statements::trusted;
use postbox::{NewEvent, Outbox};
use postbox_testkit::TestDb;
use serde_json::json;
use sqlx::Row;
use std::time::Duration;

fn order_event(n: i64) -> NewEvent {
    NewEvent::new(
        "order.created",
        "order",
        n.to_string(),
        &json!({"order_id": n}),
    )
    .unwrap()
}

async fn with_orders_table(db: &TestDb) {
    db.exec("CREATE TABLE {schema}.orders (id bigint PRIMARY KEY)")
        .await;
}

#[tokio::test]
async fn a_commit_leaves_both_rows_and_a_rollback_neither() {
    let db = TestDb::new().await;
    with_orders_table(&db).await;
    let outbox = Outbox::new(db.schema.clone());
    let insert = db.sql("INSERT INTO {schema}.orders (id) VALUES ($1)");

    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query(trusted(&insert))
        .bind(1_i64)
        .execute(&mut *tx)
        .await
        .unwrap();
    let kept = postbox::sqlx::enqueue(&outbox, &mut tx, &order_event(1))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query(trusted(&insert))
        .bind(2_i64)
        .execute(&mut *tx)
        .await
        .unwrap();
    let dropped = postbox::sqlx::enqueue(&outbox, &mut tx, &order_event(2))
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    assert_eq!(db.count("SELECT count(*) FROM {schema}.orders").await, 1);
    let row = sqlx::query(trusted(&db.sql(
        "SELECT event_id, status::text, payload->>'order_id', attempts FROM {schema}.outbox",
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(row.len(), 1, "exactly the committed event");
    assert_eq!(row[0].get::<uuid::Uuid, _>(0), kept);
    assert_ne!(kept, dropped);
    assert_eq!(row[0].get::<String, _>(1), "pending");
    assert_eq!(row[0].get::<String, _>(2), "1");
    assert_eq!(row[0].get::<i32, _>(3), 0);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_failed_statement_in_the_transaction_takes_the_event_with_it() {
    let db = TestDb::new().await;
    with_orders_table(&db).await;
    let outbox = Outbox::new(db.schema.clone());
    let mut tx = db.pool.begin().await.unwrap();
    postbox::sqlx::enqueue(&outbox, &mut tx, &order_event(1))
        .await
        .unwrap();
    let dup = db.sql("INSERT INTO {schema}.orders (id) VALUES (1), (1)");
    assert!(sqlx::query(trusted(&dup)).execute(&mut *tx).await.is_err());
    // Postgres answers COMMIT of a failed transaction with ROLLBACK.
    let _ = tx.commit().await;
    assert_eq!(db.count("SELECT count(*) FROM {schema}.outbox").await, 0);
    db.drop_schema().await;
}

#[tokio::test]
async fn batch_enqueue_keeps_input_order_and_ids() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let events: Vec<NewEvent> = (0..250).map(order_event).collect();
    let mut tx = db.pool.begin().await.unwrap();
    let ids = postbox::sqlx::enqueue_batch(&outbox, &mut tx, &events)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        ids,
        events.iter().map(NewEvent::event_id).collect::<Vec<_>>()
    );
    let stored: Vec<uuid::Uuid> = sqlx::query_scalar(trusted(
        &db.sql("SELECT event_id FROM {schema}.outbox ORDER BY id"),
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(stored, ids, "rows are inserted in input order");
    let empty = postbox::sqlx::enqueue_batch(&outbox, &mut db.pool.acquire().await.unwrap(), &[])
        .await
        .unwrap();
    assert!(empty.is_empty());
    db.drop_schema().await;
}

#[tokio::test]
async fn tokio_postgres_enqueue_commits_and_rolls_back_with_the_caller() {
    let db = TestDb::new().await;
    let (mut client, connection) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let outbox = Outbox::new(db.schema.clone());

    let tx = client.transaction().await.unwrap();
    let kept = postbox::tokio_postgres::enqueue(&outbox, &tx, &order_event(1))
        .await
        .unwrap();
    let batch =
        postbox::tokio_postgres::enqueue_batch(&outbox, &tx, &[order_event(2), order_event(3)])
            .await
            .unwrap();
    tx.commit().await.unwrap();

    let tx = client.transaction().await.unwrap();
    postbox::tokio_postgres::enqueue(&outbox, &tx, &order_event(4))
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    let stored: Vec<uuid::Uuid> = sqlx::query_scalar(trusted(
        &db.sql("SELECT event_id FROM {schema}.outbox ORDER BY id"),
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(stored, vec![kept, batch[0], batch[1]]);
    db.drop_schema().await;
}

#[tokio::test]
async fn the_sql_function_enqueues_from_any_language() {
    let db = TestDb::new().await;
    let mut tx = db.pool.begin().await.unwrap();
    let id: uuid::Uuid = sqlx::query_scalar(trusted(&db.sql(
        "SELECT {schema}.enqueue('order.created', 'order', '7', '{\"a\": 1}', '{\"traceparent\": \"00-x\"}')",
    )))
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    let defaulted: uuid::Uuid = sqlx::query_scalar(trusted(
        &db.sql("SELECT {schema}.enqueue('order.paid', 'order', '7', '[1, 2]')"),
    ))
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(id.get_version_num(), 7, "event ids are UUIDv7");
    assert!(defaulted > id, "UUIDv7 ids grow with time");
    let headers: String = sqlx::query_scalar(trusted(
        &db.sql("SELECT headers::text FROM {schema}.outbox WHERE event_id = $1"),
    ))
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(headers, r#"{"traceparent": "00-x"}"#);
    db.drop_schema().await;
}

#[tokio::test]
async fn the_sql_function_rejects_bad_input_clearly() {
    let db = TestDb::new().await;
    let long = "x".repeat(256);
    let cases = [
        (
            "SELECT {schema}.enqueue('', 'order', '1', '{}')".to_string(),
            "event_type must be 1 to 255 bytes",
        ),
        (
            format!("SELECT {{schema}}.enqueue('{long}', 'order', '1', '{{}}')"),
            "event_type must be 1 to 255 bytes",
        ),
        (
            "SELECT {schema}.enqueue('t', NULL, '1', '{}')".to_string(),
            "aggregate_type must be 1 to 255 bytes",
        ),
        (
            "SELECT {schema}.enqueue('t', 'order', '', '{}')".to_string(),
            "aggregate_id must be 1 to 255 bytes",
        ),
        (
            "SELECT {schema}.enqueue('t', 'order', '1', NULL)".to_string(),
            "payload must not be NULL",
        ),
        (
            "SELECT {schema}.enqueue('t', 'order', '1', '{}', '[1]')".to_string(),
            "headers must be a JSON object",
        ),
    ];
    for (sql, want) in cases {
        let err = sqlx::query(trusted(&db.sql(&sql)))
            .execute(&db.pool)
            .await
            .unwrap_err();
        let db_err = err.as_database_error().expect("a database error");
        assert!(
            db_err.message().contains(want),
            "{sql}: {}",
            db_err.message()
        );
        assert_eq!(db_err.code().as_deref(), Some("22023"), "{sql}");
    }
    // SQL metacharacters and unusual Unicode round-trip as data.
    let nasty = "o'; DROP TABLE x; -- \u{202e}é🦀";
    let id: uuid::Uuid = sqlx::query_scalar(trusted(
        &db.sql("SELECT {schema}.enqueue($1, $1, $1, to_jsonb($1::text))"),
    ))
    .bind(nasty)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let back: (String, String) = sqlx::query_as(trusted(
        &db.sql("SELECT aggregate_id, payload #>> '{}' FROM {schema}.outbox WHERE event_id = $1"),
    ))
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(back, (nasty.to_owned(), nasty.to_owned()));
    assert_eq!(db.count("SELECT count(*) FROM {schema}.outbox").await, 1);
    db.drop_schema().await;
}

#[tokio::test]
async fn oversized_payloads_are_refused_before_the_database() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone()).max_payload_bytes(1000);
    let big = NewEvent::new("t", "a", "1", &json!({"blob": "x".repeat(2000)})).unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let err = postbox::sqlx::enqueue(&outbox, &mut conn, &big)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("payload is"), "{err}");
    drop(conn);
    assert_eq!(db.count("SELECT count(*) FROM {schema}.outbox").await, 0);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_commit_notifies_listeners_and_a_rollback_does_not() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let mut listener = sqlx::postgres::PgListener::connect_with(&db.pool)
        .await
        .unwrap();
    listener.listen(&db.schema.notify_channel()).await.unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    postbox::sqlx::enqueue(&outbox, &mut tx, &order_event(1))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    postbox::sqlx::enqueue(&outbox, &mut tx, &order_event(2))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let n = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .expect("a notification arrives")
        .unwrap();
    assert_eq!(n.channel(), db.schema.notify_channel());
    // Only the committed transaction notified: nothing else is queued.
    assert!(
        tokio::time::timeout(Duration::from_millis(200), listener.recv())
            .await
            .is_err(),
        "the rolled-back transaction must not notify"
    );
    drop(listener);
    db.drop_schema().await;
}

/// The payload limit holds through SQL too (migrations 19 and 21): a 10 MB
/// payload through `enqueue`, `emit` or a direct insert into the log is
/// refused with SQLSTATE 54000 naming the limit; the owner can raise it.
#[tokio::test]
async fn the_payload_limit_holds_for_every_way_in() {
    let db = TestDb::new().await;
    let big = format!("{{\"blob\": \"{}\"}}", "x".repeat(10 * 1024 * 1024));
    let ways = [
        "SELECT {schema}.enqueue('t', 'a', '1', $1::jsonb)",
        "SELECT {schema}.emit('t', 'a', '1', $1::jsonb)",
        "INSERT INTO {schema}.log (event_id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES (gen_random_uuid(), 'a', '1', 't', $1::jsonb)",
    ];
    for sql in ways {
        let err = sqlx::query(trusted(&db.sql(sql)))
            .bind(&big)
            .execute(&db.pool)
            .await
            .expect_err(sql);
        let db_err = err.as_database_error().expect("a database error");
        assert_eq!(db_err.code().as_deref(), Some("54000"), "{sql}: {err}");
        assert!(db_err.message().contains("limit"), "{sql}: {err}");
    }
    // A payload under the limit goes in; a raised limit lets the big one in.
    sqlx::query(trusted(
        &db.sql("SELECT {schema}.enqueue('t', 'a', '1', '{}')"),
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    db.exec("UPDATE {schema}.limits SET max_payload_bytes = 64 * 1024 * 1024")
        .await;
    sqlx::query(trusted(&db.sql(ways[0])))
        .bind(&big)
        .execute(&db.pool)
        .await
        .unwrap();
    db.drop_schema().await;
}

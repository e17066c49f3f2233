//! `emit`: events written into the WAL only, read back from a replication
//! slot of the test's own (dropped at the end, even when the test fails: a
//! leftover slot retains WAL on the shared server).

use postbox::statements::trusted;
use postbox::{NewEvent, Outbox};
use postbox_testkit::TestDb;
use serde_json::json;
use std::future::Future;

/// Run `body` with a fresh logical slot (and its publication), then drop
/// them whatever happened.
async fn with_slot<F, Fut>(db: &TestDb, body: F)
where
    F: FnOnce(sqlx::PgPool, postbox::Schema, String) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let slot = postbox_testkit::unique("pbx_emit_");
    sqlx::query(trusted(
        &db.sql("SELECT {schema}.logical_ensure_publication($1)"),
    ))
    .bind(&slot)
    .execute(&db.pool)
    .await
    .unwrap();
    // A statement of its own, not through a PL/pgSQL function (see the
    // store's create_slot); inside the task, so that the slot is dropped
    // below whatever happens.
    let (pool, schema, name) = (db.pool.clone(), db.schema.clone(), slot.clone());
    let outcome = tokio::spawn(async move {
        sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
            .bind(&name)
            .execute(&pool)
            .await
            .unwrap();
        body(pool, schema, name).await
    })
    .await;
    sqlx::query(trusted(&db.sql("SELECT {schema}.logical_drop_slot($1)")))
        .bind(&slot)
        .execute(&db.pool)
        .await
        .unwrap();
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// The contents of `schema`'s messages the slot holds, in commit order.
async fn messages(
    pool: &sqlx::PgPool,
    schema: &postbox::Schema,
    slot: &str,
) -> Vec<serde_json::Value> {
    let rows: Vec<Vec<u8>> = sqlx::query_scalar(
        "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, \
         'proto_version', '1', 'publication_names', $1, 'messages', 'true')",
    )
    .bind(slot)
    .fetch_all(pool)
    .await
    .unwrap();
    let prefix = format!("postbox.{}\0", schema.name());
    rows.into_iter()
        .filter(|r| r.first() == Some(&b'M'))
        .filter_map(|r| {
            // 'M', flags (1), lsn (8), prefix NUL-terminated, length (4),
            // content: the tag's 64 hex digits (migration 19), then the JSON.
            let rest = r[10..].strip_prefix(prefix.as_bytes())?;
            let (tag, json) = rest[4..].split_at(64);
            assert!(tag.iter().all(u8::is_ascii_hexdigit), "a signed emit");
            Some(serde_json::from_slice(json).unwrap())
        })
        .collect()
}

fn event(n: i64) -> NewEvent {
    NewEvent::new("order.created", "order", n.to_string(), &json!({"n": n}))
        .unwrap()
        .headers([("trace", "t-1")])
        .unwrap()
}

#[tokio::test]
async fn emitted_events_reach_the_wal_only_when_committed_and_write_no_row() {
    let db = TestDb::new().await;
    with_slot(&db, |pool, schema, slot| async move {
        let outbox = Outbox::new(schema.clone());
        let mut tx = pool.begin().await.unwrap();
        let first = postbox::sqlx::emit(&outbox, &mut tx, &event(1))
            .await
            .unwrap();
        let second = postbox::sqlx::emit(&outbox, &mut tx, &event(2))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let mut tx = pool.begin().await.unwrap();
        postbox::sqlx::emit(&outbox, &mut tx, &event(3))
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        // The SQL function, from any language.
        let third: uuid::Uuid = sqlx::query_scalar(trusted(
            &schema.render("SELECT {schema}.emit('order.paid', 'order', '1', '{\"n\": 4}')"),
        ))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(third.get_version_num(), 7, "a UUIDv7");

        let got = messages(&pool, &schema, &slot).await;
        let ids: Vec<&str> = got
            .iter()
            .map(|m| m["event_id"].as_str().unwrap())
            .collect();
        assert_eq!(
            ids,
            [first.to_string(), second.to_string(), third.to_string()]
        );
        assert_eq!(got[0]["payload"], json!({"n": 1}));
        assert_eq!(got[0]["headers"], json!({"trace": "t-1"}));
        assert_eq!(got[0]["aggregate_type"], "order");
        assert_eq!(got[0]["schema_version"], 1);
        assert!(got[0]["created_at_us"].as_i64().unwrap() > 0);
        assert_eq!(got[2]["event_type"], "order.paid");
        assert_eq!(got[2]["headers"], json!({}));
        // Not numbered by default (migration 17): no sequence in the message.
        assert!(got.iter().all(|m| m.get("sequence").is_none()), "{got:?}");
        let rows: i64 = sqlx::query_scalar(trusted(
            &schema.render("SELECT count(*) FROM {schema}.outbox"),
        ))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(rows, 0, "emit writes no event row");
    })
    .await;
    db.drop_schema().await;
}

/// Rows inserted, updated or deleted in `schema`'s tables, as PostgreSQL's
/// own statistics count them for the connection's transaction (PostgreSQL
/// 15 adds the counts of the session's earlier transactions it has not
/// reported yet: compare two readings within one transaction).
async fn rows_written(conn: &mut sqlx::PgConnection, schema: &postbox::Schema) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::int8 \
         FROM pg_stat_xact_user_tables WHERE schemaname = $1",
    )
    .bind(schema.name())
    .fetch_one(conn)
    .await
    .unwrap()
}

async fn counters(pool: &sqlx::PgPool, schema: &postbox::Schema) -> Vec<(String, i64)> {
    sqlx::query_as(trusted(&schema.render(
        "SELECT aggregate_id, last_sequence FROM {schema}.aggregate_sequences ORDER BY 1",
    )))
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn by_default_emit_writes_no_table_row_at_all() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let mut tx = db.pool.begin().await.unwrap();
    let before = rows_written(&mut tx, &db.schema).await;
    for n in 0..20 {
        postbox::sqlx::emit(&outbox, &mut tx, &event(n % 3))
            .await
            .unwrap();
    }
    assert_eq!(
        rows_written(&mut tx, &db.schema).await - before,
        0,
        "20 emits inserted, updated or deleted rows"
    );
    tx.commit().await.unwrap();
    assert!(counters(&db.pool, &db.schema).await.is_empty());
    db.drop_schema().await;
}

#[tokio::test]
async fn numbered_emits_carry_their_aggregates_sequence() {
    let db = TestDb::new().await;
    db.exec("UPDATE {schema}.logical_settings SET numbered_emits = true")
        .await;
    with_slot(&db, |pool, schema, slot| async move {
        let outbox = Outbox::new(schema.clone());
        let mut tx = pool.begin().await.unwrap();
        let before = rows_written(&mut tx, &schema).await;
        for n in [1, 2] {
            postbox::sqlx::emit(&outbox, &mut tx, &event(n))
                .await
                .unwrap();
        }
        assert_eq!(
            rows_written(&mut tx, &schema).await - before,
            2,
            "one counter row each"
        );
        tx.commit().await.unwrap();
        // A rollback gives its number back.
        let mut tx = pool.begin().await.unwrap();
        postbox::sqlx::emit(&outbox, &mut tx, &event(1))
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        // The SQL function numbers too: order 1's second event.
        sqlx::query(trusted(&schema.render(
            "SELECT {schema}.emit('order.paid', 'order', '1', '{\"n\": 4}')",
        )))
        .execute(&pool)
        .await
        .unwrap();
        let got = messages(&pool, &schema, &slot).await;
        let numbered: Vec<(&str, i64)> = got
            .iter()
            .map(|m| {
                (
                    m["aggregate_id"].as_str().unwrap(),
                    m["sequence"].as_i64().unwrap(),
                )
            })
            .collect();
        assert_eq!(numbered, [("1", 1), ("2", 1), ("1", 2)]);
        assert_eq!(
            counters(&pool, &schema).await,
            [("1".to_owned(), 2), ("2".to_owned(), 1)]
        );
    })
    .await;
    db.drop_schema().await;
}

#[tokio::test]
async fn emit_checks_its_arguments_like_enqueue() {
    let db = TestDb::new().await;
    for (args, field) in [
        ("'', 'a', '1', '{}'", "event_type"),
        ("'t', NULL, '1', '{}'", "aggregate_type"),
        ("'t', 'a', repeat('x', 256), '{}'", "aggregate_id"),
        ("'t', 'a', '1', NULL", "payload"),
        ("'t', 'a', '1', '{}', '[]'", "headers"),
    ] {
        let err = sqlx::query(trusted(&db.sql(&format!("SELECT {{schema}}.emit({args})"))))
            .execute(&db.pool)
            .await
            .unwrap_err();
        let err = err.into_database_error().unwrap();
        assert_eq!(err.code().as_deref(), Some("22023"), "{args}");
        assert!(err.message().contains(field), "{args}: {}", err.message());
    }
    db.drop_schema().await;
}

//! The inbox: record (consumer, event id) in the caller's transaction, learn whether
//! it is new, purge old rows by age. Both drivers.

use postbox::statements::trusted;
use postbox::{Error, InboxOutcome, Outbox};
use postbox_testkit::TestDb;
use std::time::Duration;
use uuid::Uuid;

/// Move `n` inbox rows' `processed_at` two hours back.
async fn age_rows(db: &TestDb, n: i64) {
    db.exec(&format!(
        "UPDATE {{schema}}.inbox SET processed_at = now() - interval '2 hours' \
         WHERE ctid = ANY(ARRAY(SELECT ctid FROM {{schema}}.inbox ORDER BY event_id LIMIT {n}))"
    ))
    .await;
}

#[tokio::test]
async fn sqlx_first_record_is_new_and_the_second_a_duplicate() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let event = Uuid::now_v7();

    let mut tx = db.pool.begin().await.unwrap();
    let first = postbox::sqlx::record_inbox(&outbox, &mut tx, "billing", event)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(first, InboxOutcome::New);
    assert!(first.is_new());

    let mut tx = db.pool.begin().await.unwrap();
    let second = postbox::sqlx::record_inbox(&outbox, &mut tx, "billing", event)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(second, InboxOutcome::Duplicate);

    // Another consumer has its own record of the same event.
    let mut conn = db.pool.acquire().await.unwrap();
    let other = postbox::sqlx::record_inbox(&outbox, &mut conn, "shipping", event)
        .await
        .unwrap();
    assert_eq!(other, InboxOutcome::New);
    assert_eq!(db.count("SELECT count(*) FROM {schema}.inbox").await, 2);
    drop(conn);
    db.drop_schema().await;
}

#[tokio::test]
async fn sqlx_a_rolled_back_record_leaves_the_event_new() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let event = Uuid::now_v7();

    let mut tx = db.pool.begin().await.unwrap();
    let outcome = postbox::sqlx::record_inbox(&outbox, &mut tx, "billing", event)
        .await
        .unwrap();
    assert_eq!(outcome, InboxOutcome::New);
    tx.rollback().await.unwrap(); // the effect failed: nothing was applied

    let mut tx = db.pool.begin().await.unwrap();
    let retried = postbox::sqlx::record_inbox(&outbox, &mut tx, "billing", event)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        retried,
        InboxOutcome::New,
        "the redelivery must apply the effect"
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn sqlx_concurrent_records_of_one_event_yield_exactly_one_new() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let event = Uuid::now_v7();
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (pool, outbox) = (db.pool.clone(), outbox.clone());
            tokio::spawn(async move {
                let mut tx = pool.begin().await.unwrap();
                let outcome = postbox::sqlx::record_inbox(&outbox, &mut tx, "billing", event)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                outcome
            })
        })
        .collect();
    let mut new = 0;
    for t in tasks {
        if t.await.unwrap().is_new() {
            new += 1;
        }
    }
    assert_eq!(new, 1);
    db.drop_schema().await;
}

#[tokio::test]
async fn sqlx_invalid_consumer_names_are_refused() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let mut conn = db.pool.acquire().await.unwrap();
    for bad in [String::new(), "c".repeat(256), "a\0b".to_owned()] {
        let err = postbox::sqlx::record_inbox(&outbox, &mut conn, &bad, Uuid::now_v7())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidConsumer { .. }), "{err}");
    }
    assert_eq!(db.count("SELECT count(*) FROM {schema}.inbox").await, 0);
    drop(conn);
    db.drop_schema().await;
}

#[tokio::test]
async fn sqlx_purge_removes_only_old_rows_in_bounded_batches() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let mut conn = db.pool.acquire().await.unwrap();
    for _ in 0..5 {
        let _ = postbox::sqlx::record_inbox(&outbox, &mut conn, "billing", Uuid::now_v7())
            .await
            .unwrap();
    }
    age_rows(&db, 3).await;
    let hour = Duration::from_secs(3600);

    let first = postbox::sqlx::purge_inbox(&outbox, &mut conn, hour, 2)
        .await
        .unwrap();
    assert_eq!(first, 2, "bounded by the limit");
    let second = postbox::sqlx::purge_inbox(&outbox, &mut conn, hour, 2)
        .await
        .unwrap();
    assert_eq!(second, 1, "only rows older than an hour");
    let third = postbox::sqlx::purge_inbox(&outbox, &mut conn, hour, 2)
        .await
        .unwrap();
    assert_eq!(third, 0);
    assert_eq!(db.count("SELECT count(*) FROM {schema}.inbox").await, 2);
    drop(conn);
    db.drop_schema().await;
}

#[tokio::test]
async fn sql_inbox_apply_shares_the_record_with_the_library() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let apply = db.sql("SELECT {schema}.inbox_apply($1, $2)");
    let event = Uuid::now_v7();
    let first: bool = sqlx::query_scalar(trusted(&apply))
        .bind("billing")
        .bind(event)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let again: bool = sqlx::query_scalar(trusted(&apply))
        .bind("billing")
        .bind(event)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(first && !again);
    // The library finds the record SQL wrote, and the other way round.
    let mut conn = db.pool.acquire().await.unwrap();
    let seen = postbox::sqlx::record_inbox(&outbox, &mut conn, "billing", event)
        .await
        .unwrap();
    assert_eq!(seen, InboxOutcome::Duplicate);
    let other = Uuid::now_v7();
    let _ = postbox::sqlx::record_inbox(&outbox, &mut conn, "billing", other)
        .await
        .unwrap();
    let by_sql: bool = sqlx::query_scalar(trusted(&apply))
        .bind("billing")
        .bind(other)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert!(!by_sql);

    // A rolled-back apply leaves the event new.
    let fresh = Uuid::now_v7();
    let mut tx = db.pool.begin().await.unwrap();
    let new: bool = sqlx::query_scalar(trusted(&apply))
        .bind("billing")
        .bind(fresh)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert!(new);
    tx.rollback().await.unwrap();
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) FROM {{schema}}.inbox WHERE event_id = '{fresh}'"
        ))
        .await,
        0
    );

    // Bad input: a clear error, nothing written.
    for (consumer, code) in [("", "22023"), (&*"x".repeat(256), "22023")] {
        let err = sqlx::query_scalar::<_, bool>(trusted(&apply))
            .bind(consumer)
            .bind(Uuid::now_v7())
            .fetch_one(&db.pool)
            .await
            .unwrap_err();
        let db_err = err.as_database_error().expect("a database error");
        assert_eq!(db_err.code().as_deref(), Some(code), "{err}");
    }
    let err = sqlx::query_scalar::<_, bool>(trusted(&apply))
        .bind("billing")
        .bind(None::<Uuid>)
        .fetch_one(&db.pool)
        .await
        .unwrap_err();
    assert_eq!(
        err.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("22004")
    );
    assert_eq!(db.count("SELECT count(*) FROM {schema}.inbox").await, 2);
    drop(conn);
    db.drop_schema().await;
}

/// The Python consumer of docs/consuming.md, as printed there.
fn python_consumer() -> String {
    let doc = include_str!("../../../docs/consuming.md");
    let start = doc
        .find("```python\n# inbox_consumer.py")
        .expect("docs/consuming.md has the Python consumer")
        + "```python\n".len();
    let len = doc[start..].find("```").expect("the block ends");
    doc[start..start + len].to_owned()
}

/// The reader of docs/consumer-groups.md whose block starts with `first_line`.
fn group_reader(fence: &str, first_line: &str) -> String {
    let doc = include_str!("../../../docs/consumer-groups.md");
    let opening = format!("```{fence}\n{first_line}");
    let start = doc
        .find(&opening)
        .unwrap_or_else(|| panic!("docs/consumer-groups.md has {first_line}"))
        + fence.len()
        + 4;
    let len = doc[start..].find("```").expect("the block ends");
    doc[start..start + len].to_owned()
}

const PSYCOPG_HINT: &str =
    "install the test dependencies with: python3 -m pip install 'psycopg[binary]'";

#[tokio::test]
async fn the_book_s_python_consumer_applies_each_event_once() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE {schema}.invoices (order_id bigint NOT NULL, total_cents bigint NOT NULL)",
    )
    .await;
    let script = std::env::temp_dir().join(format!("{}-inbox_consumer.py", db.schema.name()));
    std::fs::write(&script, python_consumer()).unwrap();
    let first = serde_json::json!({
        "specversion": "1.0", "id": Uuid::now_v7(), "type": "order.placed", "source": "shop",
        "data": {"order_id": 7, "total_cents": 1250}
    });
    let second = serde_json::json!({
        "specversion": "1.0", "id": Uuid::now_v7(), "type": "order.placed", "source": "shop",
        "data": {"order_id": 8, "total_cents": 990}
    });
    // The first event comes twice, as an at-least-once delivery may bring it.
    let input = format!("{first}\n{second}\n{first}\n");
    let run = tokio::process::Command::new("python3")
        .arg(&script)
        .env("DATABASE_URL", &db.url)
        .env("POSTBOX_SCHEMA", db.schema.name())
        .env("PGOPTIONS", format!("-c search_path={}", db.schema.name()))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run python3 ({e}); {PSYCOPG_HINT}"));
    let mut run = run;
    {
        use tokio::io::AsyncWriteExt;
        let mut stdin = run.stdin.take().unwrap();
        stdin.write_all(input.as_bytes()).await.unwrap();
    }
    let out = run.wait_with_output().await.unwrap();
    let _ = std::fs::remove_file(&script);
    assert!(
        out.status.success(),
        "the consumer failed ({}); {PSYCOPG_HINT}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    let id = |e: &serde_json::Value| e["id"].as_str().unwrap().to_owned();
    assert_eq!(
        printed.lines().collect::<Vec<_>>(),
        [
            format!("applied {}", id(&first)),
            format!("applied {}", id(&second)),
            format!("duplicate {}", id(&first)),
        ]
    );
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.invoices").await,
        2,
        "each invoice once"
    );
    db.drop_schema().await;
}

#[cfg(feature = "tokio-postgres")]
mod with_tokio_postgres {
    use super::*;
    use tokio_postgres::{Client, NoTls};

    async fn client() -> Client {
        let (client, connection) = tokio_postgres::connect(&postbox_testkit::database_url(), NoTls)
            .await
            .expect("connect with tokio-postgres");
        tokio::spawn(connection);
        client
    }

    #[tokio::test]
    async fn tokio_postgres_record_duplicate_and_rollback() {
        let db = TestDb::new().await;
        let outbox = Outbox::new(db.schema.clone());
        let mut client = client().await;
        let event = Uuid::now_v7();

        let tx = client.transaction().await.unwrap();
        let outcome = postbox::tokio_postgres::record_inbox(&outbox, &tx, "billing", event)
            .await
            .unwrap();
        assert_eq!(outcome, InboxOutcome::New);
        tx.rollback().await.unwrap();

        let tx = client.transaction().await.unwrap();
        let outcome = postbox::tokio_postgres::record_inbox(&outbox, &tx, "billing", event)
            .await
            .unwrap();
        assert_eq!(outcome, InboxOutcome::New, "the rollback recorded nothing");
        tx.commit().await.unwrap();

        let tx = client.transaction().await.unwrap();
        let outcome = postbox::tokio_postgres::record_inbox(&outbox, &tx, "billing", event)
            .await
            .unwrap();
        assert_eq!(outcome, InboxOutcome::Duplicate);
        tx.commit().await.unwrap();

        // On a plain client, too.
        let outcome = postbox::tokio_postgres::record_inbox(&outbox, &client, "shipping", event)
            .await
            .unwrap();
        assert_eq!(outcome, InboxOutcome::New);
        let err = postbox::tokio_postgres::record_inbox(&outbox, &client, "", event)
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidConsumer { .. }), "{err}");
        assert_eq!(db.count("SELECT count(*) FROM {schema}.inbox").await, 2);
        db.drop_schema().await;
    }

    #[tokio::test]
    async fn tokio_postgres_purge_removes_only_old_rows_in_bounded_batches() {
        let db = TestDb::new().await;
        let outbox = Outbox::new(db.schema.clone());
        let mut client = client().await;
        for _ in 0..5 {
            let _ =
                postbox::tokio_postgres::record_inbox(&outbox, &client, "billing", Uuid::now_v7())
                    .await
                    .unwrap();
        }
        age_rows(&db, 3).await;
        let hour = Duration::from_secs(3600);

        let tx = client.transaction().await.unwrap();
        let first = postbox::tokio_postgres::purge_inbox(&outbox, &tx, hour, 2)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(first, 2, "bounded by the limit");
        let second = postbox::tokio_postgres::purge_inbox(&outbox, &client, hour, 10)
            .await
            .unwrap();
        assert_eq!(second, 1, "only rows older than an hour");
        let third = postbox::tokio_postgres::purge_inbox(&outbox, &client, hour, 10)
            .await
            .unwrap();
        assert_eq!(third, 0);
        assert_eq!(db.count("SELECT count(*) FROM {schema}.inbox").await, 2);
        db.drop_schema().await;
    }
}

/// The book's readers of a consumer group, in Python and in Node.js: each
/// event's effect once (one was applied before its acknowledgement was
/// lost), a poison event given back with its error, the rest acknowledged.
async fn the_book_s_group_reader_applies_each_event_once(
    program: &str,
    script_name: &str,
    source: String,
    hint: &str,
) {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE {schema}.invoices (order_id bigint NOT NULL, total_cents bigint NOT NULL); \
         SELECT {schema}.create_group('billing'); \
         INSERT INTO {schema}.log (event_id, event_type, aggregate_type, aggregate_id, payload) VALUES \
           ('01900000-0000-7000-8000-000000000001', 'order.placed', 'order', '7', '{\"order_id\": 7, \"total_cents\": 1250}'), \
           ('01900000-0000-7000-8000-000000000002', 'order.placed', 'order', '8', '{\"order_id\": 8, \"total_cents\": 990}'), \
           ('01900000-0000-7000-8000-000000000003', 'order.placed', 'order', '9', '{\"order_id\": 9}'); \
         INSERT INTO {schema}.inbox (consumer, event_id) VALUES ('billing', '01900000-0000-7000-8000-000000000002')",
    )
    .await;
    let script = std::env::temp_dir().join(format!("{}-{script_name}", db.schema.name()));
    std::fs::write(&script, source).unwrap();
    let global_modules = std::process::Command::new("npm")
        .args(["root", "-g"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let out = tokio::process::Command::new(program)
        .arg(&script)
        .env("DATABASE_URL", &db.url)
        .env("POSTBOX_SCHEMA", db.schema.name())
        .env("PGOPTIONS", format!("-c search_path={}", db.schema.name()))
        .env("NODE_PATH", global_modules)
        .env("STOP_WHEN_IDLE", "1")
        .output()
        .await
        .unwrap_or_else(|e| panic!("cannot run {program} ({e}); {hint}"));
    let _ = std::fs::remove_file(&script);
    assert!(
        out.status.success(),
        "the reader failed ({}); {hint}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .collect::<Vec<_>>(),
        [
            "applied 01900000-0000-7000-8000-000000000001",
            "duplicate 01900000-0000-7000-8000-000000000002",
        ]
    );
    assert_eq!(db.count("SELECT count(*) FROM {schema}.invoices").await, 1);
    // The poison event waits to come again, with the reader's error.
    assert_eq!(
        db.count(
            "SELECT count(*) FROM {schema}.group_waiting \
             WHERE group_name = 'billing' AND last_error LIKE '%total_cents%'"
        )
        .await,
        1
    );
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.group_batches")
            .await,
        0,
        "the rest acknowledged"
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn the_book_s_python_group_reader_applies_each_event_once() {
    the_book_s_group_reader_applies_each_event_once(
        "python3",
        "group_reader.py",
        group_reader("python", "# group_reader.py"),
        PSYCOPG_HINT,
    )
    .await;
}

#[tokio::test]
async fn the_book_s_node_group_reader_applies_each_event_once() {
    the_book_s_group_reader_applies_each_event_once(
        "node",
        "group_reader.js",
        group_reader("javascript", "// group_reader.js"),
        "install the test dependencies with: npm install -g pg@8",
    )
    .await;
}

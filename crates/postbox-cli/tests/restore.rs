//! The backup and restore drill: a dump of postbox's schema taken while
//! events are pending (and some are leased by a relay) is restored into a
//! fresh database after the original moved on; the relay resumes there and
//! delivers every event the dump still holds as undelivered — including ones
//! the consumer applied after the dump — and the consumer's inbox, which lives
//! in its own database and is not restored, applies each effect exactly once.

use postbox::statements::trusted;
use postbox::{InboxOutcome, NewEvent, Outbox};
use postbox_testkit::{redis_url, unique, TestDb};
use redis::streams::StreamRangeReply;
use std::path::Path;
use std::time::Duration;
use tokio::process::Command;
use uuid::Uuid;

fn events(n: usize, batch: &str) -> Vec<NewEvent> {
    (0..n)
        .map(|i| {
            NewEvent::from_json(
                "account.credited",
                "account",
                format!("{batch}-{}", i % 10),
                format!(r#"{{"batch":"{batch}","n":{i}}}"#),
            )
            .expect("a valid event")
        })
        .collect()
}

/// `postbox relay --drain` on `url`/`schema` into the stream behind `sink`.
async fn drain(url: &str, schema: &str, sink: &str) -> String {
    let run = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .args(["relay", "--drain", "--sink", sink])
        .env("DATABASE_URL", url)
        .env("POSTBOX_SCHEMA", schema)
        .env("POSTBOX_LOG", "warn")
        .env_remove("POSTBOX_CONFIG")
        .env_remove("POSTBOX_SINK")
        .env_remove("POSTBOX_FAILPOINTS")
        .kill_on_drop(true)
        .output();
    let o = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the relay drained within 2 minutes")
        .expect("run postbox relay");
    assert!(
        o.status.success(),
        "relay --drain failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

async fn tool(program: &str, args: &[&str]) {
    let o = Command::new(program)
        .args(args)
        .output()
        .await
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    assert!(
        o.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The consumer: read the stream after `cursor` and apply each delivery
/// through the inbox, effect and inbox row in one transaction. Returns
/// (applied, duplicates).
async fn consume(consumer: &TestDb, key: &str, cursor: &mut String) -> (u64, u64) {
    let outbox = Outbox::new(consumer.schema.clone());
    let mut redis = postbox_testkit::redis().await;
    let reply: StreamRangeReply = redis::cmd("XRANGE")
        .arg(key)
        .arg(format!("({cursor}"))
        .arg("+")
        .query_async(&mut redis)
        .await
        .expect("XRANGE");
    let (mut applied, mut duplicates) = (0, 0);
    for entry in reply.ids {
        let id: String = entry.get("id").expect("the event id field");
        let event_id: Uuid = id.parse().expect("a uuid");
        let mut tx = consumer.pool.begin().await.expect("begin");
        match postbox::sqlx::record_inbox(&outbox, &mut tx, "ledger", event_id)
            .await
            .expect("record in the inbox")
        {
            InboxOutcome::New => {
                sqlx::query(trusted(&consumer.sql(
                    "INSERT INTO {schema}.effects (event_id, applied) VALUES ($1, 1) \
                     ON CONFLICT (event_id) DO UPDATE SET applied = effects.applied + 1",
                )))
                .bind(event_id)
                .execute(&mut *tx)
                .await
                .expect("apply the effect");
                applied += 1;
            }
            InboxOutcome::Duplicate => duplicates += 1,
        }
        tx.commit().await.expect("commit");
        *cursor = entry.id;
    }
    (applied, duplicates)
}

async fn statuses(pool: &sqlx::PgPool, schema: &str) -> Vec<(String, i64)> {
    sqlx::query_as(trusted(&format!(
        "SELECT status::text, count(*) FROM {schema}.outbox GROUP BY 1 ORDER BY 1"
    )))
    .fetch_all(pool)
    .await
    .expect("count by status")
}

#[tokio::test]
async fn a_restored_dump_resumes_delivery_and_the_inbox_keeps_the_consumer_correct() {
    let app = TestDb::new().await;
    let schema = app.schema.name().to_owned();
    // The consumer's database: its inbox and its effects. Not part of the drill's restore.
    let consumer = TestDb::new().await;
    consumer
        .exec("CREATE TABLE {schema}.effects (event_id uuid PRIMARY KEY, applied int NOT NULL)")
        .await;
    let key = unique("postbox:restore:");
    let sink = format!("{}?mode=stream&key={key}", redis_url());
    let mut cursor = "0-0".to_owned();

    // 1. Delivered and applied before the backup.
    let before = app.enqueue_events(&events(100, "before")).await;
    drain(&app.url, &schema, &sink).await;
    assert_eq!(consume(&consumer, &key, &mut cursor).await, (100, 0));

    // 2. Pending when the backup is taken; 30 of them leased by a relay that
    //    is publishing them right now (their lease expires in a second).
    let pending = app.enqueue_events(&events(100, "pending")).await;
    sqlx::query(trusted(&app.sql(
        "UPDATE {schema}.outbox SET status = 'processing', lease_token = gen_random_uuid(), \
         lease_expires_at = now() + interval '1 second', attempts = attempts + 1 \
         WHERE event_id = ANY($1)",
    )))
    .bind(&pending[..30])
    .execute(&app.pool)
    .await
    .expect("lease 30 events");
    let dir = std::env::temp_dir().join(unique("postbox-restore-"));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let dump = dir.join("postbox.dump");
    let dump_path = dump.to_str().expect("a UTF-8 path");
    tool(
        "pg_dump",
        &[
            "--format=custom",
            "--schema",
            &schema,
            "--file",
            dump_path,
            "--dbname",
            &app.url,
        ],
    )
    .await;

    // 3. The original database moves on: everything is delivered and applied.
    drain(&app.url, &schema, &sink).await;
    assert_eq!(consume(&consumer, &key, &mut cursor).await, (100, 0));

    // 4. The database is lost; the dump is restored into a fresh one.
    let database = unique("postbox_restore_");
    sqlx::query(trusted(&format!("CREATE DATABASE {database}")))
        .execute(&app.pool)
        .await
        .expect("create the restore database");
    let mut restored_url = url::Url::parse(&app.url).expect("a URL");
    restored_url.set_path(&format!("/{database}"));
    let restored_url = restored_url.to_string();
    tool(
        "pg_restore",
        &[
            "--no-owner",
            "--exit-on-error",
            "--dbname",
            &restored_url,
            dump_path,
        ],
    )
    .await;
    let restored = sqlx::PgPool::connect(&restored_url)
        .await
        .expect("connect to the restored database");
    assert_eq!(
        statuses(&restored, &schema).await,
        vec![
            ("pending".to_owned(), 70),
            ("processing".to_owned(), 30),
            ("sent".to_owned(), 100)
        ],
        "the dump holds the undelivered events"
    );

    // 5. The relay resumes on the restored database: the pending events and
    //    the leased ones (once their lease has expired) are delivered again.
    let summary = drain(&restored_url, &schema, &sink).await;
    assert!(summary.contains("drained: 100 delivered"), "{summary}");
    assert_eq!(
        statuses(&restored, &schema).await,
        vec![("sent".to_owned(), 200)]
    );

    // 6. The consumer sees them a second time; its inbox absorbs every one.
    assert_eq!(consume(&consumer, &key, &mut cursor).await, (0, 100));
    let effects: Vec<(Uuid, i32)> = sqlx::query_as(trusted(
        &consumer.sql("SELECT event_id, applied FROM {schema}.effects"),
    ))
    .fetch_all(&consumer.pool)
    .await
    .expect("read the effects");
    assert_eq!(effects.len(), 200);
    assert!(
        effects.iter().all(|(_, n)| *n == 1),
        "an effect applied twice"
    );
    let mut all: Vec<Uuid> = before.iter().chain(&pending).copied().collect();
    let mut got: Vec<Uuid> = effects.iter().map(|(id, _)| *id).collect();
    all.sort_unstable();
    got.sort_unstable();
    assert_eq!(got, all, "each committed event has its effect");

    // 7. New events on the restored database flow as usual, with fresh sequence numbers.
    let after = events(10, "pending");
    let mut tx = restored.begin().await.expect("begin");
    postbox::sqlx::enqueue_batch(&Outbox::new(app.schema.clone()), &mut tx, &after)
        .await
        .expect("enqueue on the restored database");
    tx.commit().await.expect("commit");
    drain(&restored_url, &schema, &sink).await;
    assert_eq!(consume(&consumer, &key, &mut cursor).await, (10, 0));

    restored.close().await;
    sqlx::query(trusted(&format!("DROP DATABASE {database} WITH (FORCE)")))
        .execute(&app.pool)
        .await
        .expect("drop the restore database");
    let _ = std::fs::remove_dir_all(Path::new(&dir));
    let mut redis = postbox_testkit::redis().await;
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut redis)
        .await
        .expect("DEL");
    app.drop_schema().await;
    consumer.drop_schema().await;
}

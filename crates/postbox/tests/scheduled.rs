//! Scheduled delivery: `NewEvent::deliver_at` / `deliver_after` and the SQL
//! function's `deliver_at` argument store when an event becomes due, in the
//! outbox (claim mode) and in the log (log mode).

use chrono::{Duration as TimeDelta, Utc};
use postbox::statements::trusted;
use postbox::{Error, NewEvent, Outbox};
use postbox_testkit::TestDb;
use serde_json::json;
use sqlx::Row;
use std::time::Duration;
use uuid::Uuid;

fn event(n: i64) -> NewEvent {
    NewEvent::new("order.created", "order", n.to_string(), &json!({"n": n})).unwrap()
}

/// Seconds from the database's now() to the event's `available_at` and to
/// its `deliver_at` (NULL: not scheduled).
async fn due_in(db: &TestDb, table: &str, id: Uuid) -> (f64, Option<f64>) {
    let (available, deliver) = if table == "outbox" {
        ("available_at", "deliver_at")
    } else {
        ("deliver_at", "deliver_at")
    };
    let row = sqlx::query(trusted(&db.sql(&format!(
        "SELECT extract(epoch FROM COALESCE({available}, now()) - now())::float8 AS due, \
                extract(epoch FROM {deliver} - now())::float8 AS scheduled \
         FROM {{schema}}.{table} WHERE event_id = $1"
    ))))
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    (row.get("due"), row.get("scheduled"))
}

fn near(actual: f64, expected: f64) -> bool {
    (actual - expected).abs() < 60.0
}

#[tokio::test]
async fn the_library_stores_the_delivery_time_in_the_outbox() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let mut tx = db.pool.begin().await.unwrap();
    let at = postbox::sqlx::enqueue(
        &outbox,
        &mut tx,
        &event(1)
            .deliver_at(Utc::now() + TimeDelta::hours(2))
            .unwrap(),
    )
    .await
    .unwrap();
    let after = postbox::sqlx::enqueue(
        &outbox,
        &mut tx,
        &event(2).deliver_after(Duration::from_secs(3600)).unwrap(),
    )
    .await
    .unwrap();
    let past = postbox::sqlx::enqueue(
        &outbox,
        &mut tx,
        &event(3)
            .deliver_at(Utc::now() - TimeDelta::hours(1))
            .unwrap(),
    )
    .await
    .unwrap();
    let plain = postbox::sqlx::enqueue(&outbox, &mut tx, &event(4))
        .await
        .unwrap();
    let batch = postbox::sqlx::enqueue_batch(
        &outbox,
        &mut tx,
        &[
            event(5),
            event(6).deliver_after(Duration::from_secs(600)).unwrap(),
            event(7)
                .deliver_at(Utc::now() + TimeDelta::days(1))
                .unwrap(),
        ],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();

    let (due, scheduled) = due_in(&db, "outbox", at).await;
    assert!(
        near(due, 7200.0) && near(scheduled.unwrap(), 7200.0),
        "{due}"
    );
    let (due, scheduled) = due_in(&db, "outbox", after).await;
    assert!(
        near(due, 3600.0) && near(scheduled.unwrap(), 3600.0),
        "{due}"
    );
    let (due, scheduled) = due_in(&db, "outbox", past).await;
    assert!(due <= 0.0, "a time in the past is due at once: {due}");
    assert!(near(scheduled.unwrap(), -3600.0));
    assert_eq!(due_in(&db, "outbox", plain).await.1, None);
    assert_eq!(due_in(&db, "outbox", batch[0]).await.1, None);
    let (due, _) = due_in(&db, "outbox", batch[1]).await;
    assert!(near(due, 600.0), "{due}");
    let (due, _) = due_in(&db, "outbox", batch[2]).await;
    assert!(near(due, 86400.0), "{due}");
    // Scheduling changes nothing else: numbered in order, pending, untried.
    let sequences: Vec<i64> = sqlx::query_scalar(trusted(&db.sql(
        "SELECT sequence FROM {schema}.outbox WHERE status = 'pending' AND attempts = 0 ORDER BY id",
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(sequences.len(), 7);
    db.drop_schema().await;
}

#[tokio::test]
async fn tokio_postgres_schedules_alike() {
    let db = TestDb::new().await;
    let (mut client, connection) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let outbox = Outbox::new(db.schema.clone());
    let tx = client.transaction().await.unwrap();
    let one = postbox::tokio_postgres::enqueue(
        &outbox,
        &tx,
        &event(1).deliver_after(Duration::from_secs(1800)).unwrap(),
    )
    .await
    .unwrap();
    let batch = postbox::tokio_postgres::enqueue_batch(
        &outbox,
        &tx,
        &[
            event(2)
                .deliver_at(Utc::now() + TimeDelta::hours(3))
                .unwrap(),
            event(3),
        ],
    )
    .await
    .unwrap();
    let plain = postbox::tokio_postgres::enqueue_batch(&outbox, &tx, &[event(4)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(near(due_in(&db, "outbox", one).await.0, 1800.0));
    assert!(near(due_in(&db, "outbox", batch[0]).await.0, 10800.0));
    assert_eq!(due_in(&db, "outbox", batch[1]).await.1, None);
    assert_eq!(due_in(&db, "outbox", plain[0]).await.1, None);
    db.drop_schema().await;
}

#[tokio::test]
async fn the_sql_function_takes_deliver_at_by_name_and_keeps_its_old_calls() {
    let db = TestDb::new().await;
    let call = |args: &str| {
        db.sql(&format!(
            "SELECT {{schema}}.enqueue('order.created', 'order', 'a', {args})"
        ))
    };
    let mut ids = Vec::new();
    for args in [
        "'{}', deliver_at => now() + interval '1 hour'",
        "'{}', '{\"h\": \"v\"}', now() + interval '2 hours'",
        "'{}'",
        "'{}', '{}'",
        "'{}', deliver_at => NULL",
    ] {
        let id: Uuid = sqlx::query_scalar(trusted(&call(args)))
            .fetch_one(&db.pool)
            .await
            .unwrap_or_else(|e| panic!("enqueue(..., {args}): {e}"));
        ids.push(id);
    }
    assert!(near(due_in(&db, "outbox", ids[0]).await.0, 3600.0));
    assert!(near(due_in(&db, "outbox", ids[1]).await.0, 7200.0));
    for &id in &ids[2..] {
        assert_eq!(due_in(&db, "outbox", id).await.1, None);
    }
    // One function, not two overloads (which would make the old calls ambiguous).
    let count = db
        .count(
            "SELECT count(*) FROM pg_proc \
             WHERE proname = 'enqueue' AND pronamespace = '{schema}'::regnamespace",
        )
        .await;
    assert_eq!(count, 1);
    let err = sqlx::query_scalar::<_, Uuid>(trusted(&call("'{}', deliver_at => 'infinity'")))
        .fetch_one(&db.pool)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("deliver_at must be a finite time"),
        "{err}"
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn in_log_mode_the_log_keeps_the_delivery_time() {
    let db = TestDb::new().await;
    db.exec("UPDATE {schema}.log_settings SET producer_target = 'log'")
        .await;
    let outbox = Outbox::new(db.schema.clone());
    let mut tx = db.pool.begin().await.unwrap();
    let one = postbox::sqlx::enqueue(
        &outbox,
        &mut tx,
        &event(1).deliver_after(Duration::from_secs(900)).unwrap(),
    )
    .await
    .unwrap();
    let batch = postbox::sqlx::enqueue_batch(
        &outbox,
        &mut tx,
        &[
            event(2),
            event(3)
                .deliver_at(Utc::now() + TimeDelta::hours(1))
                .unwrap(),
        ],
    )
    .await
    .unwrap();
    let sql: Uuid = sqlx::query_scalar(trusted(&db.sql(
        "SELECT {schema}.enqueue('order.created', 'order', 'b', '{}', \
                                 deliver_at => now() + interval '30 minutes')",
    )))
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(db.count("SELECT count(*) FROM {schema}.outbox").await, 0);
    assert!(near(due_in(&db, "log", one).await.1.unwrap(), 900.0));
    assert_eq!(due_in(&db, "log", batch[0]).await.1, None);
    assert!(near(due_in(&db, "log", batch[1]).await.1.unwrap(), 3600.0));
    assert!(near(due_in(&db, "log", sql).await.1.unwrap(), 1800.0));
    db.drop_schema().await;
}

#[test]
fn out_of_range_schedules_are_refused_by_name() {
    let err = event(1)
        .deliver_after(postbox::MAX_DELIVER_AFTER + Duration::from_secs(1))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidEvent {
                field: "deliver_after",
                ..
            }
        ),
        "{err}"
    );
    let far = chrono::NaiveDate::from_ymd_opt(10_000, 1, 1)
        .and_then(|d| d.and_hms_opt(0, 0, 0))
        .unwrap()
        .and_utc();
    let err = event(1).deliver_at(far).unwrap_err();
    assert!(matches!(
        err,
        Error::InvalidEvent {
            field: "deliver_at",
            ..
        }
    ));
    let e = event(1).deliver_after(Duration::from_secs(5)).unwrap();
    assert_eq!(e.scheduled_after(), Some(Duration::from_secs(5)));
    let t = Utc::now();
    let e = e.deliver_at(t).unwrap();
    assert_eq!((e.scheduled_at(), e.scheduled_after()), (Some(t), None));
}

/// A schema migrated before scheduling existed, whose producer role was
/// granted the old functions: after the upgrade the role enqueues (scheduled
/// or not) through the new ones without any new grant.
#[tokio::test]
async fn the_upgrade_carries_the_producers_grants_over() {
    let db = TestDb::empty().await;
    db.exec(
        "CREATE SCHEMA {schema}; \
         CREATE TABLE {schema}.schema_migrations (version integer PRIMARY KEY, \
           name text NOT NULL, checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .await;
    for m in postbox::MIGRATIONS.iter().filter(|m| m.version <= 10) {
        let mut tx = db.pool.begin().await.unwrap();
        sqlx::raw_sql(trusted(&db.schema.render(m.sql)))
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query(trusted(&db.sql(
            "INSERT INTO {schema}.schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
        )))
        .bind(m.version)
        .bind(m.name)
        .bind(m.checksum())
        .execute(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    let role = format!("{}_old_producer", db.schema.name());
    db.exec(&format!(
        "CREATE ROLE {role} NOLOGIN; GRANT USAGE ON SCHEMA {{schema}} TO {role}; \
         GRANT EXECUTE ON FUNCTION \
           {{schema}}.enqueue(text, text, text, jsonb, jsonb), \
           {{schema}}.enqueue_one(uuid, text, text, text, integer, jsonb, jsonb), \
           {{schema}}.enqueue_many(uuid[], text[], text[], text[], integer[], jsonb[], jsonb[]) \
         TO {role}"
    ))
    .await;
    let applied = postbox::sqlx::migrate(&mut db.pool.acquire().await.unwrap(), &db.schema)
        .await
        .unwrap();
    assert!(applied.contains(&12), "{applied:?}");

    let outbox = Outbox::new(db.schema.clone());
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query(trusted(&format!("SET LOCAL ROLE {role}")))
        .execute(&mut *tx)
        .await
        .unwrap();
    let one = postbox::sqlx::enqueue(
        &outbox,
        &mut tx,
        &event(1).deliver_after(Duration::from_secs(60)).unwrap(),
    )
    .await
    .expect("the old grant covers enqueue_one");
    postbox::sqlx::enqueue_batch(&outbox, &mut tx, &[event(2), event(3)])
        .await
        .expect("the old grant covers enqueue_many");
    sqlx::query(trusted(&db.sql(
        "SELECT {schema}.enqueue('order.created', 'order', 'c', '{}', \
                                 deliver_at => now() + interval '1 minute')",
    )))
    .execute(&mut *tx)
    .await
    .expect("the old grant covers enqueue");
    tx.commit().await.unwrap();
    assert!(near(due_in(&db, "outbox", one).await.0, 60.0));
    assert_eq!(db.count("SELECT count(*) FROM {schema}.outbox").await, 4);
    // Nobody else gained anything: EXECUTE is still not PUBLIC's.
    let public = db
        .count(
            "SELECT count(*) FROM pg_proc p, aclexplode(p.proacl) a \
             WHERE p.pronamespace = '{schema}'::regnamespace \
               AND p.proname IN ('enqueue', 'enqueue_one', 'enqueue_many') AND a.grantee = 0",
        )
        .await;
    assert_eq!(public, 0);
    db.exec("DROP SCHEMA {schema} CASCADE").await;
    db.exec(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .await;
}

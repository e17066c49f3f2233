//! Enqueueing needs no privilege on postbox's tables: the library calls the
//! SECURITY DEFINER functions of migration 8, so a role with EXECUTE on them
//! (and USAGE on the schema) enqueues through both drivers, and one without
//! it cannot. Plus the cost of going through the functions (ignored: run it
//! by hand, `cargo test -p postbox --test main enqueue_cost -- --ignored --nocapture`).

use postbox::statements::trusted;
use postbox::{NewEvent, Outbox};
use postbox_testkit::TestDb;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::str::FromStr;
use std::time::{Duration, Instant};
use uuid::Uuid;

fn event(aggregate: &str, i: usize) -> NewEvent {
    NewEvent::new(
        "order.created",
        "order",
        aggregate.to_owned(),
        &serde_json::json!({ "i": i }),
    )
    .unwrap()
}

#[tokio::test]
async fn a_role_with_only_execute_enqueues_through_both_drivers() {
    let db = TestDb::new().await;
    let role = format!("{}_lib_producer", db.schema.name());
    let outsider = format!("{}_lib_outsider", db.schema.name());
    db.exec(&format!(
        "CREATE ROLE {role} NOLOGIN; CREATE ROLE {outsider} NOLOGIN; \
         GRANT USAGE ON SCHEMA {{schema}} TO {role}, {outsider}; \
         GRANT EXECUTE ON FUNCTION \
           {{schema}}.enqueue_one(uuid, text, text, text, integer, jsonb, jsonb, timestamptz), \
           {{schema}}.enqueue_many(uuid[], text[], text[], text[], integer[], jsonb[], jsonb[], \
                                   timestamptz[]) \
         TO {role}"
    ))
    .await;
    let outbox = Outbox::new(db.schema.clone());

    // sqlx.
    let set_role = format!("SET ROLE {role}");
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .after_connect(move |conn, _| {
            let set_role = set_role.clone();
            Box::pin(async move {
                sqlx::query(trusted(&set_role)).execute(conn).await?;
                Ok(())
            })
        })
        .connect_with(PgConnectOptions::from_str(&db.url).unwrap())
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    let mut ids = vec![postbox::sqlx::enqueue(&outbox, &mut tx, &event("a", 0))
        .await
        .expect("enqueue with EXECUTE only")];
    ids.extend(
        postbox::sqlx::enqueue_batch(&outbox, &mut tx, &[event("a", 1), event("b", 2)])
            .await
            .expect("enqueue_batch with EXECUTE only"),
    );
    tx.commit().await.unwrap();
    pool.close().await;

    // tokio-postgres.
    let (mut client, connection) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
        .batch_execute(&format!("SET ROLE {role}"))
        .await
        .unwrap();
    let tx = client.transaction().await.unwrap();
    ids.push(
        postbox::tokio_postgres::enqueue(&outbox, &tx, &event("b", 3))
            .await
            .expect("tokio-postgres enqueue with EXECUTE only"),
    );
    ids.extend(
        postbox::tokio_postgres::enqueue_batch(&outbox, &tx, &[event("a", 4), event("a", 5)])
            .await
            .expect("tokio-postgres enqueue_batch with EXECUTE only"),
    );
    tx.commit().await.unwrap();

    // A role without EXECUTE (EXECUTE is not PUBLIC's) cannot enqueue.
    client
        .batch_execute(&format!("SET ROLE {outsider}"))
        .await
        .unwrap();
    let refused = postbox::tokio_postgres::enqueue(&outbox, &client, &event("c", 6))
        .await
        .unwrap_err();
    let text = postbox::redact::error_chain(&refused);
    assert!(text.contains("permission denied"), "{text}");
    drop(client);

    let rows: Vec<(Uuid, String, i64, String)> = sqlx::query_as(trusted(&db.sql(
        "SELECT event_id, aggregate_id, sequence, status::text FROM {schema}.outbox ORDER BY id",
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let got: Vec<(Uuid, &str, i64, &str)> = rows
        .iter()
        .map(|(id, a, s, st)| (*id, a.as_str(), *s, st.as_str()))
        .collect();
    assert_eq!(
        got,
        [
            (ids[0], "a", 1, "pending"),
            (ids[1], "a", 2, "pending"),
            (ids[2], "b", 1, "pending"),
            (ids[3], "b", 2, "pending"),
            (ids[4], "a", 3, "pending"),
            (ids[5], "a", 4, "pending"),
        ]
    );

    db.exec("DROP SCHEMA {schema} CASCADE").await;
    db.exec(&format!(
        "DROP OWNED BY {role}, {outsider}; DROP ROLE {role}, {outsider}"
    ))
    .await;
    db.drop_schema().await;
}

/// The enqueue statements as they were before migration 8: direct writes.
const DIRECT_ONE: &str = "WITH seq AS (
  INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence)
  VALUES ($3, $4, 1)
  ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_sequence = s.last_sequence + 1
  RETURNING s.last_sequence)
INSERT INTO {schema}.outbox
  (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers, sequence)
SELECT $1, $2, $3, $4, $5, $6::text::jsonb, $7::text::jsonb, seq.last_sequence FROM seq";

/// The batch statement as it was before migration 8.
const DIRECT_MANY: &str = "WITH e AS (
  SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int4[], $6::text[], $7::text[])
    WITH ORDINALITY
    AS e(event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers, ord)),
counts AS (
  SELECT aggregate_type, aggregate_id, count(*) AS n FROM e GROUP BY 1, 2),
seq AS (
  INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence)
  SELECT aggregate_type, aggregate_id, n FROM counts ORDER BY aggregate_type, aggregate_id
  ON CONFLICT (aggregate_type, aggregate_id)
  DO UPDATE SET last_sequence = s.last_sequence + EXCLUDED.last_sequence
  RETURNING s.aggregate_type, s.aggregate_id, s.last_sequence)
INSERT INTO {schema}.outbox
  (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers, sequence)
SELECT e.event_id, e.event_type, e.aggregate_type, e.aggregate_id, e.schema_version,
       e.payload::jsonb, e.headers::jsonb,
       seq.last_sequence - c.n
         + row_number() OVER (PARTITION BY e.aggregate_type, e.aggregate_id ORDER BY e.ord)
FROM e
JOIN counts c ON c.aggregate_type = e.aggregate_type AND c.aggregate_id = e.aggregate_id
JOIN seq ON seq.aggregate_type = e.aggregate_type AND seq.aggregate_id = e.aggregate_id
ORDER BY e.ord";

/// `batches` batches of `size` events, one transaction each.
async fn time_batches(db: &TestDb, batches: usize, size: usize, direct: bool) -> Duration {
    let outbox = Outbox::new(db.schema.clone());
    let sql = db.sql(DIRECT_MANY);
    let mut took = Duration::ZERO;
    for b in 0..batches {
        let events: Vec<NewEvent> = (0..size)
            .map(|i| event(&format!("b{b}-{}", i % 100), i))
            .collect();
        let mut tx = db.pool.begin().await.unwrap();
        let started = Instant::now();
        if direct {
            let ids: Vec<Uuid> = events.iter().map(NewEvent::event_id).collect();
            let types: Vec<&str> = events.iter().map(NewEvent::event_type).collect();
            let agg_types: Vec<&str> = vec!["order"; size];
            let agg_ids: Vec<String> = (0..size).map(|i| format!("b{b}-{}", i % 100)).collect();
            let versions: Vec<i32> = vec![1; size];
            let payloads: Vec<&str> = events.iter().map(NewEvent::payload_json).collect();
            let headers: Vec<&str> = vec!["{}"; size];
            sqlx::query(trusted(&sql))
                .bind(&ids)
                .bind(&types)
                .bind(&agg_types)
                .bind(&agg_ids)
                .bind(&versions)
                .bind(&payloads)
                .bind(&headers)
                .execute(&mut *tx)
                .await
                .unwrap();
        } else {
            postbox::sqlx::enqueue_batch(&outbox, &mut tx, &events)
                .await
                .unwrap();
        }
        took += started.elapsed();
        tx.commit().await.unwrap();
    }
    took
}

/// One event per statement, `n` statements in one transaction (so commits
/// do not drown the statement's own cost), through the library or directly.
async fn time_singles(db: &TestDb, n: usize, direct: bool, round: usize) -> Duration {
    let outbox = Outbox::new(db.schema.clone());
    let sql = db.sql(DIRECT_ONE);
    let events: Vec<NewEvent> = (0..n)
        .map(|i| event(&format!("r{round}-{}", i % 50), i))
        .collect();
    let mut conn = db.pool.acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let started = Instant::now();
    for (i, e) in events.iter().enumerate() {
        if direct {
            sqlx::query(trusted(&sql))
                .bind(e.event_id())
                .bind(e.event_type())
                .bind("order")
                .bind(format!("r{round}-{}", i % 50))
                .bind(1i32)
                .bind(e.payload_json())
                .bind("{}")
                .execute(&mut *tx)
                .await
                .unwrap();
        } else {
            postbox::sqlx::enqueue(&outbox, &mut tx, e).await.unwrap();
        }
    }
    let took = started.elapsed();
    tx.commit().await.unwrap();
    took
}

#[tokio::test]
#[ignore = "a measurement, not a check: run by hand with --ignored --nocapture"]
async fn enqueue_cost() {
    let db = TestDb::new().await;
    let n = 2000;
    // Warm up both paths (plans cached), then alternate rounds.
    time_singles(&db, 200, true, 0).await;
    time_singles(&db, 200, false, 1).await;
    let (mut direct, mut function) = (Vec::new(), Vec::new());
    for round in 0..6 {
        direct.push(time_singles(&db, n, true, 10 + round).await);
        function.push(time_singles(&db, n, false, 20 + round).await);
    }
    direct.sort();
    function.sort();
    let (d, f) = (direct[0], function[0]);
    time_batches(&db, 2, 1000, true).await;
    time_batches(&db, 2, 1000, false).await;
    let (mut bd, mut bf) = (Vec::new(), Vec::new());
    for _ in 0..6 {
        bd.push(time_batches(&db, 5, 1000, true).await);
        bf.push(time_batches(&db, 5, 1000, false).await);
    }
    bd.sort();
    bf.sort();
    let (bd, bf) = (bd[0], bf[0]);
    println!(
        "batches of 1000, best of 6 rounds of 5 batches: direct {:.2} ms, function {:.2} ms a batch, ratio {:.2}",
        bd.as_secs_f64() * 200.0,
        bf.as_secs_f64() * 200.0,
        bf.as_secs_f64() / bd.as_secs_f64()
    );
    let per = |t: Duration| t.as_secs_f64() * 1e6 / n as f64;
    println!(
        "single-event enqueue, best of 6 rounds of {n}: direct INSERT {:.1} µs, \
         SECURITY DEFINER function {:.1} µs, ratio {:.2}",
        per(d),
        per(f),
        f.as_secs_f64() / d.as_secs_f64()
    );
    // The statements alone, in the server (no round trips): a loop of n
    // direct inserts against a loop of n function calls.
    let direct_loop = db.sql(&format!(
        "DO $$ BEGIN FOR i IN 1..{n} LOOP
           WITH seq AS (
             INSERT INTO {{schema}}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence)
             VALUES ('order', 'srv-' || (i % 50), 1)
             ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_sequence = s.last_sequence + 1
             RETURNING s.last_sequence)
           INSERT INTO {{schema}}.outbox
             (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers, sequence)
           SELECT gen_random_uuid(), 'order.created', 'order', 'srv-' || (i % 50), 1,
                  '{{\"i\": 1}}'::text::jsonb, '{{}}'::text::jsonb, seq.last_sequence FROM seq;
         END LOOP; END $$"
    ));
    let function_loop = db.sql(&format!(
        "DO $$ BEGIN FOR i IN 1..{n} LOOP
           PERFORM {{schema}}.enqueue_one(gen_random_uuid(), 'order.created', 'order', 'srv-' || (i % 50), 1,
                                          '{{\"i\": 1}}'::text::jsonb, '{{}}'::text::jsonb);
         END LOOP; END $$"
    ));
    let (mut sd, mut sf) = (Vec::new(), Vec::new());
    for _ in 0..7 {
        for (sql, out) in [(&direct_loop, &mut sd), (&function_loop, &mut sf)] {
            let started = Instant::now();
            sqlx::raw_sql(trusted(sql)).execute(&db.pool).await.unwrap();
            out.push(started.elapsed());
        }
    }
    sd.sort();
    sf.sort();
    println!(
        "in the server, best of 7 loops of {n}: direct INSERT {:.1} µs, function {:.1} µs, ratio {:.2}",
        per(sd[0]),
        per(sf[0]),
        sf[0].as_secs_f64() / sd[0].as_secs_f64()
    );
    db.drop_schema().await;
}

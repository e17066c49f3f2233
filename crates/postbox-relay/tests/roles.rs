//! The least-privilege roles of `postbox migrate --create-roles`: every
//! operation the README documents for a role works under that role alone
//! (a connection that `SET ROLE`s to it), against the real database; and
//! each role is refused what is not its job.
//!
//! The roles are cluster-wide, so each test's roles are named after its own
//! schema (`<schema>_producer`, `_relay`, `_monitor`) and dropped at the end.

use crate::support::*;
use postbox::idempotency::{self, Begin, Fingerprint, IdempotencyKey, StoredResponse};
use postbox::statements::trusted;
use postbox::{NewEvent, Outbox};
use postbox_relay::retention::{self, Table};
use postbox_relay::{
    Destination, HealthConfig, Outcome, Relay, RelayConfig, RetentionConfig, RouteConfig, Router,
    RunMode, Store,
};
use postbox_store::{DeliveryUpdate, Failure, Roles};
use postbox_testkit::TestDb;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use std::str::FromStr;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const HOUR: Duration = Duration::from_secs(3600);

/// A test schema with its three roles, created by the grant script itself.
struct RoleDb {
    db: TestDb,
    roles: Roles,
}

impl RoleDb {
    async fn new() -> RoleDb {
        let db = TestDb::new().await;
        let roles = store(&db)
            .create_roles()
            .await
            .expect("create the roles as the superuser");
        RoleDb { db, roles }
    }

    /// A pool whose every connection acts as `role` (the roles are NOLOGIN).
    async fn pool_as(&self, role: &str) -> PgPool {
        let set_role = format!("SET ROLE {role}");
        let options = PgConnectOptions::from_str(&self.db.url).unwrap();
        PgPoolOptions::new()
            .max_connections(4)
            .after_connect(move |conn, _| {
                let set_role = set_role.clone();
                Box::pin(async move {
                    sqlx::query(trusted(&set_role)).execute(conn).await?;
                    Ok(())
                })
            })
            .connect_with(options)
            .await
            .expect("connect")
    }

    async fn producer(&self) -> PgPool {
        self.pool_as(&self.roles.producer).await
    }

    async fn relay(&self) -> Store {
        Store::new(
            self.pool_as(&self.roles.relay).await,
            self.db.schema.clone(),
        )
    }

    async fn monitor(&self) -> Store {
        Store::new(
            self.pool_as(&self.roles.monitor).await,
            self.db.schema.clone(),
        )
    }

    fn outbox(&self) -> Outbox {
        Outbox::new(self.db.schema.clone())
    }

    /// Drop the schema, then the roles (nothing of theirs is left once the
    /// schema is gone).
    async fn finish(self) {
        self.db.exec("DROP SCHEMA {schema} CASCADE").await;
        for role in [
            &self.roles.producer,
            &self.roles.relay,
            &self.roles.monitor,
            &self.roles.consumer,
        ] {
            sqlx::raw_sql(trusted(&format!("DROP OWNED BY {role}; DROP ROLE {role}")))
                .execute(&self.db.pool)
                .await
                .unwrap_or_else(|e| panic!("drop role {role}: {e}"));
        }
        self.db.drop_schema().await;
    }
}

/// Whether `error` (or one of its sources) is PostgreSQL's "permission denied".
fn is_denied(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(error);
    while let Some(e) = cur {
        if let Some(sqlx::Error::Database(db)) = e.downcast_ref::<sqlx::Error>() {
            return db.code().as_deref() == Some("42501");
        }
        cur = e.source();
    }
    false
}

/// `result` must be refused with "permission denied" (not any other error).
#[track_caller]
fn assert_denied<T: std::fmt::Debug, E: std::error::Error + 'static>(
    what: &str,
    result: Result<T, E>,
) {
    match result {
        Ok(v) => panic!("{what}: expected permission denied, but it succeeded ({v:?})"),
        Err(e) => assert!(is_denied(&e), "{what}: expected permission denied, got {e}"),
    }
}

fn events(n: usize, aggregate: &str) -> Vec<NewEvent> {
    (0..n)
        .map(|i| {
            NewEvent::new(
                "order.created",
                "order",
                aggregate.to_owned(),
                &serde_json::json!({ "i": i }),
            )
            .unwrap()
        })
        .collect()
}

/// Commit `n` events as the producer, through the library's batch insert.
async fn produce(producer: &PgPool, outbox: &Outbox, n: usize) -> Vec<Uuid> {
    let batch: Vec<NewEvent> = (0..n)
        .map(|i| {
            NewEvent::new(
                "order.created",
                "order",
                format!("o-{i}"),
                &serde_json::json!({ "i": i }),
            )
            .unwrap()
        })
        .collect();
    let mut tx = producer.begin().await.unwrap();
    let ids = postbox::sqlx::enqueue_batch(outbox, &mut tx, &batch)
        .await
        .expect("the producer enqueues a batch");
    tx.commit().await.unwrap();
    ids
}

async fn drain_with(relay: Relay) {
    tokio::time::timeout(
        Duration::from_secs(60),
        relay.run(RunMode::Drain, CancellationToken::new()),
    )
    .await
    .expect("the relay drains within the timeout (a permission error makes it retry forever)");
}

/// Each producer API, under the producer role: the SQL function, the library's
/// single and batch inserts (sequences included), and idempotency keys.
#[tokio::test]
async fn the_producer_enqueues_through_every_api() {
    let r = RoleDb::new().await;
    let producer = r.producer().await;
    let outbox = r.outbox();

    // The SQL function, as producers in other languages call it.
    let from_sql: Uuid = sqlx::query_scalar(trusted(&r.db.sql(
        "SELECT {schema}.enqueue('order.created', 'order', 'a', '{\"n\": 1}', '{\"h\": \"v\"}')",
    )))
    .fetch_one(&producer)
    .await
    .expect("the producer calls <schema>.enqueue(...)");

    // The library, one event and a batch, in one transaction.
    let mut tx = producer.begin().await.unwrap();
    let one = events(1, "a").remove(0);
    let one_id = postbox::sqlx::enqueue(&outbox, &mut tx, &one)
        .await
        .expect("the producer runs postbox::sqlx::enqueue");
    assert_eq!(one_id, one.event_id());
    let batch = events(3, "a");
    let batch_ids = postbox::sqlx::enqueue_batch(&outbox, &mut tx, &batch)
        .await
        .expect("the producer runs postbox::sqlx::enqueue_batch");
    assert_eq!(
        batch_ids,
        batch.iter().map(NewEvent::event_id).collect::<Vec<_>>()
    );
    tx.commit().await.unwrap();

    // Numbered 1..=5 within aggregate a, in enqueue order.
    let sequences: Vec<(Uuid, i64)> = sqlx::query_as(trusted(&r.db.sql(
        "SELECT event_id, sequence FROM {schema}.outbox WHERE aggregate_id = 'a' ORDER BY sequence",
    )))
    .fetch_all(&r.db.pool)
    .await
    .unwrap();
    let mut expected = vec![from_sql, one_id];
    expected.extend(&batch_ids);
    assert_eq!(
        sequences,
        expected.into_iter().zip(1..).collect::<Vec<(Uuid, i64)>>()
    );

    // Request idempotency keys: new, completed, replayed, restarted once expired.
    let key = IdempotencyKey::new("orders", "k-1").unwrap();
    let fingerprint = Fingerprint::of_parts(&[b"order 1"]);
    let mut tx = producer.begin().await.unwrap();
    let Begin::Execute(pending) = idempotency::begin(&outbox, &mut tx, &key, &fingerprint, HOUR)
        .await
        .expect("the producer begins an idempotent request")
    else {
        panic!("a new key executes");
    };
    postbox::sqlx::enqueue(&outbox, &mut tx, &events(1, "b").remove(0))
        .await
        .unwrap();
    let response = StoredResponse::json(201, &serde_json::json!({ "order": 1 })).unwrap();
    idempotency::complete(&outbox, &mut tx, pending, &response)
        .await
        .expect("the producer completes it");
    tx.commit().await.unwrap();

    let mut tx = producer.begin().await.unwrap();
    let again = idempotency::begin(&outbox, &mut tx, &key, &fingerprint, HOUR)
        .await
        .expect("the producer reads its key back");
    assert!(
        matches!(again, Begin::Replay(ref s) if s.status == 201),
        "{again:?}"
    );
    tx.rollback().await.unwrap();

    r.db.exec("UPDATE {schema}.idempotency_keys SET expires_at = now() - interval '1 second'")
        .await;
    let mut tx = producer.begin().await.unwrap();
    let restarted = idempotency::begin(&outbox, &mut tx, &key, &fingerprint, HOUR)
        .await
        .expect("the producer restarts an expired key");
    assert!(matches!(restarted, Begin::Execute(_)), "{restarted:?}");
    tx.rollback().await.unwrap();

    // It cannot read events.
    assert_denied(
        "the producer reads the outbox",
        sqlx::query(trusted(&r.db.sql("SELECT payload FROM {schema}.outbox")))
            .fetch_all(&producer)
            .await,
    );

    producer.close().await;
    r.finish().await;
}

/// The relay engine under the relay role: deliveries, retries, rejections and
/// exhausted budgets become dead letters, with the gauges and the health watch
/// running beside it.
#[tokio::test]
async fn the_relay_delivers_retries_and_dead_letters() {
    let r = RoleDb::new().await;
    let producer = r.producer().await;
    let ids = produce(&producer, &r.outbox(), 30).await;
    let reject = ids[0];
    let always_retry = ids[1];

    let sink = ScriptedSink::new(move |m, before| {
        if m.event_id == reject {
            Outcome::reject("422 unprocessable")
        } else if m.event_id == always_retry || before == 0 {
            Outcome::retry("503 unavailable")
        } else {
            Outcome::Delivered
        }
    });
    let config = RelayConfig {
        max_attempts: 3,
        ..fast_config()
    };
    let relay = Relay::new(r.relay().await, sink.clone(), config)
        .unwrap()
        .with_gauges(Duration::from_millis(20))
        .unwrap()
        .with_health(HealthConfig {
            enabled: true,
            interval: Duration::from_millis(20),
            ..HealthConfig::default()
        })
        .unwrap();
    drain_with(relay).await;

    let statuses: Vec<(String, i64)> = sqlx::query_as(trusted(
        &r.db
            .sql("SELECT status::text, count(*) FROM {schema}.outbox GROUP BY 1 ORDER BY 1"),
    ))
    .fetch_all(&r.db.pool)
    .await
    .unwrap();
    assert_eq!(
        statuses,
        [("failed".to_owned(), 2), ("sent".to_owned(), 28)]
    );
    let errors: Vec<String> = sqlx::query_scalar(trusted(
        &r.db
            .sql("SELECT last_error FROM {schema}.outbox WHERE status = 'failed' ORDER BY id"),
    ))
    .fetch_all(&r.db.pool)
    .await
    .unwrap();
    assert_eq!(errors, ["422 unprocessable", "503 unavailable"]);

    producer.close().await;
    r.finish().await;
}

/// Fan-out (per-destination `deliveries` rows) and the ordered claim, under
/// the relay role.
#[tokio::test]
async fn the_relay_fans_out_and_claims_in_order() {
    let r = RoleDb::new().await;
    let producer = r.producer().await;
    let outbox = r.outbox();
    let mut tx = producer.begin().await.unwrap();
    postbox::sqlx::enqueue_batch(&outbox, &mut tx, &events(10, "x"))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let a = ScriptedSink::delivering();
    // b fails each event's first attempt: the relay records per-destination state.
    let b = ScriptedSink::new(|_, before| {
        if before == 0 {
            Outcome::retry("503 from b")
        } else {
            Outcome::Delivered
        }
    });
    let router = Router::new(
        vec![
            Destination::new("a", a.clone()),
            Destination::new("b", b.clone()),
        ],
        &[RouteConfig {
            matches: vec!["order.*".into()],
            to: vec!["a".into(), "b".into()],
            ordered: true,
            poison: Default::default(),
            ..RouteConfig::default()
        }],
    )
    .unwrap();
    let relay = Relay::with_router(r.relay().await, router, fast_config()).unwrap();
    drain_with(relay).await;

    assert_eq!(
        r.db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'sent'")
            .await,
        10
    );
    assert_eq!(
        r.db.count("SELECT count(*) FROM {schema}.deliveries WHERE status = 'sent'")
            .await,
        20,
        "both destinations recorded once b needed a retry"
    );
    // Ordered: a saw aggregate x's events in sequence.
    let seen: Vec<i64> = a
        .seen
        .lock()
        .unwrap()
        .messages
        .iter()
        .filter_map(|m| m.sequence)
        .collect();
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(seen, sorted, "delivered in sequence, each once");

    producer.close().await;
    r.finish().await;
}

/// Every statement of the relay's hot path, one by one under the relay role:
/// claim (plain and ordered), release, settle, acknowledge, per-destination
/// state, rescue of expired leases, the next-due read and the LISTEN probe.
#[tokio::test]
async fn the_relay_runs_each_hot_path_statement() {
    let r = RoleDb::new().await;
    let producer = r.producer().await;
    produce(&producer, &r.outbox(), 6).await;
    let relay = r.relay().await;
    let lease = Duration::from_secs(30);

    let claim = relay.claim(2, lease, None).await.expect("claim");
    assert_eq!(claim.ids.len(), 2);
    assert_eq!(
        relay
            .release(claim.token, &claim.ids)
            .await
            .expect("release"),
        2
    );

    let order = Router::single(ScriptedSink::delivering())
        .all_ordered(Default::default())
        .claim_order()
        .unwrap();
    let claim = relay
        .claim(3, lease, Some(&order))
        .await
        .expect("ordered claim");
    assert_eq!(claim.ids.len(), 3);
    let acked = relay
        .ack_delivered(claim.token, &claim.ids[..1])
        .await
        .expect("acknowledge");
    assert_eq!(acked, claim.ids[..1]);
    let settled = relay
        .settle_failed(
            claim.token,
            &[
                Failure {
                    id: claim.ids[1],
                    reject: true,
                    counted: true,
                    budget: 5,
                    delay: Duration::ZERO,
                    error: "rejected".into(),
                },
                Failure {
                    id: claim.ids[2],
                    reject: false,
                    counted: true,
                    budget: 5,
                    delay: Duration::from_secs(60),
                    error: "retry".into(),
                },
            ],
        )
        .await
        .expect("settle");
    assert_eq!((settled.updated, settled.dead_lettered), (2, 1));

    let updates: Vec<DeliveryUpdate> = ["a", "b"]
        .iter()
        .map(|d| DeliveryUpdate {
            outbox_id: claim.ids[2],
            destination: (*d).into(),
            delivered: *d == "a",
            dead: false,
            attempts: 1,
            delay: Duration::from_secs(60),
            error: (*d == "b").then(|| "503".to_owned()),
        })
        .collect();
    assert_eq!(
        relay
            .record_deliveries(&updates)
            .await
            .expect("record deliveries"),
        2
    );
    assert_eq!(
        relay
            .delivery_states(&claim.ids[2..])
            .await
            .expect("delivery states")
            .len(),
        2
    );

    // A lease that expired (its relay died) is rescued.
    let claim = relay.claim(10, lease, None).await.expect("claim");
    assert_eq!(claim.ids.len(), 3);
    r.db
        .exec("UPDATE {schema}.outbox SET lease_expires_at = now() - interval '1 second' WHERE status = 'processing'")
        .await;
    let rescued = relay.rescue_expired(5, 100).await.expect("rescue");
    assert_eq!(rescued.requeued.len(), 3);

    let due = relay.next_due().await.expect("next due");
    assert!(!due.in_flight);
    relay.notify_probe("probe").await.expect("notify probe");
    relay.ping().await.expect("ping");

    producer.close().await;
    relay.pool().close().await;
    r.finish().await;
}

/// Retention under the relay role: sent events deleted, then archived; old
/// inbox records; expired idempotency keys — the pass `postbox purge` and the
/// relay's `[retention]` task share.
#[tokio::test]
async fn the_relay_runs_retention_and_archiving() {
    let r = RoleDb::new().await;
    let producer = r.producer().await;
    let outbox = r.outbox();
    produce(&producer, &r.outbox(), 12).await;
    // Expired idempotency keys, written by the producer.
    for i in 0..5 {
        let key = IdempotencyKey::new("orders", format!("k-{i}")).unwrap();
        let mut tx = producer.begin().await.unwrap();
        let begun = idempotency::begin(
            &outbox,
            &mut tx,
            &key,
            &Fingerprint::of_parts(&[b"x"]),
            HOUR,
        )
        .await
        .unwrap();
        assert!(matches!(begun, Begin::Execute(_)));
        tx.commit().await.unwrap();
    }
    r.db.exec("UPDATE {schema}.idempotency_keys SET expires_at = now() - interval '1 second'")
        .await;
    // Inbox records processed long ago (consumers write them in their own transactions).
    r.db.exec(
        "INSERT INTO {schema}.inbox (consumer, event_id, processed_at) \
             SELECT 'c', gen_random_uuid(), now() - interval '30 days' FROM generate_series(1, 7)",
    )
    .await;

    let relay = r.relay().await;
    drain_with(Relay::new(relay.clone(), ScriptedSink::delivering(), fast_config()).unwrap()).await;
    r.db.exec("UPDATE {schema}.outbox SET sent_at = now() - interval '30 days' WHERE id % 2 = 0")
        .await;

    let config = RetentionConfig {
        older_than: Duration::from_secs(86_400),
        inbox: true,
        batch_size: 4,
        pause: Duration::from_millis(1),
        ..RetentionConfig::default()
    };
    let report = retention::purge(&relay, &config, &CancellationToken::new(), |_| {})
        .await
        .expect("the relay role runs a retention pass");
    assert_eq!(
        (report.outbox, report.inbox, report.idempotency_keys),
        (6, 7, 5)
    );

    r.db.exec("UPDATE {schema}.outbox SET sent_at = now() - interval '30 days'")
        .await;
    let archive = RetentionConfig {
        archive: true,
        ..config
    };
    let report = retention::purge(&relay, &archive, &CancellationToken::new(), |_| {})
        .await
        .expect("the relay role archives");
    assert_eq!(report.outbox, 6);
    assert_eq!(r.db.count("SELECT count(*) FROM {schema}.outbox").await, 0);
    assert_eq!(
        r.db.count("SELECT count(*) FROM {schema}.outbox_archive")
            .await,
        6
    );

    producer.close().await;
    relay.pool().close().await;
    r.finish().await;
}

/// The monitor reads everything `postbox status`, the metrics task, `/readyz`
/// and the health watch read — and changes nothing.
#[tokio::test]
async fn the_monitor_reads_status_gauges_and_health() {
    let r = RoleDb::new().await;
    let producer = r.producer().await;
    produce(&producer, &r.outbox(), 4).await;
    let monitor = r.monitor().await;

    let counts = monitor.status_counts().await.expect("status counts");
    assert_eq!(counts.pending, 4);
    let gauges = monitor.gauges().await.expect("gauges");
    assert_eq!(gauges.pending, 4);
    let attempts = monitor.pending_attempts().await.expect("pending attempts");
    assert_eq!(attempts.len(), 1);
    monitor
        .destination_counts()
        .await
        .expect("destination counts");
    monitor.db_health().await.expect("database health");
    monitor.next_due().await.expect("next due");
    monitor.ping().await.expect("readiness ping");
    // `slot status` and the console's slots (each with its reader's note).
    monitor.logical().status(None).await.expect("slot status");

    // Read-only.
    assert_denied(
        "the monitor claims events",
        monitor.claim(10, Duration::from_secs(30), None).await,
    );
    assert_denied(
        "the monitor reads console password hashes",
        sqlx::query(trusted(
            &r.db.sql("SELECT password_hash FROM {schema}.console_users"),
        ))
        .fetch_all(monitor.pool())
        .await,
    );

    producer.close().await;
    monitor.pool().close().await;
    r.finish().await;
}

/// The tests above catch a grant that drifts from the code: without its
/// `DELETE` on the inbox, the relay's retention pass fails on the inbox.
#[tokio::test]
async fn a_missing_grant_fails_the_operation_that_needs_it() {
    let r = RoleDb::new().await;
    r.db.exec(&format!(
        "REVOKE DELETE ON {{schema}}.inbox FROM {}",
        r.roles.relay
    ))
    .await;
    let relay = r.relay().await;
    let config = RetentionConfig {
        inbox: true,
        ..RetentionConfig::default()
    };
    let err = retention::purge(&relay, &config, &CancellationToken::new(), |_| {})
        .await
        .expect_err("retention without DELETE on the inbox");
    assert_eq!(err.table, Table::Inbox);
    assert!(is_denied(&err), "{err}");

    relay.pool().close().await;
    r.finish().await;
}

/// Run `sql` (rendered for the test's schema) on `pool`.
async fn try_exec(r: &RoleDb, pool: &PgPool, sql: &str) -> Result<u64, sqlx::Error> {
    sqlx::raw_sql(trusted(&r.db.sql(sql)))
        .execute(pool)
        .await
        .map(|done| done.rows_affected())
}

/// (event id, status, attempts, due now, last error, no lease/resolution/sent_at, sequence)
type EventState = (Uuid, String, i32, bool, Option<String>, bool, Option<i64>);

/// The producer can only enqueue: no direct write to the outbox or the
/// sequence counters, so no event already sent or failed, due in year 9999,
/// carrying an error, or renumbered. What it enqueues is always a fresh
/// pending event.
#[tokio::test]
async fn the_producer_cannot_forge_state() {
    let r = RoleDb::new().await;
    let producer = r.producer().await;
    let outbox = r.outbox();
    produce(&producer, &outbox, 2).await;

    let forgeries = [
        (
            "a plain insert",
            "INSERT INTO {schema}.outbox (event_id, event_type, aggregate_type, aggregate_id, payload) \
             VALUES (gen_random_uuid(), 't', 'a', '1', '{}')",
        ),
        (
            "an event already sent",
            "INSERT INTO {schema}.outbox (event_id, event_type, aggregate_type, aggregate_id, payload, status, sent_at) \
             VALUES (gen_random_uuid(), 't', 'a', '1', '{}', 'sent', now())",
        ),
        (
            "a forged dead letter",
            "INSERT INTO {schema}.outbox (event_id, event_type, aggregate_type, aggregate_id, payload, status, last_error) \
             VALUES (gen_random_uuid(), 't', 'a', '1', '{}', 'failed', 'forged')",
        ),
        (
            "an event due in year 9999",
            "INSERT INTO {schema}.outbox (event_id, event_type, aggregate_type, aggregate_id, payload, available_at) \
             VALUES (gen_random_uuid(), 't', 'a', '1', '{}', '9999-01-01')",
        ),
        (
            "a change to an event",
            "UPDATE {schema}.outbox SET status = 'sent', available_at = '9999-01-01', last_error = 'x'",
        ),
        ("a deleted event", "DELETE FROM {schema}.outbox"),
        (
            "a rewound sequence counter",
            "UPDATE {schema}.aggregate_sequences SET last_sequence = 0",
        ),
        (
            "a new sequence counter",
            "INSERT INTO {schema}.aggregate_sequences VALUES ('order', 'new', 100)",
        ),
        (
            "a deleted sequence counter",
            "DELETE FROM {schema}.aggregate_sequences",
        ),
    ];
    for (what, sql) in forgeries {
        assert_denied(
            &format!("the producer writes {what}"),
            try_exec(&r, &producer, sql).await,
        );
    }

    // The functions decide everything but the content; a caller's own objects
    // (a temporary `outbox` first on its search_path) do not stand in for
    // postbox's.
    let mut conn = producer.acquire().await.unwrap();
    sqlx::raw_sql(
        "CREATE TEMP TABLE outbox (LIKE pg_catalog.pg_class); \
         CREATE TEMP TABLE aggregate_sequences (x int); \
         SET search_path = pg_temp, pg_catalog",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    let id: Uuid = sqlx::query_scalar(trusted(
        &r.db
            .sql("SELECT {schema}.enqueue('order.created', 'order', 'o-0', '{}')"),
    ))
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    let one = events(1, "o-1").remove(0);
    postbox::sqlx::enqueue(&outbox, &mut conn, &one)
        .await
        .unwrap();
    sqlx::raw_sql("RESET search_path; DISCARD TEMP")
        .execute(&mut *conn)
        .await
        .unwrap();
    drop(conn);

    let rows: Vec<EventState> = sqlx::query_as(trusted(&r.db.sql(
        "SELECT event_id, status::text, attempts, available_at <= now(), last_error, \
                    lease_token IS NULL AND resolved_at IS NULL AND sent_at IS NULL, sequence \
             FROM {schema}.outbox ORDER BY id",
    )))
    .fetch_all(&r.db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 4, "{rows:?}");
    for (event_id, status, attempts, due, error, clean, _) in &rows {
        assert_eq!(
            (status.as_str(), *attempts, *due, error, *clean),
            ("pending", 0, true, &None, true),
            "{event_id}"
        );
    }
    assert_eq!(rows[2].0, id);
    assert_eq!(rows[3].0, one.event_id());
    assert_eq!(
        (rows[2].6, rows[3].6),
        (Some(2), Some(2)),
        "numbered after the first events of o-0 and o-1, by the real counters"
    );

    producer.close().await;
    r.finish().await;
}

/// The relay changes only delivery state: never what an event says, nor an
/// operator's resolution; it cannot enqueue, and cannot rewrite idempotency
/// responses or inbox records.
#[tokio::test]
async fn the_relay_changes_only_delivery_state() {
    let r = RoleDb::new().await;
    let producer = r.producer().await;
    produce(&producer, &r.outbox(), 2).await;
    let relay = r.relay().await;
    let pool = relay.pool().clone();

    let refused = [
        ("a payload", "UPDATE {schema}.outbox SET payload = '{\"forged\": true}'"),
        ("headers", "UPDATE {schema}.outbox SET headers = '{}'"),
        ("an event type", "UPDATE {schema}.outbox SET event_type = 'x'"),
        (
            "an aggregate",
            "UPDATE {schema}.outbox SET aggregate_type = 'x', aggregate_id = 'y'",
        ),
        ("a sequence", "UPDATE {schema}.outbox SET sequence = 1"),
        ("an event id", "UPDATE {schema}.outbox SET event_id = gen_random_uuid()"),
        ("a schema version", "UPDATE {schema}.outbox SET schema_version = 2"),
        (
            "a resolution",
            "UPDATE {schema}.outbox SET resolved_at = now(), resolution = 'discarded'",
        ),
        (
            "a new event",
            "INSERT INTO {schema}.outbox (event_id, event_type, aggregate_type, aggregate_id, payload) \
             VALUES (gen_random_uuid(), 't', 'a', '1', '{}')",
        ),
        (
            "a sequence counter",
            "UPDATE {schema}.aggregate_sequences SET last_sequence = 0",
        ),
        (
            "an idempotent response",
            "UPDATE {schema}.idempotency_keys SET response_body = 'forged'",
        ),
        ("an inbox record", "UPDATE {schema}.inbox SET processed_at = now()"),
        (
            "a replay job's range",
            "UPDATE {schema}.replay_jobs SET hi = hi + 1, destination = 'x', from_at = from_at",
        ),
        ("a replay job away", "DELETE FROM {schema}.replay_jobs"),
        ("a seen destination away", "DELETE FROM {schema}.destinations_seen"),
    ];
    for (what, sql) in refused {
        assert_denied(
            &format!("the relay rewrites {what}"),
            try_exec(&r, &pool, sql).await,
        );
    }
    assert_denied(
        "the relay enqueues",
        try_exec(&r, &pool, "SELECT {schema}.enqueue('t', 'a', '1', '{}')").await,
    );
    // Its own columns it may change.
    assert_eq!(
        try_exec(
            &r,
            &pool,
            "UPDATE {schema}.outbox SET available_at = now(), last_error = NULL"
        )
        .await
        .expect("the relay changes delivery state"),
        2
    );
    // …and a replay job's position, counts and state (migration 30).
    try_exec(
        &r,
        &pool,
        "UPDATE {schema}.replay_jobs SET after_id = after_id, delivered = delivered + 1, \
         state = 'done', finished_at = now(), updated_at = now()",
    )
    .await
    .expect("the relay moves a replay job");

    producer.close().await;
    pool.close().await;
    r.finish().await;
}

/// Log mode under the relay role: producers (as the producer role) append to
/// the log, the relay delivers through its cursors, hands what it could not
/// deliver to the outbox (copied from the log by migration 10's function),
/// then rotates and truncates the ring with archiving; and it cannot write
/// the log, its settings or its segments itself.
#[tokio::test]
async fn the_relay_runs_log_mode() {
    let r = RoleDb::new().await;
    let owner = store(&r.db).log();
    owner
        .set_producer_target(postbox_store::ProducerTarget::Log)
        .await
        .unwrap();
    let producer = r.producer().await;
    let ids = produce(&producer, &r.outbox(), 40).await;
    let in_log: i64 = sqlx::query_scalar(trusted(&r.db.sql("SELECT count(*) FROM {schema}.log")))
        .fetch_one(&r.db.pool)
        .await
        .unwrap();
    assert_eq!(in_log, 40, "the producer role appends to the log");
    // The relay's log-mode gauges include each consumer group's.
    store(&r.db)
        .groups()
        .create(&postbox_store::NewGroup::new("billing"))
        .await
        .unwrap();
    let relay_store = r.relay().await;
    postbox_relay::metrics::refresh_log_lag(&relay_store)
        .await
        .expect("the relay reads the log-mode gauges, consumer groups' included");
    relay_store.pool().close().await;

    let (reject, retry) = (ids[0], ids[1]);
    let sink = ScriptedSink::new(move |m, before| {
        if m.event_id == reject {
            Outcome::reject("422 unprocessable")
        } else if m.event_id == retry && before == 0 {
            Outcome::retry("503 unavailable")
        } else {
            Outcome::Delivered
        }
    });
    let config = RelayConfig {
        mode: postbox_relay::ReadMode::Log,
        ..fast_config()
    };
    let relay_store = r.relay().await;
    drain_with(Relay::new(relay_store.clone(), sink.clone(), config).unwrap()).await;
    let tried = sink.ids();
    let distinct: std::collections::HashSet<&Uuid> = tried.iter().collect();
    assert_eq!(distinct.len(), 40, "every event reached the sink");
    assert_eq!(
        tried.iter().filter(|id| **id == retry).count(),
        2,
        "the handed-off event was retried from the outbox"
    );

    let handed: Vec<(Uuid, String, String, serde_json::Value)> =
        sqlx::query_as(trusted(&r.db.sql(
            "SELECT event_id, status::text, event_type, payload FROM {schema}.outbox ORDER BY id",
        )))
        .fetch_all(&r.db.pool)
        .await
        .unwrap();
    assert_eq!(handed.len(), 2, "the two events the sink did not take");
    let by_id: std::collections::HashMap<Uuid, (String, String, serde_json::Value)> = handed
        .into_iter()
        .map(|(id, status, t, p)| (id, (status, t, p)))
        .collect();
    assert_eq!(by_id[&reject].0, "failed");
    assert_eq!(by_id[&retry].0, "sent");
    assert_eq!(by_id[&reject].1, "order.created", "copied from the log");
    assert_eq!(by_id[&reject].2, serde_json::json!({ "i": 0 }));

    // Maintenance: a rotation (segment age zero), then a truncation of the
    // segment every cursor has read, archived.
    let log = relay_store.log();
    let (rotated, _) = log.maintain(Duration::ZERO, true).await.expect("rotate");
    assert!(rotated, "the relay role rotates the ring");
    let (_, removed) = log
        .maintain(Duration::from_secs(3600), true)
        .await
        .expect("truncate");
    assert_eq!(removed, 40, "the relay role truncates the segment it read");
    let archived: i64 = sqlx::query_scalar(trusted(
        &r.db.sql("SELECT count(*) FROM {schema}.outbox_archive"),
    ))
    .fetch_one(&r.db.pool)
    .await
    .unwrap();
    assert_eq!(archived, 38, "archived, except the two the outbox holds");

    let pool = relay_store.pool().clone();
    let refused = [
        (
            "appends to the log",
            "INSERT INTO {schema}.log (event_id, event_type, aggregate_type, aggregate_id, payload) \
             VALUES (gen_random_uuid(), 't', 'a', '1', '{}')",
        ),
        ("rewrites the log", "UPDATE {schema}.log SET payload = '{}'"),
        ("deletes from the log", "DELETE FROM {schema}.log"),
        ("truncates a segment", "TRUNCATE {schema}.log_1"),
        (
            "reads a segment directly",
            "SELECT count(*) FROM {schema}.log_1",
        ),
        (
            "moves the producers",
            "UPDATE {schema}.log_settings SET producer_target = 'outbox'",
        ),
    ];
    for (what, sql) in refused {
        assert_denied(&format!("the relay {what}"), try_exec(&r, &pool, sql).await);
    }

    producer.close().await;
    pool.close().await;
    r.finish().await;
}

#[tokio::test]
async fn the_relay_reads_the_status_of_its_replication_slots() {
    let r = RoleDb::new().await;
    let relay = r.relay().await;
    // Logical mode's reader checks its slot's lag and when it was last read
    // (`logical_readers`) while it reads.
    relay
        .logical()
        .status(None)
        .await
        .expect("the slots' status, as the relay");
    drop(relay);
    r.finish().await;
}

/// The monitor writes nothing and cannot enqueue.
#[tokio::test]
async fn the_monitor_changes_nothing() {
    let r = RoleDb::new().await;
    let monitor = r.monitor().await;
    let pool = monitor.pool().clone();
    for sql in [
        "SELECT {schema}.enqueue('t', 'a', '1', '{}')",
        "UPDATE {schema}.outbox SET status = 'sent'",
        "DELETE FROM {schema}.outbox",
        "DELETE FROM {schema}.idempotency_keys",
        "INSERT INTO {schema}.inbox (consumer, event_id) VALUES ('c', gen_random_uuid())",
    ] {
        assert_denied(sql, try_exec(&r, &pool, sql).await);
    }
    let outbox = r.outbox();
    let mut conn = pool.acquire().await.unwrap();
    assert_denied(
        "the monitor runs the library's enqueue",
        postbox::sqlx::enqueue(&outbox, &mut conn, &events(1, "m").remove(0)).await,
    );
    drop(conn);
    pool.close().await;
    r.finish().await;
}

/// Running the script again (after an upgrade) takes back what earlier
/// versions granted more broadly: a table-wide INSERT for the producer, a
/// table-wide UPDATE for the relay.
#[tokio::test]
async fn running_the_script_again_takes_back_broader_grants() {
    let r = RoleDb::new().await;
    r.db.exec(&format!(
        "GRANT INSERT ON {{schema}}.outbox TO {p}; \
             GRANT SELECT, INSERT, UPDATE ON {{schema}}.aggregate_sequences TO {p}; \
             GRANT UPDATE ON {{schema}}.outbox TO {relay}",
        p = r.roles.producer,
        relay = r.roles.relay,
    ))
    .await;
    let again = store(&r.db)
        .create_roles()
        .await
        .expect("run the script again");
    assert_eq!(again, r.roles);

    let producer = r.producer().await;
    assert_denied(
        "the producer inserts directly after the re-run",
        try_exec(
            &r,
            &producer,
            "INSERT INTO {schema}.outbox (event_id, event_type, aggregate_type, aggregate_id, payload, status) \
             VALUES (gen_random_uuid(), 't', 'a', '1', '{}', 'sent')",
        )
        .await,
    );
    assert_denied(
        "the producer rewrites counters after the re-run",
        try_exec(
            &r,
            &producer,
            "UPDATE {schema}.aggregate_sequences SET last_sequence = 0",
        )
        .await,
    );
    produce(&producer, &r.outbox(), 1).await;
    let relay = r.relay().await;
    assert_denied(
        "the relay rewrites payloads after the re-run",
        try_exec(
            &r,
            relay.pool(),
            "UPDATE {schema}.outbox SET payload = 'null'",
        )
        .await,
    );
    drain_with(Relay::new(relay.clone(), ScriptedSink::delivering(), fast_config()).unwrap()).await;
    assert_eq!(
        r.db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'sent'")
            .await,
        1
    );

    producer.close().await;
    relay.pool().close().await;
    r.finish().await;
}

/// Emitting is the producer's job alone (migration 19): the relay, the
/// monitor and a role with nothing but the schema's USAGE are refused
/// `emit` and `emit_one` (PostgreSQL makes a new function executable by
/// PUBLIC); the producer emits.
#[tokio::test]
async fn only_the_producer_may_emit() {
    let rdb = RoleDb::new().await;
    let schema = rdb.db.schema.name().to_owned();
    let stranger = format!("{schema}_stranger");
    rdb.db
        .exec(&format!(
            "CREATE ROLE {stranger} NOLOGIN; GRANT USAGE ON SCHEMA {{schema}} TO {stranger}"
        ))
        .await;
    let emit = format!("SELECT {schema}.emit('t', 'a', '1', '{{}}'::jsonb)");
    let emit_one = format!(
        "SELECT {schema}.emit_one(gen_random_uuid(), 't', 'a', '1', 1, '{{}}'::jsonb, '{{}}'::jsonb)"
    );
    let relay = rdb.relay().await;
    let monitor = rdb.monitor().await;
    let strangers = rdb.pool_as(&stranger).await;
    for (who, pool) in [
        ("relay", relay.pool()),
        ("monitor", monitor.pool()),
        ("stranger", &strangers),
    ] {
        for sql in [&emit, &emit_one] {
            assert_denied(
                &format!("{who}: {sql}"),
                sqlx::query(trusted(sql)).execute(pool).await,
            );
        }
    }
    let producer = rdb.producer().await;
    let mut tx = producer.begin().await.unwrap();
    sqlx::query(trusted(&emit)).execute(&mut *tx).await.unwrap();
    tx.rollback().await.unwrap();
    strangers.close().await;
    rdb.db
        .exec(&format!("DROP OWNED BY {stranger}; DROP ROLE {stranger}"))
        .await;
    rdb.finish().await;
}

/// The relay hands events to the outbox only from what a producer emitted
/// (migration 19): the hand-off that takes an event's fields is not its
/// to call, and the one that takes emitted content refuses a content whose
/// tag is not the schema key's.
#[tokio::test]
async fn the_relay_cannot_write_an_events_content() {
    let rdb = RoleDb::new().await;
    let schema = rdb.db.schema.name().to_owned();
    let relay = rdb.relay().await;
    let fields = format!(
        "SELECT {schema}.logical_handoff('d', ARRAY[gen_random_uuid()], ARRAY['t'], ARRAY['a'], \
         ARRAY['1'], ARRAY[1], ARRAY['{{}}'::jsonb], ARRAY['{{}}'::jsonb], ARRAY[now()], \
         ARRAY[NULL::timestamptz], ARRAY[NULL::bigint], ARRAY[false], ARRAY[0::float8], \
         ARRAY[''], ARRAY[false], ARRAY[1], '{{}}'::uuid[], '{{}}'::text[])"
    );
    assert_denied(
        "relay: logical_handoff with an event's fields",
        sqlx::query(trusted(&fields)).execute(relay.pool()).await,
    );
    let content = r#"{"event_id":"01a23142-d1d0-7a07-85ba-b8914fce081b","event_type":"admin.granted","aggregate_type":"a","aggregate_id":"1","schema_version":1,"payload":{},"headers":{},"created_at_us":1796122792399425}"#;
    let forged = format!(
        "SELECT {schema}.logical_handoff_verified('d', ARRAY[$1], ARRAY[$2::bytea], ARRAY[false], \
         ARRAY[0::float8], ARRAY[''], ARRAY[false], ARRAY[1], '{{}}'::uuid[], '{{}}'::text[])"
    );
    for tag in [vec![0u8; 32], Vec::new()] {
        assert_denied(
            "relay: logical_handoff_verified with a tag that is not the key's",
            sqlx::query(trusted(&forged))
                .bind(content)
                .bind(&tag)
                .execute(relay.pool())
                .await,
        );
    }
    let events: i64 =
        sqlx::query_scalar(trusted(&rdb.db.sql("SELECT count(*) FROM {schema}.outbox")))
            .fetch_one(&rdb.db.pool)
            .await
            .unwrap();
    assert_eq!(events, 0, "nothing reached the outbox");
    // The key is the owner's alone.
    let monitor = rdb.monitor().await;
    for (who, pool) in [("relay", relay.pool()), ("monitor", monitor.pool())] {
        assert_denied(
            &format!("{who}: reading the key"),
            sqlx::query(trusted(
                &rdb.db.sql("SELECT ipad FROM {schema}.logical_key"),
            ))
            .execute(pool)
            .await,
        );
    }
    rdb.finish().await;
}

/// Logical mode's numbered emits (migration 17): the producer emits in
/// either setting (the counter row only when on) and cannot change it; the
/// relay reads it, as its start-up check for ordered routes does.
#[tokio::test]
async fn the_producer_emits_in_either_setting_and_the_relay_reads_it() {
    let r = RoleDb::new().await;
    let producer = r.producer().await;
    let relay = r.relay().await;
    let outbox = r.outbox();
    for (numbered, aggregate) in [(false, "o-off"), (true, "o-on")] {
        store(&r.db)
            .logical()
            .set_numbered_emits(numbered)
            .await
            .unwrap();
        let mut tx = producer.begin().await.unwrap();
        postbox::sqlx::emit(&outbox, &mut tx, &events(1, aggregate)[0])
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(relay.logical().numbered_emits().await.unwrap(), numbered);
        let router = Router::single(ScriptedSink::delivering()).all_ordered(Default::default());
        let config = RelayConfig {
            mode: postbox_relay::ReadMode::Logical,
            ..fast_config()
        };
        let checked = Relay::with_router(relay.clone(), router, config)
            .unwrap()
            .check_start()
            .await;
        assert_eq!(checked.is_ok(), numbered, "{checked:?}");
    }
    assert_eq!(
        r.db.count("SELECT count(*) FROM {schema}.aggregate_sequences WHERE aggregate_id = 'o-on'")
            .await,
        1
    );
    assert_eq!(
        r.db.count("SELECT count(*) FROM {schema}.aggregate_sequences")
            .await,
        1,
        "the emit that was not numbered wrote no counter"
    );
    assert_denied(
        "the producer changes the setting",
        try_exec(
            &r,
            &producer,
            "UPDATE {schema}.logical_settings SET numbered_emits = false",
        )
        .await,
    );
    assert_denied(
        "the relay changes the setting",
        sqlx::query(trusted(
            &r.db
                .sql("UPDATE {schema}.logical_settings SET numbered_emits = false"),
        ))
        .execute(relay.pool())
        .await,
    );
    producer.close().await;
    r.finish().await;
}

/// Who may execute each function of the schema, every mode's included: the
/// whole matrix (producer, relay, monitor, any login through PUBLIC) is
/// written down here, so a function added without deciding who may run it,
/// or a grant widened by accident, fails this test.
/// The consumer role reads consumer groups (receive, ack, nack) and
/// nothing else: no table of the schema, no group of its own making, no
/// event written, no other schema.
#[tokio::test]
async fn the_consumer_reads_groups_and_nothing_else() {
    let r = RoleDb::new().await;
    let owner = store(&r.db).groups();
    owner
        .create(&postbox_store::NewGroup::new("billing"))
        .await
        .unwrap();
    r.db.exec(
        "INSERT INTO {schema}.log (event_id, event_type, aggregate_type, aggregate_id, payload) \
         SELECT gen_random_uuid(), 'order.placed', 'order', 'o' || i, '{}' \
         FROM generate_series(1, 3) AS i",
    )
    .await;
    let consumer = Store::new(r.pool_as(&r.roles.consumer).await, r.db.schema.clone());
    let groups = consumer.groups();
    let got = groups
        .receive("billing", 10, Duration::from_secs(60), Duration::ZERO)
        .await
        .expect("the consumer receives");
    assert_eq!(got.len(), 3);
    assert!(groups
        .nack("billing", &got[0].receipt, Duration::ZERO, Some("later"))
        .await
        .expect("the consumer nacks"));
    let receipts: Vec<String> = got[1..].iter().map(|e| e.receipt.clone()).collect();
    assert_eq!(
        groups
            .ack("billing", &receipts)
            .await
            .expect("the consumer acks"),
        2
    );

    // Serving groups over HTTP, it finds the group a token opens, and
    // reads no token's hash; nor does the monitor.
    let (_, token) = owner
        .create_token("billing", None, "tester")
        .await
        .expect("the owner makes a token");
    assert_eq!(
        groups
            .group_of_token(&token)
            .await
            .expect("the consumer looks a token up"),
        Some("billing".to_owned())
    );
    assert!(
        groups
            .pending("billing")
            .await
            .expect("the consumer asks whether billing has events"),
        "billing holds an event nacked for now"
    );
    let monitor = r.monitor().await;
    assert_denied(
        "monitor: reading the tokens' hashes",
        sqlx::query(trusted(
            &r.db.sql("SELECT token_hash FROM {schema}.group_tokens"),
        ))
        .execute(monitor.pool())
        .await,
    );
    assert_denied(
        "consumer: making a token",
        consumer.groups().create_token("billing", None, "me").await,
    );

    let pool = consumer.pool().clone();
    for sql in [
        "SELECT * FROM {schema}.group_tokens",
        "SELECT * FROM {schema}.log",
        "SELECT * FROM {schema}.outbox",
        "SELECT * FROM {schema}.group_batches",
        "SELECT * FROM {schema}.consumer_groups",
        "UPDATE {schema}.consumer_groups SET lo = '1:1:'",
        "SELECT {schema}.create_group('mine')",
        "SELECT {schema}.drop_group('billing')",
        "SELECT {schema}.enqueue('t', 'a', '1', '{}')",
        "SELECT {schema}.log_truncate(0, false)",
        "INSERT INTO {schema}.log (event_id, event_type, aggregate_type, aggregate_id, payload) \
         VALUES (gen_random_uuid(), 't', 'a', '1', '{}')",
    ] {
        assert_denied(sql, try_exec(&r, &pool, sql).await);
    }
    // Another outbox's schema in the same database is out of reach.
    let other = TestDb::new().await;
    store(&other)
        .groups()
        .create(&postbox_store::NewGroup::new("billing"))
        .await
        .unwrap();
    assert_denied(
        "the consumer reads another schema's group",
        sqlx::query(trusted(
            &other.sql("SELECT * FROM {schema}.receive('billing', 10)"),
        ))
        .fetch_all(&pool)
        .await,
    );
    other.drop_schema().await;
    pool.close().await;
    r.finish().await;
}

#[tokio::test]
async fn every_function_states_who_may_execute_it() {
    let r = RoleDb::new().await;
    let rows: Vec<(String, bool, bool, bool, bool, bool, bool)> = sqlx::query_as(
        "SELECT p.oid::regprocedure::text,
                p.prosecdef,
                has_function_privilege($2, p.oid, 'EXECUTE'),
                has_function_privilege($3, p.oid, 'EXECUTE'),
                has_function_privilege($4, p.oid, 'EXECUTE'),
                has_function_privilege($5, p.oid, 'EXECUTE'),
                EXISTS (SELECT FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
                        WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE')
           FROM pg_proc p
          WHERE p.pronamespace = $1::regnamespace
          ORDER BY 1",
    )
    .bind(r.db.schema.name())
    .bind(&r.roles.producer)
    .bind(&r.roles.relay)
    .bind(&r.roles.monitor)
    .bind(&r.roles.consumer)
    .fetch_all(&r.db.pool)
    .await
    .unwrap();
    let prefix = format!("{}.", r.db.schema.name());
    let actual: Vec<String> = rows
        .iter()
        .map(|(f, definer, producer, relay, monitor, consumer, public)| {
            // A function that runs with its owner's rights is never for any
            // login: whoever may call it is named.
            assert!(
                !(*definer && *public),
                "{f} is SECURITY DEFINER and executable by PUBLIC"
            );
            let who: Vec<&str> = [
                (*producer, "producer"),
                (*relay, "relay"),
                (*monitor, "monitor"),
                (*consumer, "consumer"),
                (*public, "PUBLIC"),
            ]
            .iter()
            .filter(|(yes, _)| *yes)
            .map(|(_, name)| *name)
            .collect();
            let name = f.strip_prefix(&prefix).unwrap_or(f);
            let name = name.split('(').next().unwrap_or(name);
            let rights = if *definer { " (owner's rights)" } else { "" };
            format!(
                "{name}{rights}: {}",
                if who.is_empty() {
                    "owner only".to_owned()
                } else {
                    who.join(", ")
                }
            )
        })
        .collect();
    let mut actual = actual;
    actual.dedup();
    // PUBLIC may run only functions that run with the caller's own rights
    // (they reach nothing the caller could not reach anyway).
    let expected = [
        "ack (owner's rights): consumer",
        "check_payload (owner's rights): owner only",
        "create_group: owner only",
        "drop_group: owner only",
        "emit: producer",
        "emit_one (owner's rights): producer",
        "enqueue (owner's rights): producer",
        "enqueue_many (owner's rights): producer",
        "enqueue_one (owner's rights): producer",
        "glob_like: producer, relay, monitor, consumer, PUBLIC",
        "group_pending (owner's rights): consumer",
        "group_receipts: owner only",
        "group_replay_dead: owner only",
        "group_token_group (owner's rights): consumer",
        "inbox_apply: producer, relay, monitor, consumer, PUBLIC",
        "inbox_sequence: producer, relay, monitor, consumer, PUBLIC",
        "limits_payload_too_big: owner only",
        "log_floor: relay",
        "log_handoff (owner's rights): relay",
        "log_open: producer, relay, monitor, consumer, PUBLIC",
        "log_page: producer, relay, monitor, consumer, PUBLIC",
        "log_part: producer, relay, monitor, consumer, PUBLIC",
        "log_producing: producer, relay, monitor, consumer, PUBLIC",
        "log_rotate (owner's rights): relay",
        "log_segment: producer, relay, monitor, consumer, PUBLIC",
        "log_truncate (owner's rights): relay",
        "logical_drop_slot: producer, relay, monitor, consumer, PUBLIC",
        "logical_ensure_publication: producer, relay, monitor, consumer, PUBLIC",
        "logical_ensure_slot: producer, relay, monitor, consumer, PUBLIC",
        "logical_handoff (owner's rights): owner only",
        "logical_handoff_verified (owner's rights): relay",
        "logical_prefix: producer, relay, monitor, consumer, PUBLIC",
        "logical_read_failed (owner's rights): relay",
        "logical_read_now (owner's rights): relay",
        "logical_tag: owner only",
        "logical_verify (owner's rights): relay",
        "nack (owner's rights): consumer",
        "notify_relays: producer, relay, monitor, consumer, PUBLIC",
        "receive (owner's rights): consumer",
        "uuid_v7: producer, relay, monitor, consumer, PUBLIC",
    ];
    assert_eq!(
        actual,
        expected,
        "the execute matrix changed: decide who may run each function, then write it here:\n{}",
        actual.join("\n")
    );
    r.finish().await;
}

/// Under the relay role, a destination added with `start = "beginning"`
/// gets a replay job the relay makes (migration 30) and runs to its end:
/// the new destination receives the events delivered before it came.
#[tokio::test]
async fn the_relay_makes_and_runs_a_replay_job_for_a_new_destination() {
    let r = RoleDb::new().await;
    let producer = r.producer().await;
    produce(&producer, &r.outbox(), 5).await;
    let route = |to: &[&str]| RouteConfig {
        matches: vec!["*".into()],
        to: to.iter().map(|s| s.to_string()).collect(),
        ..RouteConfig::default()
    };
    let a = ScriptedSink::delivering();
    let router = Router::new(vec![Destination::new("a", a.clone())], &[route(&["a"])]).unwrap();
    drain_with(Relay::with_router(r.relay().await, router, fast_config()).unwrap()).await;

    let b = ScriptedSink::delivering();
    let router = Router::new(
        vec![
            Destination::new("a", a.clone()),
            Destination::new("b", b.clone()).with_start(Some(postbox_store::GroupStart::Beginning)),
        ],
        &[route(&["a", "b"])],
    )
    .unwrap();
    drain_with(Relay::with_router(r.relay().await, router, fast_config()).unwrap()).await;
    assert_eq!(
        b.seen.lock().unwrap().messages.len(),
        5,
        "b got the history"
    );
    assert_eq!(
        r.db.count(
            "SELECT count(*) FROM {schema}.replay_jobs \
             WHERE destination = 'b' AND created_by = 'relay' AND state = 'done' AND delivered = 5"
        )
        .await,
        1
    );
    producer.close().await;
    r.finish().await;
}

//! The least-privilege roles of `postbox migrate --create-roles`: every
//! operation the README documents for a role works under that role alone
//! (a connection that `SET ROLE`s to it), against the real database; and
//! each role is refused what is not its job.
//!
//! The roles are cluster-wide, so each test's roles are named after its own
//! schema (`<schema>_producer`, `_relay`, `_monitor`) and dropped at the end.

use crate::support::*;
use postbox::idempotency::{self, Begin, Fingerprint, IdempotencyKey, StoredResponse};
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
                    sqlx::query(&set_role).execute(conn).await?;
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
        for role in [&self.roles.producer, &self.roles.relay, &self.roles.monitor] {
            sqlx::raw_sql(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
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
    let from_sql: Uuid = sqlx::query_scalar(&r.db.sql(
        "SELECT {schema}.enqueue('order.created', 'order', 'a', '{\"n\": 1}', '{\"h\": \"v\"}')",
    ))
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
    let sequences: Vec<(Uuid, i64)> = sqlx::query_as(&r.db.sql(
        "SELECT event_id, sequence FROM {schema}.outbox WHERE aggregate_id = 'a' ORDER BY sequence",
    ))
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
        sqlx::query(&r.db.sql("SELECT payload FROM {schema}.outbox"))
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

    let statuses: Vec<(String, i64)> = sqlx::query_as(
        &r.db
            .sql("SELECT status::text, count(*) FROM {schema}.outbox GROUP BY 1 ORDER BY 1"),
    )
    .fetch_all(&r.db.pool)
    .await
    .unwrap();
    assert_eq!(
        statuses,
        [("failed".to_owned(), 2), ("sent".to_owned(), 28)]
    );
    let errors: Vec<String> = sqlx::query_scalar(
        &r.db
            .sql("SELECT last_error FROM {schema}.outbox WHERE status = 'failed' ORDER BY id"),
    )
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
            Destination {
                name: "a".into(),
                sink: a.clone(),
            },
            Destination {
                name: "b".into(),
                sink: b.clone(),
            },
        ],
        &[RouteConfig {
            matches: vec!["order.*".into()],
            to: vec!["a".into(), "b".into()],
            ordered: true,
            poison: Default::default(),
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

    // Read-only.
    assert_denied(
        "the monitor claims events",
        monitor.claim(10, Duration::from_secs(30), None).await,
    );
    assert_denied(
        "the monitor reads console password hashes",
        sqlx::query(&r.db.sql("SELECT password_hash FROM {schema}.console_users"))
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

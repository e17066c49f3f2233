//! Logical mode: events emitted into the WAL (`emit`) are read from a
//! replication slot and delivered in commit order; failures leave the stream
//! for the outbox; the slot is confirmed only past what was settled; a
//! standby takes the slot over. Each test has its own schema and its own
//! slot, dropped at the end even when the test fails (a leftover slot
//! retains WAL on the shared server).

use crate::ordering::{poisoning, OrderSink};
use crate::support::*;
use async_trait::async_trait;
use postbox::statements::trusted;
use postbox::{NewEvent, Outbox, SequenceCheck};
use postbox_relay::{
    LogicalTransport, Message, Outcome, PoisonPolicy, ReadMode, Relay, RelayConfig, Router,
    RunMode, Sink, SinkError,
};
use postbox_store::{Action, Selection};
use postbox_testkit::{wait_for, TestDb};
use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use uuid::Uuid;

/// Run `body` with a slot name of its own; afterwards drop the slot (and
/// its publication), waiting for any reader still holding it to go.
async fn with_slot<F, Fut>(db: TestDb, body: F)
where
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let _shared = BIG.read().await;
    with_slot_alone(db, body).await
}

/// Every slot decodes all of the database's WAL, and a read re-decodes
/// from the slot's restart position: the 100,000-event transaction runs
/// alone so that the other tests' slots do not each decode it many times.
static BIG: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

async fn with_slot_alone<F, Fut>(db: TestDb, body: F)
where
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let slot = postbox_testkit::unique("pbx_t_");
    let outcome = tokio::spawn(body(slot.clone())).await;
    let drop = db.sql("SELECT {schema}.logical_drop_slot($1)");
    let mut dropped = false;
    for _ in 0..100 {
        if sqlx::query(trusted(&drop))
            .bind(&slot)
            .execute(&db.pool)
            .await
            .is_ok()
        {
            dropped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(dropped, "replication slot {slot} could not be dropped");
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
    db.drop_schema().await;
}

fn config(slot: &str) -> RelayConfig {
    RelayConfig {
        mode: ReadMode::Logical,
        batch_size: 50,
        logical_slot: Some(slot.to_owned()),
        logical_poll_interval: Duration::from_millis(10),
        ..fast_config()
    }
}

fn event(i: usize, event_type: &str) -> NewEvent {
    NewEvent::new(
        event_type,
        "order",
        format!("a{}", i % 5),
        &serde_json::json!({"i": i}),
    )
    .unwrap()
}

/// Emit `n` events, each in its own transaction.
async fn emit(
    pool: &sqlx::PgPool,
    schema: &postbox::Schema,
    n: usize,
    event_type: &str,
) -> Vec<Uuid> {
    let outbox = Outbox::new(schema.clone());
    let mut ids = Vec::new();
    for i in 0..n {
        let mut tx = pool.begin().await.unwrap();
        ids.push(
            postbox::sqlx::emit(&outbox, &mut tx, &event(i, event_type))
                .await
                .unwrap(),
        );
        tx.commit().await.unwrap();
    }
    ids
}

/// A relay running forever until `stop`, aborted when dropped.
fn spawn_relay(
    pool: &sqlx::PgPool,
    schema: &postbox::Schema,
    sink: Arc<dyn Sink>,
    config: RelayConfig,
    stop: CancellationToken,
) -> AbortOnDropHandle<postbox_relay::StatsSnapshot> {
    spawn_routed(pool, schema, Router::single(sink), config, stop)
}

fn spawn_routed(
    pool: &sqlx::PgPool,
    schema: &postbox::Schema,
    router: Router,
    config: RelayConfig,
    stop: CancellationToken,
) -> AbortOnDropHandle<postbox_relay::StatsSnapshot> {
    let relay = Relay::with_router(
        postbox_relay::Store::new(pool.clone(), schema.clone()),
        router,
        config,
    )
    .unwrap();
    AbortOnDropHandle::new(tokio::spawn(async move {
        relay.run(RunMode::Forever, stop).await
    }))
}

/// Start a relay and wait until it has created (and reads) the slot, so
/// that what is emitted next is in it.
async fn started(
    db_pool: &sqlx::PgPool,
    schema: &postbox::Schema,
    slot: &str,
    sink: Arc<dyn Sink>,
    stop: CancellationToken,
) -> AbortOnDropHandle<postbox_relay::StatsSnapshot> {
    started_routed(
        db_pool,
        schema,
        slot,
        Router::single(sink),
        config(slot),
        stop,
    )
    .await
}

async fn started_routed(
    db_pool: &sqlx::PgPool,
    schema: &postbox::Schema,
    slot: &str,
    router: Router,
    config: RelayConfig,
    stop: CancellationToken,
) -> AbortOnDropHandle<postbox_relay::StatsSnapshot> {
    let relay = spawn_routed(db_pool, schema, router, config, stop);
    wait_for_slot(db_pool, slot, true).await;
    relay
}

async fn wait_for_slot(pool: &sqlx::PgPool, slot: &str, held: bool) {
    let store_slot = slot.to_owned();
    wait_for("the slot to exist and be held", Duration::from_secs(60), || {
        let (pool, slot) = (pool.clone(), store_slot.clone());
        async move {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_replication_slots s WHERE slot_name = $1 \
                 AND confirmed_flush_lsn IS NOT NULL AND \
                 EXISTS (SELECT FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted \
                         AND l.objid = (hashtextextended('postbox.logical.' || $1, 0) & 4294967295)::oid)",
            )
            .bind(&slot)
            .fetch_one(&pool)
            .await
            .unwrap();
            (n == 1) == held
        }
    })
    .await;
}

#[tokio::test]
async fn emitted_events_are_delivered_in_commit_order_and_rolled_back_ones_never() {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, |slot| async move {
        let sink = ScriptedSink::delivering();
        let stop = CancellationToken::new();
        let relay = started(&pool, &schema, &slot, sink.clone(), stop.clone()).await;
        let outbox = Outbox::new(schema.clone());
        // Emitted first, committed last.
        let mut early = pool.begin().await.unwrap();
        let late_commit = postbox::sqlx::emit(&outbox, &mut early, &event(0, "order.created"))
            .await
            .unwrap();
        let mut tx = pool.begin().await.unwrap();
        let first_commit = postbox::sqlx::emit(&outbox, &mut tx, &event(1, "order.created"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let mut rolled = pool.begin().await.unwrap();
        postbox::sqlx::emit(&outbox, &mut rolled, &event(2, "order.created"))
            .await
            .unwrap();
        rolled.rollback().await.unwrap();
        early.commit().await.unwrap();
        let rest = emit(&pool, &schema, 120, "order.created").await;
        let mut expected = vec![first_commit, late_commit];
        expected.extend(rest);
        let n = expected.len();
        wait_for("every committed event", Duration::from_secs(60), || {
            let sink = sink.clone();
            async move { sink.count() >= n }
        })
        .await;
        stop.cancel();
        let stats = relay.await.unwrap();
        assert_eq!(
            sink.ids(),
            expected,
            "commit order, each once, no rolled-back event"
        );
        assert_eq!(stats.delivered, n as u64);
        let first = sink.seen.lock().unwrap().messages[0].clone();
        assert_eq!(first.sequence, None, "emits are not numbered by default");
        assert_eq!(first.payload.get(), r#"{"i": 1}"#);
        let rows: i64 = sqlx::query_scalar(trusted(
            &schema.render("SELECT count(*) FROM {schema}.outbox"),
        ))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(rows, 0, "delivered events leave no row");
    })
    .await;
}

#[tokio::test]
async fn a_poison_event_goes_to_the_outbox_and_does_not_hold_the_slot() {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, |slot| async move {
        // Rejects poison, fails flaky once.
        let sink = ScriptedSink::new(|m, before| match m.event_type.as_str() {
            "poison" => Outcome::Reject {
                error: "cannot take it".into(),
            },
            "flaky" if before == 0 => Outcome::retry("broker hiccup"),
            _ => Outcome::Delivered,
        });
        let stop = CancellationToken::new();
        let relay = started(&pool, &schema, &slot, sink.clone(), stop.clone()).await;
        let poison = emit(&pool, &schema, 1, "poison").await;
        let flaky = emit(&pool, &schema, 1, "flaky").await;
        let fine = emit(&pool, &schema, 30, "order.created").await;
        let want: HashSet<Uuid> = fine.iter().chain(&flaky).copied().collect();
        let flaky_id = flaky[0];
        wait_for(
            "the good events and the retried one",
            Duration::from_secs(60),
            || {
                let (sink, want) = (sink.clone(), want.clone());
                async move {
                    let got: HashSet<Uuid> = sink.ids().into_iter().collect();
                    want.is_subset(&got)
                        && sink.ids().iter().filter(|&&i| i == flaky_id).count() == 2
                }
            },
        )
        .await;
        // The sink took the retried event before the outbox row is marked
        // sent: wait for the acknowledgement too.
        let rows = || async {
            sqlx::query_as::<_, (Uuid, String)>(trusted(
                &schema.render("SELECT event_id, status::text FROM {schema}.outbox ORDER BY id"),
            ))
            .fetch_all(&pool)
            .await
            .unwrap()
        };
        let want_rows = vec![
            (poison[0], "failed".to_owned()),
            (flaky[0], "sent".to_owned()),
        ];
        wait_for(
            "the retried event acknowledged",
            Duration::from_secs(30),
            || async {
                rows()
                    .await
                    .iter()
                    .all(|(_, s)| s != "processing" && s != "pending")
            },
        )
        .await;
        assert_eq!(
            rows().await,
            want_rows,
            "a row only for failures: the dead letter and the retried event"
        );
        // The slot was confirmed past the poison event.
        let lag: f64 = sqlx::query_scalar(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::float8 \
             FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(&slot)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert!(
            lag < 16.0 * 1024.0 * 1024.0,
            "confirmed near the WAL's end: {lag}"
        );
        stop.cancel();
        relay.await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn a_relay_killed_before_confirming_redelivers_only_what_was_unconfirmed() {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, |slot| async move {
        let first = ScriptedSink::delivering();
        let stop = CancellationToken::new();
        let relay = started(&pool, &schema, &slot, first.clone(), stop.clone()).await;
        let confirmed = emit(&pool, &schema, 40, "order.created").await;
        wait_for("the first events", Duration::from_secs(60), || {
            let first = first.clone();
            async move { first.count() == 40 }
        })
        .await;
        // Let it confirm them (the round after publishing), then take the
        // sink hostage and kill the relay mid-publish.
        stop.cancel();
        relay.await.unwrap();
        let gate = Arc::new(Notify::new());
        let held = ScriptedSink::held(gate.clone());
        let relay = started(
            &pool,
            &schema,
            &slot,
            held.clone(),
            CancellationToken::new(),
        )
        .await;
        let unconfirmed = emit(&pool, &schema, 10, "order.created").await;
        held.entered.notified().await;
        drop(relay); // killed while publishing: nothing confirmed
        wait_for_slot(&pool, &slot, false).await;

        let again = ScriptedSink::delivering();
        let stop = CancellationToken::new();
        let relay = started(&pool, &schema, &slot, again.clone(), stop.clone()).await;
        wait_for(
            "the unconfirmed events again",
            Duration::from_secs(60),
            || {
                let again = again.clone();
                async move { again.count() >= 10 }
            },
        )
        .await;
        stop.cancel();
        relay.await.unwrap();
        assert_eq!(
            again.ids(),
            unconfirmed,
            "exactly the unconfirmed events, in order"
        );
        assert!(confirmed.iter().all(|id| !again.ids().contains(id)));
    })
    .await;
}

#[tokio::test]
async fn a_standby_takes_the_slot_over_when_the_reader_dies() {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, |slot| async move {
        let a = ScriptedSink::delivering();
        let b = ScriptedSink::delivering();
        let relay_a = started(&pool, &schema, &slot, a.clone(), CancellationToken::new()).await;
        let stop_b = CancellationToken::new();
        let relay_b = spawn_relay(&pool, &schema, b.clone(), config(&slot), stop_b.clone());
        let before = emit(&pool, &schema, 20, "order.created").await;
        wait_for("the reader's deliveries", Duration::from_secs(60), || {
            let a = a.clone();
            async move { a.count() >= 20 }
        })
        .await;
        assert_eq!(b.count(), 0, "the standby reads nothing");
        drop(relay_a); // the reader dies
        let after = emit(&pool, &schema, 20, "order.created").await;
        let took_over = std::time::Instant::now();
        // (What A delivered in its last 100 ms may come again: its
        // confirmation had not reached the server when it died.)
        let want: HashSet<Uuid> = after.iter().copied().collect();
        wait_for("the standby's deliveries", Duration::from_secs(30), || {
            let (b, want) = (b.clone(), want.clone());
            async move { want.is_subset(&b.ids().into_iter().collect()) }
        })
        .await;
        assert!(
            took_over.elapsed() < Duration::from_secs(10),
            "taken over within a bounded time"
        );
        stop_b.cancel();
        relay_b.await.unwrap();
        let got_b: HashSet<Uuid> = b.ids().into_iter().collect();
        assert!(after.iter().all(|id| got_b.contains(id)));
        // Whatever A delivered and confirmed is not delivered again.
        let got_a: HashSet<Uuid> = a.ids().into_iter().collect();
        assert!(before.iter().all(|id| got_a.contains(id)));
    })
    .await;
}

/// Counts deliveries (a 100,000-event transaction is too many to keep).
#[derive(Default)]
struct Counting {
    delivered: AtomicUsize,
    distinct: Mutex<HashSet<Uuid>>,
    largest_batch: AtomicUsize,
}

#[async_trait]
impl Sink for Counting {
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        self.delivered.fetch_add(batch.len(), Ordering::Relaxed);
        self.largest_batch.fetch_max(batch.len(), Ordering::Relaxed);
        let mut d = self.distinct.lock().unwrap();
        d.extend(batch.iter().map(|m| m.event_id));
        vec![Outcome::Delivered; batch.len()]
    }
    async fn check(&self) -> Result<(), SinkError> {
        Ok(())
    }
    fn describe(&self) -> String {
        "counting test sink".into()
    }
}

#[tokio::test]
async fn a_transaction_of_100000_events_passes_through_in_batches() {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    let _alone = BIG.write().await;
    with_slot_alone(db, |slot| async move {
        let sink = Arc::new(Counting::default());
        let stop = CancellationToken::new();
        let relay = started(&pool, &schema, &slot, sink.clone(), stop.clone()).await;
        sqlx::query(trusted(&schema.render(
            "SELECT {schema}.emit_one({schema}.uuid_v7(), 'bulk.loaded', 'bulk', (i % 97)::text, 1, \
             jsonb_build_object('i', i), '{}') FROM generate_series(1, 100000) AS i",
        )))
        .execute(&pool)
        .await
        .unwrap();
        wait_for("all 100,000 events", Duration::from_secs(300), || {
            let sink = sink.clone();
            async move { sink.delivered.load(Ordering::Relaxed) >= 100_000 }
        })
        .await;
        stop.cancel();
        let stats = relay.await.unwrap();
        assert_eq!(stats.delivered, 100_000);
        assert_eq!(sink.distinct.lock().unwrap().len(), 100_000);
        assert!(sink.largest_batch.load(Ordering::Relaxed) <= 1000);
    })
    .await;
}

#[tokio::test]
async fn a_scheduled_emit_waits_for_its_time_and_the_slot_does_not() {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, |slot| async move {
        let times: Arc<Mutex<std::collections::HashMap<Uuid, chrono::DateTime<chrono::Utc>>>> =
            Arc::default();
        let noted = times.clone();
        let sink = ScriptedSink::new(move |m, _| {
            noted
                .lock()
                .unwrap()
                .entry(m.event_id)
                .or_insert_with(chrono::Utc::now);
            Outcome::Delivered
        });
        let stop = CancellationToken::new();
        let relay = started(&pool, &schema, &slot, sink.clone(), stop.clone()).await;
        let outbox = Outbox::new(schema.clone());
        // One scheduled from Rust, one from SQL by name, then a plain one.
        let mut tx = pool.begin().await.unwrap();
        let rust = postbox::sqlx::emit(
            &outbox,
            &mut tx,
            &event(0, "order.created")
                .deliver_after(Duration::from_secs(2))
                .unwrap(),
        )
        .await
        .unwrap();
        let sql: Uuid = sqlx::query_scalar(trusted(&schema.render(
            "SELECT {schema}.emit('order.created', 'order', 'a1', '{}', \
             deliver_at => now() + interval '2 seconds')",
        )))
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
        let plain = emit(&pool, &schema, 1, "order.created").await[0];
        let seen = |id: Uuid| times.lock().unwrap().get(&id).copied();
        wait_for("all three delivered", Duration::from_secs(60), || async {
            [rust, sql, plain].iter().all(|&id| seen(id).is_some())
        })
        .await;
        stop.cancel();
        relay.await.unwrap();
        assert_eq!(sink.count(), 3, "each once");
        for id in [rust, sql] {
            // Handed to the outbox untried, kept there until its time.
            let (status, attempts, error, due): (
                String,
                i32,
                Option<String>,
                chrono::DateTime<chrono::Utc>,
            ) = sqlx::query_as(trusted(&schema.render(
                "SELECT status::text, attempts, last_error, deliver_at \
                     FROM {schema}.outbox WHERE event_id = $1",
            )))
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
            assert_eq!((status.as_str(), attempts, error), ("sent", 1, None));
            let at = seen(id).unwrap();
            assert!(at >= due, "delivered at {at}, due at {due}");
            // Emitted after both and delivered before either was due: the
            // slot moved on past them.
            let plain_at = seen(plain).unwrap();
            assert!(plain_at < due, "the slot waited: {plain_at} vs {due}");
        }
        let refused = sqlx::query(trusted(
            &schema.render("SELECT {schema}.emit('t', 'a', '1', '{}', deliver_at => 'infinity')"),
        ))
        .execute(&pool)
        .await
        .unwrap_err();
        assert_eq!(
            refused
                .as_database_error()
                .and_then(|e| e.code())
                .as_deref(),
            Some("22023")
        );
    })
    .await;
}

/// The WAL's position now.
async fn wal_now(pool: &sqlx::PgPool) -> String {
    sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Emit `n` events (each in its own transaction), then wait until `sink`
/// has seen `n` more deliveries and the slot is confirmed past their
/// commits; their ids.
async fn emit_delivered_and_confirmed(
    pool: &sqlx::PgPool,
    schema: &postbox::Schema,
    slot: &str,
    sink: &ScriptedSink,
    n: usize,
) -> Vec<Uuid> {
    let before = sink.count();
    let ids = emit(pool, schema, n, "order.created").await;
    let after = wal_now(pool).await;
    wait_for("the events delivered", Duration::from_secs(60), || async {
        sink.count() >= before + n
    })
    .await;
    wait_for(
        "the slot confirmed past their commits",
        Duration::from_secs(30),
        || confirmed_past(pool, slot, &after),
    )
    .await;
    ids
}

/// The slot's confirmed position is at least the WAL position `lsn`.
async fn confirmed_past(pool: &sqlx::PgPool, slot: &str, lsn: &str) -> bool {
    sqlx::query_scalar(
        "SELECT confirmed_flush_lsn >= $2::text::pg_lsn FROM pg_replication_slots \
         WHERE slot_name = $1",
    )
    .bind(slot)
    .bind(lsn)
    .fetch_optional(pool)
    .await
    .unwrap()
    .unwrap_or(false)
}

#[tokio::test]
async fn an_event_committed_while_the_reader_idles_is_pushed_to_it_and_confirmed() {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, |slot| async move {
        let sink = ScriptedSink::delivering();
        let stop = CancellationToken::new();
        let relay = started(&pool, &schema, &slot, sink.clone(), stop.clone()).await;
        // The slot is held by a walsender streaming to the relay (not read
        // by peeks that come and go): the reader idles on the stream.
        let walsender = || {
            let (pool, slot) = (pool.clone(), slot.clone());
            async move {
                sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM pg_replication_slots s \
                     JOIN pg_stat_replication r ON r.pid = s.active_pid \
                     WHERE s.slot_name = $1 AND s.active AND r.state = 'streaming'",
                )
                .bind(&slot)
                .fetch_one(&pool)
                .await
                .unwrap()
                    == 1
            }
        };
        wait_for(
            "a walsender streaming the slot",
            Duration::from_secs(30),
            walsender,
        )
        .await;
        let ids = emit_delivered_and_confirmed(&pool, &schema, &slot, &sink, 1).await;
        assert_eq!(sink.ids(), ids);
        // Still the same stream: nothing reconnected to read it.
        assert!(walsender().await, "the stream stays open");
        stop.cancel();
        let stats = relay.await.unwrap();
        assert_eq!(stats.delivered, 1);
    })
    .await;
}

#[tokio::test]
async fn the_sql_transport_still_reads_and_confirms_the_slot() {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, |slot| async move {
        let sink = ScriptedSink::delivering();
        let stop = CancellationToken::new();
        let sql = RelayConfig {
            logical_transport: postbox_relay::LogicalTransport::Sql,
            ..config(&slot)
        };
        let relay = spawn_relay(&pool, &schema, sink.clone(), sql, stop.clone());
        wait_for_slot(&pool, &slot, true).await;
        let ids = emit_delivered_and_confirmed(&pool, &schema, &slot, &sink, 60).await;
        stop.cancel();
        relay.await.unwrap();
        assert_eq!(sink.ids(), ids, "commit order, each once");
    })
    .await;
}

#[tokio::test]
async fn draining_stops_once_it_has_read_what_was_committed_before_it_started() {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, |slot| async move {
        // A first relay creates the slot; then events wait in it.
        let stop = CancellationToken::new();
        let first = started(
            &pool,
            &schema,
            &slot,
            ScriptedSink::delivering(),
            stop.clone(),
        )
        .await;
        stop.cancel();
        first.await.unwrap();
        let ids = emit(&pool, &schema, 30, "order.created").await;
        let after = wal_now(&pool).await;
        let sink = ScriptedSink::delivering();
        let relay = Relay::new(
            postbox_relay::Store::new(pool.clone(), schema.clone()),
            sink.clone(),
            config(&slot),
        )
        .unwrap();
        let stats = tokio::time::timeout(
            Duration::from_secs(60),
            relay.run(RunMode::Drain, CancellationToken::new()),
        )
        .await
        .expect("the drain ends by itself");
        assert_eq!(stats.delivered, 30);
        assert_eq!(sink.ids(), ids);
        assert!(
            confirmed_past(&pool, &slot, &after).await,
            "the drain confirmed what it delivered"
        );
    })
    .await;
}

// Ordered routes in logical mode: emitted events carry their aggregate's
// sequence once emits are numbered (migrations 16 and 17); an aggregate's events the destination has not
// taken wait in the outbox, where the ordered claim delivers them, and its
// later events join them there.

/// `per` events for each of `aggregates` aggregates (`acc-0`, `acc-1`, …),
/// emitted in `per` transactions of one event per aggregate.
async fn emit_aggregates(
    pool: &sqlx::PgPool,
    schema: &postbox::Schema,
    aggregates: usize,
    per: usize,
) {
    let outbox = Outbox::new(schema.clone());
    for n in 0..per {
        let mut tx = pool.begin().await.unwrap();
        for a in 0..aggregates {
            let event = NewEvent::new(
                "account.changed",
                "account",
                format!("acc-{a}"),
                &serde_json::json!({ "n": n }),
            )
            .unwrap();
            postbox::sqlx::emit(&outbox, &mut tx, &event).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
}

fn ordered(sink: Arc<OrderSink>, poison: PoisonPolicy) -> Router {
    Router::single(sink).all_ordered(poison)
}

/// `postbox migrate --emit-sequence on`: ordered routes in logical mode
/// need it.
async fn number_emits(pool: &sqlx::PgPool, schema: &postbox::Schema) {
    postbox_relay::Store::new(pool.clone(), schema.clone())
        .logical()
        .set_numbered_emits(true)
        .await
        .unwrap();
}

#[tokio::test]
async fn ordered_routes_refuse_to_read_until_emits_are_numbered() {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, |slot| async move {
        let store = postbox_relay::Store::new(pool.clone(), schema.clone());
        assert!(
            !store.logical().numbered_emits().await.unwrap(),
            "off by default"
        );
        let sink = OrderSink::new(|_| Outcome::Delivered);
        let relay =
            |router: Router| Relay::with_router(store.clone(), router, config(&slot)).unwrap();
        let refused = relay(ordered(sink.clone(), PoisonPolicy::Block))
            .check_start()
            .await
            .unwrap_err();
        assert!(
            matches!(refused, postbox_relay::StartError::UnnumberedEmits { .. }),
            "{refused:?}"
        );
        let said = refused.to_string();
        assert!(
            said.contains("ordered routes in logical mode need numbered emits")
                && said.contains("postbox migrate --emit-sequence on"),
            "{said}"
        );
        // Unordered routes need no number.
        relay(Router::single(sink.clone()))
            .check_start()
            .await
            .unwrap();
        // A relay run anyway does not open the slot while emits are not
        // numbered, and reads once they are.
        let stop = CancellationToken::new();
        let running = spawn_routed(
            &pool,
            &schema,
            ordered(sink.clone(), PoisonPolicy::Block),
            config(&slot),
            stop.clone(),
        );
        let slots = || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
            )
            .bind(&slot)
            .fetch_one(&pool)
            .await
            .unwrap()
        };
        assert_eq!(slots().await, 0);
        number_emits(&pool, &schema).await;
        relay(ordered(sink.clone(), PoisonPolicy::Block))
            .check_start()
            .await
            .unwrap();
        wait_for_slot(&pool, &slot, true).await;
        emit_aggregates(&pool, &schema, 2, 3).await;
        wait_for("numbered deliveries", Duration::from_secs(60), || async {
            (0..2).all(|a| sink.delivered(&format!("acc-{a}")) == vec![1, 2, 3])
        })
        .await;
        stop.cancel();
        running.await.unwrap();
    })
    .await;
}

async fn count(pool: &sqlx::PgPool, schema: &postbox::Schema, sql: &str) -> i64 {
    sqlx::query_scalar(trusted(&schema.render(sql)))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Every aggregate's deliveries never run ahead: each is the next sequence
/// or one delivered before (a redelivery), as the consumer's sequence check
/// sees it; and all of `1..=per` arrived.
fn assert_in_sequence(sink: &OrderSink, aggregates: usize, per: i64) {
    for a in 0..aggregates {
        let key = format!("acc-{a}");
        let delivered = sink.delivered(&key);
        let mut last = 0;
        for &s in &delivered {
            assert!(s <= last + 1, "{key} got {s} after {last}: {delivered:?}");
            last = last.max(s);
        }
        assert_eq!(last, per, "{key}: {delivered:?}");
    }
}

#[tokio::test]
async fn ordered_a_retry_holds_back_only_its_own_aggregate_then_it_flows_from_the_slot_again() {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, |slot| async move {
        // acc-3's first event keeps failing until the test lets it through.
        let open = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let o = open.clone();
        let sink = OrderSink::new(move |m| {
            if m.aggregate_id == "acc-3" && !o.load(Ordering::SeqCst) {
                Outcome::retry("not yet")
            } else {
                Outcome::Delivered
            }
        });
        let config = RelayConfig {
            max_attempts: 1000,
            ..config(&slot)
        };
        let stop = CancellationToken::new();
        number_emits(&pool, &schema).await;
        let router = ordered(sink.clone(), PoisonPolicy::Block);
        let relay = started_routed(&pool, &schema, &slot, router, config, stop.clone()).await;
        emit_aggregates(&pool, &schema, 10, 3).await;
        wait_for(
            "every other aggregate delivered",
            Duration::from_secs(60),
            || async {
                (0..10)
                    .filter(|&a| a != 3)
                    .all(|a| sink.delivered(&format!("acc-{a}")) == vec![1, 2, 3])
            },
        )
        .await;
        // Its later events wait behind it in the outbox, untried.
        wait_for(
            "acc-3 held in the outbox",
            Duration::from_secs(60),
            || async {
                count(
                    &pool,
                    &schema,
                    "SELECT count(*) FROM {schema}.outbox WHERE aggregate_id = 'acc-3'",
                )
                .await
                    == 3
            },
        )
        .await;
        assert!(sink.delivered("acc-3").is_empty());
        {
            let j = sink.journal.lock().unwrap();
            assert!(
                j.attempted["acc-3"].iter().all(|&s| s == 1),
                "only the head was tried"
            );
            assert!(j.overlaps.is_empty(), "overlaps: {:?}", j.overlaps);
        }
        assert_eq!(
            count(
                &pool,
                &schema,
                "SELECT count(*) FROM {schema}.outbox WHERE aggregate_id <> 'acc-3'"
            )
            .await,
            0,
            "other aggregates never left the slot"
        );
        open.store(true, Ordering::SeqCst);
        wait_for(
            "acc-3 delivered in order",
            Duration::from_secs(60),
            || async { sink.delivered("acc-3") == vec![1, 2, 3] },
        )
        .await;
        wait_for(
            "acc-3's events marked sent",
            Duration::from_secs(60),
            || async {
                count(
                    &pool,
                    &schema,
                    "SELECT count(*) FROM {schema}.outbox \
                     WHERE aggregate_id = 'acc-3' AND status = 'sent'",
                )
                .await
                    == 3
            },
        )
        .await;
        // Nothing of acc-3 waits in the outbox any more: its next event
        // flows from the slot again.
        emit_aggregates(&pool, &schema, 10, 1).await;
        wait_for("acc-3's next event", Duration::from_secs(60), || async {
            sink.delivered("acc-3") == vec![1, 2, 3, 4]
        })
        .await;
        assert_eq!(
            count(
                &pool,
                &schema,
                "SELECT count(*) FROM {schema}.outbox WHERE aggregate_id = 'acc-3'"
            )
            .await,
            3,
            "delivered from the slot"
        );
        stop.cancel();
        relay.await.unwrap();
        // The consumer's sequence check applies each of acc-3's events in turn.
        let outbox = Outbox::new(schema.clone());
        for seq in sink.delivered("acc-3") {
            let mut tx = pool.begin().await.unwrap();
            let v =
                postbox::sqlx::check_sequence(&outbox, &mut tx, "ledger", "account", "acc-3", seq)
                    .await
                    .unwrap();
            tx.commit().await.unwrap();
            assert_eq!(v, SequenceCheck::Apply, "sequence {seq}");
        }
    })
    .await;
}

#[tokio::test]
async fn ordered_over_sql_a_blocking_dead_letter_holds_its_aggregate_until_discarded() {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, |slot| async move {
        let sink = poisoning("acc-7", 2);
        let config = RelayConfig {
            logical_transport: LogicalTransport::Sql,
            ..config(&slot)
        };
        let stop = CancellationToken::new();
        number_emits(&pool, &schema).await;
        let router = ordered(sink.clone(), PoisonPolicy::Block);
        let relay = started_routed(&pool, &schema, &slot, router, config, stop.clone()).await;
        emit_aggregates(&pool, &schema, 10, 5).await;
        wait_for(
            "the other aggregates, and acc-7 up to its dead letter",
            Duration::from_secs(60),
            || async {
                (0..10)
                    .filter(|&a| a != 7)
                    .all(|a| sink.delivered(&format!("acc-{a}")) == vec![1, 2, 3, 4, 5])
                    && count(
                        &pool,
                        &schema,
                        "SELECT count(*) FROM {schema}.outbox WHERE status = 'pending'",
                    )
                    .await
                        == 3
            },
        )
        .await;
        assert_eq!(
            sink.delivered("acc-7"),
            vec![1],
            "the aggregate waits behind its dead letter"
        );
        assert_eq!(
            count(
                &pool,
                &schema,
                "SELECT count(*) FROM {schema}.outbox WHERE status = 'failed'"
            )
            .await,
            1
        );
        let applied = postbox_relay::Store::new(pool.clone(), schema.clone())
            .dead_letters()
            .apply(
                &Selection::All(Default::default()),
                &Action::Discard {
                    reason: "bad data".into(),
                },
                "test",
                100,
                |_| {},
            )
            .await
            .unwrap();
        assert_eq!(applied.count, 1);
        wait_for(
            "acc-7's successors once it is discarded",
            Duration::from_secs(60),
            || async { sink.delivered("acc-7") == vec![1, 3, 4, 5] },
        )
        .await;
        stop.cancel();
        relay.await.unwrap();
        assert!(sink.journal.lock().unwrap().overlaps.is_empty());
    })
    .await;
}

#[tokio::test]
async fn ordered_skip_lets_the_aggregate_go_on_from_the_slot() {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, |slot| async move {
        let sink = poisoning("acc-2", 2);
        let stop = CancellationToken::new();
        number_emits(&pool, &schema).await;
        let router = ordered(sink.clone(), PoisonPolicy::Skip);
        let relay =
            started_routed(&pool, &schema, &slot, router, config(&slot), stop.clone()).await;
        emit_aggregates(&pool, &schema, 4, 4).await;
        wait_for("every aggregate", Duration::from_secs(60), || async {
            sink.delivered("acc-2") == vec![1, 3, 4]
                && [0, 1, 3]
                    .iter()
                    .all(|a| sink.delivered(&format!("acc-{a}")) == vec![1, 2, 3, 4])
        })
        .await;
        stop.cancel();
        relay.await.unwrap();
        assert_eq!(
            count(&pool, &schema, "SELECT count(*) FROM {schema}.outbox").await,
            1,
            "only the dead letter left the slot"
        );
    })
    .await;
}

/// Random failures, and the relay killed between two halves of the
/// stream: every aggregate's events arrive in sequence (redeliveries of
/// what was not confirmed aside) and none is left behind.
async fn order_holds_through_random_failures_and_a_restart(transport: LogicalTransport) {
    let (aggregates, per) = (30, 3);
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, move |slot| async move {
        let sink = OrderSink::new(|_| {
            if rand::random::<f64>() < 0.2 {
                Outcome::retry("random failure")
            } else {
                Outcome::Delivered
            }
        });
        let config = RelayConfig {
            logical_transport: transport,
            batch_size: 20,
            max_attempts: 100,
            backoff_base: Duration::from_millis(1),
            backoff_max: Duration::from_millis(20),
            // The killed relay's claims come back soon.
            lease: Duration::from_secs(3),
            publish_timeout: Duration::from_secs(1),
            ..config(&slot)
        };
        number_emits(&pool, &schema).await;
        let router = || ordered(sink.clone(), PoisonPolicy::Block);
        let first = started_routed(
            &pool,
            &schema,
            &slot,
            router(),
            config.clone(),
            CancellationToken::new(),
        )
        .await;
        emit_aggregates(&pool, &schema, aggregates, per).await;
        wait_for("some deliveries", Duration::from_secs(60), || async {
            sink.journal
                .lock()
                .unwrap()
                .delivered
                .values()
                .map(Vec::len)
                .sum::<usize>()
                >= aggregates
        })
        .await;
        drop(first); // killed: what it did not confirm is read again
        wait_for_slot(&pool, &slot, false).await;
        emit_aggregates(&pool, &schema, aggregates, per).await;
        let stop = CancellationToken::new();
        let second = started_routed(&pool, &schema, &slot, router(), config, stop.clone()).await;
        wait_for(
            "every event, in the outbox too",
            Duration::from_secs(120),
            || async {
                (0..aggregates).all(|a| {
                    sink.delivered(&format!("acc-{a}")).iter().max() == Some(&(2 * per as i64))
                }) && count(
                    &pool,
                    &schema,
                    "SELECT count(*) FROM {schema}.outbox WHERE status <> 'sent'",
                )
                .await
                    == 0
            },
        )
        .await;
        stop.cancel();
        second.await.unwrap();
        assert_in_sequence(&sink, aggregates, 2 * per as i64);
        let retries: usize = sink
            .journal
            .lock()
            .unwrap()
            .attempted
            .values()
            .map(Vec::len)
            .sum::<usize>()
            - aggregates * 2 * per;
        assert!(retries > 5, "the sink failed often enough ({retries})");
    })
    .await;
}

#[tokio::test]
async fn ordered_stream_order_holds_through_random_failures_and_a_restart() {
    order_holds_through_random_failures_and_a_restart(LogicalTransport::Stream).await;
}

#[tokio::test]
async fn ordered_sql_order_holds_through_random_failures_and_a_restart() {
    order_holds_through_random_failures_and_a_restart(LogicalTransport::Sql).await;
}

/// Creating a slot waits for the transactions in progress to end; the
/// creation then succeeds (PostgreSQL 15 failed it, after creating the slot,
/// when it ran inside a PL/pgSQL function).
#[tokio::test]
async fn a_slot_is_created_while_another_transaction_is_open() {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, move |slot| async move {
        let mut open = pool.begin().await.unwrap();
        let xid: String = sqlx::query_scalar("SELECT pg_current_xact_id()::text")
            .fetch_one(&mut *open)
            .await
            .unwrap();
        let logical = postbox_store::Store::new(pool.clone(), schema.clone()).logical();
        let creating = {
            let (pool, slot, logical) = (pool.clone(), slot.clone(), logical.clone());
            tokio::spawn(async move {
                let mut conn = pool.acquire().await.unwrap();
                logical.ensure_slot(&mut conn, &slot).await
            })
        };
        wait_for(
            "the creation waits for the open transaction",
            Duration::from_secs(60),
            || async {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' \
                 AND transactionid::text = $1 AND NOT granted",
                )
                .bind(&xid)
                .fetch_one(&pool)
                .await
                .unwrap();
                waiting > 0
            },
        )
        .await;
        open.commit().await.unwrap();
        let created = creating.await.unwrap();
        assert!(matches!(created, Ok(true)), "{created:?}");
        let mut conn = pool.acquire().await.unwrap();
        let again = logical.ensure_slot(&mut conn, &slot).await.unwrap();
        assert!(!again, "an existing slot is not created again");
    })
    .await;
}

/// Messages under the schema's prefix that are not events, or events no
/// producer emitted (no tag, a wrong tag), between real emits: each real event arrives once, in commit order, nothing else does,
/// the slot is confirmed past all of them (nothing stalls), and what was
/// set aside is kept for an operator.
async fn malformed_messages_are_set_aside_and_do_not_stall(transport: LogicalTransport) {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, move |slot| async move {
        let sink = ScriptedSink::delivering();
        let stop = CancellationToken::new();
        let config = RelayConfig {
            logical_transport: transport,
            ..config(&slot)
        };
        let relay = spawn_relay(&pool, &schema, sink.clone(), config, stop.clone());
        wait_for_slot(&pool, &slot, true).await;
        let prefix = format!("postbox.{}", schema.name());
        let forged = br#"{"event_id":"01a23142-d1d0-7a07-85ba-b8914fce081b","event_type":"admin.granted","aggregate_type":"a","aggregate_id":"1","schema_version":1,"payload":{},"headers":{},"created_at_us":1796122792399425,"sequence":999}"#;
        let mut badly_tagged = b"0".repeat(64);
        badly_tagged.extend_from_slice(forged);
        let garbage: [&[u8]; 7] = [
            // A well-formed event anyone could write under the prefix
            // (pg_logical_emit_message is executable by PUBLIC): no tag.
            forged,
            // …and with a tag that is not the key's.
            &badly_tagged,
            b"not json at all",
            br#"{"event_id":"zzz"}"#,
            br#"{"event_id":"01a23142-d1d0-7a07-85ba-b8914fce081b","event_type":"t","aggregate_type":"a","aggregate_id":"1","schema_version":1,"payload":{},"headers":[1,2],"created_at_us":1}"#,
            b"\xff\xfe\x00binary",
            b"",
        ];
        let mut ids = Vec::new();
        for (i, bad) in garbage.iter().enumerate() {
            ids.extend(emit(&pool, &schema, 1, "order.created").await);
            // A transaction of a real event with garbage on both sides.
            let mut tx = pool.begin().await.unwrap();
            sqlx::query("SELECT pg_logical_emit_message(true, $1, $2::bytea)")
                .bind(&prefix)
                .bind(*bad)
                .execute(&mut *tx)
                .await
                .unwrap();
            ids.push(
                postbox::sqlx::emit(&Outbox::new(schema.clone()), &mut tx, &event(i, "order.paid"))
                    .await
                    .unwrap(),
            );
            sqlx::query("SELECT pg_logical_emit_message(true, $1, $2::bytea)")
                .bind(&prefix)
                .bind(*bad)
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
        }
        let after = wal_now(&pool).await;
        wait_for("every real event delivered", Duration::from_secs(60), || async {
            sink.count() >= ids.len()
        })
        .await;
        wait_for(
            "the slot confirmed past the garbage",
            Duration::from_secs(30),
            || confirmed_past(&pool, &slot, &after),
        )
        .await;
        stop.cancel();
        relay.await.unwrap();
        assert_eq!(sink.ids(), ids, "every real event once, in commit order, nothing else");
        let kept = postbox_relay::Store::new(pool.clone(), schema.clone())
            .logical()
            .refused(100)
            .await
            .unwrap();
        // At most ten a second are kept: some, never more than were refused.
        assert!(!kept.is_empty() && kept.len() <= 2 * garbage.len(), "{kept:?}");
        assert!(
            kept.iter().all(|r| r.reason.starts_with("not an event")
                || r.reason.starts_with("it carries no tag")
                || r.reason.starts_with("its tag does not match")),
            "{kept:?}"
        );
    })
    .await;
}

/// The stream reader reads on while a batch publishes: a transaction far
/// larger than a batch, with messages that are not events among its events,
/// is delivered whole, once, in order, and every one of those messages is
/// set aside — also the ones read while a batch was in flight.
#[tokio::test]
async fn messages_read_while_a_batch_publishes_are_delivered_or_set_aside() {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, move |slot| async move {
        let sink = ScriptedSink::delivering();
        let stop = CancellationToken::new();
        let relay = spawn_relay(&pool, &schema, sink.clone(), config(&slot), stop.clone());
        wait_for_slot(&pool, &slot, true).await;
        let prefix = format!("postbox.{}", schema.name());
        let outbox = Outbox::new(schema.clone());
        let mut tx = pool.begin().await.unwrap();
        let mut ids = Vec::new();
        for i in 0..300 {
            if i % 50 == 17 {
                sqlx::query("SELECT pg_logical_emit_message(true, $1, $2::bytea)")
                    .bind(&prefix)
                    .bind(format!("not an event {i}").as_bytes())
                    .execute(&mut *tx)
                    .await
                    .unwrap();
            }
            ids.push(
                postbox::sqlx::emit(&outbox, &mut tx, &event(i, "order.created"))
                    .await
                    .unwrap(),
            );
        }
        tx.commit().await.unwrap();
        let after = wal_now(&pool).await;
        wait_for("every event delivered", Duration::from_secs(60), || async {
            sink.count() >= ids.len()
        })
        .await;
        wait_for(
            "the slot confirmed past the transaction",
            Duration::from_secs(30),
            || confirmed_past(&pool, &slot, &after),
        )
        .await;
        stop.cancel();
        relay.await.unwrap();
        assert_eq!(sink.ids(), ids, "every event once, in order");
        let kept = postbox_relay::Store::new(pool.clone(), schema.clone())
            .logical()
            .refused(100)
            .await
            .unwrap();
        assert_eq!(
            kept.len(),
            6,
            "every message that is not an event set aside: {kept:?}"
        );
    })
    .await;
}

#[tokio::test]
async fn malformed_messages_are_set_aside_on_the_stream() {
    malformed_messages_are_set_aside_and_do_not_stall(LogicalTransport::Stream).await;
}

#[tokio::test]
async fn malformed_messages_are_set_aside_over_sql() {
    malformed_messages_are_set_aside_and_do_not_stall(LogicalTransport::Sql).await;
}

/// A slot whose publication did not exist when a change it still has to
/// decode was written fails at that change on every read (pgoutput looks
/// the publication up as of each change). The relay reads it once, then says
/// what to do and backs off, and the failures the schema notes add up;
/// before, every new session read and delivered the same events again at
/// once and wiped the failures noted, forever.
async fn a_slot_missing_its_publication_is_read_once_not_in_a_loop(transport: LogicalTransport) {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, move |slot| async move {
        // The slot made by hand, without the publication the relay makes
        // first; then events, then a table change.
        sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
            .bind(&slot)
            .execute(&pool)
            .await
            .unwrap();
        let ids = emit(&pool, &schema, 5, "order.created").await;
        let table = format!("\"{}\".no_publication", schema.name());
        for statement in [
            format!("CREATE TABLE {table} (x int)"),
            format!("INSERT INTO {table} VALUES (1)"),
        ] {
            sqlx::query(trusted(&statement))
                .execute(&pool)
                .await
                .unwrap();
        }
        let sink = ScriptedSink::delivering();
        let stop = CancellationToken::new();
        let config = RelayConfig {
            logical_transport: transport,
            ..config(&slot)
        };
        let relay = spawn_relay(&pool, &schema, sink.clone(), config, stop.clone());
        let logical = postbox_relay::Store::new(pool.clone(), schema.clone()).logical();
        wait_for(
            "four failed reads in a row noted, saying what to do",
            Duration::from_secs(60),
            || async {
                let status = logical.status(Some(&slot)).await.unwrap();
                status.first().is_some_and(|s| {
                    s.reader_failures >= 4
                        && s.reader_error
                            .as_deref()
                            .is_some_and(|e| e.contains(&format!("postbox slot drop {slot}")))
                })
            },
        )
        .await;
        stop.cancel();
        relay.await.unwrap();
        let delivered = sink.ids();
        assert!(
            delivered.len() <= ids.len() && delivered.iter().all(|id| ids.contains(id)),
            "each event read once at most: {} deliveries of {} events",
            delivered.len(),
            ids.len()
        );
    })
    .await;
}

#[tokio::test]
async fn a_slot_missing_its_publication_is_read_once_on_the_stream() {
    a_slot_missing_its_publication_is_read_once_not_in_a_loop(LogicalTransport::Stream).await;
}

#[tokio::test]
async fn a_slot_missing_its_publication_is_read_once_over_sql() {
    a_slot_missing_its_publication_is_read_once_not_in_a_loop(LogicalTransport::Sql).await;
}

/// After a server crash, PostgreSQL 15 can bring a slot back at a position
/// older than the one its reader confirmed (it saves a logical slot's
/// confirmed position only now and then), and the stream would start over
/// from there, delivering again everything since. The reader notes where it
/// confirmed the slot with its read notes, and a session that finds the
/// slot behind its note moves it up first. Here the slot stands before 5
/// events a note says were delivered (as after such a crash): only the 3
/// after the note are delivered, and the reader notes its new position. A
/// note written on another server (`foreign`: its system identifier is not
/// this server's, as in a schema restored from elsewhere) is not followed:
/// all 8 are delivered.
async fn slot_behind_a_note(transport: LogicalTransport, foreign: bool) {
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, move |slot| async move {
        // The publication, then the slot, as the relay makes them (the
        // slot by a statement of its own: see `create_slot`).
        let quoted = format!("\"{}\"", schema.name());
        for statement in [
            format!("SELECT {quoted}.logical_ensure_publication($1)"),
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')".to_owned(),
        ] {
            sqlx::query(trusted(&statement))
                .bind(&slot)
                .execute(&pool)
                .await
                .unwrap();
        }
        let delivered_before = emit(&pool, &schema, 5, "order.created").await;
        let noted = wal_now(&pool).await;
        sqlx::query(trusted(&format!(
            "SELECT {quoted}.logical_read_now($1, $2::text::pg_lsn)"
        )))
        .bind(&slot)
        .bind(&noted)
        .execute(&pool)
        .await
        .unwrap();
        if foreign {
            sqlx::query(trusted(&format!(
                "UPDATE {quoted}.logical_readers SET confirmed_on = confirmed_on # 1"
            )))
            .execute(&pool)
            .await
            .unwrap();
        }
        let after = emit(&pool, &schema, 3, "order.created").await;
        let expected = if foreign {
            [delivered_before.clone(), after.clone()].concat()
        } else {
            after.clone()
        };
        let end = wal_now(&pool).await;
        // Every view says how much of the slot's lag was delivered already
        // (the console and `slot status` render these fields).
        let logical = postbox_relay::Store::new(pool.clone(), schema.clone()).logical();
        let status = logical.status(Some(&slot)).await.unwrap().remove(0);
        assert_eq!(
            status.noted_lsn.is_some(),
            !foreign,
            "a note from this server only: {status:?}"
        );
        assert_eq!(
            status.behind_note().is_some(),
            !foreign,
            "the slot behind its reader's note: {status:?}"
        );
        if !foreign {
            assert_eq!(status.noted_lsn.as_deref(), Some(noted.as_str()));
            let behind: f64 = sqlx::query_scalar(
                "SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn)::float8",
            )
            .bind(&noted)
            .bind(status.confirmed_lsn.as_deref().unwrap())
            .fetch_one(&pool)
            .await
            .unwrap();
            assert_eq!(status.behind_note_bytes, Some(behind), "{status:?}");
            assert!(
                status.summary().contains("delivered already"),
                "{}",
                status.summary()
            );
        }

        let sink = ScriptedSink::delivering();
        let stop = CancellationToken::new();
        let config = RelayConfig {
            logical_transport: transport,
            ..config(&slot)
        };
        let relay = spawn_relay(&pool, &schema, sink.clone(), config, stop.clone());
        wait_for("the events expected", Duration::from_secs(60), || {
            let (sink, n) = (sink.clone(), expected.len());
            async move { sink.count() >= n }
        })
        .await;
        let note = format!(
            "SELECT coalesce(confirmed_lsn >= $2::text::pg_lsn, false) \
             FROM {quoted}.logical_readers WHERE slot_name = $1"
        );
        wait_for(
            "the reader to note its position past them",
            Duration::from_secs(30),
            || async {
                sqlx::query_scalar::<_, bool>(trusted(&note))
                    .bind(&slot)
                    .bind(&end)
                    .fetch_optional(&pool)
                    .await
                    .unwrap()
                    .unwrap_or(false)
            },
        )
        .await;
        stop.cancel();
        relay.await.unwrap();
        let delivered = sink.ids();
        if !foreign {
            assert!(
                delivered_before.iter().all(|id| !delivered.contains(id)),
                "the events before the note were delivered again"
            );
        }
        assert_eq!(delivered, expected, "the events expected, once each");
    })
    .await;
}

#[tokio::test]
async fn a_slot_behind_the_readers_note_is_moved_up_to_it_on_the_stream() {
    slot_behind_a_note(LogicalTransport::Stream, false).await;
}

#[tokio::test]
async fn a_slot_behind_the_readers_note_is_moved_up_to_it_over_sql() {
    slot_behind_a_note(LogicalTransport::Sql, false).await;
}

#[tokio::test]
async fn a_note_written_on_another_server_is_not_followed() {
    slot_behind_a_note(LogicalTransport::Stream, true).await;
}

/// Filters and transforms in logical mode (see `shaping.rs`): billing
/// gets only orders of at least 100, transformed, audit every event as
/// emitted, and the event billing's transform fails on is a dead letter of
/// billing only, handed to the outbox while the slot moves on.
#[tokio::test]
async fn filters_and_transforms_apply_to_events_read_from_the_slot() {
    use crate::shaping::{
        billing_and_audit, check_deliveries, check_the_dead_letter, order, totals,
    };
    let db = TestDb::new().await;
    let (pool, schema) = (db.pool.clone(), db.schema.clone());
    with_slot(db, |slot| async move {
        let (billing, audit) = (ScriptedSink::delivering(), ScriptedSink::delivering());
        let stop = CancellationToken::new();
        let router = billing_and_audit(billing.clone(), audit.clone());
        let relay =
            started_routed(&pool, &schema, &slot, router, config(&slot), stop.clone()).await;
        let outbox = Outbox::new(schema.clone());
        let mut ids = Vec::new();
        for (i, total) in totals().iter().enumerate() {
            let mut tx = pool.begin().await.unwrap();
            ids.push(
                postbox::sqlx::emit(&outbox, &mut tx, &order(i, total))
                    .await
                    .unwrap(),
            );
            tx.commit().await.unwrap();
        }
        let n = ids.len();
        wait_for(
            "audit took every event, billing its 80",
            Duration::from_secs(60),
            || {
                let (billing, audit) = (billing.clone(), audit.clone());
                let (pool, schema) = (pool.clone(), schema.clone());
                async move {
                    audit.count() == n
                        && billing.count() == 80
                        && count(
                            &pool,
                            &schema,
                            "SELECT count(*) FROM {schema}.deliveries WHERE status = 'failed'",
                        )
                        .await
                            == 1
                }
            },
        )
        .await;
        stop.cancel();
        let stats = relay.await.unwrap();
        check_deliveries(&ids, &billing, &audit);
        check_the_dead_letter(&pool, &schema, ids[100]).await;
        assert_eq!(stats.filtered, 20);
    })
    .await;
}

//! Ordered delivery: one event per aggregate in flight, in sequence, through
//! failures and several relays; poison policies `block` and `skip`; the
//! consumer-side sequence check.

use crate::support::*;
use async_trait::async_trait;
use postbox::{NewEvent, Outbox, SequenceCheck};
use postbox_relay::{
    Message, Outcome, PoisonPolicy, Relay, RelayConfig, Router, RunMode, Sink, SinkError,
};
use postbox_store::{Action, Applied, Selection};
use postbox_testkit::{wait_for, TestDb};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Per aggregate: every sequence attempted, every sequence delivered, and
/// whether two of its events were ever in a publish call at the same time.
#[derive(Default)]
pub(crate) struct Journal {
    pub(crate) attempted: HashMap<String, Vec<i64>>,
    pub(crate) delivered: HashMap<String, Vec<i64>>,
    in_flight: HashSet<String>,
    pub(crate) overlaps: Vec<String>,
}

type Verdict = dyn Fn(&Message) -> Outcome + Send + Sync;

/// A sink that answers by `verdict` and journals per aggregate (logical
/// mode's ordered tests use it too).
pub(crate) struct OrderSink {
    pub(crate) journal: Mutex<Journal>,
    verdict: Box<Verdict>,
}

impl OrderSink {
    pub(crate) fn new(verdict: impl Fn(&Message) -> Outcome + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(Self {
            journal: Mutex::default(),
            verdict: Box::new(verdict),
        })
    }

    pub(crate) fn delivered(&self, aggregate: &str) -> Vec<i64> {
        let j = self.journal.lock().unwrap();
        j.delivered.get(aggregate).cloned().unwrap_or_default()
    }
}

#[async_trait]
impl Sink for OrderSink {
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        {
            let mut j = self.journal.lock().unwrap();
            for m in batch {
                if !j.in_flight.insert(m.aggregate_id.clone()) {
                    j.overlaps.push(m.aggregate_id.clone());
                }
            }
        }
        // Let other relays run while these are "on the wire".
        tokio::task::yield_now().await;
        let mut j = self.journal.lock().unwrap();
        batch
            .iter()
            .map(|m| {
                j.in_flight.remove(&m.aggregate_id);
                let seq = m.sequence.expect("every new event has a sequence");
                j.attempted
                    .entry(m.aggregate_id.clone())
                    .or_default()
                    .push(seq);
                let outcome = (self.verdict)(m);
                if outcome == Outcome::Delivered {
                    j.delivered
                        .entry(m.aggregate_id.clone())
                        .or_default()
                        .push(seq);
                }
                outcome
            })
            .collect()
    }

    async fn check(&self) -> Result<(), SinkError> {
        Ok(())
    }

    fn describe(&self) -> String {
        "order journal".into()
    }
}

/// `per` events for each of `aggregates` aggregates, enqueued interleaved in
/// batches, so a claim sees many aggregates at once.
async fn enqueue_aggregates(db: &TestDb, aggregates: usize, per: usize) {
    let mut events = Vec::with_capacity(aggregates * per);
    for n in 0..per {
        for a in 0..aggregates {
            events.push(
                NewEvent::new(
                    "account.changed",
                    "account",
                    format!("acc-{a}"),
                    &serde_json::json!({ "n": n }),
                )
                .unwrap(),
            );
        }
    }
    for chunk in events.chunks(5000) {
        db.enqueue_events(chunk).await;
    }
}

fn ordered_relay(
    db: &TestDb,
    sink: Arc<dyn Sink>,
    poison: PoisonPolicy,
    config: RelayConfig,
) -> Relay {
    Relay::with_router(store(db), Router::single(sink).all_ordered(poison), config).unwrap()
}

/// One ordered relay with `poison`, drained.
async fn drain_ordered(db: &TestDb, sink: &Arc<OrderSink>, poison: PoisonPolicy) {
    drain_all(&[ordered_relay(db, sink.clone(), poison, fast_config())]).await;
}

/// An operator's replay or discard of dead letters, as `postbox dlq` does it.
async fn operator(db: &TestDb, selection: Selection, action: Action) -> Applied {
    store(db)
        .dead_letters()
        .apply(&selection, &action, "test", 100, |_| {})
        .await
        .unwrap()
}

async fn drain_all(relays: &[Relay]) {
    let runs = relays
        .iter()
        .map(|r| r.run(RunMode::Drain, CancellationToken::new()));
    tokio::time::timeout(Duration::from_secs(300), futures::future::join_all(runs))
        .await
        .expect("the relays drain within the timeout");
}

#[tokio::test]
async fn two_relays_keep_every_aggregate_in_order_through_random_failures() {
    let db = TestDb::new().await;
    let (aggregates, per) = (1000, 20);
    enqueue_aggregates(&db, aggregates, per).await;
    // 20 % of publish answers are failures, at random.
    let sink = OrderSink::new(|_| {
        if rand::random::<f64>() < 0.2 {
            Outcome::retry("random failure")
        } else {
            Outcome::Delivered
        }
    });
    let config = RelayConfig {
        batch_size: 200,
        max_attempts: 100,
        backoff_base: Duration::from_millis(1),
        backoff_max: Duration::from_millis(20),
        ..fast_config()
    };
    let a = ordered_relay(&db, sink.clone(), PoisonPolicy::Block, config.clone());
    let b = ordered_relay(&db, sink.clone(), PoisonPolicy::Block, config);
    drain_all(&[a, b]).await;

    {
        let j = sink.journal.lock().unwrap();
        assert!(
            j.overlaps.is_empty(),
            "two events of one aggregate in flight at once: {:?}",
            &j.overlaps[..j.overlaps.len().min(5)]
        );
        let want: Vec<i64> = (1..=per as i64).collect();
        for a in 0..aggregates {
            let key = format!("acc-{a}");
            assert_eq!(
                j.delivered.get(&key),
                Some(&want),
                "{key} delivered out of order or incompletely"
            );
            // Attempts never run ahead of delivery: each attempt is the next
            // undelivered number or a retry of it.
            let attempted = &j.attempted[&key];
            assert!(
                attempted
                    .windows(2)
                    .all(|w| w[1] == w[0] || w[1] == w[0] + 1),
                "{key} attempts {attempted:?}"
            );
        }
        let retries: usize = j.attempted.values().map(Vec::len).sum::<usize>() - aggregates * per;
        assert!(
            retries > 1000,
            "the sink failed often enough to matter ({retries} retries)"
        );
    }
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'sent'")
            .await,
        (aggregates * per) as i64
    );
    db.drop_schema().await;
}

/// A sink that rejects one event of one aggregate and delivers everything else.
pub(crate) fn poisoning(aggregate: &'static str, sequence: i64) -> Arc<OrderSink> {
    OrderSink::new(move |m| {
        if m.aggregate_id == aggregate && m.sequence == Some(sequence) {
            Outcome::reject("poison")
        } else {
            Outcome::Delivered
        }
    })
}

#[tokio::test]
async fn a_poisoned_aggregate_blocks_only_itself_until_an_operator_discards_it() {
    let db = TestDb::new().await;
    enqueue_aggregates(&db, 50, 5).await;
    let sink = poisoning("acc-7", 2);
    drain_ordered(&db, &sink, PoisonPolicy::Block).await;
    assert_eq!(
        sink.delivered("acc-7"),
        vec![1],
        "the aggregate waits behind its dead letter"
    );
    for a in (0..50).filter(|&a| a != 7) {
        assert_eq!(sink.delivered(&format!("acc-{a}")), vec![1, 2, 3, 4, 5]);
    }
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'failed'")
            .await,
        1
    );
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'pending'")
            .await,
        3
    );

    // The operator discards the dead letter: the aggregate goes on.
    let dead: Vec<uuid::Uuid> = store(&db)
        .dead_letters()
        .list(&Default::default(), 10)
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.event_id)
        .collect();
    assert_eq!(dead.len(), 1);
    operator(
        &db,
        Selection::Ids(dead),
        Action::Discard {
            reason: "bad data, fixed by hand".into(),
        },
    )
    .await;
    drain_ordered(&db, &sink, PoisonPolicy::Block).await;
    assert_eq!(sink.delivered("acc-7"), vec![1, 3, 4, 5]);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_replayed_blocking_dead_letter_is_delivered_before_its_successors() {
    let db = TestDb::new().await;
    enqueue_aggregates(&db, 3, 4).await;
    let fixed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let f = fixed.clone();
    let sink = OrderSink::new(move |m| {
        if m.aggregate_id == "acc-1"
            && m.sequence == Some(2)
            && !f.load(std::sync::atomic::Ordering::SeqCst)
        {
            Outcome::reject("down for good")
        } else {
            Outcome::Delivered
        }
    });
    drain_ordered(&db, &sink, PoisonPolicy::Block).await;
    assert_eq!(sink.delivered("acc-1"), vec![1]);
    fixed.store(true, std::sync::atomic::Ordering::SeqCst);
    let applied = operator(&db, Selection::All(Default::default()), Action::Replay).await;
    assert_eq!(applied.count, 1);
    drain_ordered(&db, &sink, PoisonPolicy::Block).await;
    assert_eq!(sink.delivered("acc-1"), vec![1, 2, 3, 4]);
    db.drop_schema().await;
}

#[tokio::test]
async fn skip_lets_the_aggregate_go_on_and_the_consumer_sees_the_gap() {
    let db = TestDb::new().await;
    enqueue_aggregates(&db, 4, 4).await;
    let sink = poisoning("acc-2", 2);
    drain_ordered(&db, &sink, PoisonPolicy::Skip).await;
    assert_eq!(sink.delivered("acc-2"), vec![1, 3, 4]);
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'failed'")
            .await,
        1
    );

    // The consumer applies what arrives through the sequence check.
    let outbox = Outbox::new(db.schema.clone());
    let mut verdicts = Vec::new();
    for seq in sink.delivered("acc-2") {
        let mut tx = db.pool.begin().await.unwrap();
        let v = postbox::sqlx::check_sequence(&outbox, &mut tx, "ledger", "account", "acc-2", seq)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        verdicts.push(v);
    }
    assert_eq!(
        verdicts,
        vec![
            SequenceCheck::Apply,
            SequenceCheck::Gap {
                expected: 2,
                got: 3
            },
            SequenceCheck::Gap {
                expected: 2,
                got: 4
            },
        ]
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn a_retry_holds_back_only_its_own_aggregate() {
    let db = TestDb::new().await;
    enqueue_aggregates(&db, 10, 3).await;
    // acc-3's first event keeps failing until the test lets it through.
    let open = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let o = open.clone();
    let sink = OrderSink::new(move |m| {
        if m.aggregate_id == "acc-3" && !o.load(std::sync::atomic::Ordering::SeqCst) {
            Outcome::retry("not yet")
        } else {
            Outcome::Delivered
        }
    });
    let config = RelayConfig {
        max_attempts: 1000,
        ..fast_config()
    };
    let relay = ordered_relay(&db, sink.clone(), PoisonPolicy::Block, config);
    let stop = CancellationToken::new();
    let run = relay.run(RunMode::Forever, stop.clone());
    let check = async {
        wait_for(
            "every other aggregate delivered",
            Duration::from_secs(30),
            || async {
                (0..10)
                    .filter(|&a| a != 3)
                    .all(|a| sink.delivered(&format!("acc-{a}")).len() == 3)
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
        }
        open.store(true, std::sync::atomic::Ordering::SeqCst);
        wait_for(
            "acc-3 delivered in order",
            Duration::from_secs(30),
            || async { sink.delivered("acc-3") == vec![1, 2, 3] },
        )
        .await;
        stop.cancel();
    };
    tokio::join!(run, check);
    db.drop_schema().await;
}

/// Send the schema's producers into the log (log mode).
async fn producing_into_the_log(db: &TestDb) {
    store(db)
        .log()
        .set_producer_target(postbox_store::ProducerTarget::Log)
        .await
        .unwrap();
}

fn log_config(config: RelayConfig) -> RelayConfig {
    RelayConfig {
        mode: postbox_relay::ReadMode::Log,
        ..config
    }
}

#[tokio::test]
async fn log_mode_keeps_every_aggregate_in_order_through_random_failures() {
    let db = TestDb::new().await;
    producing_into_the_log(&db).await;
    let (aggregates, per) = (200, 10);
    enqueue_aggregates(&db, aggregates, per).await;
    // 20 % of publish answers are failures, at random.
    let sink = OrderSink::new(|_| {
        if rand::random::<f64>() < 0.2 {
            Outcome::retry("random failure")
        } else {
            Outcome::Delivered
        }
    });
    let config = log_config(RelayConfig {
        batch_size: 300,
        max_attempts: 100,
        backoff_base: Duration::from_millis(1),
        backoff_max: Duration::from_millis(20),
        ..fast_config()
    });
    drain_all(&[ordered_relay(
        &db,
        sink.clone(),
        PoisonPolicy::Block,
        config,
    )])
    .await;
    {
        let j = sink.journal.lock().unwrap();
        assert!(
            j.overlaps.is_empty(),
            "two events of one aggregate in flight at once: {:?}",
            &j.overlaps[..j.overlaps.len().min(5)]
        );
        let want: Vec<i64> = (1..=per as i64).collect();
        for a in 0..aggregates {
            let key = format!("acc-{a}");
            assert_eq!(
                j.delivered.get(&key),
                Some(&want),
                "{key} delivered out of order or incompletely"
            );
            let attempted = &j.attempted[&key];
            assert!(
                attempted
                    .windows(2)
                    .all(|w| w[1] == w[0] || w[1] == w[0] + 1),
                "{key} attempts {attempted:?}"
            );
        }
        let retries: usize = j.attempted.values().map(Vec::len).sum::<usize>() - aggregates * per;
        assert!(retries > 100, "the sink failed often enough ({retries})");
    }
    db.drop_schema().await;
}

#[tokio::test]
async fn in_log_mode_a_retry_holds_back_only_its_own_aggregate_then_it_flows_from_the_log_again() {
    let db = TestDb::new().await;
    producing_into_the_log(&db).await;
    enqueue_aggregates(&db, 10, 3).await;
    // acc-3's first event keeps failing until the test lets it through.
    let open = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let o = open.clone();
    let sink = OrderSink::new(move |m| {
        if m.aggregate_id == "acc-3" && !o.load(std::sync::atomic::Ordering::SeqCst) {
            Outcome::retry("not yet")
        } else {
            Outcome::Delivered
        }
    });
    let config = log_config(RelayConfig {
        max_attempts: 1000,
        ..fast_config()
    });
    let relay = ordered_relay(&db, sink.clone(), PoisonPolicy::Block, config);
    let stop = CancellationToken::new();
    let run = relay.run(RunMode::Forever, stop.clone());
    let check = async {
        wait_for(
            "every other aggregate delivered",
            Duration::from_secs(30),
            || async {
                (0..10)
                    .filter(|&a| a != 3)
                    .all(|a| sink.delivered(&format!("acc-{a}")).len() == 3)
            },
        )
        .await;
        // Its later events wait behind it in the outbox, untried.
        wait_for(
            "acc-3 held in the outbox",
            Duration::from_secs(30),
            || async {
                db.count("SELECT count(*) FROM {schema}.outbox WHERE aggregate_id = 'acc-3'")
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
        }
        assert_eq!(
            db.count("SELECT count(*) FROM {schema}.outbox WHERE aggregate_id <> 'acc-3'")
                .await,
            0,
            "other aggregates never left the log"
        );
        open.store(true, std::sync::atomic::Ordering::SeqCst);
        wait_for(
            "acc-3 delivered in order",
            Duration::from_secs(30),
            || async { sink.delivered("acc-3") == vec![1, 2, 3] },
        )
        .await;
        wait_for("acc-3's events marked sent", Duration::from_secs(30), || async {
            db.count(
                "SELECT count(*) FROM {schema}.outbox WHERE aggregate_id = 'acc-3' AND status = 'sent'",
            )
            .await
                == 3
        })
        .await;
        // Nothing of acc-3 waits in the outbox any more: its next events
        // flow from the log again.
        enqueue_aggregates(&db, 10, 1).await;
        wait_for("acc-3's next event", Duration::from_secs(30), || async {
            sink.delivered("acc-3") == vec![1, 2, 3, 4]
        })
        .await;
        assert_eq!(
            db.count("SELECT count(*) FROM {schema}.outbox WHERE aggregate_id = 'acc-3'")
                .await,
            3,
            "delivered from the log"
        );
        stop.cancel();
    };
    tokio::join!(run, check);

    // The consumer's sequence check applies each of acc-3's events in turn.
    let outbox = Outbox::new(db.schema.clone());
    for seq in sink.delivered("acc-3") {
        let mut tx = db.pool.begin().await.unwrap();
        let v = postbox::sqlx::check_sequence(&outbox, &mut tx, "ledger", "account", "acc-3", seq)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(v, SequenceCheck::Apply, "sequence {seq}");
    }
    db.drop_schema().await;
}

#[tokio::test]
async fn in_log_mode_a_poisoned_aggregate_blocks_only_itself_until_discarded() {
    let db = TestDb::new().await;
    producing_into_the_log(&db).await;
    enqueue_aggregates(&db, 50, 5).await;
    let sink = poisoning("acc-7", 2);
    let config = log_config(fast_config());
    drain_all(&[ordered_relay(
        &db,
        sink.clone(),
        PoisonPolicy::Block,
        config.clone(),
    )])
    .await;
    assert_eq!(sink.delivered("acc-7"), vec![1]);
    for a in (0..50).filter(|&a| a != 7) {
        assert_eq!(sink.delivered(&format!("acc-{a}")), vec![1, 2, 3, 4, 5]);
    }
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'failed'")
            .await,
        1
    );
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'pending'")
            .await,
        3,
        "its successors wait behind it"
    );
    let applied = operator(
        &db,
        Selection::All(Default::default()),
        Action::Discard {
            reason: "bad data".into(),
        },
    )
    .await;
    assert_eq!(applied.count, 1);
    drain_all(&[ordered_relay(
        &db,
        sink.clone(),
        PoisonPolicy::Block,
        config,
    )])
    .await;
    assert_eq!(sink.delivered("acc-7"), vec![1, 3, 4, 5]);
    db.drop_schema().await;
}

#[tokio::test]
async fn in_log_mode_skip_lets_the_aggregate_go_on_from_the_log() {
    let db = TestDb::new().await;
    producing_into_the_log(&db).await;
    enqueue_aggregates(&db, 4, 4).await;
    let sink = poisoning("acc-2", 2);
    drain_all(&[ordered_relay(
        &db,
        sink.clone(),
        PoisonPolicy::Skip,
        log_config(fast_config()),
    )])
    .await;
    assert_eq!(sink.delivered("acc-2"), vec![1, 3, 4]);
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox").await,
        1,
        "only the dead letter left the log"
    );
    db.drop_schema().await;
}

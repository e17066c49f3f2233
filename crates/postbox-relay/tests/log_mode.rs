//! Log mode: events appended to the log are delivered by per-destination
//! cursors; what a destination does not take goes to the outbox's retries and
//! dead letters; a transaction held open is delivered once it commits.

use crate::support::*;
use postbox::statements::trusted;
use postbox_relay::{
    Destination, Outcome, ReadMode, Relay, RelayConfig, RouteConfig, Router, RunMode,
};
use postbox_testkit::{wait_for, TestDb};
use std::collections::HashMap;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// A producer in log mode (the same statement shape as the library's).
const APPEND: &str = "WITH seq AS ( \
       INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence) \
       VALUES ('order', $2, 1) \
       ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_sequence = s.last_sequence + 1 \
       RETURNING s.last_sequence) \
     INSERT INTO {schema}.log (event_id, event_type, aggregate_type, aggregate_id, payload, sequence) \
     SELECT $1, $3, 'order', $2, '{}'::jsonb, seq.last_sequence FROM seq";

async fn append(db: &TestDb, n: usize, event_type: &str) -> Vec<Uuid> {
    let sql = db.sql(APPEND);
    let mut ids = Vec::new();
    for i in 0..n {
        let id = Uuid::now_v7();
        sqlx::query(trusted(&sql))
            .bind(id)
            .bind(format!("a{}", i % 7))
            .bind(event_type)
            .execute(&db.pool)
            .await
            .unwrap();
        ids.push(id);
    }
    ids
}

fn log_config() -> RelayConfig {
    RelayConfig {
        mode: ReadMode::Log,
        batch_size: 40,
        ..fast_config()
    }
}

fn times(sink: &ScriptedSink) -> HashMap<Uuid, usize> {
    let mut m = HashMap::new();
    for id in sink.ids() {
        *m.entry(id).or_default() += 1;
    }
    m
}

#[tokio::test]
async fn every_event_is_delivered_once_and_no_event_row_is_updated() {
    every_event_once(true).await;
}

#[tokio::test]
async fn cursor_moves_without_waiting_for_the_flush_deliver_the_same() {
    every_event_once(false).await;
}

async fn every_event_once(synchronous_commit: bool) {
    let db = TestDb::new().await;
    let ids = append(&db, 300, "order.created").await;
    let sink = ScriptedSink::delivering();
    let config = RelayConfig {
        synchronous_commit,
        ..log_config()
    };
    let stats = drain_with(&db, Router::single(sink.clone()), config).await;
    assert_eq!(stats.delivered, 300);
    let seen = times(&sink);
    assert_eq!(seen.len(), 300);
    assert!(seen.values().all(|&n| n == 1), "each event once");
    assert!(ids.iter().all(|id| seen.contains_key(id)));
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox").await,
        0,
        "nothing went through the outbox"
    );
    // …so the relay counted its deliveries by minute (flushed as it stopped).
    assert_eq!(
        db.count(
            "SELECT coalesce(sum(delivered), 0)::bigint FROM {schema}.deliveries_by_minute \
             WHERE destination = 'default' AND mode = 'log'"
        )
        .await,
        300
    );
    // The log's rows were only ever inserted: none deleted, none updated or locked.
    assert_eq!(db.count("SELECT count(*) FROM {schema}.log").await, 300);
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.log WHERE xmax <> 0")
            .await,
        0
    );
    db.drop_schema().await;
}

/// Pages read ahead are read from where the page before them would end if
/// it were dense; across gaps in the ids (sequence values taken and never
/// written) those guesses are wrong and must be dropped unread.
#[tokio::test]
async fn pages_read_ahead_across_gaps_in_the_ids_deliver_every_event_once_in_order() {
    let db = TestDb::new().await;
    // Runs of events (batch 40) with gaps of ids between them: dense pages,
    // a page ending short of a full run, gaps of 1, 5 and 39 ids, and runs
    // ending on and off a page's end.
    let runs = [
        (120, 5),
        (97, 1),
        (40, 39),
        (83, 0),
        (200, 40),
        (41, 2),
        (79, 0),
    ];
    for (events, gap) in runs {
        sqlx::query(trusted(&db.sql(
            "INSERT INTO {schema}.log (event_id, event_type, aggregate_type, aggregate_id, payload, sequence) \
             SELECT {schema}.uuid_v7(), 'order.created', 'order', g::text, '{}'::jsonb, 1 \
             FROM generate_series(1, $1) g",
        )))
        .bind(events)
        .execute(&db.pool)
        .await
        .unwrap();
        sqlx::query(trusted(&db.sql(
            "SELECT count(nextval('{schema}.outbox_id_seq')) FROM generate_series(1, $1)",
        )))
        .bind(gap)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let written: Vec<Uuid> = sqlx::query_scalar(trusted(
        &db.sql("SELECT event_id FROM {schema}.log ORDER BY id"),
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(written.len(), 660);
    let sink = ScriptedSink::delivering();
    let stats = drain_with(&db, Router::single(sink.clone()), log_config()).await;
    assert_eq!(stats.delivered, 660);
    assert_eq!(sink.ids(), written, "every event once, in id order");
    db.drop_schema().await;
}

#[tokio::test]
async fn retries_and_rejections_leave_the_log_for_the_outbox() {
    let db = TestDb::new().await;
    let ids = append(&db, 60, "order.created").await;
    let (flaky, poison) = (ids[5], ids[17]);
    let sink = ScriptedSink::new(move |m, seen| {
        if m.event_id == poison {
            Outcome::Reject {
                error: "schema mismatch".into(),
            }
        } else if m.event_id == flaky && seen < 2 {
            Outcome::Retry {
                error: "try later".into(),
                after: Some(Duration::from_millis(10)),
            }
        } else {
            Outcome::Delivered
        }
    });
    let stats = drain_with(&db, Router::single(sink.clone()), log_config()).await;
    let seen = times(&sink);
    assert_eq!(
        seen[&flaky], 3,
        "retried through the outbox until delivered"
    );
    assert_eq!(seen[&poison], 1, "a rejection is not retried");
    assert_eq!(stats.delivered, 59);
    assert_eq!(
        db.count(&format!("SELECT count(*) FROM {{schema}}.outbox WHERE event_id = '{poison}' AND status = 'failed' AND last_error LIKE '%schema mismatch%'")).await,
        1,
        "the rejected event is a dead letter operators can see"
    );
    assert_eq!(
        db.count(&format!("SELECT count(*) FROM {{schema}}.outbox WHERE event_id = '{flaky}' AND status = 'sent' AND attempts = 3")).await,
        1
    );
    // The tally counts the log's 58 deliveries under `log` and the one the
    // outbox delivered after its retries under `claim` (it is a `sent` row
    // too): the console counts each once.
    let counted = "SELECT coalesce(sum(delivered), 0)::bigint FROM {schema}.deliveries_by_minute WHERE mode = ";
    assert_eq!(
        (
            db.count(&format!("{counted}'log'")).await,
            db.count(&format!("{counted}'claim'")).await
        ),
        (58, 1)
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn a_failing_destination_never_holds_back_or_duplicates_to_another() {
    let db = TestDb::new().await;
    let ids = append(&db, 80, "order.created").await;
    let flaky = ids[3];
    let good = ScriptedSink::delivering();
    let bad = ScriptedSink::new(move |m, seen| {
        if m.event_id == flaky && seen < 1 {
            Outcome::Retry {
                error: "down".into(),
                after: Some(Duration::from_millis(10)),
            }
        } else {
            Outcome::Delivered
        }
    });
    let router = Router::new(
        vec![
            Destination::new("good", good.clone()),
            Destination::new("bad", bad.clone()),
        ],
        &[RouteConfig {
            matches: vec!["*".into()],
            to: vec!["good".into(), "bad".into()],
            ordered: false,
            poison: Default::default(),
            ..RouteConfig::default()
        }],
    )
    .unwrap();
    drain_with(&db, router, log_config()).await;
    let (g, b) = (times(&good), times(&bad));
    assert_eq!(g.len(), 80);
    assert!(
        g.values().all(|&n| n == 1),
        "the healthy destination got each event once"
    );
    assert_eq!(b.len(), 80);
    assert_eq!(b[&flaky], 2, "the failing destination retried its event");
    assert!(b
        .iter()
        .filter(|(id, _)| **id != flaky)
        .all(|(_, &n)| n == 1));
    db.drop_schema().await;
}

#[tokio::test]
async fn an_event_of_a_transaction_held_open_is_delivered_when_it_commits() {
    let db = TestDb::new().await;
    let sink = ScriptedSink::delivering();
    let relay = Relay::new(store(&db), sink.clone(), log_config()).unwrap();
    let stop = CancellationToken::new();
    let running = {
        let stop = stop.clone();
        tokio::spawn(async move { relay.run(RunMode::Forever, stop).await })
    };
    let sql = db.sql(APPEND);
    let held = Uuid::now_v7();
    let mut open = db.pool.begin().await.unwrap();
    sqlx::query(trusted(&sql))
        .bind(held)
        .bind("x")
        .bind("order.created")
        .execute(&mut *open)
        .await
        .unwrap();
    let later = append(&db, 20, "order.created").await;
    wait_for("the later events", Duration::from_secs(30), || {
        let sink = sink.clone();
        let later = later.clone();
        async move { later.iter().all(|id| sink.ids().contains(id)) }
    })
    .await;
    assert!(!sink.ids().contains(&held), "not before it commits");
    open.commit().await.unwrap();
    wait_for("the held event", Duration::from_secs(30), || {
        let sink = sink.clone();
        async move { sink.ids().contains(&held) }
    })
    .await;
    stop.cancel();
    let stats = running.await.unwrap();
    assert_eq!(stats.delivered, 21);
    assert!(times(&sink).values().all(|&n| n == 1));
    db.drop_schema().await;
}

#[tokio::test]
async fn producers_write_into_the_log_once_the_schema_is_in_log_mode() {
    let db = TestDb::new().await;
    let log = store(&db).log();
    log.set_producer_target(postbox_store::ProducerTarget::Log)
        .await
        .unwrap();
    assert_eq!(
        log.producer_target().await.unwrap(),
        postbox_store::ProducerTarget::Log
    );
    // The Rust library (one event and a batch) and the SQL function.
    let from_rust = enqueue(&db, 30).await;
    db.exec("SELECT {schema}.enqueue('order.paid', 'order', 'sql-1', '{\"n\": 1}')")
        .await;
    assert_eq!(db.count("SELECT count(*) FROM {schema}.outbox").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM {schema}.log").await, 31);
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.log WHERE aggregate_id = 'sql-1' AND sequence = 1")
            .await,
        1,
        "sequences are numbered as in claim mode"
    );
    let sink = ScriptedSink::delivering();
    let stats = drain_with(&db, Router::single(sink.clone()), log_config()).await;
    assert_eq!(stats.delivered, 31);
    assert!(from_rust.iter().all(|id| sink.ids().contains(id)));
    db.drop_schema().await;
}

/// Inserts into the log say so on the relays' channel (migration 18), so a
/// relay in log mode wakes only its log readers for them; the outbox's
/// inserts (hand-offs, claim-mode producers) still wake everyone.
#[tokio::test]
async fn log_inserts_announce_themselves_apart_from_outbox_inserts() {
    let db = TestDb::new().await;
    let mut listener = sqlx::postgres::PgListener::connect_with(&db.pool)
        .await
        .unwrap();
    listener.listen(&db.schema.notify_channel()).await.unwrap();
    append(&db, 1, "order.placed").await;
    let n = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .expect("a notification")
        .unwrap();
    assert_eq!(n.payload(), "log");
    enqueue(&db, 1).await;
    let n = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .expect("a notification")
        .unwrap();
    assert_eq!(n.payload(), "", "the outbox's notification is unchanged");
    drop(listener);
    db.drop_schema().await;
}

#[tokio::test]
async fn delivered_segments_are_emptied_without_vacuum() {
    let db = TestDb::new().await;
    let sink = ScriptedSink::delivering();
    let config = RelayConfig {
        log_segment_age: Duration::from_millis(200),
        ..log_config()
    };
    let relay = Relay::new(store(&db), sink.clone(), config).unwrap();
    let stop = CancellationToken::new();
    let running = {
        let stop = stop.clone();
        tokio::spawn(async move { relay.run(RunMode::Forever, stop).await })
    };
    let mut all = Vec::new();
    for round in 0..3 {
        all.extend(append(&db, 50, "order.created").await);
        wait_for(
            &format!("round {round} delivered and its segment emptied"),
            Duration::from_secs(30),
            || {
                let (db, sink, all) = (&db, sink.clone(), all.clone());
                async move {
                    all.iter().all(|id| sink.ids().contains(id))
                        && db.count("SELECT count(*) FROM {schema}.log").await == 0
                }
            },
        )
        .await;
    }
    // Emptied by TRUNCATE: no dead tuples, no pages left behind.
    let pages = db
        .count(
            "SELECT sum(pg_relation_size(c.oid))::bigint FROM pg_inherits i \
             JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = '{schema}.log'::regclass",
        )
        .await;
    assert!(pages <= 8192, "segments keep {pages} bytes");
    stop.cancel();
    let stats = running.await.unwrap();
    assert_eq!(stats.delivered, 150);
    assert!(times(&sink).values().all(|&n| n == 1));
    db.drop_schema().await;
}

#[tokio::test]
async fn a_segment_a_cursor_has_not_read_is_kept() {
    let db = TestDb::new().await;
    let log = store(&db).log();
    log.ensure_cursors(&["slow".to_owned()]).await.unwrap();
    append(&db, 10, "order.created").await;
    db.exec("UPDATE {schema}.log_settings SET rotated_at = now() - interval '1 hour'")
        .await;
    let (rotated, removed) = log.maintain(Duration::from_secs(1), false).await.unwrap();
    assert!(rotated, "producers move to the next segment");
    assert_eq!(removed, 0);
    let (_, removed) = log
        .maintain(Duration::from_secs(3600), false)
        .await
        .unwrap();
    assert_eq!(removed, 0, "the cursor has not read segment 0");
    assert_eq!(db.count("SELECT count(*) FROM {schema}.log").await, 10);
    db.drop_schema().await;
}

/// `n` events over `aggregates` aggregates, in one transaction per 100.
async fn append_over(db: &TestDb, n: usize, aggregates: usize) -> Vec<Uuid> {
    let sql = db.sql(APPEND);
    let mut ids = Vec::new();
    for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
        let mut tx = db.pool.begin().await.unwrap();
        for &i in chunk {
            let id = Uuid::now_v7();
            sqlx::query(trusted(&sql))
                .bind(id)
                .bind(format!("a{}", i % aggregates))
                .bind("order.created")
                .execute(&mut *tx)
                .await
                .unwrap();
            ids.push(id);
        }
        tx.commit().await.unwrap();
    }
    ids
}

/// How many of the log cursor's partitions each relay holds now.
async fn holdings(db: &TestDb) -> Vec<i64> {
    sqlx::query_scalar(trusted(&db.sql(
        "SELECT count(*) FROM {schema}.log_cursors \
         WHERE owner IS NOT NULL AND lease_expires_at > now() GROUP BY owner ORDER BY 1",
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

fn split_config(partitions: u16) -> RelayConfig {
    RelayConfig {
        log_partitions: partitions,
        lease: Duration::from_secs(2),
        publish_timeout: Duration::from_millis(500),
        ..log_config()
    }
}

/// Each aggregate's sequences in the order the sink received them.
fn sequences(sink: &ScriptedSink) -> HashMap<String, Vec<i64>> {
    let mut by: HashMap<String, Vec<i64>> = HashMap::new();
    for m in &sink.seen.lock().unwrap().messages {
        by.entry(m.aggregate_id.clone())
            .or_default()
            .push(m.sequence.unwrap());
    }
    by
}

#[tokio::test]
async fn two_relays_split_one_log_and_deliver_each_event_once_in_order() {
    let db = TestDb::new().await;
    let sink = ScriptedSink::delivering();
    let relay = |sink: std::sync::Arc<ScriptedSink>| {
        let router = Router::single(sink).all_ordered(Default::default());
        Relay::with_router(store(&db), router, split_config(4)).unwrap()
    };
    let (a, b) = (relay(sink.clone()), relay(sink.clone()));
    let stop = CancellationToken::new();
    let (run_a, run_b) = (
        a.run(RunMode::Forever, stop.clone()),
        b.run(RunMode::Forever, stop.clone()),
    );
    let check = async {
        wait_for("each relay holds half", Duration::from_secs(30), || async {
            holdings(&db).await == vec![2, 2]
        })
        .await;
        let ids = append_over(&db, 1000, 60).await;
        wait_for("every event delivered", Duration::from_secs(60), || {
            let sink = sink.clone();
            async move { sink.count() >= 1000 }
        })
        .await;
        stop.cancel();
        ids
    };
    let (stats_a, stats_b, ids) = tokio::join!(run_a, run_b, check);
    let seen = times(&sink);
    assert_eq!(seen.len(), 1000);
    assert!(ids.iter().all(|id| seen[id] == 1), "each event once");
    assert!(
        stats_a.delivered > 0 && stats_b.delivered > 0,
        "both relays delivered: {} and {}",
        stats_a.delivered,
        stats_b.delivered
    );
    assert_eq!(stats_a.delivered + stats_b.delivered, 1000);
    for (aggregate, seqs) in sequences(&sink) {
        assert!(
            seqs.windows(2).all(|w| w[1] == w[0] + 1),
            "{aggregate} out of order: {seqs:?}"
        );
    }
    db.drop_schema().await;
}

#[tokio::test]
async fn a_dead_relays_partitions_are_taken_over_within_its_lease() {
    let db = TestDb::new().await;
    let sink = ScriptedSink::delivering();
    let relay = || Relay::new(store(&db), sink.clone(), split_config(4)).unwrap();
    let (a, b) = (relay(), relay());
    let stop = CancellationToken::new();
    let doomed = tokio::spawn({
        let stop = stop.clone();
        async move { a.run(RunMode::Forever, stop).await }
    });
    let survivor = tokio::spawn({
        let stop = stop.clone();
        async move { b.run(RunMode::Forever, stop).await }
    });
    wait_for("each relay holds half", Duration::from_secs(30), || async {
        holdings(&db).await == vec![2, 2]
    })
    .await;
    // The relay dies: no release, its leases and heartbeat run out.
    doomed.abort();
    let ids = append_over(&db, 400, 40).await;
    wait_for(
        "the survivor delivers every event",
        Duration::from_secs(30),
        || {
            let (sink, ids) = (sink.clone(), ids.clone());
            async move {
                let seen = sink.ids();
                ids.iter().all(|id| seen.contains(id))
            }
        },
    )
    .await;
    assert_eq!(holdings(&db).await, vec![4], "it holds every partition");
    stop.cancel();
    let stats = survivor.await.unwrap();
    assert_eq!(stats.delivered, 400);
    assert!(times(&sink).values().all(|&n| n == 1));
    db.drop_schema().await;
}

#[tokio::test]
async fn a_destination_is_re_split_when_no_relay_holds_it() {
    let db = TestDb::new().await;
    let first = append_over(&db, 100, 10).await;
    let sink = ScriptedSink::delivering();
    drain_with(&db, Router::single(sink.clone()), log_config()).await;
    assert_eq!(sink.count(), 100);
    let log = store(&db).log();
    let split = log.ensure_split(&["default".to_owned()], 3).await.unwrap();
    assert_eq!(split, vec![("default".to_owned(), 3)]);
    // Every partition starts where the single cursor was: nothing again.
    let later = append_over(&db, 90, 9).await;
    drain_with(&db, Router::single(sink.clone()), split_config(3)).await;
    let seen = times(&sink);
    assert!(first.iter().chain(&later).all(|id| seen[id] == 1));
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.log_cursors WHERE parts = 3")
            .await,
        3
    );
    db.drop_schema().await;
}

//! Consumer groups (migration 26) against the real database: readers of one
//! group share its events without duplicates while they acknowledge in
//! time, get back what a crashed reader held, never lose an event, and in
//! an ordered group never hold two events of one aggregate at once.

use postbox::statements::trusted;
use postbox::Schema;
use postbox_store::{GroupStart, Groups, NewGroup, Received, Store};
use postbox_testkit::TestDb;
use sqlx::PgPool;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const MINUTE: Duration = Duration::from_secs(60);
const NO_WAIT: Duration = Duration::ZERO;

/// Commit `n` events into the log in transactions of `per_tx`, spread over
/// `aggregates` aggregates of type `order` (event `i` on aggregate `i %
/// aggregates`, numbered in its aggregate), typed `order.placed`.
async fn append(db: &TestDb, n: i64, per_tx: i64, aggregates: i64) {
    append_to(&db.pool, &db.schema, n, per_tx, aggregates).await;
}

async fn append_to(pool: &PgPool, schema: &Schema, n: i64, per_tx: i64, aggregates: i64) {
    let mut start = 0;
    while start < n {
        let end = (start + per_tx).min(n);
        sqlx::query(trusted(&schema.render(
            "INSERT INTO {schema}.log (event_id, event_type, aggregate_type, aggregate_id, payload, sequence) \
             SELECT gen_random_uuid(), 'order.placed', 'order', 'o' || (i % $3), \
                    jsonb_build_object('i', i), i / $3 + 1 \
             FROM generate_series($1::bigint, $2::bigint - 1) AS i",
        )))
        .bind(start)
        .bind(end)
        .bind(aggregates)
        .execute(pool)
        .await
        .expect("append events to the log");
        start = end;
    }
}

fn groups(db: &TestDb) -> Groups {
    Store::new(db.pool.clone(), db.schema.clone()).groups()
}

fn receipts(batch: &[Received]) -> Vec<String> {
    batch.iter().map(|r| r.receipt.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_readers_share_100_000_events_each_acknowledged_once() {
    let db = TestDb::new().await;
    let g = groups(&db);
    g.create(&NewGroup::new("billing")).await.unwrap();
    const EVENTS: i64 = 100_000;

    // Producers commit while the readers read.
    let producer = {
        let (pool, schema) = (db.pool.clone(), db.schema.clone());
        tokio::spawn(async move { append_to(&pool, &schema, EVENTS, 2_000, 1_000).await })
    };

    let acked = Arc::new(Mutex::new(Vec::<i64>::new()));
    let mut readers = Vec::new();
    for _ in 0..4 {
        let g = g.clone();
        let acked = acked.clone();
        readers.push(tokio::spawn(async move {
            loop {
                let batch = g
                    .receive("billing", 500, MINUTE, NO_WAIT)
                    .await
                    .expect("receive");
                if batch.is_empty() {
                    if acked.lock().unwrap().len() as i64 >= EVENTS {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                assert!(batch.iter().all(|r| r.attempts == 1), "a redelivery");
                let n = g.ack("billing", &receipts(&batch)).await.expect("ack");
                assert_eq!(
                    n as usize,
                    batch.len(),
                    "every receipt acknowledged its event"
                );
                acked.lock().unwrap().extend(batch.iter().map(|r| r.id));
            }
        }));
    }
    producer.await.unwrap();
    for r in readers {
        tokio::time::timeout(Duration::from_secs(300), r)
            .await
            .expect("the readers finish")
            .unwrap();
    }
    let acked = acked.lock().unwrap().clone();
    let distinct: HashSet<i64> = acked.iter().copied().collect();
    assert_eq!(acked.len() as i64, EVENTS, "each event acknowledged once");
    assert_eq!(distinct.len() as i64, EVENTS);
    let in_log = db.count("SELECT count(*) FROM {schema}.log").await;
    assert_eq!(in_log, EVENTS);

    let status = g.status().await.unwrap();
    assert_eq!(status.len(), 1);
    let s = &status[0];
    assert_eq!(
        (s.unread, s.in_flight, s.waiting, s.dead_letters),
        (0, 0, 0, 0)
    );
    assert_eq!(s.received, EVENTS);
    assert!(s.readers >= 1);
    assert_eq!(s.lag_seconds, None);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_crashed_reader_s_events_come_back_and_none_is_lost() {
    let db = TestDb::new().await;
    let g = groups(&db);
    g.create(&NewGroup::new("billing")).await.unwrap();
    append(&db, 1_000, 100, 50).await;

    // A reader takes 300 events and dies without acknowledging them (its
    // visibility is one second); another acknowledges what it gets.
    let lost = g
        .receive("billing", 300, Duration::from_secs(1), NO_WAIT)
        .await
        .unwrap();
    assert_eq!(lost.len(), 300);
    let mut done: BTreeMap<i64, i32> = BTreeMap::new();
    let deadline = tokio::time::Instant::now() + MINUTE;
    while done.len() < 1_000 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of 1000 acknowledged",
            done.len()
        );
        let batch = g
            .receive("billing", 200, MINUTE, Duration::from_millis(200))
            .await
            .unwrap();
        g.ack("billing", &receipts(&batch)).await.unwrap();
        for r in &batch {
            assert!(done.insert(r.id, r.attempts).is_none(), "{} twice", r.id);
        }
    }
    for r in &lost {
        assert_eq!(done[&r.id], 2, "the dead reader's event came back once");
    }
    // The dead reader's receipts no longer acknowledge anything.
    assert_eq!(g.ack("billing", &receipts(&lost)).await.unwrap(), 0);
    db.drop_schema().await;
}

#[tokio::test]
async fn nack_delays_and_max_attempts_make_a_dead_letter_with_its_error() {
    let db = TestDb::new().await;
    let g = groups(&db);
    let mut group = NewGroup::new("billing");
    group.max_attempts = 2;
    g.create(&group).await.unwrap();
    append(&db, 3, 3, 3).await;

    let first = g.receive("billing", 10, MINUTE, NO_WAIT).await.unwrap();
    assert_eq!(first.len(), 3);
    let (poison, rest) = first.split_first().unwrap();
    g.ack("billing", &receipts(rest)).await.unwrap();
    // Given back with a delay: not handed out before it ends.
    assert!(g
        .nack(
            "billing",
            &poison.receipt,
            Duration::from_millis(300),
            Some("boom 1")
        )
        .await
        .unwrap());
    assert!(!g
        .nack("billing", &poison.receipt, NO_WAIT, None)
        .await
        .unwrap());
    assert!(g
        .receive("billing", 10, MINUTE, NO_WAIT)
        .await
        .unwrap()
        .is_empty());
    let again = g
        .receive("billing", 10, MINUTE, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!((again[0].id, again[0].attempts), (poison.id, 2));
    // A reader's error text with a secret and a terminal escape in it.
    g.nack(
        "billing",
        &again[0].receipt,
        NO_WAIT,
        Some("boom 2: postgres://app:hunter2@db/x \u{1b}[2J token=abc123"),
    )
    .await
    .unwrap();
    // Its second attempt was its last: the next receive files it as a dead letter.
    assert!(g
        .receive("billing", 10, MINUTE, NO_WAIT)
        .await
        .unwrap()
        .is_empty());
    let dead = g.dead_letters("billing", 0, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].event_id, poison.event_id);
    assert_eq!(dead[0].attempts, 2);
    // Shown masked, in every view (they all read it here).
    let shown = dead[0].last_error.as_deref().unwrap();
    assert!(shown.starts_with("boom 2: postgres://***@db/x"), "{shown}");
    assert!(
        !shown.contains("hunter2") && !shown.contains("abc123") && !shown.contains('\u{1b}'),
        "{shown}"
    );
    let s = &g.status().await.unwrap()[0];
    assert_eq!(
        (s.dead_letters, s.dead_lettered, s.in_flight, s.waiting),
        (1, 1, 0, 0)
    );
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn an_ordered_group_never_hands_out_two_events_of_one_aggregate() {
    let db = TestDb::new().await;
    let g = groups(&db);
    let mut group = NewGroup::new("ledger");
    group.ordered = true;
    g.create(&group).await.unwrap();
    const EVENTS: i64 = 3_000;
    append(&db, EVENTS, 500, 20).await;

    // aggregate → (in flight now, last sequence acknowledged)
    let state = Arc::new(Mutex::new(HashMap::<String, (bool, i64)>::new()));
    let total = Arc::new(Mutex::new(0_i64));
    let mut readers = Vec::new();
    for reader in 0..3 {
        let (g, state, total) = (g.clone(), state.clone(), total.clone());
        readers.push(tokio::spawn(async move {
            let mut round = 0;
            while *total.lock().unwrap() < EVENTS {
                round += 1;
                let batch = g.receive("ledger", 50, MINUTE, NO_WAIT).await.unwrap();
                {
                    let mut s = state.lock().unwrap();
                    for r in &batch {
                        let e = s.entry(r.aggregate_id.clone()).or_insert((false, 0));
                        assert!(!e.0, "two events of {} in flight at once", r.aggregate_id);
                        e.0 = true;
                    }
                }
                tokio::task::yield_now().await;
                // Reader 0 gives every third batch back, out of turn.
                if reader == 0 && round % 3 == 0 {
                    for r in &batch {
                        state.lock().unwrap().get_mut(&r.aggregate_id).unwrap().0 = false;
                        g.nack("ledger", &r.receipt, NO_WAIT, None).await.unwrap();
                    }
                    continue;
                }
                {
                    let mut s = state.lock().unwrap();
                    for r in &batch {
                        let e = s.get_mut(&r.aggregate_id).unwrap();
                        assert_eq!(r.sequence, Some(e.1 + 1), "{} out of order", r.aggregate_id);
                        *e = (false, e.1 + 1);
                    }
                }
                let n = g.ack("ledger", &receipts(&batch)).await.unwrap();
                assert_eq!(n as usize, batch.len());
                *total.lock().unwrap() += n as i64;
                if batch.is_empty() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }));
    }
    for r in readers {
        tokio::time::timeout(Duration::from_secs(300), r)
            .await
            .expect("the readers finish")
            .unwrap();
    }
    assert_eq!(*total.lock().unwrap(), EVENTS);
    db.drop_schema().await;
}

#[tokio::test]
async fn types_and_start_points_choose_what_a_group_reads() {
    let db = TestDb::new().await;
    let g = groups(&db);
    db.exec(
        "INSERT INTO {schema}.log (event_id, event_type, aggregate_type, aggregate_id, payload, created_at) \
         VALUES (gen_random_uuid(), 'order.placed', 'order', 'old', '{}', now() - interval '2 days')",
    )
    .await;
    let mut from_start = NewGroup::new("everything");
    from_start.start = GroupStart::Beginning;
    g.create(&from_start).await.unwrap();
    let mut since = NewGroup::new("since-yesterday");
    since.start = GroupStart::At(chrono::Utc::now() - chrono::Duration::days(1));
    g.create(&since).await.unwrap();
    let mut typed = NewGroup::new("orders_only");
    typed.types = Some(vec!["order.*".to_owned()]);
    g.create(&typed).await.unwrap();
    g.create(&NewGroup::new("from-now")).await.unwrap();
    db.exec(
        "INSERT INTO {schema}.log (event_id, event_type, aggregate_type, aggregate_id, payload) \
         VALUES (gen_random_uuid(), 'order.shipped', 'order', 'new', '{}'), \
                (gen_random_uuid(), 'user_created', 'user', 'u', '{}')",
    )
    .await;
    let read = |name: &'static str| {
        let g = g.clone();
        async move {
            let mut types: Vec<String> = g
                .receive(name, 10, MINUTE, NO_WAIT)
                .await
                .unwrap()
                .into_iter()
                .map(|r| format!("{}/{}", r.event_type, r.aggregate_id))
                .collect();
            types.sort();
            types
        }
    };
    assert_eq!(
        read("everything").await,
        ["order.placed/old", "order.shipped/new", "user_created/u"]
    );
    assert_eq!(
        read("since-yesterday").await,
        ["order.shipped/new", "user_created/u"]
    );
    // `_` is itself in a glob, not LIKE's any-character.
    assert_eq!(read("orders_only").await, ["order.shipped/new"]);
    assert_eq!(
        read("from-now").await,
        ["order.shipped/new", "user_created/u"]
    );

    // Bad input is refused with a reason, and nothing is created.
    for (bad, code) in [
        (NewGroup::new("everything"), "42710"),
        (NewGroup::new("no spaces"), "22023"),
        (
            NewGroup {
                max_attempts: 0,
                ..NewGroup::new("zero")
            },
            "22023",
        ),
        (
            NewGroup {
                types: Some(vec![]),
                ..NewGroup::new("no-types")
            },
            "22023",
        ),
    ] {
        let err = g.create(&bad).await.unwrap_err();
        let db_err = err.as_database_error().expect("a database error");
        assert_eq!(
            db_err.code().as_deref(),
            Some(code),
            "{}: {db_err}",
            bad.name
        );
    }
    let err = g.receive("missing", 10, MINUTE, NO_WAIT).await.unwrap_err();
    assert_eq!(
        err.as_database_error().unwrap().code().as_deref(),
        Some("42704")
    );
    for bad in [
        "x",
        "00000000-0000-0000-0000-000000000000:1:2",
        "00000000-0000-0000-0000-000000000000:",
    ] {
        let err = g.ack("everything", &[bad.to_owned()]).await.unwrap_err();
        assert_eq!(
            err.as_database_error().unwrap().code().as_deref(),
            Some("22023"),
            "{bad}"
        );
    }
    assert_eq!(g.status().await.unwrap().len(), 4);
    assert!(g
        .drop_group("from-now", "test", Some("done"))
        .await
        .unwrap());
    assert!(!g.drop_group("from-now", "test", None).await.unwrap());
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.audit_log WHERE action = 'group_drop'")
            .await,
        1
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn the_log_keeps_a_segment_until_every_group_is_done_with_it() {
    let db = TestDb::new().await;
    let g = groups(&db);
    let mut group = NewGroup::new("slow");
    group.start = GroupStart::Beginning;
    g.create(&group).await.unwrap();
    append(&db, 10, 10, 2).await;
    // Producers move to segment 1; segment 0 holds the ten events.
    db.exec("UPDATE {schema}.log_settings SET segment = 1")
        .await;
    let truncate = || async {
        sqlx::query_scalar::<_, Option<i64>>(trusted(
            &db.sql("SELECT {schema}.log_truncate(0, false)"),
        ))
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    assert_eq!(truncate().await, None, "unread by the group");
    let batch = g.receive("slow", 10, MINUTE, NO_WAIT).await.unwrap();
    assert_eq!(batch.len(), 10);
    assert_eq!(truncate().await, None, "in flight");
    g.nack("slow", &batch[0].receipt, MINUTE, None)
        .await
        .unwrap();
    g.ack("slow", &receipts(&batch[1..])).await.unwrap();
    // This receive finds the window read to its end and moves the cursor
    // past it: the segment is still needed for the one event waiting.
    let again = g
        .receive("slow", 10, MINUTE, Duration::from_millis(300))
        .await;
    assert!(
        again.unwrap().is_empty(),
        "the nacked event waits its minute"
    );
    assert_eq!(truncate().await, None, "one event waiting");
    db.exec("UPDATE {schema}.group_waiting SET visible_at = now()")
        .await;
    let last = g.receive("slow", 10, MINUTE, NO_WAIT).await.unwrap();
    g.ack("slow", &receipts(&last)).await.unwrap();
    assert_eq!(truncate().await, Some(10));
    db.drop_schema().await;
}

#[tokio::test]
async fn a_partial_ack_settles_only_the_events_it_names() {
    let db = TestDb::new().await;
    let g = groups(&db);
    g.create(&NewGroup::new("billing")).await.unwrap();
    append(&db, 10, 10, 10).await;
    let batch = g
        .receive("billing", 10, Duration::from_secs(1), NO_WAIT)
        .await
        .unwrap();
    assert_eq!(batch.len(), 10);
    // Three of them, one named twice: three acknowledged, then none again.
    let mut some = receipts(&batch[2..5]);
    some.push(some[0].clone());
    assert_eq!(g.ack("billing", &some).await.unwrap(), 3);
    assert_eq!(g.ack("billing", &some).await.unwrap(), 0);
    // The other seven come back when their visibility ends.
    let mut back: Vec<i64> = Vec::new();
    let deadline = tokio::time::Instant::now() + MINUTE;
    while back.len() < 7 && tokio::time::Instant::now() < deadline {
        let again = g
            .receive("billing", 10, MINUTE, Duration::from_millis(200))
            .await
            .unwrap();
        back.extend(again.iter().map(|r| r.id));
    }
    back.sort();
    let mut expected: Vec<i64> = batch[..2].iter().chain(&batch[5..]).map(|r| r.id).collect();
    expected.sort();
    assert_eq!(back, expected);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_replayed_dead_letter_comes_again_even_once_the_log_lost_it() {
    let db = TestDb::new().await;
    let g = groups(&db);
    let mut group = NewGroup::new("billing");
    group.max_attempts = 1;
    g.create(&group).await.unwrap();
    append(&db, 2, 2, 2).await;
    let first = g.receive("billing", 10, MINUTE, NO_WAIT).await.unwrap();
    assert_eq!(first.len(), 2);
    for r in &first {
        g.nack("billing", &r.receipt, NO_WAIT, Some("down"))
            .await
            .unwrap();
    }
    assert!(g
        .receive("billing", 10, MINUTE, NO_WAIT)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(g.dead_letters("billing", 0, 10).await.unwrap().len(), 2);
    // The log no longer has the first (truncated since, say).
    sqlx::query(trusted(&db.sql("DELETE FROM {schema}.log WHERE id = $1")))
        .bind(first[0].id)
        .execute(&db.pool)
        .await
        .unwrap();
    let replayed = g
        .replay_dead("billing", Some(&[first[0].event_id]), "test", Some("fixed"))
        .await
        .unwrap();
    assert_eq!(replayed, 1);
    assert_eq!(g.dead_letters("billing", 0, 10).await.unwrap().len(), 1);
    let again = g.receive("billing", 10, MINUTE, NO_WAIT).await.unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(
        (again[0].event_id, again[0].attempts, &again[0].payload),
        (first[0].event_id, 1, &first[0].payload),
        "the same event, from the group's copy, on a fresh attempt"
    );
    // It dies again: a dead letter once more, with its new error.
    g.nack("billing", &again[0].receipt, NO_WAIT, Some("down again"))
        .await
        .unwrap();
    assert!(g
        .receive("billing", 10, MINUTE, NO_WAIT)
        .await
        .unwrap()
        .is_empty());
    let dead = g.dead_letters("billing", 0, 10).await.unwrap();
    assert_eq!(dead.len(), 2);
    assert_eq!(dead[0].last_error.as_deref(), Some("down again"));
    // Everything else: replayed at once, audited.
    assert_eq!(
        g.replay_dead("billing", None, "test", None).await.unwrap(),
        2
    );
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.audit_log WHERE action = 'group_replay_dead'")
            .await,
        2
    );
    db.drop_schema().await;
}

//! Per-aggregate sequence numbers: assigned in the producing transaction by the
//! library (one event, a batch) and by the SQL function alike; gap-free across
//! rollbacks; concurrent producers on one aggregate serialize. And the
//! consumer-side tracker that judges apply / duplicate / gap.

use postbox::statements::trusted;
use postbox::{NewEvent, Outbox, SequenceCheck};
use postbox_testkit::TestDb;
use sqlx::Row;

fn event(aggregate: &str, n: usize) -> NewEvent {
    NewEvent::new(
        "account.changed",
        "account",
        aggregate,
        &serde_json::json!({ "n": n }),
    )
    .unwrap()
}

/// (aggregate_id, sequence) of every committed event, in id order.
async fn sequences(db: &TestDb) -> Vec<(String, i64)> {
    sqlx::query(trusted(&db.sql(
        "SELECT aggregate_id, sequence FROM {schema}.outbox ORDER BY id",
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

fn of(all: &[(String, i64)], aggregate: &str) -> Vec<i64> {
    all.iter()
        .filter(|(a, _)| a == aggregate)
        .map(|(_, s)| *s)
        .collect()
}

#[tokio::test]
async fn single_and_batch_enqueue_number_each_aggregate_from_one() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let mut tx = db.pool.begin().await.unwrap();
    postbox::sqlx::enqueue(&outbox, &mut tx, &event("a", 0))
        .await
        .unwrap();
    postbox::sqlx::enqueue(&outbox, &mut tx, &event("b", 0))
        .await
        .unwrap();
    // A batch interleaving two aggregates and a new one: numbered in input order.
    let batch: Vec<NewEvent> = ["a", "b", "a", "c", "a"]
        .iter()
        .enumerate()
        .map(|(i, a)| event(a, i))
        .collect();
    postbox::sqlx::enqueue_batch(&outbox, &mut tx, &batch)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // The SQL function continues the same numbering.
    db.exec("SELECT {schema}.enqueue('account.changed', 'account', 'a', '{}'::jsonb)")
        .await;
    let client_events = {
        let (client, conn) =
            tokio_postgres::connect(&postbox_testkit::database_url(), tokio_postgres::NoTls)
                .await
                .unwrap();
        tokio::spawn(conn);
        postbox::tokio_postgres::enqueue(&outbox, &client, &event("b", 9))
            .await
            .unwrap();
        postbox::tokio_postgres::enqueue_batch(&outbox, &client, &[event("c", 1), event("c", 2)])
            .await
            .unwrap()
    };
    assert_eq!(client_events.len(), 2);
    let all = sequences(&db).await;
    assert_eq!(of(&all, "a"), vec![1, 2, 3, 4, 5]);
    assert_eq!(of(&all, "b"), vec![1, 2, 3]);
    assert_eq!(of(&all, "c"), vec![1, 2, 3]);
    // Same aggregate id under another aggregate type is another aggregate.
    db.exec("SELECT {schema}.enqueue('user.changed', 'user', 'a', '{}'::jsonb)")
        .await;
    let user: i64 = db
        .count("SELECT sequence FROM {schema}.outbox WHERE aggregate_type = 'user'")
        .await;
    assert_eq!(user, 1);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_rolled_back_transaction_leaves_no_gap() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    db.enqueue_events(&[event("a", 1)]).await;
    let mut tx = db.pool.begin().await.unwrap();
    postbox::sqlx::enqueue_batch(&outbox, &mut tx, &[event("a", 2), event("a", 3)])
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    sqlx::query(trusted(&db.sql(
        "SELECT {schema}.enqueue('account.changed', 'account', 'a', '{}'::jsonb)",
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    sqlx::query("ROLLBACK").execute(&mut *conn).await.unwrap();
    db.enqueue_events(&[event("a", 4)]).await;
    assert_eq!(of(&sequences(&db).await, "a"), vec![1, 2]);
    drop(conn);
    db.drop_schema().await;
}

#[tokio::test]
async fn concurrent_producers_on_one_aggregate_get_distinct_gap_free_numbers() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let pool = db.another_pool(8).await;
    let mut tasks = Vec::new();
    for worker in 0..8 {
        let pool = pool.clone();
        let outbox = Outbox::new(db.schema.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..25 {
                let mut tx = pool.begin().await.unwrap();
                if i % 2 == 0 {
                    postbox::sqlx::enqueue(&outbox, &mut tx, &event("hot", worker * 100 + i))
                        .await
                        .unwrap();
                } else {
                    let batch = [
                        event("hot", i),
                        event(&format!("cold-{worker}"), i),
                        event("hot", i),
                    ];
                    postbox::sqlx::enqueue_batch(&outbox, &mut tx, &batch)
                        .await
                        .unwrap();
                }
                // Every fifth transaction rolls back: its numbers are handed out again.
                if i % 5 == 4 {
                    tx.rollback().await.unwrap();
                } else {
                    tx.commit().await.unwrap();
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    drop(outbox);
    let all = sequences(&db).await;
    let mut hot = of(&all, "hot");
    hot.sort_unstable();
    let expected: Vec<i64> = (1..=hot.len() as i64).collect();
    assert!(hot.len() > 100, "{} hot events", hot.len());
    assert_eq!(hot, expected, "distinct, gap-free, from 1");
    for worker in 0..8 {
        let mut cold = of(&all, &format!("cold-{worker}"));
        cold.sort_unstable();
        assert_eq!(cold, (1..=cold.len() as i64).collect::<Vec<_>>());
    }
    db.drop_schema().await;
}

#[tokio::test]
async fn the_consumer_tracker_judges_apply_duplicate_and_gap() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let check = |seq: i64| {
        let pool = db.pool.clone();
        let outbox = &outbox;
        async move {
            let mut tx = pool.begin().await.unwrap();
            let c = postbox::sqlx::check_sequence(outbox, &mut tx, "billing", "account", "a", seq)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            c
        }
    };
    assert_eq!(check(1).await, SequenceCheck::Apply);
    assert_eq!(check(1).await, SequenceCheck::Duplicate { last: 1 });
    assert_eq!(
        check(3).await,
        SequenceCheck::Gap {
            expected: 2,
            got: 3
        }
    );
    // A gap does not move the tracker; an apply that rolls back does not either.
    let mut tx = db.pool.begin().await.unwrap();
    let c = postbox::sqlx::check_sequence(&outbox, &mut tx, "billing", "account", "a", 2)
        .await
        .unwrap();
    assert!(c.is_apply());
    tx.rollback().await.unwrap();
    assert_eq!(check(2).await, SequenceCheck::Apply);
    // The handler accepts a gap (e.g. 3 was skipped upstream as poison).
    let mut tx = db.pool.begin().await.unwrap();
    let c = postbox::sqlx::accept_gap(&outbox, &mut tx, "billing", "account", "a", 4)
        .await
        .unwrap();
    assert_eq!(
        c,
        SequenceCheck::Gap {
            expected: 3,
            got: 4
        }
    );
    tx.commit().await.unwrap();
    assert_eq!(check(5).await, SequenceCheck::Apply);
    assert_eq!(check(3).await, SequenceCheck::Duplicate { last: 5 });
    // Another consumer keeps its own tracker; tokio-postgres agrees.
    let (client, conn) =
        tokio_postgres::connect(&postbox_testkit::database_url(), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(conn);
    let c = postbox::tokio_postgres::check_sequence(
        &outbox,
        &client,
        "audit",
        ("account", "a"),
        1,
        false,
    )
    .await
    .unwrap();
    assert_eq!(c, SequenceCheck::Apply);
    // Bad input is refused before the database.
    let mut conn = db.pool.acquire().await.unwrap();
    let err = postbox::sqlx::check_sequence(&outbox, &mut conn, "billing", "account", "a", 0)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("sequence"), "{err}");
    drop(conn);
    db.drop_schema().await;
}

//! The log's snapshot windows are exact: every committed event is read once,
//! none from a rolled-back transaction, whatever the commit order, and each
//! aggregate's events in sequence order.

use postbox::statements::trusted;
use postbox_store::{Log, LogWindow, Store};
use postbox_testkit::TestDb;
use rand::Rng;
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;
use uuid::Uuid;

/// What a producer does in log mode: bump the aggregate's counter, then
/// append the event (the same order as the library and the SQL function).
const APPEND: &str = "WITH seq AS ( \
       INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence) \
       VALUES ('order', $2, 1) \
       ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_sequence = s.last_sequence + 1 \
       RETURNING s.last_sequence) \
     INSERT INTO {schema}.log (event_id, event_type, aggregate_type, aggregate_id, payload, sequence) \
     SELECT $1, 'order.placed', 'order', $2, '{}'::jsonb, seq.last_sequence FROM seq";

struct Reader {
    log: Log,
    owner: Uuid,
    destination: String,
}

impl Reader {
    /// A reader under an owner of its own (the cursor must be free).
    async fn new(db: &TestDb) -> Reader {
        let log = Store::new(db.pool.clone(), db.schema.clone()).log();
        let destination = "default".to_owned();
        let owner = Uuid::new_v4();
        log.ensure_cursors(std::slice::from_ref(&destination))
            .await
            .unwrap();
        let held = log
            .acquire(owner, &destination, 0, Duration::from_secs(60))
            .await
            .unwrap();
        assert!(held);
        Reader {
            log,
            owner,
            destination,
        }
    }

    /// Read one window to its end, page by page, moving the cursor past
    /// each page at once; returns (event id, aggregate, sequence). The window
    /// is opened with its first page from its floor, as the relay does: the
    /// exactness tests below then check the floor too (a floor too high
    /// skips events).
    async fn read_window(&self, page: i64) -> Vec<(Uuid, String, i64)> {
        let mut out = Vec::new();
        let (mut window, mut events) = self
            .log
            .open(&self.destination, 0, self.owner, None, page)
            .await
            .unwrap()
            .expect("the reader holds its cursor");
        loop {
            let done = (events.len() as i64) < page;
            let last = events.last().map_or(window.after_id, |e| e.id);
            out.extend(events.iter().map(seen));
            assert!(self
                .log
                .advance(&window, self.owner, last, events.len() as i64, done)
                .await
                .unwrap());
            if done {
                return out;
            }
            window.after_id = last;
            events = self.log.page(&window, page).await.unwrap();
        }
    }
}

/// How the relay reads: each window opened with its first page in one
/// statement (`open`), the next window starting where the last one ended
/// (`from`) while the move that closed the last one is still to be
/// committed — moves are applied one window late, as a reader's move
/// committing behind it would be.
struct BehindReader {
    reader: Reader,
    /// Where the next window starts, once a window has been read.
    next_lo: Option<String>,
    /// The last window's move, not applied yet: (window, last id, count).
    late: Option<(LogWindow, i64, i64)>,
}

impl BehindReader {
    /// Read one window to its end (moves within it applied at once, the
    /// one closing it left late); returns what it read.
    async fn read_window(&mut self, page: i64) -> Vec<(Uuid, String, i64)> {
        let log = self.reader.log.clone();
        let owner = self.reader.owner;
        let (mut window, mut events) = log
            .open(
                &self.reader.destination,
                0,
                owner,
                self.next_lo.as_deref(),
                page,
            )
            .await
            .unwrap()
            .expect("the reader holds its cursor");
        // The window before this one is moved past only now.
        self.apply_late().await;
        let mut out = Vec::new();
        loop {
            let done = (events.len() as i64) < page;
            let last = events.last().map_or(window.after_id, |e| e.id);
            out.extend(events.iter().map(seen));
            if done {
                self.next_lo = Some(window.hi.clone());
                self.late = Some((window, last, events.len() as i64));
                return out;
            }
            assert!(log
                .advance(&window, owner, last, events.len() as i64, false)
                .await
                .unwrap());
            window.after_id = last;
            events = log.page(&window, page).await.unwrap();
        }
    }

    async fn apply_late(&mut self) {
        if let Some((window, last, n)) = self.late.take() {
            assert!(self
                .reader
                .log
                .advance(&window, self.reader.owner, last, n, true)
                .await
                .unwrap());
        }
    }
}

#[tokio::test]
async fn a_transaction_held_open_is_read_when_it_commits_and_a_rollback_never() {
    let db = TestDb::new().await;
    let append = db.sql(APPEND);
    let reader = Reader::new(&db).await;

    let (held, late, lost) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    let mut open = db.pool.begin().await.unwrap();
    sqlx::query(trusted(&append))
        .bind(held)
        .bind("a")
        .execute(&mut *open)
        .await
        .unwrap();
    let mut rolled_back = db.pool.begin().await.unwrap();
    sqlx::query(trusted(&append))
        .bind(lost)
        .bind("c")
        .execute(&mut *rolled_back)
        .await
        .unwrap();
    // A later transaction (a higher id, a higher txid) commits first.
    sqlx::query(trusted(&append))
        .bind(late)
        .bind("b")
        .execute(&db.pool)
        .await
        .unwrap();

    let first = reader.read_window(10).await;
    assert_eq!(ids(&first), [late], "only the committed event so far");
    assert!(reader.read_window(10).await.is_empty());

    open.commit().await.unwrap();
    rolled_back.rollback().await.unwrap();
    let second = reader.read_window(10).await;
    assert_eq!(ids(&second), [held], "the held event, once it committed");
    assert!(reader.read_window(10).await.is_empty(), "nothing twice");
    db.drop_schema().await;
}

#[tokio::test]
async fn randomized_producers_are_read_exactly_once_in_aggregate_order() {
    randomized_producers(false).await;
}

/// The same, read as the relay reads: windows opened with their first page,
/// each from where the last one ended while its move commits behind.
#[tokio::test]
async fn randomized_producers_are_read_exactly_once_with_moves_behind_the_reader() {
    randomized_producers(true).await;
}

async fn randomized_producers(behind: bool) {
    let db = TestDb::new().await;
    let append = db.sql(APPEND);
    let mut reader = Windows::new(&db, behind).await;
    let producers = 8;
    let per_producer = 60;
    let pool = db.another_pool(producers + 2).await;

    let mut tasks = Vec::new();
    for p in 0..producers {
        let pool = pool.clone();
        let append = append.clone();
        tasks.push(tokio::spawn(async move {
            let mut committed = Vec::new();
            for _ in 0..per_producer {
                let (events, hold, commit, aggregate) = {
                    let mut rng = rand::rng();
                    (
                        rng.random_range(1..4),
                        rng.random_range(0..15u64),
                        rng.random_bool(0.8),
                        format!("agg-{}", rng.random_range(0..6)),
                    )
                };
                let mut tx = pool.begin().await.unwrap();
                let mut ids = Vec::new();
                for _ in 0..events {
                    let id = Uuid::now_v7();
                    sqlx::query(trusted(&append))
                        .bind(id)
                        .bind(&aggregate)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    ids.push(id);
                }
                // Some transactions stay open while others commit around them.
                tokio::time::sleep(Duration::from_millis(hold)).await;
                if commit {
                    tx.commit().await.unwrap();
                    committed.extend(ids);
                } else {
                    tx.rollback().await.unwrap();
                }
            }
            (p, committed)
        }));
    }

    let mut read = Vec::new();
    let mut expected = HashSet::new();
    while !tasks.is_empty() {
        read.extend(reader.read_window(7).await);
        let (done, running): (Vec<_>, Vec<_>) = tasks.into_iter().partition(|t| t.is_finished());
        tasks = running;
        for task in done {
            let (_, committed) = task.await.unwrap();
            expected.extend(committed);
        }
    }
    // Everything committed is visible now: one last window takes the rest.
    read.extend(reader.read_window(7).await);
    // And once every move is in, a reader that starts from the cursor's row
    // (a relay taking over) finds nothing left.
    reader.finish().await;
    let fresh = Reader::new(&db).await;
    assert!(
        fresh.read_window(7).await.is_empty(),
        "read again after the moves"
    );

    let got: Vec<Uuid> = ids(&read);
    let unique: HashSet<Uuid> = got.iter().copied().collect();
    assert_eq!(unique.len(), got.len(), "an event was read twice");
    let missing = expected.difference(&unique).count();
    let extra = unique.difference(&expected).count();
    assert!(
        missing == 0 && extra == 0,
        "{missing} committed events never read, {extra} read that were never committed \
         (of {} committed)",
        expected.len()
    );

    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    for (_, aggregate, sequence) in &read {
        let before = last.insert(aggregate.clone(), *sequence).unwrap_or(0);
        assert!(
            *sequence > before,
            "{aggregate}: sequence {sequence} read after {before}"
        );
    }
    db.drop_schema().await;
}

#[tokio::test]
async fn a_second_owner_cannot_read_a_held_cursor_until_its_lease_ends() {
    let db = TestDb::new().await;
    let reader = Reader::new(&db).await;
    let other = Uuid::new_v4();
    let held = reader
        .log
        .acquire(other, &reader.destination, 0, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(!held, "the cursor is leased to the first reader");
    assert!(reader
        .log
        .open(&reader.destination, 0, other, None, 10)
        .await
        .unwrap()
        .is_none());
    reader
        .log
        .release(reader.owner, &reader.destination, 0)
        .await
        .unwrap();
    let held = reader
        .log
        .acquire(other, &reader.destination, 0, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(held, "released leases are taken at once");
    db.drop_schema().await;
}

/// One of the two readers.
enum Windows {
    Plain(Reader),
    Behind(BehindReader),
}

impl Windows {
    async fn new(db: &TestDb, behind: bool) -> Windows {
        let reader = Reader::new(db).await;
        if behind {
            Windows::Behind(BehindReader {
                reader,
                next_lo: None,
                late: None,
            })
        } else {
            Windows::Plain(reader)
        }
    }

    async fn read_window(&mut self, page: i64) -> Vec<(Uuid, String, i64)> {
        match self {
            Windows::Plain(r) => r.read_window(page).await,
            Windows::Behind(r) => r.read_window(page).await,
        }
    }

    /// Apply what is late, and give the cursor up.
    async fn finish(&mut self) {
        let reader = match self {
            Windows::Plain(r) => r,
            Windows::Behind(r) => {
                r.apply_late().await;
                &r.reader
            }
        };
        reader
            .log
            .release(reader.owner, &reader.destination, 0)
            .await
            .unwrap();
    }
}

/// A schema whose log's cursor for `default` is split into two partitions.
async fn split_in_two() -> (TestDb, Log, String) {
    let db = TestDb::new().await;
    let log = Store::new(db.pool.clone(), db.schema.clone()).log();
    let destination = "default".to_owned();
    log.ensure_split(std::slice::from_ref(&destination), 2)
        .await
        .unwrap();
    (db, log, destination)
}

/// A renewal never gives a partition back (moves of it may be in flight),
/// but says when another relay is owed it; `acquire` then gives it back.
#[tokio::test]
async fn a_renewal_keeps_a_partition_owed_to_another_relay_and_says_so() {
    let (db, log, destination) = split_in_two().await;
    let lease = Duration::from_secs(60);
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    // Alone, the first relay takes both partitions.
    assert!(log.acquire(a, &destination, 0, lease).await.unwrap());
    assert!(log.acquire(a, &destination, 1, lease).await.unwrap());
    // A second relay arrives: its share is one, and nothing is free yet.
    assert!(!log.acquire(b, &destination, 1, lease).await.unwrap());
    let renewed = log.renew(a, &destination, 1, lease).await.unwrap();
    assert_eq!(
        renewed,
        postbox_store::Lease {
            held: true,
            beyond_share: true
        },
        "kept, and owed to the other relay"
    );
    let first = log.renew(a, &destination, 0, lease).await.unwrap();
    assert!(first.held && !first.beyond_share, "within its share");
    assert!(!log.acquire(b, &destination, 1, lease).await.unwrap());
    // Once its moves are in, the first relay gives it back.
    assert!(!log.acquire(a, &destination, 1, lease).await.unwrap());
    assert!(log.acquire(b, &destination, 1, lease).await.unwrap());
    db.drop_schema().await;
}

/// A reader new to a destination and a partition given back announce
/// themselves (`log-lease`), so that the other relays check their share at
/// once; renewals and takes of a free partition stay quiet.
#[tokio::test]
async fn a_joining_reader_and_a_given_back_partition_announce_themselves() {
    let (db, log, destination) = split_in_two().await;
    let channel = db.schema.notify_channel();
    let mut listener = sqlx::postgres::PgListener::connect_with(&db.pool)
        .await
        .unwrap();
    listener.listen(&channel).await.unwrap();
    // The notifications a step sent: those before a mark sent after it
    // (a channel's notifications arrive in commit order).
    let mut sent_by = async |step: &str| -> Vec<String> {
        sqlx::query("SELECT pg_notify($1, 'mark')")
            .bind(&channel)
            .execute(&db.pool)
            .await
            .unwrap();
        let mut got = Vec::new();
        loop {
            let n = tokio::time::timeout(Duration::from_secs(30), listener.recv())
                .await
                .unwrap_or_else(|_| panic!("{step}: the mark never came"))
                .unwrap();
            if n.payload() == "mark" {
                return got;
            }
            got.push(n.payload().to_owned());
        }
    };
    let lease = Duration::from_secs(60);
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let announced = vec!["log-lease".to_owned()];
    assert!(log.acquire(a, &destination, 0, lease).await.unwrap());
    assert_eq!(sent_by("a joins").await, announced, "a joins");
    assert!(log.acquire(a, &destination, 1, lease).await.unwrap());
    assert!(log.acquire(a, &destination, 0, lease).await.unwrap());
    assert!(sent_by("a renews").await.is_empty(), "a renews");
    assert!(!log.acquire(b, &destination, 1, lease).await.unwrap());
    assert_eq!(sent_by("b joins").await, announced, "b joins");
    assert!(
        log.renew(a, &destination, 1, lease)
            .await
            .unwrap()
            .beyond_share
    );
    assert!(sent_by("a keeps").await.is_empty(), "a keeps what it owes");
    assert!(!log.acquire(a, &destination, 1, lease).await.unwrap());
    assert_eq!(sent_by("a gives back").await, announced, "a gives back");
    assert!(log.acquire(b, &destination, 1, lease).await.unwrap());
    assert!(sent_by("b takes").await.is_empty(), "b takes a free one");
    drop(listener);
    db.drop_schema().await;
}

/// What a reader saw of an event: its id, aggregate and sequence.
fn seen(e: &postbox_store::LogEvent) -> (Uuid, String, i64) {
    (
        e.event.event_id,
        e.event.aggregate_id.clone(),
        e.event.sequence.unwrap(),
    )
}

fn ids(read: &[(Uuid, String, i64)]) -> Vec<Uuid> {
    read.iter().map(|(id, _, _)| *id).collect()
}

#[tokio::test]
async fn a_cursor_lags_by_the_committed_events_it_has_not_read() {
    let db = TestDb::new().await;
    let append = db.sql(APPEND);
    let reader = Reader::new(&db).await;
    for i in 0..5 {
        sqlx::query(trusted(&append))
            .bind(Uuid::now_v7())
            .bind(format!("a{i}"))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let lag = reader.log.cursor_lag().await.unwrap();
    assert_eq!(lag.len(), 1);
    assert_eq!(lag[0].lag_events, 5);
    assert!(lag[0].lag_seconds.is_some() && lag[0].held);
    assert_eq!(reader.read_window(100).await.len(), 5);
    let lag = reader.log.cursor_lag().await.unwrap();
    assert_eq!(
        (lag[0].lag_events, lag[0].lag_seconds, lag[0].delivered),
        (0, None, 5)
    );
    db.drop_schema().await;
}

/// A handoff naming an event the log does not hold under that id (a bug the
/// relay could have) is refused and the cursor does not move: the page is
/// read again rather than its events skipped.
#[tokio::test]
async fn a_handoff_of_an_event_not_in_the_log_moves_nothing() {
    let db = TestDb::new().await;
    let reader = Reader::new(&db).await;
    let append = db.sql(APPEND);
    for i in 0..2 {
        sqlx::query(trusted(&append))
            .bind(Uuid::now_v7())
            .bind(format!("a{i}"))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let (window, mut page) = reader
        .log
        .open(&reader.destination, 0, reader.owner, None, 10)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(page.len(), 2);
    let last = page[1].id;
    page[0].id += 1_000_000; // not this event's id
    let handoffs: Vec<_> = page
        .iter()
        .map(|event| postbox_store::Handoff {
            event,
            dead: false,
            delay: Duration::from_secs(1),
            attempts: 1,
            error: "503".into(),
            others: Vec::new(),
        })
        .collect();
    let refused = reader
        .log
        .settle_page(&window, reader.owner, last, 0, true, &handoffs)
        .await;
    assert!(refused.is_err(), "refused: {refused:?}");
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox").await,
        0,
        "nothing handed off"
    );
    let (unmoved, again) = reader
        .log
        .open(&reader.destination, 0, reader.owner, None, 10)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (&unmoved.lo, unmoved.after_id),
        (&window.lo, window.after_id),
        "the cursor did not move past the page"
    );
    assert_eq!(again.len(), 2);

    // Named rightly, both are handed off and the cursor moves.
    page[0].id = again[0].id;
    let handoffs: Vec<_> = page
        .iter()
        .map(|event| postbox_store::Handoff {
            event,
            dead: false,
            delay: Duration::from_secs(1),
            attempts: 1,
            error: "503".into(),
            others: Vec::new(),
        })
        .collect();
    assert!(reader
        .log
        .settle_page(&window, reader.owner, last, 0, true, &handoffs)
        .await
        .unwrap());
    assert_eq!(db.count("SELECT count(*) FROM {schema}.outbox").await, 2);
    db.drop_schema().await;
}

/// Every column of an event reaches the relay as it was committed, whether
/// it is read from a window's first page (`open`), a later page (`page`) or
/// a claim: the fields differ from one another and from their defaults, so
/// a column returned under another's name (`log_page` returns its columns
/// by position) or read from the wrong place shows.
#[tokio::test]
async fn an_event_is_read_as_committed_from_a_window_a_page_and_a_claim() {
    let db = TestDb::new().await;
    let reader = Reader::new(&db).await;
    let columns = "event_id, event_type, aggregate_type, aggregate_id, schema_version, \
                   payload, headers, sequence, created_at";
    let values = "$1, $2, $3, $4, $5, $6::jsonb, $7::jsonb, $8, $9";
    let created = chrono::DateTime::parse_from_rfc3339("2026-01-02T03:04:05.678901Z")
        .unwrap()
        .with_timezone(&chrono::Utc);
    let expected = |i: i64| Expected {
        event_type: format!("order.placed.{i}"),
        aggregate_type: format!("order-type-{i}"),
        aggregate_id: format!("order-id-{i}"),
        schema_version: 3 + i as i32,
        payload: format!(r#"{{"n": {i}, "s": "x"}}"#),
        headers: BTreeMap::from([
            ("h".to_owned(), format!("v{i}")),
            ("n".to_owned(), "7".to_owned()),
        ]),
        sequence: Some(40 + i),
        created_at: created + chrono::Duration::seconds(i),
    };
    let mut ids = Vec::new();
    for table in ["log", "outbox"] {
        let insert = db.sql(&format!(
            "INSERT INTO {{schema}}.{table} ({columns}) VALUES ({values})"
        ));
        for i in 0..3 {
            let e = expected(i);
            let id = Uuid::now_v7();
            ids.push(id);
            let headers = serde_json::json!({"h": format!("v{i}"), "n": 7}).to_string();
            sqlx::query(trusted(&insert))
                .bind(id)
                .bind(&e.event_type)
                .bind(&e.aggregate_type)
                .bind(&e.aggregate_id)
                .bind(e.schema_version)
                .bind(&e.payload)
                .bind(headers)
                .bind(e.sequence)
                .bind(e.created_at)
                .execute(&db.pool)
                .await
                .unwrap();
        }
    }
    let check = |source: &str, i: i64, event: &postbox_store::ClaimedEvent, id: Uuid| {
        let e = expected(i);
        let payload: serde_json::Value = serde_json::from_str(event.payload.get()).unwrap();
        let want: serde_json::Value = serde_json::from_str(&e.payload).unwrap();
        assert_eq!(
            (
                event.event_id,
                &event.event_type,
                &event.aggregate_type,
                &event.aggregate_id,
                event.schema_version,
                payload,
                &event.headers,
                event.sequence,
                event.created_at,
                event.attempt,
            ),
            (
                id,
                &e.event_type,
                &e.aggregate_type,
                &e.aggregate_id,
                e.schema_version,
                want,
                &e.headers,
                e.sequence,
                e.created_at,
                1,
            ),
            "{source}: event {i}"
        );
    };
    // The window's first page holds one event, the next page the rest.
    let (mut window, first) = reader
        .log
        .open(&reader.destination, 0, reader.owner, None, 1)
        .await
        .unwrap()
        .expect("the reader holds its cursor");
    assert_eq!(first.len(), 1);
    check("open", 0, &first[0].event, ids[0]);
    window.after_id = first[0].id;
    let page = reader.log.page(&window, 10).await.unwrap();
    assert_eq!(page.len(), 2);
    for (i, e) in page.iter().enumerate() {
        assert!(!e.scheduled);
        check("page", i as i64 + 1, &e.event, ids[i + 1]);
    }
    let store = Store::new(db.pool.clone(), db.schema.clone());
    let claim = store
        .claim(10, Duration::from_secs(60), None)
        .await
        .unwrap();
    assert_eq!(claim.events.len(), 3);
    for (i, event) in claim.events.iter().enumerate() {
        check("claim", i as i64, event, ids[i + 3]);
    }
    db.drop_schema().await;
}

/// What `an_event_is_read_as_committed_from_a_window_a_page_and_a_claim` wrote.
struct Expected {
    event_type: String,
    aggregate_type: String,
    aggregate_id: String,
    schema_version: i32,
    payload: String,
    headers: BTreeMap<String, String>,
    sequence: Option<i64>,
    created_at: chrono::DateTime<chrono::Utc>,
}

/// A window's floor (migration 31's `log_floor`) is the lowest id of the
/// window's events less one, whatever the transactions that wrote them:
/// large ones it visits one by one, small ones it walks, a mix of both, a
/// large one still in progress at the window's end (none of its ids
/// count), one in progress at its start, one rolled back. Every pair of
/// snapshots taken along the way is a window, and each answer is held to
/// the plain definition.
#[tokio::test]
async fn a_windows_floor_is_its_lowest_event_id_whatever_wrote_it() {
    let db = TestDb::new().await;
    let pool = db.another_pool(3).await;
    let insert = db.sql(
        "INSERT INTO {schema}.log (event_id, event_type, aggregate_type, aggregate_id, payload) \
         SELECT gen_random_uuid(), 'order.placed', 'order', 'o-1', '{}' \
         FROM generate_series(1, $1)",
    );
    // A transaction that has appended `n` events, still open.
    let begun = |n: i32| {
        let (pool, insert) = (pool.clone(), insert.clone());
        async move {
            let mut tx = pool.begin().await.unwrap();
            sqlx::query(trusted(&insert))
                .bind(n)
                .execute(&mut *tx)
                .await
                .unwrap();
            tx
        }
    };
    let append = |n: i32| {
        let begun = begun(n);
        async move { begun.await.commit().await.unwrap() }
    };
    let snapshot = || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>("SELECT pg_current_snapshot()::text")
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let mut snapshots = vec![snapshot().await];

    // Large transactions, then small ones after them.
    for _ in 0..3 {
        append(40).await;
    }
    snapshots.push(snapshot().await);
    for _ in 0..5 {
        append(1).await;
    }
    // Small ones, then a large one.
    append(2).await;
    append(60).await;
    snapshots.push(snapshot().await);

    // A large transaction takes the lowest ids and stays open across the
    // next snapshots, while large ones commit after it.
    let open = begun(50).await;
    append(30).await;
    append(30).await;
    snapshots.push(snapshot().await);
    // One rolled back among them.
    begun(45).await.rollback().await.unwrap();
    append(25).await;
    snapshots.push(snapshot().await);
    open.commit().await.unwrap();
    snapshots.push(snapshot().await);
    append(1).await;
    snapshots.push(snapshot().await);

    let floor = db.sql("SELECT {schema}.log_floor($1::pg_snapshot, $2::pg_snapshot)");
    let defined = db.sql(
        "SELECT min(l.id) - 1 FROM {schema}.log l \
         WHERE pg_visible_in_snapshot(l.txid, $2::pg_snapshot) \
           AND (l.txid >= pg_snapshot_xmax($1::pg_snapshot) \
                OR l.txid = ANY (ARRAY(SELECT pg_snapshot_xip($1::pg_snapshot))))",
    );
    let mut windows = 0;
    for (i, lo) in snapshots.iter().enumerate() {
        for hi in &snapshots[i..] {
            let got: Option<i64> = sqlx::query_scalar(trusted(&floor))
                .bind(lo)
                .bind(hi)
                .fetch_one(&db.pool)
                .await
                .unwrap();
            let want: Option<i64> = sqlx::query_scalar(trusted(&defined))
                .bind(lo)
                .bind(hi)
                .fetch_one(&db.pool)
                .await
                .unwrap();
            assert_eq!(got, want, "window {lo} .. {hi}");
            windows += 1;
        }
    }
    assert_eq!(windows, 28);
    drop(pool);
    db.drop_schema().await;
}

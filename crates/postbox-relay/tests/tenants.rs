//! One relay serving many outboxes: discovery, outboxes added and removed at
//! run time, isolation of a broken outbox, fairness under a huge backlog.
//! Each test makes its own schemas (and databases) under a unique prefix and
//! drops them at the end.

use crate::support::{fast_config, Logs, ScriptedSink};
use postbox::statements::trusted;
use postbox::{NewEvent, Schema};
use postbox_relay::{
    OutboxSource, Outcome, ReadMode, Router, RunMode, Sink, Store, Tenants, TenantsConfig,
};
use postbox_store::directory::NamePattern as Pattern;
use postbox_testkit::{database_url, unique, wait_for};
use sqlx::postgres::PgConnectOptions;
use sqlx::PgPool;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(30);

fn connect() -> PgConnectOptions {
    PgConnectOptions::from_str(&database_url()).unwrap()
}

fn config() -> TenantsConfig {
    TenantsConfig {
        relay: fast_config(),
        max_in_flight_batches: 4,
        pool_size: 2,
        rediscover_interval: Duration::from_millis(200),
        idle_poll: Duration::from_millis(200),
        ..TenantsConfig::default()
    }
}

async fn pool() -> PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(connect())
        .await
        .unwrap()
}

async fn migrated(pool: &PgPool, name: &str) -> Schema {
    let schema = Schema::new(name).unwrap();
    let mut conn = pool.acquire().await.unwrap();
    postbox::sqlx::migrate(&mut conn, &schema).await.unwrap();
    schema
}

/// A migrated outbox whose producers write where a relay in `mode` reads.
async fn migrated_for(pool: &PgPool, name: &str, mode: ReadMode) -> Schema {
    let schema = migrated(pool, name).await;
    if mode == ReadMode::Log {
        Store::new(pool.clone(), schema.clone())
            .log()
            .set_producer_target(postbox_store::ProducerTarget::Log)
            .await
            .unwrap();
    }
    schema
}

async fn drop_schema(pool: &PgPool, schema: &str) {
    sqlx::raw_sql(trusted(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE")))
        .execute(pool)
        .await
        .unwrap();
}

async fn enqueue(pool: &PgPool, schema: &Schema, event_type: &str, n: usize) {
    let outbox = postbox::Outbox::new(schema.clone());
    let events: Vec<NewEvent> = (0..n)
        .map(|i| {
            NewEvent::new(
                event_type,
                "order",
                i.to_string(),
                &serde_json::json!({"i": i}),
            )
            .unwrap()
        })
        .collect();
    for chunk in events.chunks(1000) {
        let mut tx = pool.begin().await.unwrap();
        postbox::sqlx::enqueue_batch(&outbox, &mut tx, chunk)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
}

fn delivered_from(sink: &ScriptedSink, source: &str) -> usize {
    sink.seen
        .lock()
        .unwrap()
        .messages
        .iter()
        .filter(|m| m.source.as_deref() == Some(source))
        .count()
}

fn start(tenants: Arc<Tenants>, stop: &CancellationToken) -> tokio::task::JoinHandle<()> {
    let stop = stop.clone();
    tokio::spawn(async move {
        tenants.run(RunMode::Forever, stop).await;
    })
}

#[tokio::test]
async fn serves_every_schema_matching_the_pattern() {
    let pool = pool().await;
    let prefix = unique("tn");
    let a = migrated(&pool, &format!("{prefix}_a")).await;
    let b = migrated(&pool, &format!("{prefix}_b")).await;
    let other = migrated(&pool, &unique("tn_other_")).await;
    // Matching but never migrated: not an outbox.
    sqlx::raw_sql(trusted(&format!("CREATE SCHEMA {prefix}_bare")))
        .execute(&pool)
        .await
        .unwrap();
    let sink = ScriptedSink::delivering();
    let tenants = Arc::new(
        Tenants::new(
            config(),
            vec![OutboxSource::Discover {
                connect: connect(),
                databases: None,
                schemas: Pattern::parse(&format!("{prefix}_*")).unwrap(),
            }],
            Router::single(sink.clone() as Arc<dyn Sink>),
        )
        .unwrap(),
    );
    let stop = CancellationToken::new();
    let task = start(tenants.clone(), &stop);
    enqueue(&pool, &a, "order.created", 3).await;
    enqueue(&pool, &b, "order.created", 2).await;
    enqueue(&pool, &other, "order.created", 1).await;
    let source = |s: &Schema| format!("postbox/postgres/{}", s.name());
    wait_for(
        "both outboxes delivered, each event naming its outbox",
        WAIT,
        || async {
            delivered_from(&sink, &source(&a)) == 3 && delivered_from(&sink, &source(&b)) == 2
        },
    )
    .await;
    let names: Vec<String> = tenants.status().into_iter().map(|o| o.name).collect();
    assert_eq!(
        names,
        vec![
            format!("postgres/{}", a.name()),
            format!("postgres/{}", b.name())
        ]
    );
    wait_for("both outboxes acknowledged", WAIT, || async {
        tenants.total().delivered == 5
    })
    .await;
    assert_eq!(
        sink.count(),
        5,
        "the schema outside the pattern is not served"
    );
    stop.cancel();
    task.await.unwrap();
    for s in [a.name(), b.name(), other.name(), &format!("{prefix}_bare")] {
        drop_schema(&pool, s).await;
    }
}

#[tokio::test]
async fn outboxes_come_and_go_without_a_restart() {
    let pool = pool().await;
    let prefix = unique("tn");
    let first = migrated(&pool, &format!("{prefix}_1")).await;
    let sink = ScriptedSink::delivering();
    let tenants = Arc::new(
        Tenants::new(
            config(),
            vec![OutboxSource::Discover {
                connect: connect(),
                databases: None,
                schemas: Pattern::parse(&format!("{prefix}_*")).unwrap(),
            }],
            Router::single(sink.clone() as Arc<dyn Sink>),
        )
        .unwrap(),
    );
    let stop = CancellationToken::new();
    let task = start(tenants.clone(), &stop);
    enqueue(&pool, &first, "order.created", 1).await;
    wait_for("the first outbox delivers", WAIT, || async {
        sink.count() == 1
    })
    .await;

    // A tenant is added: it is found and served.
    let second = migrated(&pool, &format!("{prefix}_2")).await;
    enqueue(&pool, &second, "order.created", 2).await;
    wait_for("the added outbox delivers", WAIT, || async {
        sink.count() == 3
    })
    .await;

    // A tenant is removed: its engine stops, the others go on.
    drop_schema(&pool, first.name()).await;
    let first_name = format!("postgres/{}", first.name());
    wait_for("the removed outbox is no longer served", WAIT, || async {
        tenants
            .status()
            .iter()
            .any(|o| o.name == first_name && !o.serving)
    })
    .await;
    enqueue(&pool, &second, "order.created", 1).await;
    wait_for("the remaining outbox still delivers", WAIT, || async {
        sink.count() == 4
    })
    .await;
    stop.cancel();
    task.await.unwrap();
    drop_schema(&pool, second.name()).await;
}

#[tokio::test]
async fn a_broken_outbox_never_stops_the_others() {
    let pool = pool().await;
    let prefix = unique("tn");
    let good = migrated(&pool, &format!("{prefix}_good")).await;
    let poisoned = migrated(&pool, &format!("{prefix}_poison")).await;
    let missing = Schema::new(&format!("{prefix}_missing")).unwrap();
    let nowhere = connect().database(&unique("tn_no_db_"));
    // Rejects every event of type `poison`.
    let sink = ScriptedSink::new(|m, _| {
        if m.event_type == "poison" {
            Outcome::reject("cannot take this")
        } else {
            Outcome::Delivered
        }
    });
    let outbox = |connect: PgConnectOptions, schema: &Schema| OutboxSource::Outbox {
        connect,
        schema: schema.clone(),
        with: None,
    };
    let logs = Logs::default();
    let _capturing = logs.capture(tracing::Level::WARN);
    let tenants = Arc::new(
        Tenants::new(
            config(),
            vec![
                outbox(nowhere.clone(), &good),
                outbox(connect(), &missing),
                outbox(connect(), &poisoned),
                outbox(connect(), &good),
            ],
            Router::single(sink.clone() as Arc<dyn Sink>),
        )
        .unwrap(),
    );
    let stop = CancellationToken::new();
    let task = start(tenants.clone(), &stop);
    enqueue(&pool, &poisoned, "poison", 5).await;
    enqueue(&pool, &poisoned, "order.created", 2).await;
    enqueue(&pool, &good, "order.created", 3).await;
    let good_source = format!("postbox/postgres/{}", good.name());
    let poisoned_source = format!("postbox/postgres/{}", poisoned.name());
    wait_for("the healthy outboxes deliver", WAIT, || async {
        delivered_from(&sink, &good_source) == 3 && delivered_from(&sink, &poisoned_source) == 7
    })
    .await;
    let of = |name: &str| {
        tenants
            .status()
            .into_iter()
            .find(|o| o.name.ends_with(name))
            .unwrap()
    };
    let poisoned_name = format!("postgres/{}", poisoned.name());
    wait_for(
        "the poison events are dead letters, the others delivered",
        WAIT,
        || async {
            let s = of(&poisoned_name).stats;
            s.dead_lettered == 5 && s.delivered == 2
        },
    )
    .await;
    wait_for("the broken outboxes' errors are counted", WAIT, || async {
        let status = tenants.status();
        let errors = |suffix: &str| {
            status
                .iter()
                .find(|o| o.name.ends_with(suffix))
                .map_or(0, |o| o.errors)
        };
        errors(&format!("/{}", missing.name())) > 0
            && errors(&format!(
                "{}/{}",
                nowhere.get_database().unwrap(),
                good.name()
            )) > 0
    })
    .await;
    assert!(!of(&format!("/{}", missing.name())).serving);
    let text = logs.text();
    assert!(
        text.contains(&format!("outbox=postgres/{}", missing.name())),
        "the missing outbox is named in the log: {text}"
    );
    assert!(
        text.contains(nowhere.get_database().unwrap()),
        "the broken database is named in the log: {text}"
    );
    stop.cancel();
    task.await.unwrap();
    drop_schema(&pool, good.name()).await;
    drop_schema(&pool, poisoned.name()).await;
}

#[tokio::test]
async fn a_huge_backlog_does_not_starve_a_quiet_outbox() {
    const BACKLOG: usize = 20_000;
    let pool = pool().await;
    let prefix = unique("tn");
    let busy = migrated(&pool, &format!("{prefix}_busy")).await;
    let quiet = migrated(&pool, &format!("{prefix}_quiet")).await;
    enqueue(&pool, &busy, "order.created", BACKLOG).await;
    let sink = ScriptedSink::delivering();
    let mut config = config();
    config.max_in_flight_batches = 2;
    config.relay.batch_size = 100;
    let tenants = Arc::new(
        Tenants::new(
            config,
            vec![OutboxSource::Discover {
                connect: connect(),
                databases: None,
                schemas: Pattern::parse(&format!("{prefix}_*")).unwrap(),
            }],
            Router::single(sink.clone() as Arc<dyn Sink>),
        )
        .unwrap(),
    );
    let stop = CancellationToken::new();
    let task = start(tenants.clone(), &stop);
    let busy_source = format!("postbox/postgres/{}", busy.name());
    let quiet_source = format!("postbox/postgres/{}", quiet.name());
    wait_for("the busy outbox is draining", WAIT, || async {
        delivered_from(&sink, &busy_source) >= 500
    })
    .await;
    let mut latencies = Vec::new();
    for _ in 0..3 {
        let before = delivered_from(&sink, &quiet_source);
        let committed = Instant::now();
        enqueue(&pool, &quiet, "order.created", 1).await;
        wait_for("the quiet outbox's event is delivered", WAIT, || async {
            delivered_from(&sink, &quiet_source) == before + 1
        })
        .await;
        latencies.push(committed.elapsed());
        let busy_done = delivered_from(&sink, &busy_source);
        assert!(
            busy_done < BACKLOG * 9 / 10,
            "the quiet outbox was served while the busy one still had a backlog ({busy_done} of {BACKLOG} done)"
        );
    }
    assert!(
        latencies.iter().all(|l| *l < Duration::from_secs(2)),
        "each quiet event waited for a turn, not for the backlog: {latencies:?}"
    );
    wait_for(
        "the backlog drains too",
        Duration::from_secs(120),
        || async { delivered_from(&sink, &busy_source) == BACKLOG },
    )
    .await;
    stop.cancel();
    task.await.unwrap();
    drop_schema(&pool, busy.name()).await;
    drop_schema(&pool, quiet.name()).await;
}

#[tokio::test]
async fn a_quiet_outbox_is_served_while_every_busy_batch_is_stuck() {
    quiet_outbox_served_while_busy_batches_are_stuck(ReadMode::Claim).await;
}

#[tokio::test]
async fn a_quiet_log_mode_outbox_is_served_while_every_busy_batch_is_stuck() {
    quiet_outbox_served_while_busy_batches_are_stuck(ReadMode::Log).await;
}

/// Two permits (one shared, one reserved for outboxes with nothing in
/// flight); a busy outbox whose destination never answers, so its batches
/// hold their permits for good; then a quiet outbox appears and commits an
/// event, which is delivered all the same. In log mode the busy outbox reads
/// four partitions at once, so without the reserve (or with its readers each
/// asking as idle) it would hold both permits.
async fn quiet_outbox_served_while_busy_batches_are_stuck(mode: ReadMode) {
    let pool = pool().await;
    let prefix = unique("tn");
    let busy = migrated_for(&pool, &format!("{prefix}_busy"), mode).await;
    enqueue(&pool, &busy, "order.created", 200).await;
    let quiet_name = format!("{prefix}_quiet");
    let gate = Arc::new(tokio::sync::Notify::new());
    let stuck = ScriptedSink::held(gate.clone());
    let sink = ScriptedSink::delivering();
    let mut config = config();
    config.max_in_flight_batches = 2;
    config.relay.batch_size = 10;
    config.relay.mode = mode;
    config.relay.log_partitions = 4;
    let tenants = Arc::new(
        Tenants::new(
            config,
            vec![
                OutboxSource::Outbox {
                    connect: connect(),
                    schema: busy.clone(),
                    with: Some(Arc::new(Router::single(stuck.clone() as Arc<dyn Sink>))),
                },
                // Not there yet: served once it is migrated.
                OutboxSource::Outbox {
                    connect: connect(),
                    schema: Schema::new(&quiet_name).unwrap(),
                    with: None,
                },
            ],
            Router::single(sink.clone() as Arc<dyn Sink>),
        )
        .unwrap(),
    );
    let stop = CancellationToken::new();
    let task = start(tenants.clone(), &stop);
    wait_for(
        "the busy outbox's batch is stuck in its sink",
        WAIT,
        || async { stuck.count() >= 10 },
    )
    .await;
    // Whatever the busy outbox holds or waits for, the quiet one's event
    // goes through (with first-come permits alone, the busy outbox would
    // hold both and the quiet event wait for its sink).
    let quiet = migrated_for(&pool, &quiet_name, mode).await;
    enqueue(&pool, &quiet, "order.created", 1).await;
    wait_for("the quiet outbox's event is delivered", WAIT, || async {
        sink.count() == 1
    })
    .await;
    let busy_stats = tenants
        .status()
        .into_iter()
        .find(|o| o.schema == busy.name())
        .expect("the busy outbox is listed")
        .stats;
    assert_eq!(
        busy_stats.delivered, 0,
        "the busy outbox's batches were all still stuck"
    );
    stop.cancel();
    // Let the stuck batches answer, so the relay stops without waiting out its timeout.
    wait_for("the relay stops", WAIT, || async {
        gate.notify_waiters();
        task.is_finished()
    })
    .await;
    task.await.unwrap();
    drop_schema(&pool, busy.name()).await;
    drop_schema(&pool, quiet.name()).await;
}

/// Log-mode outboxes obey the global cap too: every reader's round is a
/// batch holding a permit until its page is settled.
#[tokio::test]
async fn log_mode_outboxes_never_have_more_batches_in_flight_than_the_cap() {
    outboxes_never_have_more_batches_in_flight_than_the_cap(ReadMode::Log).await;
}

/// So do logical-mode ones: every batch read from an outbox's slot holds a
/// permit until it is published and handed off. Each outbox reads its own
/// slot, `postbox_<schema>`.
#[tokio::test]
async fn logical_mode_outboxes_never_have_more_batches_in_flight_than_the_cap() {
    outboxes_never_have_more_batches_in_flight_than_the_cap(ReadMode::Logical).await;
}

/// Publish calls are held until the test lets them go; the sink keeps the
/// most ever in progress.
async fn outboxes_never_have_more_batches_in_flight_than_the_cap(mode: ReadMode) {
    const CAP: usize = 3;
    const OUTBOXES: usize = 4;
    const EVENTS: usize = 30;
    let pool = pool().await;
    let prefix = unique("tn");
    let mut schemas = Vec::new();
    for i in 0..OUTBOXES {
        let schema = migrated_for(&pool, &format!("{prefix}_{i}"), mode).await;
        if mode != ReadMode::Logical {
            enqueue(&pool, &schema, "order.created", EVENTS).await;
        }
        schemas.push(schema);
    }
    let gate = Arc::new(tokio::sync::Notify::new());
    let sink = ScriptedSink::held(gate.clone());
    let mut config = config();
    config.max_in_flight_batches = CAP;
    // Held calls must not time out (a timed-out call is retried, and counted
    // as in progress for good).
    config.relay.publish_timeout = Duration::from_secs(120);
    config.relay.lease = Duration::from_secs(300);
    config.relay.mode = mode;
    config.relay.batch_size = 5;
    // Log mode: two readers per outbox, eight could publish at once without
    // the cap. Logical mode: one reader per outbox, four.
    config.relay.log_partitions = 2;
    let tenants = Arc::new(
        Tenants::new(
            config,
            vec![OutboxSource::Discover {
                connect: connect(),
                databases: None,
                schemas: Pattern::parse(&format!("{prefix}_*")).unwrap(),
            }],
            Router::single(sink.clone() as Arc<dyn Sink>),
        )
        .unwrap(),
    );
    let stop = CancellationToken::new();
    let task = start(tenants.clone(), &stop);
    let slots: Vec<String> = schemas
        .iter()
        .map(|s| format!("postbox_{}", s.name()))
        .collect();
    if mode == ReadMode::Logical {
        // Emitted once each outbox's reader has created its slot.
        wait_for("every outbox's slot", WAIT, || async {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_replication_slots \
                 WHERE slot_name = ANY($1) AND confirmed_flush_lsn IS NOT NULL",
            )
            .bind(&slots)
            .fetch_one(&pool)
            .await
            .unwrap();
            n == OUTBOXES as i64
        })
        .await;
        for schema in &schemas {
            emit(&pool, schema, "order.created", EVENTS).await;
        }
    }
    let total = OUTBOXES * EVENTS;
    // Every outbox has work for its readers: the cap's worth arrive and
    // stay (without the cap, all of them would).
    wait_for("the cap's worth of batches is held", WAIT, || async {
        sink.seen.lock().unwrap().calls >= CAP
    })
    .await;
    wait_for("every event is delivered", WAIT, || async {
        gate.notify_waiters();
        tenants.total().delivered == total as u64
    })
    .await;
    let (most, delivered) = {
        let seen = sink.seen.lock().unwrap();
        (seen.most_calls, seen.messages.len())
    };
    assert_eq!(
        delivered,
        total,
        "every event once: {:?}, twice: {:?}",
        tenants.total(),
        {
            let mut ids = sink.ids();
            ids.sort();
            ids.windows(2)
                .filter(|w| w[0] == w[1])
                .map(|w| w[0])
                .collect::<Vec<_>>()
        }
    );
    assert_eq!(
        most, CAP,
        "batches in flight at once, across every {mode:?}-mode outbox"
    );
    stop.cancel();
    task.await.unwrap();
    if mode == ReadMode::Logical {
        drop_slots(&pool, &schemas[0], &slots).await;
    }
    for s in &schemas {
        drop_schema(&pool, s.name()).await;
    }
}

/// `n` events emitted into the WAL in one transaction (logical mode).
async fn emit(pool: &PgPool, schema: &Schema, event_type: &str, n: usize) {
    let outbox = postbox::Outbox::new(schema.clone());
    let mut tx = pool.begin().await.unwrap();
    for i in 0..n {
        let event = NewEvent::new(
            event_type,
            "order",
            i.to_string(),
            &serde_json::json!({"i": i}),
        )
        .unwrap();
        postbox::sqlx::emit(&outbox, &mut tx, &event).await.unwrap();
    }
    tx.commit().await.unwrap();
}

/// Drop replication slots (a leftover slot retains WAL on the shared
/// server), once their readers have let them go.
async fn drop_slots(pool: &PgPool, schema: &Schema, slots: &[String]) {
    let drop = schema.render("SELECT {schema}.logical_drop_slot($1)");
    for slot in slots {
        wait_for("the slot dropped", WAIT, || async {
            sqlx::query(trusted(&drop))
                .bind(slot)
                .execute(pool)
                .await
                .is_ok()
        })
        .await;
    }
}

#[tokio::test]
async fn serves_the_matching_schemas_of_every_matching_database() {
    let admin = pool().await;
    let prefix = unique("tndb");
    let databases = [format!("{prefix}_x"), format!("{prefix}_y")];
    let mut schemas = Vec::new();
    for db in &databases {
        sqlx::raw_sql(trusted(&format!("CREATE DATABASE {db}")))
            .execute(&admin)
            .await
            .unwrap();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with(connect().database(db))
            .await
            .unwrap();
        let schema = migrated(&pool, "tenant_1").await;
        enqueue(&pool, &schema, "order.created", 2).await;
        pool.close().await;
        schemas.push(schema);
    }
    let sink = ScriptedSink::delivering();
    let tenants = Arc::new(
        Tenants::new(
            config(),
            vec![OutboxSource::Discover {
                connect: connect(),
                databases: Some(Pattern::parse(&format!("{prefix}_*")).unwrap()),
                schemas: Pattern::parse("tenant_*").unwrap(),
            }],
            Router::single(sink.clone() as Arc<dyn Sink>),
        )
        .unwrap(),
    );
    let stop = CancellationToken::new();
    let task = start(tenants.clone(), &stop);
    wait_for("every database's outbox delivers", WAIT, || async {
        databases
            .iter()
            .all(|db| delivered_from(&sink, &format!("postbox/{db}/tenant_1")) == 2)
    })
    .await;
    stop.cancel();
    task.await.unwrap();
    drop(tenants);
    for db in &databases {
        sqlx::raw_sql(trusted(&format!("DROP DATABASE {db} WITH (FORCE)")))
            .execute(&admin)
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn idle_outboxes_hold_no_batch_permit() {
    let pool = pool().await;
    let prefix = unique("tn");
    let mut schemas = Vec::new();
    for i in 0..6 {
        schemas.push(migrated(&pool, &format!("{prefix}_{i}")).await);
    }
    let sink = ScriptedSink::delivering();
    let mut config = config();
    // One permit, and polls far beyond the test: only wake-ups can serve.
    config.max_in_flight_batches = 1;
    config.idle_poll = Duration::from_secs(600);
    config.rediscover_interval = Duration::from_secs(600);
    let tenants = Arc::new(
        Tenants::new(
            config,
            vec![OutboxSource::Discover {
                connect: connect(),
                databases: None,
                schemas: Pattern::parse(&format!("{prefix}_*")).unwrap(),
            }],
            Router::single(sink.clone() as Arc<dyn Sink>),
        )
        .unwrap(),
    );
    let stop = CancellationToken::new();
    let task = start(tenants.clone(), &stop);
    wait_for("every outbox is served", WAIT, || async {
        tenants.status().iter().filter(|o| o.serving).count() == schemas.len()
    })
    .await;
    for s in &schemas {
        enqueue(&pool, s, "order.created", 1).await;
    }
    // An idle engine waiting for work must not keep the only permit.
    wait_for("every outbox delivers", Duration::from_secs(10), || async {
        sink.count() == schemas.len()
    })
    .await;
    stop.cancel();
    task.await.unwrap();
    for s in &schemas {
        drop_schema(&pool, s.name()).await;
    }
}

/// The backlog gauges of every outbox, each labelled with its outbox, so an
/// alert can name the tenant.
#[test]
fn every_outbox_has_its_own_labelled_backlog_gauges() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use postbox_relay::label::OutboxLabels;
    use postbox_relay::metrics as m;

    let debugging = DebuggingRecorder::new();
    let snapshotter = debugging.snapshotter();
    let recorder = OutboxLabels::new(debugging, false);
    // What this thread records: a current-thread runtime keeps every task on it.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let pool = pool().await;
            let prefix = unique("tngauge");
            let a = migrated(&pool, &format!("{prefix}_a")).await;
            let b = migrated(&pool, &format!("{prefix}_b")).await;
            enqueue(&pool, &a, "order.created", 2).await;
            // Two dead letters in a, none in b: nothing for the relay to claim.
            sqlx::raw_sql(trusted(&format!(
                "UPDATE {}.outbox SET status = 'failed', attempts = 5",
                a.name()
            )))
            .execute(&pool)
            .await
            .unwrap();
            let mut config = config();
            config.gauges = Some(Duration::from_millis(100));
            let sink = ScriptedSink::delivering();
            let tenants = Arc::new(
                Tenants::new(
                    config,
                    vec![OutboxSource::Discover {
                        connect: connect(),
                        databases: None,
                        schemas: Pattern::parse(&format!("{prefix}_*")).unwrap(),
                    }],
                    Router::single(sink as Arc<dyn Sink>),
                )
                .unwrap(),
            );
            let stop = CancellationToken::new();
            let task = start(tenants.clone(), &stop);
            let dead_letters = |schema: &Schema| {
                let suffix = format!("/{}", schema.name());
                snapshotter
                    .snapshot()
                    .into_vec()
                    .into_iter()
                    .find_map(|(key, _, _, value)| {
                        let key = key.key();
                        let ours = key.name() == m::DEAD_LETTERS
                            && key
                                .labels()
                                .any(|l| l.key() == "outbox" && l.value().ends_with(&suffix));
                        match value {
                            DebugValue::Gauge(v) if ours => Some(v.into_inner()),
                            _ => None,
                        }
                    })
            };
            wait_for(
                "each outbox's dead-letter gauge, labelled",
                WAIT,
                || async { dead_letters(&a) == Some(2.0) && dead_letters(&b) == Some(0.0) },
            )
            .await;
            stop.cancel();
            task.await.unwrap();
            drop_schema(&pool, a.name()).await;
            drop_schema(&pool, b.name()).await;
        })
    });
}

/// The health watch covers every outbox: an outbox whose table is mostly
/// dead tuples is warned about under its name and reported unhealthy in
/// `status`, while the other outbox of the database stays healthy.
#[tokio::test]
async fn the_health_watch_names_the_unhealthy_outbox() {
    let pool = pool().await;
    let prefix = unique("tnhealth");
    let fine = migrated(&pool, &format!("{prefix}_fine")).await;
    let sick = migrated(&pool, &format!("{prefix}_sick")).await;
    // 200 dead tuples autovacuum may not clean, and none alive.
    sqlx::raw_sql(trusted(&format!(
        "ALTER TABLE {0}.outbox SET (autovacuum_enabled = off)",
        sick.name()
    )))
    .execute(&pool)
    .await
    .unwrap();
    enqueue(&pool, &sick, "order.created", 200).await;
    sqlx::raw_sql(trusted(&format!(
        "DELETE FROM {0}.outbox; SELECT pg_stat_force_next_flush()",
        sick.name()
    )))
    .execute(&pool)
    .await
    .unwrap();
    let logs = Logs::default();
    let _capturing = logs.capture(tracing::Level::WARN);
    let mut config = config();
    config.health = Some(postbox_relay::HealthConfig {
        interval: Duration::from_millis(100),
        // Only the outbox tables: other tests' transactions and slots are not ours.
        max_transaction_age: Duration::from_secs(86_400),
        max_slot_xmin_age: i64::MAX,
        max_dead_tuple_ratio: 0.5,
        min_dead_tuples: 50,
        ..Default::default()
    });
    let tenants = Arc::new(
        Tenants::new(
            config,
            vec![OutboxSource::Discover {
                connect: connect(),
                databases: None,
                schemas: Pattern::parse(&format!("{prefix}_*")).unwrap(),
            }],
            Router::single(ScriptedSink::delivering() as Arc<dyn Sink>),
        )
        .unwrap(),
    );
    let stop = CancellationToken::new();
    let task = start(tenants.clone(), &stop);
    let of = |schema: &Schema| {
        tenants
            .status()
            .into_iter()
            .find(|o| o.schema == schema.name())
    };
    wait_for("the sick outbox is reported unhealthy", WAIT, || async {
        of(&sick).is_some_and(|o| {
            o.serving && !o.healthy && o.health.iter().any(|p| p.kind == "dead_tuples")
        })
    })
    .await;
    // What the whole database shows (autovacuum off on the server, say) is
    // reported on both; the dead tuples only on the sick one.
    let (fine_status, sick_status) = (of(&fine).unwrap(), of(&sick).unwrap());
    let wide: Vec<_> = sick_status
        .health
        .iter()
        .filter(|p| p.kind != "dead_tuples")
        .cloned()
        .collect();
    assert_eq!(fine_status.health, wide, "{fine_status:?}");
    assert_eq!(fine_status.healthy, wide.is_empty(), "{fine_status:?}");
    let text = logs.text();
    let warned = |schema: &Schema| {
        text.lines().any(|l| {
            l.contains("mostly dead tuples")
                && l.contains(&format!("outbox=postgres/{}", schema.name()))
        })
    };
    assert!(warned(&sick), "the warning names the sick outbox: {text}");
    assert!(!warned(&fine), "nothing is said of the other: {text}");
    stop.cancel();
    task.await.unwrap();
    // No longer served: nothing to report.
    assert!(of(&sick).is_some_and(|o| !o.serving && o.health.is_empty()));
    drop_schema(&pool, fine.name()).await;
    drop_schema(&pool, sick.name()).await;
}

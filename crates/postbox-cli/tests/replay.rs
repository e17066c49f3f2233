//! `postbox replay` through the real binary against PostgreSQL and Redis: a
//! job killed half-way and resumed delivers each event of its range at least
//! once and nothing outside it, through the destination's filter, to that
//! destination only, in claim and log mode; bad input is refused with its
//! exit code and nothing sent; retention (the purge, log truncation) keeps
//! what an open job still reads, until it is cancelled (audited). A
//! destination added to an outbox starts where its `start` says.

use postbox::statements::trusted;
use postbox::NewEvent;
use postbox_testkit::{redis, wait_for, TestDb};
use redis::AsyncCommands;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;
use uuid::Uuid;

fn command(db: &TestDb, config: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_postbox"));
    c.args(args)
        .env("DATABASE_URL", &db.url)
        .env("POSTBOX_SCHEMA", db.schema.name())
        .env("POSTBOX_LOG", "warn")
        .env("POSTBOX_CONFIG", config)
        .env("USER", "replay-tester")
        .env_remove("POSTBOX_SINK")
        .env_remove("POSTBOX_SOURCE")
        .env("NO_COLOR", "1");
    c
}

fn postbox(db: &TestDb, config: &Path, args: &[&str]) -> Output {
    command(db, config, args).output().expect("run postbox")
}

fn spawn(db: &TestDb, config: &Path, args: &[&str]) -> Child {
    command(db, config, args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("run postbox")
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Removes the test's file and Redis lists, and kills a runner left
/// behind, even when the test fails.
struct Cleanup {
    file: PathBuf,
    keys: Vec<String>,
    child: Option<Child>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_file(&self.file);
        if let Ok(client) = ::redis::Client::open(postbox_testkit::redis_url()) {
            if let Ok(mut c) = client.get_connection() {
                for k in &self.keys {
                    let _: Result<(), _> = ::redis::cmd("DEL").arg(k).query(&mut c);
                }
            }
        }
    }
}

/// billing (a Redis list) takes events with an even `n`; audit (another
/// list) takes every event. Both are routed every type.
fn setup(db: &TestDb, mode: &str) -> Cleanup {
    let keys = vec![
        format!("{}_billing", db.schema.name()),
        format!("{}_audit", db.schema.name()),
    ];
    let toml = format!(
        r#"[relay]
mode = "{mode}"

[destinations.billing]
url = "{redis}?key={billing}"
filter = '.payload.n % 2 == 0'

[destinations.audit]
url = "{redis}?key={audit}"

[[routes]]
match = ["*"]
to = ["billing", "audit"]
"#,
        redis = postbox_testkit::redis_url(),
        billing = keys[0],
        audit = keys[1],
    );
    let file = std::env::temp_dir().join(format!("{}_replay.toml", db.schema.name()));
    std::fs::write(&file, toml).unwrap();
    Cleanup {
        file,
        keys,
        child: None,
    }
}

/// Commit `n` events of `event_type`, numbered from `first`, in
/// transactions of 1,000.
async fn commit(db: &TestDb, event_type: &str, first: usize, n: usize) -> Vec<(Uuid, usize)> {
    let events: Vec<NewEvent> = (first..first + n)
        .map(|i| {
            NewEvent::new(
                event_type,
                "order",
                (i % 7).to_string(),
                &serde_json::json!({"n": i}),
            )
            .unwrap()
        })
        .collect();
    let ids = db.enqueue_events(&events).await;
    ids.into_iter().zip(first..first + n).collect()
}

async fn clock(db: &TestDb) -> String {
    let t: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// The event ids a Redis list received, with how many times each.
async fn received(key: &str) -> Vec<Uuid> {
    let mut redis = redis().await;
    let bodies: Vec<String> = redis.lrange(key, 0, -1).await.unwrap();
    bodies
        .iter()
        .map(|b| {
            let v: serde_json::Value = serde_json::from_str(b).unwrap();
            v["id"].as_str().unwrap().parse().unwrap()
        })
        .collect()
}

async fn job(db: &TestDb) -> (i64, String, i64, i64, i64) {
    let r: (i64, String, i64, i64, i64) = sqlx::query_as(trusted(&db.sql(
        "SELECT id, state, delivered, filtered, total FROM {schema}.replay_jobs ORDER BY id DESC LIMIT 1",
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    r
}

async fn delivered_so_far(db: &TestDb) -> i64 {
    sqlx::query_scalar(trusted(
        &db.sql("SELECT coalesce(max(delivered), 0) FROM {schema}.replay_jobs"),
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

async fn killed_half_way_and_resumed(mode: &str) {
    let db = TestDb::new().await;
    let mut cleanup = setup(&db, mode);
    let cfg = cleanup.file.clone();
    if mode == "log" {
        let o = postbox(&db, &cfg, &["migrate", "--mode", "log"]);
        assert!(o.status.success(), "{}", text(&o));
    }
    // Before the range, in it (orders and users), after it.
    commit(&db, "order.placed", 0, 50).await;
    let from = clock(&db).await;
    let inside = commit(&db, "order.placed", 1000, 1200).await;
    commit(&db, "user.created", 3000, 100).await;
    let to = clock(&db).await;
    commit(&db, "order.placed", 5000, 50).await;
    let wanted: BTreeSet<Uuid> = inside
        .iter()
        .filter(|(_, n)| n % 2 == 0)
        .map(|(id, _)| *id)
        .collect();

    let args = [
        "replay",
        "--destination",
        "billing",
        "--from",
        &from,
        "--to",
        &to,
        "--types",
        "order.*",
        "--batch-size",
        "50",
        "--rate",
        "400/s",
    ];
    cleanup.child = Some(spawn(&db, &cfg, &args));
    wait_for(
        "the replay is half-way",
        Duration::from_secs(60),
        || async { delivered_so_far(&db).await >= 150 },
    )
    .await;
    let mut child = cleanup.child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let (id, state, delivered, _, total) = job(&db).await;
    assert_eq!(state, "running", "a killed runner leaves its job running");
    assert_eq!(total, 1200, "the range's orders");
    assert!(delivered < 600, "killed half-way: {delivered}");

    let o = postbox(
        &db,
        &cfg,
        &["replay", "resume", &id.to_string(), "--batch-size", "200"],
    );
    assert!(o.status.success(), "{}", text(&o));
    let (_, state, delivered, filtered, _) = job(&db).await;
    assert_eq!(state, "done");
    assert_eq!(delivered, 600, "each even order counted once");
    assert_eq!(filtered, 600, "each odd order filtered out by billing");

    let got = received(&cleanup.keys[0]).await;
    let distinct: BTreeSet<Uuid> = got.iter().copied().collect();
    assert_eq!(
        distinct, wanted,
        "billing got each even order of the range at least once, nothing else"
    );
    assert!(
        got.len() < wanted.len() + 100,
        "at most a page or two again"
    );
    assert!(
        received(&cleanup.keys[1]).await.is_empty(),
        "audit is not replayed to"
    );

    // The job and its start are on record.
    let o = postbox(&db, &cfg, &["replay", "show", &id.to_string(), "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let shown: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        shown["source"],
        if mode == "log" { "log" } else { "outbox" }
    );
    assert_eq!(shown["created_by"], "replay-tester");
    let audited = db
        .count("SELECT count(*) FROM {schema}.audit_log WHERE action = 'replay_start'")
        .await;
    assert_eq!(audited, 1);
    drop(cleanup);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_replay_killed_half_way_and_resumed_delivers_its_range_in_claim_mode() {
    killed_half_way_and_resumed("claim").await;
}

#[tokio::test]
async fn a_replay_killed_half_way_and_resumed_delivers_its_range_in_log_mode() {
    killed_half_way_and_resumed("log").await;
}

#[tokio::test]
async fn bad_input_is_refused_with_its_exit_code_and_nothing_is_sent() {
    let db = TestDb::new().await;
    let cleanup = setup(&db, "claim");
    let cfg = cleanup.file.clone();
    let before = clock(&db).await;
    commit(&db, "order.placed", 0, 20).await;
    let after = clock(&db).await;

    let cases: [(&[&str], i32, &str); 7] = [
        (
            &["--destination", "nope", "--from", "1h"],
            3,
            "no destination \"nope\"",
        ),
        (
            &[
                "--destination",
                "billing",
                "--from",
                &after,
                "--to",
                &before,
            ],
            4,
            "must be after --from",
        ),
        (
            &["--destination", "billing", "--from", "2999-01-01T00:00:00Z"],
            4,
            "in the future",
        ),
        (
            &[
                "--destination",
                "billing",
                "--from",
                "1h",
                "--types",
                "invoice.*",
            ],
            5,
            "nothing to replay",
        ),
        (
            &[
                "--destination",
                "billing",
                "--from",
                "2000-01-01T00:00:00Z",
                "--to",
                "2000-01-02T00:00:00Z",
            ],
            6,
            "before the oldest event",
        ),
        (
            &["--destination", "billing", "--from", "1h", "--rate", "0/s"],
            2,
            "not a rate",
        ),
        (
            &[
                "--destination",
                "billing",
                "--from",
                "1h",
                "--aggregate",
                "order",
            ],
            1,
            "not TYPE:ID",
        ),
    ];
    for (args, code, says) in cases {
        let mut all = vec!["replay"];
        all.extend_from_slice(args);
        let o = postbox(&db, &cfg, &all);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(code), "{args:?}: {t}");
        assert!(t.contains(says), "{args:?} should say {says:?}: {t}");
    }
    let o = postbox(
        &db,
        &cfg,
        &[
            "replay",
            "--destination",
            "billing",
            "--from",
            &before,
            "--dry-run",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("would replay 20 events"),
        "{}",
        text(&o)
    );
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.replay_jobs").await,
        0,
        "no job made"
    );
    assert!(received(&cleanup.keys[0]).await.is_empty(), "nothing sent");
    let o = postbox(&db, &cfg, &["replay", "resume", "12345"]);
    assert!(!o.status.success(), "{}", text(&o));
    drop(cleanup);
    db.drop_schema().await;
}

/// Start a slow replay of everything to billing, and kill it once it has
/// delivered a page: its job stays open (running, no runner).
async fn open_job(db: &TestDb, cleanup: &mut Cleanup, from: &str) -> i64 {
    let cfg = cleanup.file.clone();
    cleanup.child = Some(spawn(
        db,
        &cfg,
        &[
            "replay",
            "--destination",
            "billing",
            "--from",
            from,
            "--batch-size",
            "2",
            "--rate",
            "2/s",
        ],
    ));
    wait_for(
        "the replay's first page",
        Duration::from_secs(30),
        || async { delivered_so_far(db).await >= 1 },
    )
    .await;
    let mut child = cleanup.child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let (id, state, ..) = job(db).await;
    assert_eq!(state, "running");
    id
}

#[tokio::test]
async fn the_purge_keeps_what_an_open_replay_reads_until_it_is_cancelled() {
    let db = TestDb::new().await;
    let mut cleanup = setup(&db, "claim");
    let cfg = cleanup.file.clone();
    let from = clock(&db).await;
    commit(&db, "order.placed", 0, 40).await;
    db.exec("UPDATE {schema}.outbox SET status = 'sent', sent_at = now() - interval '2 days'")
        .await;
    let id = open_job(&db, &mut cleanup, &from).await;

    let o = postbox(&db, &cfg, &["purge", "--older-than", "1d"]);
    assert!(o.status.success(), "{}", text(&o));
    let (after_id, hi): (i64, i64) = sqlx::query_as(trusted(
        &db.sql("SELECT after_id, hi FROM {schema}.replay_jobs WHERE id = $1"),
    ))
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let kept = db
        .count("SELECT count(*) FROM {schema}.outbox WHERE id >= (SELECT after_id FROM {schema}.replay_jobs)")
        .await;
    assert_eq!(kept, hi - after_id + 1, "what the job still reads stays");
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox").await,
        kept,
        "what it has read went"
    );

    let o = postbox(
        &db,
        &cfg,
        &["replay", "cancel", &id.to_string(), "--actor", "ops"],
    );
    assert!(o.status.success(), "{}", text(&o));
    let o = postbox(&db, &cfg, &["replay", "resume", &id.to_string()]);
    assert_eq!(o.status.code(), Some(8), "a cancelled job does not resume");
    let o = postbox(&db, &cfg, &["purge", "--older-than", "1d"]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(db.count("SELECT count(*) FROM {schema}.outbox").await, 0);
    assert_eq!(
        db.count(
            "SELECT count(*) FROM {schema}.audit_log WHERE action = 'replay_cancel' AND actor = 'ops'"
        )
        .await,
        1
    );
    drop(cleanup);
    db.drop_schema().await;
}

#[tokio::test]
async fn log_truncation_keeps_the_segments_an_open_replay_reads() {
    let db = TestDb::new().await;
    let mut cleanup = setup(&db, "log");
    let cfg = cleanup.file.clone();
    let o = postbox(&db, &cfg, &["migrate", "--mode", "log"]);
    assert!(o.status.success(), "{}", text(&o));
    let from = clock(&db).await;
    commit(&db, "order.placed", 0, 30).await;
    // Every destination reads it all, and producers move to the next segment.
    let o = postbox(&db, &cfg, &["relay", "--drain"]);
    assert!(o.status.success(), "{}", text(&o));
    let segment: i32 = sqlx::query_scalar(trusted(
        &db.sql("SELECT segment FROM {schema}.log_settings"),
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let moved: bool = sqlx::query_scalar(trusted(&db.sql("SELECT {schema}.log_rotate('0s')")))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(moved);
    let id = open_job(&db, &mut cleanup, &from).await;

    let truncate = || async {
        sqlx::query_scalar::<_, Option<i64>>(trusted(
            &db.sql("SELECT {schema}.log_truncate($1, false)"),
        ))
        .bind(segment)
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    assert_eq!(truncate().await, None, "an open job keeps its segment");
    let o = postbox(&db, &cfg, &["replay", "cancel", &id.to_string()]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(truncate().await, Some(30), "a cancelled one does not");
    drop(cleanup);
    db.drop_schema().await;
}

/// A file of `[destinations.NAME]` sections, each a Redis list named after
/// the schema and the destination, with its `start` when given, every type
/// routed to each.
fn destinations(
    db: &TestDb,
    mode: &str,
    file: &Path,
    list: &[(&str, Option<&str>)],
) -> Vec<String> {
    let mut toml = format!("[relay]\nmode = \"{mode}\"\n");
    let mut keys = Vec::new();
    for (name, start) in list {
        let key = format!("{}_{name}", db.schema.name());
        toml += &format!(
            "\n[destinations.{name}]\nurl = \"{}?key={key}\"\n",
            postbox_testkit::redis_url()
        );
        if let Some(start) = start {
            toml += &format!("start = \"{start}\"\n");
        }
        keys.push(key);
    }
    let names: Vec<String> = list.iter().map(|(n, _)| format!("{n:?}")).collect();
    toml += &format!(
        "\n[[routes]]\nmatch = [\"*\"]\nto = [{}]\n",
        names.join(", ")
    );
    std::fs::write(file, toml).unwrap();
    keys
}

fn drain(db: &TestDb, cfg: &Path) {
    let o = postbox(db, cfg, &["relay", "--drain"]);
    assert!(o.status.success(), "{}", text(&o));
}

/// The `n` of each event a Redis list received, sorted.
async fn numbers(key: &str) -> Vec<i64> {
    let mut redis = redis().await;
    let bodies: Vec<String> = redis.lrange(key, 0, -1).await.unwrap();
    let mut n: Vec<i64> = bodies
        .iter()
        .map(|b| {
            let v: serde_json::Value = serde_json::from_str(b).unwrap();
            v["data"]["n"].as_i64().unwrap()
        })
        .collect();
    n.sort_unstable();
    n
}

/// In log mode a destination added to a running outbox starts now unless
/// it says otherwise: `beginning` gets what the log retains, a time gets
/// what was created from then on, `now` and no `start` only what comes
/// next. The outbox's first destination, with no `start`, got everything.
#[tokio::test]
async fn a_destination_added_to_a_log_mode_outbox_starts_where_it_says() {
    let db = TestDb::new().await;
    let mut cleanup = setup(&db, "log");
    let cfg = cleanup.file.clone();
    let o = postbox(&db, &cfg, &["migrate", "--mode", "log"]);
    assert!(o.status.success(), "{}", text(&o));
    commit(&db, "order.placed", 0, 10).await;
    let t = clock(&db).await;
    commit(&db, "order.placed", 10, 5).await;
    cleanup.keys = destinations(&db, "log", &cfg, &[("first", None)]);
    drain(&db, &cfg);

    let later = [
        ("first", None),
        ("plain", None),
        ("history", Some("beginning")),
        ("since", Some(t.as_str())),
        ("fresh", Some("now")),
    ];
    cleanup.keys = destinations(&db, "log", &cfg, &later);
    drain(&db, &cfg);
    commit(&db, "order.placed", 15, 3).await;
    drain(&db, &cfg);

    let all: Vec<i64> = (0..18).collect();
    let k = &cleanup.keys;
    assert_eq!(numbers(&k[0]).await, all, "the first destination");
    assert_eq!(numbers(&k[1]).await, vec![15, 16, 17], "no start: now");
    assert_eq!(numbers(&k[2]).await, all, "beginning");
    assert_eq!(numbers(&k[3]).await, (10..18).collect::<Vec<_>>(), "a time");
    assert_eq!(numbers(&k[4]).await, vec![15, 16, 17], "now");
}

/// In claim mode a start time keeps every event created before it from
/// that destination (filtered out, counted), and the others get them; a
/// start that is not one is refused at start-up naming the field.
#[tokio::test]
async fn a_start_time_keeps_earlier_events_from_a_destination_in_claim_mode() {
    let db = TestDb::new().await;
    let mut cleanup = setup(&db, "claim");
    let cfg = cleanup.file.clone();
    cleanup.keys = destinations(
        &db,
        "claim",
        &cfg,
        &[("all", None), ("since", Some("yesterday"))],
    );
    let o = postbox(&db, &cfg, &["relay", "--drain"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("destinations.since.start: \"yesterday\""),
        "{}",
        text(&o)
    );

    commit(&db, "order.placed", 0, 10).await;
    let t = clock(&db).await;
    commit(&db, "order.placed", 10, 5).await;
    cleanup.keys = destinations(
        &db,
        "claim",
        &cfg,
        &[("all", None), ("since", Some(t.as_str()))],
    );
    drain(&db, &cfg);
    assert_eq!(numbers(&cleanup.keys[0]).await, (0..15).collect::<Vec<_>>());
    assert_eq!(
        numbers(&cleanup.keys[1]).await,
        (10..15).collect::<Vec<_>>()
    );
    let o = postbox(&db, &cfg, &["status", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let status = String::from_utf8_lossy(&o.stdout);
    assert!(status.contains("\"filtered\""), "{status}");
}

/// The relay's replay jobs: (created_by, state, delivered).
async fn relay_jobs(db: &TestDb) -> Vec<(String, String, String, i64)> {
    sqlx::query_as(trusted(&db.sql(
        "SELECT destination, created_by, state, delivered FROM {schema}.replay_jobs ORDER BY id",
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// What a list received, each event once (a replay job and live delivery
/// may both send an event still undelivered when the destination came).
async fn distinct_numbers(key: &str) -> Vec<i64> {
    let mut n = numbers(key).await;
    n.dedup();
    n
}

/// In claim and logical mode, a destination added to a running outbox with
/// `start = "beginning"` gets a replay job, made and run by the relay, of
/// what the outbox retains; one with a time gets what was created since
/// (live events created before it are filtered out); one with no start
/// only what is still undelivered. The outbox's first destinations get no
/// job, and a relay started again makes none. In logical mode the outbox
/// retains only what was enqueued into it (emitted events leave no row):
/// events 0–9 are enqueued, 10–15 emitted.
async fn a_destination_added_with_a_start_in_the_past(mode: &str) {
    let db = TestDb::new().await;
    let mut cleanup = setup(&db, mode);
    let cfg = cleanup.file.clone();
    let slot = postbox_testkit::unique("pbx_start_");
    let write = |keys: &[(&str, Option<&str>)]| {
        let k = destinations(&db, mode, &cfg, keys);
        if mode == "logical" {
            let mut toml = std::fs::read_to_string(&cfg).unwrap();
            toml = toml.replacen(
                "[relay]\n",
                &format!("[relay]\nlogical_slot = \"{slot}\"\n"),
                1,
            );
            std::fs::write(&cfg, toml).unwrap();
        }
        k
    };
    let _slot = postbox_testkit::SlotGuard(slot.clone());
    cleanup.keys = write(&[("first", Some("beginning"))]);
    drain(&db, &cfg);
    commit(&db, "order.placed", 0, 10).await;
    drain(&db, &cfg);
    assert!(
        relay_jobs(&db).await.is_empty(),
        "the first destinations get no job"
    );

    let late = if mode == "logical" {
        let emit = db.sql(
            "SELECT {schema}.emit('order.placed', 'order', '1', jsonb_build_object('n', $1::int))",
        );
        for n in 10..13 {
            sqlx::query(trusted(&emit))
                .bind(n)
                .execute(&db.pool)
                .await
                .unwrap();
        }
        let t = clock(&db).await;
        for n in 13..16 {
            sqlx::query(trusted(&emit))
                .bind(n)
                .execute(&db.pool)
                .await
                .unwrap();
        }
        t
    } else {
        commit(&db, "order.placed", 10, 3).await;
        let t = clock(&db).await;
        commit(&db, "order.placed", 13, 3).await;
        t
    };
    cleanup.keys = write(&[
        ("first", Some("beginning")),
        ("history", Some("beginning")),
        ("since", Some(late.as_str())),
        ("plain", None),
    ]);
    drain(&db, &cfg);
    drain(&db, &cfg);
    let k = &cleanup.keys;
    let all: Vec<i64> = (0..16).collect();
    assert_eq!(distinct_numbers(&k[0]).await, all, "the first destination");
    assert_eq!(distinct_numbers(&k[1]).await, all, "beginning");
    assert_eq!(
        distinct_numbers(&k[2]).await,
        vec![13, 14, 15],
        "a time: earlier live events filtered out"
    );
    assert_eq!(
        numbers(&k[3]).await,
        (10..16).collect::<Vec<_>>(),
        "no start: what was undelivered"
    );
    let jobs = relay_jobs(&db).await;
    let history: Vec<_> = jobs.iter().filter(|j| j.0 == "history").collect();
    assert_eq!(history.len(), 1, "one job for beginning: {jobs:?}");
    assert_eq!(
        (history[0].1.as_str(), history[0].2.as_str()),
        ("relay", "done")
    );
    assert!(
        jobs.iter().all(|j| j.0 != "plain" && j.0 != "first"),
        "{jobs:?}"
    );
    drop(cleanup);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_destination_added_with_a_start_in_the_past_gets_history_in_claim_mode() {
    a_destination_added_with_a_start_in_the_past("claim").await;
}

#[tokio::test]
async fn a_destination_added_with_a_start_in_the_past_gets_history_in_logical_mode() {
    a_destination_added_with_a_start_in_the_past("logical").await;
}

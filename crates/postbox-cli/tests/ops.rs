//! Operations: the metrics endpoint during a relay run, retention (`purge`),
//! least-privilege roles and the extended `status`, through the real binary.

use postbox::statements::trusted;
use postbox_testkit::{wait_for, TestDb};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn command(db: &TestDb, url: &str, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_postbox"));
    c.args(args)
        .env("DATABASE_URL", url)
        .env("POSTBOX_SCHEMA", db.schema.name())
        .env("POSTBOX_LOG", "warn")
        .env_remove("POSTBOX_CONFIG")
        .env_remove("POSTBOX_SINK")
        .env_remove("POSTBOX_METRICS_LISTEN")
        .env("NO_COLOR", "1");
    c
}

fn run(db: &TestDb, args: &[&str]) -> Output {
    command(db, &db.url, args).output().expect("run postbox")
}

#[track_caller]
fn ok(o: Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

async fn enqueue(db: &TestDb, n: usize) {
    for i in 0..n {
        sqlx::query(trusted(&db.sql(
            "SELECT {schema}.enqueue('order.created', 'order', $1, jsonb_build_object('n', $2::int))",
        )))
        .bind(format!("o-{i}"))
        .bind(i as i32)
        .execute(&db.pool)
        .await
        .unwrap();
    }
}

/// `GET path` over plain HTTP/1.1; returns (status, body).
pub(crate) async fn get(addr: &str, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(request.as_bytes()).await.unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).await.unwrap();
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = raw.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    (status, body)
}

/// The value of an exposition line `name{labels} value`, matching `series` exactly.
fn sample(scrape: &str, series: &str) -> Option<f64> {
    scrape.lines().find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok()).flatten()
    })
}

/// A relay child, killed when dropped.
pub(crate) struct Relay(pub(crate) Child);

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The address a relay started with `--metrics-listen 127.0.0.1:0` and a
/// piped stderr logs it bound (port 0 → any free port).
pub(crate) async fn metrics_addr(child: &mut Child) -> String {
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some((_, rest)) = line.split_once("http://") {
                let addr: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
                    .collect();
                let _ = tx.send(addr);
            }
        }
    });
    tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(30)))
        .await
        .unwrap()
        .expect("the relay announces its metrics address")
}

#[tokio::test]
async fn metrics_move_during_a_relay_run_and_health_endpoints_answer() {
    let db = TestDb::new().await;
    enqueue(&db, 40).await;
    let mut child = command(
        &db,
        &db.url,
        &[
            "relay",
            "--sink",
            "stdout",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    )
    .env("POSTBOX_LOG", "info")
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .expect("start the relay");
    let addr = metrics_addr(&mut child).await;
    // Transparent huge pages are off for the relay process (with them, its
    // allocator's arenas took 2 MiB pages and a drain's RSS doubled).
    #[cfg(target_os = "linux")]
    {
        let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
        if let Some(line) = status.lines().find(|l| l.starts_with("THP_enabled:")) {
            assert_eq!(line.split_whitespace().nth(1), Some("0"), "{line}");
        }
    }
    let mut relay = Relay(child);

    assert_eq!(get(&addr, "/healthz").await, (200, "ok".to_owned()));
    let delivered = "postbox_publish_outcomes_total{outcome=\"delivered\",destination=\"default\"}";
    wait_for("40 deliveries in /metrics", Duration::from_secs(30), || {
        let addr = addr.clone();
        async move {
            let scrape = get(&addr, "/metrics").await.1;
            sample(&scrape, delivered) == Some(40.0)
                && sample(&scrape, "postbox_commit_to_delivery_seconds_count") == Some(40.0)
        }
    })
    .await;
    let scrape = get(&addr, "/metrics").await.1;
    assert_eq!(
        sample(&scrape, "postbox_publish_attempts_count"),
        Some(40.0)
    );
    assert!(sample(&scrape, "postbox_publish_duration_seconds_count").unwrap_or(0.0) >= 1.0);
    assert_eq!(
        sample(
            &scrape,
            "postbox_publish_outcomes_total{outcome=\"retry\",destination=\"default\"}"
        ),
        Some(0.0)
    );
    assert_eq!(sample(&scrape, "postbox_acks_lost_total"), Some(0.0));
    // The LISTEN probe comes back (a direct connection, no pooler).
    wait_for("the LISTEN probe to come back", Duration::from_secs(30), || {
        let addr = addr.clone();
        async move { sample(&get(&addr, "/metrics").await.1, "postbox_listen_working") == Some(1.0) }
    })
    .await;
    assert!(scrape.contains("# TYPE postbox_commit_to_delivery_seconds histogram"));

    // The gauges follow the table: make a dead letter and a pending event appear.
    db.exec("UPDATE {schema}.outbox SET status = 'failed' WHERE id = (SELECT min(id) FROM {schema}.outbox)")
        .await;
    wait_for("the dead-letter gauge shows 1", Duration::from_secs(30), || {
        let addr = addr.clone();
        async move { sample(&get(&addr, "/metrics").await.1, "postbox_dead_letters") == Some(1.0) }
    })
    .await;
    assert_eq!(get(&addr, "/readyz").await, (200, "ready".to_owned()));

    // Not ready once postbox's table is gone.
    db.exec("ALTER TABLE {schema}.outbox RENAME TO outbox_moved")
        .await;
    assert_eq!(
        get(&addr, "/readyz").await,
        (503, "database unavailable".to_owned())
    );
    db.exec("ALTER TABLE {schema}.outbox_moved RENAME TO outbox")
        .await;

    // SIGTERM: a graceful stop.
    let pid = relay.0.id() as i32;
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let status = tokio::task::spawn_blocking(move || relay.0.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
    db.drop_schema().await;
}

/// Rows of every kind; `old` ones were settled ten days ago.
async fn mixed_rows(db: &TestDb) {
    enqueue(db, 30).await;
    // ids 1-10: sent long ago; 11-15: sent just now; 16-20: failed long ago;
    // 21-25: pending (created long ago); 26-30: processing.
    db.exec(
        "UPDATE {schema}.outbox SET status = 'sent', sent_at = now() - interval '10 days',
                created_at = now() - interval '10 days' WHERE id <= 10;
         UPDATE {schema}.outbox SET status = 'sent', sent_at = now() WHERE id BETWEEN 11 AND 15;
         UPDATE {schema}.outbox SET status = 'failed', created_at = now() - interval '10 days',
                available_at = now() - interval '10 days' WHERE id BETWEEN 16 AND 20;
         UPDATE {schema}.outbox SET created_at = now() - interval '10 days' WHERE id BETWEEN 21 AND 25;
         UPDATE {schema}.outbox SET status = 'processing', lease_token = gen_random_uuid(),
                lease_expires_at = now() + interval '1 hour', created_at = now() - interval '10 days'
                WHERE id > 25;
         INSERT INTO {schema}.inbox (consumer, event_id, processed_at)
           SELECT 'billing', gen_random_uuid(), now() - interval '10 days' FROM generate_series(1, 7);
         INSERT INTO {schema}.inbox (consumer, event_id)
           SELECT 'billing', gen_random_uuid() FROM generate_series(1, 3);",
    )
    .await;
}

async fn by_status(db: &TestDb) -> Vec<(String, i64)> {
    sqlx::query_as(trusted(&db.sql(
        "SELECT status::text, count(*) FROM {schema}.outbox GROUP BY 1 ORDER BY 1",
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

fn counts(pairs: &[(&str, i64)]) -> Vec<(String, i64)> {
    pairs.iter().map(|(s, n)| (s.to_string(), *n)).collect()
}

#[tokio::test]
async fn purge_deletes_only_old_sent_rows_in_batches() {
    let db = TestDb::new().await;
    mixed_rows(&db).await;
    let out = ok(run(
        &db,
        &[
            "purge",
            "--older-than",
            "7d",
            "--batch-size",
            "3",
            "--pause",
            "1ms",
        ],
    ));
    assert_eq!(out.trim(), "purged: 10 sent events deleted");
    assert_eq!(
        by_status(&db).await,
        counts(&[
            ("failed", 5),
            ("pending", 5),
            ("processing", 5),
            ("sent", 5)
        ])
    );
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE id <= 10")
            .await,
        0
    );
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.inbox").await,
        10,
        "no --inbox"
    );

    let out = ok(run(&db, &["purge", "--older-than", "7d", "--inbox"]));
    assert_eq!(
        out.trim(),
        "purged: 0 sent events deleted, 7 inbox records deleted"
    );
    assert_eq!(db.count("SELECT count(*) FROM {schema}.inbox").await, 3);

    let bad = run(&db, &["purge", "--older-than", "7d", "--batch-size", "0"]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("--batch-size: must be between 1 and 100000")
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn purge_archive_moves_old_sent_rows() {
    let db = TestDb::new().await;
    mixed_rows(&db).await;
    let before: Vec<(uuid::Uuid, serde_json::Value)> = sqlx::query_as(trusted(
        &db.sql("SELECT event_id, payload FROM {schema}.outbox WHERE id <= 10 ORDER BY id"),
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let out = ok(run(
        &db,
        &[
            "purge",
            "--older-than",
            "7d",
            "--archive",
            "--batch-size",
            "4",
        ],
    ));
    assert_eq!(out.trim(), "purged: 10 sent events archived");
    let archived: Vec<(uuid::Uuid, serde_json::Value)> = sqlx::query_as(trusted(
        &db.sql("SELECT event_id, payload FROM {schema}.outbox_archive ORDER BY id"),
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(archived, before);
    assert_eq!(
        by_status(&db).await,
        counts(&[
            ("failed", 5),
            ("pending", 5),
            ("processing", 5),
            ("sent", 5)
        ])
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn status_json_keeps_its_keys_and_adds_attempts_and_the_oldest_event() {
    let db = TestDb::new().await;
    mixed_rows(&db).await;
    db.exec("UPDATE {schema}.outbox SET attempts = 2 WHERE id IN (21, 22)")
        .await;
    let oldest: uuid::Uuid = sqlx::query_scalar(trusted(
        &db.sql("SELECT event_id FROM {schema}.outbox WHERE id = 21"),
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&ok(run(&db, &["status", "--json"]))).unwrap();
    assert_eq!(v["pending"], 5);
    assert_eq!(v["processing"], 5);
    assert_eq!(v["sent"], 15);
    assert_eq!(v["failed"], 5);
    assert_eq!(v["dead_letters"], 5);
    assert!(v["oldest_pending_age_seconds"].as_f64().unwrap() > 9.0 * 86_400.0);
    assert_eq!(v["oldest_pending_event_id"], oldest.to_string());
    assert_eq!(
        v["pending_attempts"],
        serde_json::json!([{"attempts": 0, "count": 3}, {"attempts": 2, "count": 2}])
    );
    let text = ok(run(&db, &["status"]));
    assert!(text.contains("pending by attempts  0: 3, 2: 2"), "{text}");
    db.drop_schema().await;
}

/// `status` says how far back a replay reaches (the oldest event of the
/// source a replay reads by default: the outbox with its archive, or in log
/// mode the log) and lists the replay jobs still open, which hold retention
/// back; `status --schemas` says the same per outbox.
#[tokio::test]
async fn status_shows_the_oldest_replayable_event_and_the_open_replay_jobs() {
    use postbox_store::{NewReplay, PageDone, ProducerTarget, ReplayRange, ReplaySource, Store};
    let db = TestDb::new().await;
    let json =
        |args: &[&str]| -> serde_json::Value { serde_json::from_str(&ok(run(&db, args))).unwrap() };
    let v = json(&["status", "--json"]);
    assert!(v["oldest_replayable_at"].is_null(), "{v}");
    assert_eq!(v["replay_source"], "outbox", "{v}");
    assert_eq!(v["replay_jobs"], serde_json::json!([]), "{v}");
    let text = ok(run(&db, &["status"]));
    assert!(
        text.contains("oldest replayable event  -  (the outbox and its archive hold no event)"),
        "{text}"
    );
    assert!(!text.contains("replay jobs"), "{text}");

    enqueue(&db, 3).await;
    db.exec("UPDATE {schema}.outbox SET created_at = now() - interval '3 hours'")
        .await;
    let store = Store::new(db.pool.clone(), db.schema.clone());
    let replays = store.replays();
    let job = |destination: &str, total: i64| NewReplay {
        destination: destination.to_owned(),
        source: ReplaySource::Outbox,
        range: ReplayRange {
            from: chrono::Utc::now() - chrono::Duration::hours(4),
            to: chrono::Utc::now(),
            types: None,
            type_likes: None,
            aggregate_type: None,
            aggregate_id: None,
        },
        rate: None,
        new_ids: false,
        hi: 3,
        total,
        actor: "test".to_owned(),
    };
    let paused = replays.create(&job("billing", 3)).await.unwrap();
    let page = PageDone {
        after_id: 2,
        after_event: uuid::Uuid::nil(),
        delivered: 1,
        filtered: 1,
        rejected: 0,
        error: None,
    };
    assert!(replays.advance(paused, &page).await.unwrap());
    replays
        .set_state(paused, "paused", &["running"], None)
        .await
        .unwrap();
    let done = replays.create(&job("audit", 3)).await.unwrap();
    replays
        .set_state(done, "done", &["running"], None)
        .await
        .unwrap();

    let v = json(&["status", "--json"]);
    let oldest =
        chrono::DateTime::parse_from_rfc3339(v["oldest_replayable_at"].as_str().unwrap()).unwrap();
    let age = chrono::Utc::now()
        .signed_duration_since(oldest)
        .num_seconds();
    assert!((3 * 3600 - 60..=3 * 3600 + 60).contains(&age), "{v}");
    assert_eq!(v["replay_source"], "outbox", "{v}");
    let jobs = v["replay_jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 1, "the done job is not open: {v}");
    assert_eq!(jobs[0]["id"], paused, "{v}");
    assert_eq!(jobs[0]["state"], "paused", "{v}");
    assert_eq!(jobs[0]["destination"], "billing", "{v}");
    assert_eq!(
        (&jobs[0]["handled"], &jobs[0]["total"]),
        (&2.into(), &3.into()),
        "{v}"
    );
    let text = ok(run(&db, &["status"]));
    assert!(
        text.contains(&format!(
            "oldest replayable event  {}",
            oldest.format("%Y-%m-%d %H:%M:%S UTC")
        )) && text.contains("ago; in the outbox and its archive)"),
        "{text}"
    );
    assert!(
        text.contains(
            "replay jobs  1 open; an open job holds retention back until done or cancelled"
        ),
        "{text}"
    );
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{paused} ")))
        .unwrap_or_else(|| panic!("a line for job {paused}: {text}"));
    assert!(
        line.contains("billing") && line.contains("paused") && line.trim_end().ends_with("2/3"),
        "{line}"
    );

    // Many outboxes: the same, per outbox.
    let lines = json(&["status", "--schemas", db.schema.name(), "--json"]);
    let l = &lines[0];
    assert_eq!(l["replay_source"], "outbox", "{l}");
    assert_eq!(l["oldest_replayable_at"], v["oldest_replayable_at"], "{l}");
    assert_eq!(l["replay_jobs"][0]["id"], paused, "{l}");
    let text = ok(run(&db, &["status", "--schemas", db.schema.name()]));
    assert!(text.contains("oldest replayable"), "{text}");
    assert!(
        text.contains(&format!(
            ": {paused} to billing, paused (2/3 handled); it holds retention back until done or cancelled"
        )),
        "{text}"
    );

    // Log mode: a replay reads the log (empty here) and the archive.
    store
        .log()
        .set_producer_target(ProducerTarget::Log)
        .await
        .unwrap();
    let v = json(&["status", "--json"]);
    assert_eq!(v["replay_source"], "log", "{v}");
    assert!(v["oldest_replayable_at"].is_null(), "{v}");
    let text = ok(run(&db, &["status"]));
    assert!(
        text.contains("oldest replayable event  -  (the log and the archive hold no event)"),
        "{text}"
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn the_relay_role_drains_and_cannot_read_application_tables() {
    let db = TestDb::new().await;
    let schema = db.schema.name().to_owned();
    let printed = ok(run(&db, &["migrate", "--create-roles", "--print-sql"]));
    assert!(
        printed.contains(&format!("CREATE ROLE {schema}_relay NOLOGIN")),
        "{printed}"
    );
    let out = ok(run(&db, &["migrate", "--create-roles"]));
    assert!(out.contains(&format!("{schema}_relay")), "{out}");
    ok(run(&db, &["migrate", "--create-roles"])); // idempotent

    let login = format!("{schema}_login");
    let producer_login = format!("{schema}_plogin");
    let app = format!("{schema}_app");
    db.exec(&format!(
        "CREATE ROLE {login} LOGIN; GRANT {schema}_relay TO {login};
         CREATE ROLE {producer_login} LOGIN; GRANT {schema}_producer TO {producer_login};
         CREATE SCHEMA {app}; CREATE TABLE {app}.orders (id int); INSERT INTO {app}.orders VALUES (1);"
    ))
    .await;
    // The test database's URL with another user (trust authentication).
    let url_for = |user: &str| {
        let (scheme, rest) = db.url.split_once("://").unwrap();
        let host = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
        format!("{scheme}://{user}@{host}")
    };

    // The producer can enqueue, and cannot read the outbox.
    let producer = sqlx::PgPool::connect(&url_for(&producer_login))
        .await
        .unwrap();
    for i in 0..25 {
        sqlx::query(trusted(
            &db.sql("SELECT {schema}.enqueue('order.created', 'order', $1, '{}')"),
        ))
        .bind(i.to_string())
        .execute(&producer)
        .await
        .unwrap();
    }
    let denied = sqlx::query(trusted(&db.sql("SELECT count(*) FROM {schema}.outbox")))
        .execute(&producer)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&denied).as_deref(), Some("42501"), "{denied}");
    producer.close().await;

    // The relay's login drains under its role, with retention on.
    let config = std::env::temp_dir().join(format!("{schema}.toml"));
    std::fs::write(
        &config,
        "[retention]\nenabled = true\nolder_than = \"1h\"\ninbox = true\n",
    )
    .unwrap();
    let drained = command(
        &db,
        &url_for(&login),
        &["relay", "--sink", "stdout", "--drain"],
    )
    .arg("--config")
    .arg(&config)
    .stdout(Stdio::piped())
    .output()
    .unwrap();
    let _ = std::fs::remove_file(&config);
    let summary = ok(drained);
    assert!(summary.contains("drained: 25 delivered"), "{summary}");

    let relay = sqlx::PgPool::connect(&url_for(&login)).await.unwrap();
    let denied = sqlx::query(trusted(&format!("SELECT * FROM {app}.orders")))
        .execute(&relay)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&denied).as_deref(), Some("42501"), "{denied}");
    let store = postbox_relay::Store::new(relay.clone(), db.schema.clone());
    assert_eq!(
        store.purge_sent(Duration::ZERO, 100, true).await.unwrap(),
        25
    );
    relay.close().await;

    db.exec(&format!("DROP SCHEMA {app} CASCADE")).await;
    // The roles, the two logins included, go with the schema (they are
    // named after it).
    db.drop_schema().await;
}

fn sqlstate(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
}

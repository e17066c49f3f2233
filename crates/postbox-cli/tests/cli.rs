use postbox::statements::trusted;
use postbox_testkit::{redis, redis_url, unique, TestDb};
use redis::AsyncCommands;
use std::collections::HashSet;
use std::process::{Command, Output};

fn postbox(db: &TestDb, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_postbox"))
        .args(args)
        .env("DATABASE_URL", &db.url)
        .env("POSTBOX_SCHEMA", db.schema.name())
        .env("POSTBOX_LOG", "warn")
        .env_remove("POSTBOX_CONFIG")
        .env_remove("POSTBOX_SINK")
        .output()
        .expect("run postbox")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[track_caller]
fn ok(o: Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status,
        stdout(&o),
        stderr(&o)
    );
    stdout(&o)
}

#[tokio::test]
async fn migrate_sql_enqueue_relay_drain_and_status() {
    let db = TestDb::empty().await;
    assert!(ok(postbox(&db, &["migrate"])).contains("applied migration"));
    assert!(
        ok(postbox(&db, &["migrate"])).contains("up to date"),
        "a second run changes nothing"
    );

    // Producers in any language use the SQL function; some transactions roll back.
    let mut committed = HashSet::new();
    let mut rolled_back = HashSet::new();
    for i in 0..60 {
        let mut tx = db.pool.begin().await.unwrap();
        let id: uuid::Uuid = sqlx::query_scalar(trusted(&db.sql(
            "SELECT {schema}.enqueue('order.created', 'order', $1, jsonb_build_object('n', $2::int))",
        )))
        .bind(format!("o-{i}"))
        .bind(i)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        if i % 5 == 0 {
            tx.rollback().await.unwrap();
            rolled_back.insert(id.to_string());
        } else {
            tx.commit().await.unwrap();
            committed.insert(id.to_string());
        }
    }
    // And the enqueue command.
    let id = ok(postbox(
        &db,
        &[
            "enqueue",
            "--type",
            "order.created",
            "--aggregate-type",
            "order",
            "--aggregate-id",
            "o-x",
            "--payload",
            r#"{"n": -1}"#,
            "--header",
            "traceparent=00-abc",
        ],
    ));
    committed.insert(id.trim().to_owned());

    let prefix = unique("test:cli:");
    let sink = format!("{}?key={prefix}:{{event_type}}", redis_url());
    let summary = ok(postbox(
        &db,
        &["relay", "--sink", &sink, "--drain", "--batch-size", "7"],
    ));
    assert!(
        summary.contains(&format!(
            "drained: {} delivered, 0 retried, 0 dead-lettered",
            committed.len()
        )),
        "{summary}"
    );

    let mut r = redis().await;
    let key = format!("{prefix}:order.created");
    let bodies: Vec<String> = r.lrange(&key, 0, -1).await.unwrap();
    let delivered: HashSet<String> = bodies
        .iter()
        .map(|b| {
            serde_json::from_str::<serde_json::Value>(b).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(bodies.len(), committed.len(), "each committed event once");
    assert_eq!(delivered, committed);
    assert!(rolled_back.is_disjoint(&delivered));
    let _: () = r.del(&key).await.unwrap();

    let status: serde_json::Value =
        serde_json::from_str(&ok(postbox(&db, &["status", "--json"]))).unwrap();
    assert_eq!(status["pending"], 0);
    assert_eq!(status["processing"], 0);
    assert_eq!(status["failed"], 0);
    assert_eq!(status["sent"], committed.len());
    assert!(status["oldest_pending_age_seconds"].is_null());
    assert!(ok(postbox(&db, &["status"])).contains("pending     0"));
    db.drop_schema().await;
}

#[tokio::test]
async fn invalid_input_and_config_get_clear_errors() {
    let db = TestDb::new().await;
    let dir = std::env::temp_dir().join(unique("postbox-cli-"));
    std::fs::create_dir_all(&dir).unwrap();
    let bad_field = dir.join("bad_field.toml");
    std::fs::write(&bad_field, "[relay]\nbatch_size = 0\n").unwrap();
    let unknown = dir.join("unknown.toml");
    std::fs::write(
        &unknown,
        "database_url = \"postgres://u:hunter2@h/db\"\n[relay]\nbatchsize = 5\n",
    )
    .unwrap();

    let cfg = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "--config".into(),
                cfg(&bad_field),
                "relay".into(),
                "--sink".into(),
                "stdout".into(),
            ],
            "relay.batch_size: must be between 1 and 10000",
        ),
        (
            vec!["--config".into(), cfg(&unknown), "status".into()],
            "unknown field `batchsize`",
        ),
        (
            vec![
                "--config".into(),
                cfg(&dir.join("missing.toml")),
                "status".into(),
            ],
            "cannot read config file",
        ),
        (
            vec!["relay".into(), "--sink".into(), "kafka-ish://x".into()],
            "unsupported sink",
        ),
        (
            vec![
                "relay".into(),
                "--sink".into(),
                "redis://127.0.0.1?mode=queue".into(),
            ],
            "mode: expected list or stream",
        ),
        (vec!["relay".into()], "no sink given"),
        (
            vec!["--schema".into(), "Bad-Name".into(), "migrate".into()],
            "invalid schema name",
        ),
        (
            vec![
                "enqueue".into(),
                "--type".into(),
                "".into(),
                "--aggregate-type".into(),
                "a".into(),
                "--aggregate-id".into(),
                "1".into(),
                "--payload".into(),
                "{}".into(),
            ],
            "event_type must not be empty",
        ),
        (
            vec![
                "enqueue".into(),
                "--type".into(),
                "t".into(),
                "--aggregate-type".into(),
                "a".into(),
                "--aggregate-id".into(),
                "1".into(),
                "--payload".into(),
                "{oops".into(),
            ],
            "--payload could not be parsed as JSON (line 1, column 2)",
        ),
    ];
    for (args, want) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = postbox(&db, &args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = stderr(&out);
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("hunter2"), "{args:?} leaked a secret: {err}");
    }

    // A database URL with a password that cannot be reached: a clear error without the password.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .args(["status"])
        .env(
            "DATABASE_URL",
            format!("postgres://app:hunter2@127.0.0.1:{closed}/db"),
        )
        .env("POSTBOX_LOG", "error")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "cannot connect to PostgreSQL at 127.0.0.1:{closed}/db"
        )),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");

    let out = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .args(["status"])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert!(
        stderr(&out).contains("no database given"),
        "{}",
        stderr(&out)
    );
    std::fs::remove_dir_all(&dir).unwrap();
    db.drop_schema().await;
}

#[test]
fn every_command_has_help() {
    for cmd in [
        vec!["--help"],
        vec!["migrate", "--help"],
        vec!["enqueue", "--help"],
        vec!["relay", "--help"],
        vec!["status", "--help"],
        vec!["demo", "--help"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_postbox"))
            .args(&cmd)
            .output()
            .unwrap();
        assert!(out.status.success(), "{cmd:?}");
        assert!(stdout(&out).contains("Usage: postbox"), "{cmd:?}");
    }
}

#[test]
fn the_demo_runs_on_a_throwaway_cluster() {
    demo_in_mode("claim", "claim mode (the outbox table)");
}

#[test]
fn the_demo_runs_in_log_and_logical_mode() {
    demo_in_mode("log", "log mode (producers append to the log)");
    demo_in_mode("logical", "logical mode (producers emit into the WAL");
}

fn demo_in_mode(mode: &str, says: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .args(["demo", "--orders", "400", "--rate", "2000", "--mode", mode])
        .env_remove("DATABASE_URL")
        .env_remove("POSTBOX_CONFIG")
        .env("POSTBOX_LOG", "warn")
        .output()
        .unwrap();
    let text = stdout(&out);
    assert!(out.status.success(), "{mode}: {text}\n{}", stderr(&out));
    assert!(text.contains(says), "{mode}: {text}");
    assert!(text.contains("rolled-back events delivered    0"), "{text}");
    assert!(
        text.contains("OK: every committed event delivered"),
        "{mode}: {text}"
    );
    // Every order the report counts was sent by the relay at least once.
    let sent: u64 = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("events sent by the relay"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("{mode}: no sent count in {text}"));
    let committed: u64 = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("committed with their event"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("{mode}: no committed count in {text}"));
    assert!(sent >= committed && committed > 300, "{mode}: {text}");
}

/// The server's roles that creating the `pgq` extension makes.
async fn pgq_roles(pool: &sqlx::PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT rolname::text FROM pg_roles WHERE rolname LIKE 'pgq\\_%' ORDER BY 1")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// One `postbox bench` at a time in this binary: two side by side on one
/// server ended in `deadlock detected` (the pgq peer creates and drops its
/// extension, a server-wide step), and their figures would mean nothing.
pub(crate) static BENCH: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `--replay-beside N`: each mode's LISTEN latency again with a replay of
/// N retained events running beside the live traffic, which it reports.
#[tokio::test]
async fn bench_measures_latency_beside_a_replay() {
    let _alone = BENCH.lock().await;
    let db = TestDb::empty().await;
    let schema = unique("bench_t_");
    let key = unique("test:bench:");
    let sink = format!("{}?key={key}", redis_url());
    let out = ok(postbox(
        &db,
        &[
            "bench",
            "--rate",
            "100",
            "--duration",
            "1s",
            "--bench-schema",
            &schema,
            "--sink",
            &sink,
            "--only",
            "latency",
            "--latency-modes",
            "claim",
            "--replay-beside",
            "2000",
            "--json",
        ],
    ));
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    let modes: Vec<&str> = r["latency"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["mode"].as_str().unwrap())
        .collect();
    assert_eq!(modes.len(), 4, "{r}");
    assert_eq!(modes[0], "LISTEN/NOTIFY", "{r}");
    let beside = modes[1];
    let replayed: i64 = beside
        .strip_prefix("LISTEN/NOTIFY, beside a replay of 2000 events (")
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{beside}"));
    assert!(replayed > 0, "the replay ran beside: {beside}");
    assert!(beside.contains(" replayed in "), "{beside}");
    assert!(r["latency"][1]["events"].as_u64().unwrap() > 0, "{r}");
}

#[tokio::test]
async fn bench_runs_on_tiny_inputs() {
    // Only proves the harness works end to end; figures come from real runs.
    let _alone = BENCH.lock().await;
    let db = TestDb::empty().await;
    let schema = unique("bench_t_");
    let key = unique("test:bench:");
    let sink = format!("{}?key={key}", redis_url());
    let pgq_roles_before = pgq_roles(&db.pool).await;
    let out = ok(postbox(
        &db,
        &[
            "bench",
            "--events",
            "3000",
            "--naive-events",
            "200",
            "--rate",
            "200",
            "--duration",
            "1s",
            "--relays",
            "1,2",
            "--aggregates",
            "100",
            "--bench-schema",
            &schema,
            "--sink",
            &sink,
            "--peers",
            "pgq",
            "--only",
            "drain,latency,producer,scale,ordered,groups",
            "--json",
        ],
    ));
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(
        r["drain"]["relay_events_per_s"].as_f64().unwrap() > 0.0,
        "{r}"
    );
    // Consumer groups read by one and four readers over SQL and HTTP, and
    // PgQ's consumer API; then commit → a long-polling reader of each.
    let groups: Vec<(String, f64)> = r["groups"]["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["reader"].as_str().unwrap().to_owned(),
                g["events_per_s"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(groups.len(), 5, "{r}");
    assert!(groups.iter().all(|(_, rate)| *rate > 0.0), "{r}");
    for reader in ["PgQ", "HTTP receive + ack, 4"] {
        assert!(
            groups.iter().any(|(name, _)| name.starts_with(reader)),
            "{reader}: {r}"
        );
    }
    let polls: Vec<&str> = r["groups"]["latency"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["mode"].as_str().unwrap())
        .collect();
    assert_eq!(
        polls,
        ["SQL long poll (2 s)", "HTTP long poll (20 s)"],
        "{r}"
    );
    // PgQ's consumer ran on the same events (test.sh installs the
    // extension), and each reader's CPU was measured.
    assert!(
        r["drain"]["pgq"]["events_per_s"].as_f64().unwrap() > 0.0,
        "{r}"
    );
    let readers: Vec<&str> = r["drain"]["cost"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["reader"].as_str().unwrap())
        .collect();
    assert_eq!(readers, ["claim", "log", "logical", "pgq"], "{r}");
    assert!(
        r["drain"]["cost"][1]["reader_cpu_s_per_million"]
            .as_f64()
            .unwrap()
            > 0.0,
        "{r}"
    );
    assert!(
        r["drain"]["cost"][1]["postgres_cpu_s_per_million"]
            .as_f64()
            .unwrap()
            > 0.0,
        "the server runs on this machine: {r}"
    );
    assert!(
        r["drain"]["ceiling_events_per_s"].as_f64().unwrap() > 0.0,
        "{r}"
    );
    assert!(
        r["drain"]["naive_events_per_s"].as_f64().unwrap() > 0.0,
        "{r}"
    );
    assert!(
        r["drain"]["log_relay_events_per_s"].as_f64().unwrap() > 0.0,
        "the log-mode drain ran: {r}"
    );
    assert!(
        r["drain"]["shaped"]["events_per_s"].as_f64().unwrap() > 0.0
            && r["drain"]["shaped"]["vs_without"].as_f64().unwrap() > 0.0,
        "the log-mode drain with a filter and a transform ran: {r}"
    );
    assert!(
        r["drain"]["wal_bytes_per_event"].as_f64().unwrap() > 0.0,
        "{r}"
    );
    assert_eq!(r["drain"]["log_after"]["dead_tuples"], 0, "{r}");
    assert!(
        r["drain"]["log_ceiling_events_per_s"].as_f64().unwrap() > 0.0
            && r["drain"]["log_read_events_per_s"].as_f64().unwrap() > 0.0,
        "the pure-SQL log ceiling and the page read over the wire ran: {r}"
    );
    assert_eq!(r["latency"].as_array().unwrap().len(), 6, "{r}");
    assert_eq!(
        r["latency"][5]["mode"], "logical mode (emit, replication slot)",
        "{r}"
    );
    assert!(
        r["latency"][5]["events"].as_u64().unwrap() > 0,
        "logical mode delivered: {r}"
    );
    assert_eq!(
        r["latency"][4]["mode"], "log mode, LISTEN/NOTIFY, asynchronous relay commits",
        "{r}"
    );
    assert!(
        r["latency"][4]["events"].as_u64().unwrap() > 0,
        "log mode delivered with asynchronous cursor moves: {r}"
    );
    assert!(
        r["drain"]["logical_relay_events_per_s"].as_f64().unwrap() > 0.0,
        "logical mode drained: {r}"
    );
    assert_eq!(r["producer"]["emit_table_rows"], 0, "{r}");
    assert!(r["latency"][0]["events"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(r["latency"][3]["mode"], "log mode, LISTEN/NOTIFY", "{r}");
    assert!(
        r["latency"][3]["events"].as_u64().unwrap() > 0,
        "log mode delivered: {r}"
    );
    assert_eq!(r["scale"].as_array().unwrap().len(), 2, "{r}");
    assert!(
        r["ordered"]["ordered_events_per_s"].as_f64().unwrap() > 0.0,
        "{r}"
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_namespace WHERE nspname = $1")
        .bind(&schema)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "the bench schema is dropped afterwards");
    let pgq: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_extension WHERE extname = 'pgq'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        pgq, 0,
        "the extension the bench created is dropped afterwards"
    );
    assert_eq!(
        pgq_roles(&db.pool).await,
        pgq_roles_before,
        "the roles the bench's extension made are dropped afterwards"
    );
    // The sustained run: producers, the relay with retention, samples, RSS.
    let out = ok(postbox(
        &db,
        &[
            "bench",
            "--only",
            "sustained",
            "--sustained-rate",
            "400",
            "--sustained-duration",
            "3s",
            "--bench-schema",
            &schema,
            "--sink",
            &sink,
            "--json",
        ],
    ));
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(r["sustained"]["events"].as_u64().unwrap() > 0, "{r}");
    assert!(
        !r["sustained"]["samples"].as_array().unwrap().is_empty(),
        "{r}"
    );
    assert!(
        r["sustained"]["relay_peak_rss_mb"].as_f64().unwrap() > 0.0,
        "{r}"
    );
    let refused = postbox(&db, &["bench", "--bench-schema", "postbox"]);
    assert!(
        stderr(&refused).contains("must contain \"bench\""),
        "{}",
        stderr(&refused)
    );
}

#[tokio::test]
async fn the_relay_refuses_an_unmigrated_or_outdated_schema() {
    let db = TestDb::empty().await;
    let out = postbox(&db, &["relay", "--sink", "stdout", "--drain"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("has no postbox tables: run `postbox migrate` first"),
        "{}",
        stderr(&out)
    );
    ok(postbox(&db, &["migrate"]));
    db.exec("DELETE FROM {schema}.schema_migrations WHERE version = (SELECT max(version) FROM {schema}.schema_migrations)").await;
    let out = postbox(&db, &["relay", "--sink", "stdout", "--drain"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("this relay needs"),
        "{}",
        stderr(&out)
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn the_relay_fans_out_to_configured_destinations_and_orders_on_request() {
    let db = TestDb::new().await;
    let (k1, k2) = (unique("test:fan:a:"), unique("test:fan:b:"));
    let dir = std::env::temp_dir().join(unique("postbox-routes-"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("relay.toml");
    std::fs::write(
        &config,
        format!(
            "[destinations.a]\nurl = \"{url}?key={k1}\"\n\
             [destinations.b]\nurl = \"{url}?key={k2}\"\n\
             [[routes]]\nmatch = [\"order.*\"]\nto = [\"a\", \"b\"]\n\
             [[routes]]\nmatch = [\"user.created\"]\nto = [\"b\"]\n",
            url = redis_url()
        ),
    )
    .unwrap();
    for (i, t) in [
        "order.created",
        "order.paid",
        "user.created",
        "order.created",
    ]
    .iter()
    .enumerate()
    {
        db.exec(&format!(
            "SELECT {{schema}}.enqueue('{t}', 'order', 'o-{}', '{{}}'::jsonb)",
            i % 2
        ))
        .await;
    }
    let cfg = config.to_str().unwrap();
    let out = ok(postbox(
        &db,
        &["--config", cfg, "relay", "--drain", "--ordered"],
    ));
    assert!(out.contains("drained: 4 delivered"), "{out}");
    let mut r = redis().await;
    let a: Vec<String> = r.lrange(&k1, 0, -1).await.unwrap();
    let b: Vec<String> = r.lrange(&k2, 0, -1).await.unwrap();
    assert_eq!((a.len(), b.len()), (3, 4));
    // Every message carries its sequence number within its aggregate.
    let seqs: Vec<i64> = b
        .iter()
        .rev()
        .map(|m| {
            serde_json::from_str::<serde_json::Value>(m).unwrap()["sequence"]
                .as_i64()
                .unwrap()
        })
        .collect();
    assert_eq!(seqs, vec![1, 1, 2, 2]);
    let status: serde_json::Value =
        serde_json::from_str(&ok(postbox(&db, &["--config", cfg, "status", "--json"]))).unwrap();
    assert_eq!(status["sent"], 4, "{status}");
    assert!(status["destinations"].is_array(), "{status}");
    let _: () = r.del(&[&k1, &k2]).await.unwrap();

    // Routes that name an unknown destination are refused, naming the field.
    std::fs::write(
        &config,
        "[destinations.a]\nurl = \"stdout\"\n[[routes]]\nmatch = [\"*\"]\nto = [\"b\"]\n",
    )
    .unwrap();
    let refused = postbox(&db, &["--config", cfg, "relay", "--drain"]);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("routes[0].to"),
        "{}",
        stderr(&refused)
    );
    // --sink and [destinations] together are ambiguous.
    let refused = postbox(&db, &["--config", cfg, "relay", "--sink", "stdout"]);
    assert!(
        stderr(&refused).contains("not both"),
        "{}",
        stderr(&refused)
    );
    let _ = std::fs::remove_dir_all(&dir);
    db.drop_schema().await;
}

#[tokio::test]
async fn log_mode_from_migrate_to_a_drained_relay_and_back() {
    let db = TestDb::empty().await;
    let migrated = ok(postbox(&db, &["migrate", "--mode", "log"]));
    assert!(
        migrated.contains("producers write into the log"),
        "{migrated}"
    );
    let mut committed = HashSet::new();
    for i in 0..25 {
        let id = ok(postbox(
            &db,
            &[
                "enqueue",
                "--type",
                "order.created",
                "--aggregate-type",
                "order",
                "--aggregate-id",
                &format!("o-{i}"),
                "--payload",
                r#"{"n": 1}"#,
            ],
        ));
        committed.insert(id.trim().to_owned());
    }
    assert_eq!(db.count("SELECT count(*) FROM {schema}.log").await, 25);
    let refused = postbox(&db, &["migrate", "--mode", "claim"]);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("has not read"),
        "{}",
        stderr(&refused)
    );

    let prefix = unique("test:cli:log:");
    let sink = format!("{}?key={prefix}", redis_url());
    let summary = ok(postbox(
        &db,
        &[
            "relay",
            "--mode",
            "log",
            "--sink",
            &sink,
            "--drain",
            "--batch-size",
            "7",
        ],
    ));
    assert!(summary.contains("drained: 25 delivered"), "{summary}");
    let mut r = postbox_testkit::redis().await;
    let got: Vec<String> = redis::AsyncCommands::lrange(&mut r, &prefix, 0, -1)
        .await
        .unwrap();
    assert_eq!(got.len(), 25);
    let _: () = redis::AsyncCommands::del(&mut r, &prefix).await.unwrap();

    let status = ok(postbox(&db, &["status"]));
    assert!(status.contains("write into the log"), "{status}");
    assert!(status.contains("default"), "a cursor line: {status}");
    let json: serde_json::Value =
        serde_json::from_str(&ok(postbox(&db, &["status", "--json"]))).unwrap();
    assert_eq!(json["log_cursors"][0]["lag_events"], 0, "{json}");
    assert!(ok(postbox(&db, &["migrate", "--mode", "claim"])).contains("into the outbox"));
    db.drop_schema().await;
}

#[tokio::test]
async fn emit_sequence_round_trips_and_ordered_logical_relays_need_it() {
    let db = TestDb::empty().await;
    ok(postbox(&db, &["migrate"]));
    let numbered = || async {
        db.count("SELECT count(*) FROM {schema}.logical_settings WHERE numbered_emits")
            .await
            == 1
    };
    assert!(!numbered().await, "off by default");
    let status = ok(postbox(&db, &["status"]));
    assert!(status.contains("emits       not numbered"), "{status}");
    // An ordered relay in logical mode refuses to start, saying what to run.
    let refused = postbox(
        &db,
        &[
            "relay",
            "--mode",
            "logical",
            "--ordered",
            "--sink",
            "stdout",
            "--slot",
            "never_created",
        ],
    );
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("run `postbox migrate --emit-sequence on`"),
        "{}",
        stderr(&refused)
    );
    for _ in 0..2 {
        let on = ok(postbox(&db, &["migrate", "--emit-sequence", "on"]));
        assert!(on.contains("emits are numbered"), "{on}");
        assert!(numbered().await);
    }
    let json: serde_json::Value =
        serde_json::from_str(&ok(postbox(&db, &["status", "--json"]))).unwrap();
    assert_eq!(json["numbered_emits"], true, "{json}");
    let off = ok(postbox(&db, &["migrate", "--emit-sequence", "off"]));
    assert!(off.contains("emits are not numbered"), "{off}");
    assert!(!numbered().await);
    let bad = postbox(&db, &["migrate", "--emit-sequence", "maybe"]);
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("--emit-sequence") && stderr(&bad).contains("on or off"),
        "{}",
        stderr(&bad)
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn enqueue_schedules_events_and_status_counts_them_apart() {
    let db = TestDb::new().await;
    let args = |extra: &[&str]| {
        let mut a = vec![
            "enqueue",
            "--type",
            "order.created",
            "--aggregate-type",
            "order",
            "--aggregate-id",
            "1",
            "--payload",
            "{}",
        ];
        a.extend_from_slice(extra);
        a.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let run = |extra: &[&str]| {
        let a = args(extra);
        postbox(&db, &a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let at = (chrono::Utc::now() + chrono::Duration::hours(2)).to_rfc3339();
    ok(run(&["--deliver-after", "1h"]));
    ok(run(&["--deliver-at", &at]));
    ok(run(&[]));

    let both = run(&["--deliver-after", "1h", "--deliver-at", &at]);
    assert!(!both.status.success());
    assert!(stderr(&both).contains("--deliver-at"), "{}", stderr(&both));
    let bad = run(&["--deliver-at", "tomorrow"]);
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("--deliver-at") && stderr(&bad).contains("RFC 3339"),
        "{}",
        stderr(&bad)
    );

    let status: serde_json::Value =
        serde_json::from_str(&ok(postbox(&db, &["status", "--json"]))).unwrap();
    assert_eq!(
        (&status["pending"], &status["scheduled"]),
        (&1.into(), &2.into())
    );
    let next = status["next_scheduled_in_seconds"].as_f64().unwrap();
    assert!((3000.0..=3600.0).contains(&next), "{next}");
    let text = ok(postbox(&db, &["status"]));
    assert!(text.contains("scheduled   2  (the first due in"), "{text}");
    // `dlq show` (any event by id) says when a scheduled event is due.
    let id: uuid::Uuid = sqlx::query_scalar(trusted(
        &db.sql("SELECT event_id FROM {schema}.outbox WHERE deliver_at IS NOT NULL LIMIT 1"),
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let shown = ok(postbox(&db, &["dlq", "show", &id.to_string()]));
    assert!(shown.contains("scheduled for   "), "{shown}");

    // A drain delivers the due event and does not wait for the scheduled ones.
    let out = postbox(&db, &["relay", "--sink", "stdout", "--drain"]);
    let all = format!("{}{}", stdout(&out), stderr(&out));
    assert!(out.status.success(), "{all}");
    assert!(all.contains("drained: 1 delivered"), "{all}");
    let status: serde_json::Value =
        serde_json::from_str(&ok(postbox(&db, &["status", "--json"]))).unwrap();
    assert_eq!(
        (&status["pending"], &status["scheduled"]),
        (&0.into(), &2.into())
    );
    db.drop_schema().await;
}

/// `postbox status` shows the replication slot this schema's logical-mode
/// relay reads (`postbox_<schema>` by default, or `--slot` elsewhere), and
/// says so when no relay reads it.
#[tokio::test]
async fn status_shows_the_schemas_replication_slot() {
    let db = TestDb::new().await;
    let slot = format!("postbox_{}", db.schema.name());
    let without: serde_json::Value =
        serde_json::from_str(&ok(postbox(&db, &["status", "--json"]))).unwrap();
    assert!(without["logical_slot"].is_null(), "{without}");

    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(&slot)
        .execute(&db.pool)
        .await
        .expect("create a logical slot (wal_level = logical)");
    let shown = postbox(&db, &["status"]);
    let json = postbox(&db, &["status", "--json"]);
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&slot)
        .execute(&db.pool)
        .await
        .expect("drop the slot");

    let shown = ok(shown);
    assert!(
        shown.contains(&format!("logical slot  {slot}: NOT READ")),
        "{shown}"
    );
    let json: serde_json::Value = serde_json::from_str(&ok(json)).unwrap();
    assert_eq!(json["logical_slot"]["slot_name"], slot.as_str(), "{json}");
    assert_eq!(json["logical_slot"]["active"], false, "{json}");
}

/// A drain that lasts longer than bench's progress interval (2 s) reports
/// how far it got while it runs: one-event batches make 3,000 events take
/// several seconds even on a fast machine. POSTBOX_PROGRESS=always stands in
/// for a terminal.
#[tokio::test]
async fn bench_shows_progress_within_a_long_drain() {
    let _alone = BENCH.lock().await;
    let db = TestDb::empty().await;
    let schema = unique("bench_p_");
    let sink = format!("{}?key={}", redis_url(), unique("test:bench:"));
    let o = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .args([
            "bench",
            "--only",
            "drain",
            "--events",
            "3000",
            "--batch-size",
            "1",
            "--naive-events",
            "50",
            "--bench-schema",
            &schema,
            "--sink",
            &sink,
            "--json",
        ])
        .env("DATABASE_URL", &db.url)
        .env("POSTBOX_LOG", "warn")
        .env("POSTBOX_PROGRESS", "always")
        .env_remove("POSTBOX_CONFIG")
        .output()
        .expect("run postbox bench");
    ok(o.clone());
    let err = stderr(&o);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("drained") && l.contains("/3000"))
        .collect();
    assert!(!lines.is_empty(), "no progress line in:\n{err}");
    let mut redis = redis().await;
    let _: () = redis
        .del(sink.rsplit_once("key=").unwrap().1)
        .await
        .unwrap();
}

//! `postbox route test` through the real binary: for one event (a file, or
//! an id in the database), which destinations get it and the exact body and
//! headers each receives — checked against what the relay then delivers to
//! Redis, in claim and log mode — and an expression that fails or does not
//! compile, named with its position.

use postbox_testkit::{redis, TestDb};
use redis::AsyncCommands;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn postbox(db: &TestDb, config: &std::path::Path, args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .args(args)
        .env("DATABASE_URL", &db.url)
        .env("POSTBOX_SCHEMA", db.schema.name())
        .env("POSTBOX_LOG", "warn")
        .env("POSTBOX_CONFIG", config)
        .env_remove("POSTBOX_SINK")
        .env_remove("POSTBOX_SOURCE")
        .env("NO_COLOR", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run postbox");
    if let Some(text) = stdin {
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    drop(child.stdin.take());
    child.wait_with_output().expect("postbox's output")
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Removes the test's files and Redis lists, even when it fails.
struct Cleanup {
    files: Vec<PathBuf>,
    keys: Vec<String>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for f in &self.files {
            let _ = std::fs::remove_file(f);
        }
        if let Ok(client) = ::redis::Client::open(postbox_testkit::redis_url()) {
            if let Ok(mut c) = client.get_connection() {
                for k in &self.keys {
                    let _: Result<(), _> = ::redis::cmd("DEL").arg(k).query(&mut c);
                }
            }
        }
    }
}

/// billing (Redis list) gets orders of at least 100, slimmed, with a header
/// of its own; audit (another list) gets every event as committed.
fn config(db: &TestDb, mode: &str, cleanup: &mut Cleanup) -> PathBuf {
    let (billing, audit) = (
        format!("{}_billing", db.schema.name()),
        format!("{}_audit", db.schema.name()),
    );
    let toml = format!(
        r#"[relay]
mode = "{mode}"

[destinations.billing]
url = "{redis}?key={billing}"
source = "shop"
filter = '.payload.total >= 100'
headers = '{{"x-customer": .payload.customer}}'

[destinations.audit]
url = "{redis}?key={audit}"

[[routes]]
match = ["order.*"]
to = ["billing"]
transform = '{{order: .aggregate_id, total: .payload.total}}'

[[routes]]
match = ["*"]
to = ["audit"]
"#,
        redis = postbox_testkit::redis_url()
    );
    let path = std::env::temp_dir().join(format!("{}_{mode}_routes.toml", db.schema.name()));
    std::fs::write(&path, toml).unwrap();
    cleanup.files.push(path.clone());
    cleanup.keys.extend([billing, audit]);
    path
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(o)))
}

fn line<'a>(report: &'a serde_json::Value, destination: &str) -> &'a serde_json::Value {
    report["destinations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["destination"] == destination)
        .unwrap_or_else(|| panic!("no {destination} in {report}"))
}

#[tokio::test]
async fn route_test_shows_what_each_destination_gets_from_a_file() {
    let db = TestDb::new().await;
    let mut cleanup = Cleanup {
        files: vec![],
        keys: vec![],
    };
    let cfg = config(&db, "claim", &mut cleanup);
    let event = r#"{"event_type": "order.placed", "aggregate_type": "order", "aggregate_id": "42",
                   "payload": {"total": 250, "customer": "c42", "card": "4111"}}"#;
    let o = postbox(&db, &cfg, &["route", "test", "-", "--json"], Some(event));
    assert!(o.status.success(), "{}", text(&o));
    let r = json(&o);
    let billing = line(&r, "billing");
    assert_eq!(billing["outcome"], "sends", "{r}");
    let body: serde_json::Value = serde_json::from_str(billing["body"].as_str().unwrap()).unwrap();
    assert_eq!(
        body["data"],
        serde_json::json!({"order": "42", "total": 250})
    );
    assert_eq!(body["source"], "shop");
    assert_eq!(billing["headers"], serde_json::json!({"x-customer": "c42"}));
    assert_eq!(line(&r, "audit")["outcome"], "sends");

    // Under billing's threshold: filtered out, and by whose filter.
    let small = event.replace("250", "20");
    let o = postbox(&db, &cfg, &["route", "test", "-"], Some(&small));
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("billing: filtered out by the filter of destinations.billing"),
        "{t}"
    );

    // Another type: no route sends it to billing.
    let other = event.replace("order.placed", "user.created");
    let r = json(&postbox(
        &db,
        &cfg,
        &["route", "test", "-", "--json"],
        Some(&other),
    ));
    assert_eq!(line(&r, "billing")["outcome"], "not_routed", "{r}");

    // A header expression that fails on this event: a dead letter of billing
    // only, named, and the command exits 1.
    let bad = event.replace(r#""c42""#, "[1]");
    let o = postbox(&db, &cfg, &["route", "test", "-", "--json"], Some(&bad));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let r = json(&o);
    let error = line(&r, "billing")["error"].as_str().unwrap().to_owned();
    assert!(
        error.starts_with("headers of destinations.billing failed"),
        "{error}"
    );
    assert_eq!(line(&r, "audit")["outcome"], "sends");

    // An expression that does not compile: named with its position, no output.
    let broken = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace(".payload.total >= 100", ".payload.total >= (100");
    let broken_cfg = cfg.with_extension("broken.toml");
    std::fs::write(&broken_cfg, broken).unwrap();
    cleanup.files.push(broken_cfg.clone());
    let o = postbox(&db, &broken_cfg, &["route", "test", "-"], Some(event));
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("destinations.billing.filter"), "{t}");
    assert!(t.contains("column"), "{t}");
    db.drop_schema().await;
}

/// `route test --event-id` reads the event where the mode keeps it, and the
/// body and headers it prints are what the relay then delivers.
async fn the_preview_is_what_the_relay_delivers(mode: &str) {
    let db = TestDb::new().await;
    let mut cleanup = Cleanup {
        files: vec![],
        keys: vec![],
    };
    let cfg = config(&db, mode, &mut cleanup);
    if mode == "log" {
        let o = postbox(&db, &cfg, &["migrate", "--mode", "log"], None);
        assert!(o.status.success(), "{}", text(&o));
    }
    let ids = db
        .enqueue_events(&[postbox::NewEvent::new(
            "order.placed",
            "order",
            "7",
            &serde_json::json!({"total": 300, "customer": "c7", "b": 1, "ab": 2}),
        )
        .unwrap()])
        .await;
    let id = ids[0].to_string();
    let o = postbox(
        &db,
        &cfg,
        &["route", "test", "--event-id", &id, "--json"],
        None,
    );
    assert!(o.status.success(), "{}", text(&o));
    let r = json(&o);
    assert_eq!(
        r["found_in"],
        if mode == "log" { "log" } else { "outbox" },
        "{r}"
    );
    let billing = line(&r, "billing")["body"].as_str().unwrap().to_owned();
    let audit = line(&r, "audit")["body"].as_str().unwrap().to_owned();

    let o = postbox(&db, &cfg, &["relay", "--drain"], None);
    assert!(o.status.success(), "{}", text(&o));
    let mut redis = redis().await;
    let got: Vec<String> = redis.lrange(&cleanup.keys[0], 0, -1).await.unwrap();
    assert_eq!(got, vec![billing], "billing's list");
    let got: Vec<String> = redis.lrange(&cleanup.keys[1], 0, -1).await.unwrap();
    assert_eq!(got, vec![audit], "audit's list");
    db.drop_schema().await;
}

#[tokio::test]
async fn the_preview_is_what_the_relay_delivers_in_claim_mode() {
    the_preview_is_what_the_relay_delivers("claim").await;
}

#[tokio::test]
async fn the_preview_is_what_the_relay_delivers_in_log_mode() {
    the_preview_is_what_the_relay_delivers("log").await;
}

/// A stored event is previewed as `dlq show` shows it: what `[redact]`
/// names is masked before the expressions run, so a transform that copies
/// it shows the mask.
#[tokio::test]
async fn an_event_from_the_database_is_previewed_redacted() {
    let db = TestDb::new().await;
    let path = std::env::temp_dir().join(format!("{}_redact.toml", db.schema.name()));
    let mut cleanup = Cleanup {
        files: vec![path.clone()],
        keys: vec![],
    };
    std::fs::write(
        &path,
        "[redact]\npaths = [\"card.number\"]\n\n[sink]\nurl = \"stdout\"\ntransform = '{card: .payload.card.number}'\n",
    )
    .unwrap();
    let ids = db
        .enqueue_events(&[postbox::NewEvent::new(
            "order.placed",
            "order",
            "9",
            &serde_json::json!({"card": {"number": "4111111111111111"}}),
        )
        .unwrap()])
        .await;
    let id = ids[0].to_string();
    let o = postbox(
        &db,
        &path,
        &["route", "test", "--event-id", &id, "--json"],
        None,
    );
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(!t.contains("4111111111111111"), "{t}");
    let r = json(&o);
    assert_eq!(r["redacted"], true, "{r}");
    let body: serde_json::Value =
        serde_json::from_str(line(&r, "default")["body"].as_str().unwrap()).unwrap();
    assert_eq!(body["data"], serde_json::json!({"card": "***"}), "{r}");
    cleanup.files.clear();
    let _ = std::fs::remove_file(&path);
    db.drop_schema().await;
}

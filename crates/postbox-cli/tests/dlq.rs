//! `postbox dlq`: the real binary against a real PostgreSQL, one schema per test.

use postbox::statements::trusted;
use postbox::{NewEvent, Outbox};
use postbox_relay::Store;
use postbox_testkit::TestDb;
use serde_json::Value;
use sqlx::Row;
use std::process::{Command, Output};
use std::time::Duration;
use uuid::Uuid;

fn dlq(db: &TestDb, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_postbox"))
        .arg("dlq")
        .args(args)
        .env("DATABASE_URL", &db.url)
        .env("POSTBOX_SCHEMA", db.schema.name())
        .env("POSTBOX_LOG", "warn")
        .env("USER", "os-user-under-test")
        .env_remove("POSTBOX_CONFIG")
        .output()
        .expect("run postbox")
}

#[track_caller]
fn ok(o: Output) -> (String, String) {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        o.status.success(),
        "exit {:?}\nstdout: {out}\nstderr: {err}",
        o.status
    );
    (out, err)
}

/// Enqueue `n` events of `event_type` and turn them into dead letters.
async fn dead_letters(db: &TestDb, event_type: &str, n: usize) -> Vec<Uuid> {
    let events: Vec<NewEvent> = (0..n)
        .map(|i| {
            NewEvent::new(
                event_type,
                "order",
                i.to_string(),
                &serde_json::json!({"n": i}),
            )
            .unwrap()
        })
        .collect();
    let ids = db.enqueue_events(&events).await;
    sqlx::query(trusted(&db.sql(
        "UPDATE {schema}.outbox SET status = 'failed', attempts = 5, \
         last_error = 'sink rejected: 400 bad request #' || id WHERE event_id = ANY($1)",
    )))
    .bind(&ids)
    .execute(&db.pool)
    .await
    .unwrap();
    ids
}

async fn row(db: &TestDb, event_id: Uuid) -> sqlx::postgres::PgRow {
    sqlx::query(trusted(&db.sql(
        "SELECT status::text, attempts, resolution, resolution_note, replaced_by, replay_of, \
         available_at <= now() FROM {schema}.outbox WHERE event_id = $1",
    )))
    .bind(event_id)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

async fn audit(db: &TestDb) -> Vec<(String, String, i64, Option<String>, Value, Value)> {
    sqlx::query(trusted(&db.sql(
        "SELECT actor, action, count, reason, selection, details FROM {schema}.audit_log ORDER BY id",
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|r| {
        (
            r.get(0),
            r.get(1),
            r.get(2),
            r.get(3),
            r.get(4),
            r.get(5),
        )
    })
    .collect()
}

#[tokio::test]
async fn list_show_replay_and_discard_leave_an_audit_trail() {
    let db = TestDb::new().await;
    let ids = dead_letters(&db, "order.created", 4).await;
    let other = dead_letters(&db, "invoice.sent", 1).await;
    let healthy = postbox_relay_free_event(&db).await;

    // list: every unresolved dead letter, or one type; the healthy event never.
    let (out, _) = ok(dlq(&db, &["list", "--json"]));
    let listed: Vec<Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(listed.len(), 5);
    assert!(listed[0]["last_error"]
        .as_str()
        .unwrap()
        .contains("400 bad request"));
    let (out, _) = ok(dlq(&db, &["list", "--type", "invoice.sent", "--json"]));
    let listed: Vec<Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["event_id"], other[0].to_string());
    let (out, _) = ok(dlq(
        &db,
        &["list", "--since", "2999-01-01T00:00:00Z", "--json"],
    ));
    assert_eq!(out.trim(), "[]");
    let (out, _) = ok(dlq(&db, &["list", "--limit", "2"]));
    assert_eq!(out.lines().count(), 3, "header and two rows: {out}");

    // show: the whole event.
    let (out, _) = ok(dlq(&db, &["show", &ids[0].to_string(), "--json"]));
    let shown: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(shown["payload"], serde_json::json!({"n": 0}));
    assert_eq!(shown["status"], "failed");
    let missing = dlq(&db, &["show", &Uuid::now_v7().to_string()]);
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no event"));

    // replay under the same id: pending, attempts 0, due now; a relay claims it with that id.
    let (out, _) = ok(dlq(
        &db,
        &["replay", &ids[0].to_string(), "--actor", "alice"],
    ));
    assert!(
        out.contains("replayed 1 dead letter(s) under their own event id"),
        "{out}"
    );
    let r = row(&db, ids[0]).await;
    assert_eq!(r.get::<String, _>(0), "pending");
    assert_eq!(r.get::<i32, _>(1), 0);
    assert!(r.get::<bool, _>(6));
    let store = Store::new(db.pool.clone(), db.schema.clone());
    let claim = store
        .claim(100, Duration::from_secs(30), None)
        .await
        .unwrap();
    let claimed: Vec<Uuid> = claim.events.iter().map(|m| m.event_id).collect();
    assert!(claimed.contains(&ids[0]), "{claimed:?}");
    assert!(claimed.contains(&healthy));
    assert_eq!(claimed.len(), 2, "no other dead letter is claimable");
    let attempt = claim
        .events
        .iter()
        .find(|m| m.event_id == ids[0])
        .unwrap()
        .attempt;
    assert_eq!(attempt, 1, "a replay starts a fresh retry budget");

    // replay with --new-id: a pending copy with a fresh id; the original is resolved as replaced.
    let (out, _) = ok(dlq(&db, &["replay", &ids[1].to_string(), "--new-id"]));
    let (original, copy) = out.lines().next().unwrap().split_once(" -> ").unwrap();
    assert_eq!(original, ids[1].to_string());
    let copy: Uuid = copy.parse().unwrap();
    assert_ne!(copy, ids[1]);
    assert_eq!(copy.get_version_num(), 7);
    let r = row(&db, ids[1]).await;
    assert_eq!(
        r.get::<String, _>(0),
        "failed",
        "the original stays as it was"
    );
    assert_eq!(r.get::<Option<String>, _>(2).as_deref(), Some("replaced"));
    assert_eq!(r.get::<Option<Uuid>, _>(4), Some(copy));
    let c = row(&db, copy).await;
    assert_eq!(c.get::<String, _>(0), "pending");
    assert_eq!(c.get::<Option<Uuid>, _>(5), Some(ids[1]));
    let claim = store
        .claim(100, Duration::from_secs(30), None)
        .await
        .unwrap();
    assert_eq!(claim.events.len(), 1);
    assert_eq!(claim.events[0].event_id, copy);
    assert_eq!(claim.events[0].payload.get(), r#"{"n": 1}"#);

    // discard: needs a reason; the row stays, resolved as discarded.
    let no_reason = dlq(&db, &["discard", &ids[2].to_string()]);
    assert!(!no_reason.status.success());
    let (out, _) = ok(dlq(
        &db,
        &[
            "discard",
            &ids[2].to_string(),
            "--reason",
            "customer cancelled",
            "--actor",
            "bob",
        ],
    ));
    assert!(out.contains("discarded 1 dead letter(s)"), "{out}");
    let r = row(&db, ids[2]).await;
    assert_eq!(r.get::<String, _>(0), "failed");
    assert_eq!(r.get::<Option<String>, _>(2).as_deref(), Some("discarded"));
    assert_eq!(
        r.get::<Option<String>, _>(3).as_deref(),
        Some("customer cancelled")
    );

    // Only the untouched ones are still listed; acting on a resolved one is refused.
    let (out, _) = ok(dlq(&db, &["list", "--json"]));
    let listed: Vec<Value> = serde_json::from_str(&out).unwrap();
    let still: Vec<&str> = listed
        .iter()
        .map(|v| v["event_id"].as_str().unwrap())
        .collect();
    assert_eq!(still, [ids[3].to_string(), other[0].to_string()]);
    let again = dlq(&db, &["replay", &ids[2].to_string()]);
    assert!(!again.status.success(), "a discarded event is not replayed");
    assert!(String::from_utf8_lossy(&again.stderr).contains("not an unresolved dead letter"));

    // The audit log: who, what, which, how many, why, and the last error each had.
    let log = audit(&db).await;
    assert_eq!(
        log.len(),
        3,
        "a refused action changes nothing and is not logged: {log:?}"
    );
    let (actor, action, count, reason, selection, details) = &log[0];
    assert_eq!(
        (actor.as_str(), action.as_str(), *count),
        ("alice", "dlq.replay", 1)
    );
    assert_eq!(reason, &None);
    assert_eq!(selection, &serde_json::json!({"ids": [ids[0]]}));
    assert_eq!(details[0]["event_id"], ids[0].to_string());
    assert!(details[0]["last_error"]
        .as_str()
        .unwrap()
        .contains("400 bad request"));
    let (actor, action, count, _, _, details) = &log[1];
    assert_eq!(
        (actor.as_str(), action.as_str(), *count),
        ("os-user-under-test", "dlq.replay_new_id", 1)
    );
    assert_eq!(details[0]["new_event_id"], copy.to_string());
    let (actor, action, count, reason, _, _) = &log[2];
    assert_eq!(
        (actor.as_str(), action.as_str(), *count),
        ("bob", "dlq.discard", 1)
    );
    assert_eq!(reason.as_deref(), Some("customer cancelled"));

    // `show` includes the event's audit history; `audit` prints the log.
    let (out, _) = ok(dlq(&db, &["show", &ids[2].to_string()]));
    assert!(
        out.contains("customer cancelled") && out.contains("dlq.discard"),
        "{out}"
    );
    let (out, _) = ok(dlq(&db, &["audit", "--json"]));
    assert_eq!(serde_json::from_str::<Vec<Value>>(&out).unwrap().len(), 3);
    db.drop_schema().await;
}

/// One ordinary pending event, to show that dead-letter commands leave it alone.
async fn postbox_relay_free_event(db: &TestDb) -> Uuid {
    let outbox = Outbox::new(db.schema.clone());
    let mut tx = db.pool.begin().await.unwrap();
    let e = NewEvent::new("order.paid", "order", "x", &serde_json::json!({})).unwrap();
    let id = postbox::sqlx::enqueue(&outbox, &mut tx, &e).await.unwrap();
    tx.commit().await.unwrap();
    id
}

#[tokio::test]
async fn bulk_replay_runs_in_bounded_batches_with_progress_and_a_filter() {
    let db = TestDb::new().await;
    let wanted = dead_letters(&db, "order.created", 2500).await;
    dead_letters(&db, "invoice.sent", 300).await;

    // Progress per batch when asked for (it is shown on a terminal, never in a pipe by default).
    let replay = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .args(["dlq", "replay", "--all", "--type", "order.created"])
        .env("DATABASE_URL", &db.url)
        .env("POSTBOX_SCHEMA", db.schema.name())
        .env("POSTBOX_LOG", "warn")
        .env("POSTBOX_PROGRESS", "always")
        .env("USER", "os-user-under-test")
        .env_remove("POSTBOX_CONFIG")
        .output()
        .expect("run postbox");
    let (out, err) = ok(replay);
    assert!(
        out.contains("replayed 2500 dead letter(s) under their own event id in 3 batch(es)"),
        "{out}"
    );
    assert!(err.contains("replayed 1000/2500 (40%)"), "{err}");
    assert!(err.contains("replayed 2500/2500 (100%)"), "{err}");

    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'pending' AND attempts = 0 AND event_type = 'order.created'").await,
        2500
    );
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'failed' AND resolved_at IS NULL AND event_type = 'invoice.sent'").await,
        300,
        "the filter held"
    );
    let log = audit(&db).await;
    let counts: Vec<i64> = log.iter().map(|e| e.2).collect();
    assert_eq!(
        counts,
        [1000, 1000, 500],
        "one audit entry per committed batch"
    );
    for (actor, action, _, _, selection, details) in &log {
        assert_eq!(actor, "os-user-under-test");
        assert_eq!(action, "dlq.replay");
        assert_eq!(
            selection,
            &serde_json::json!({"all": true, "type": "order.created"})
        );
        assert!(details
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["last_error"].is_string()));
    }

    // The relay claims every replayed event again, under its original id.
    let store = Store::new(db.pool.clone(), db.schema.clone());
    let mut claimed = Vec::new();
    loop {
        let c = store
            .claim(1000, Duration::from_secs(30), None)
            .await
            .unwrap();
        if c.events.is_empty() {
            break;
        }
        claimed.extend(c.events.into_iter().map(|m| m.event_id));
    }
    claimed.sort();
    let mut want = wanted.clone();
    want.sort();
    assert_eq!(claimed, want);

    // Discard the rest in small batches; an explicit reason is kept on each row.
    let (out, err) = ok(dlq(
        &db,
        &[
            "discard",
            "--all",
            "--reason",
            "obsolete",
            "--batch-size",
            "128",
        ],
    ));
    assert!(
        out.contains("discarded 300 dead letter(s) in 3 batch(es)"),
        "{out}"
    );
    assert!(!err.contains("300/300"), "no progress in a pipe: {err}");
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE resolution = 'discarded' AND resolution_note = 'obsolete'").await,
        300
    );
    db.drop_schema().await;
}

/// `[redact]` masks payload paths and headers in `dlq show`, text and JSON,
/// and leaves the stored event untouched.
#[tokio::test]
async fn show_masks_configured_payload_paths_and_headers() {
    let db = TestDb::new().await;
    let event = NewEvent::new(
        "card.charged",
        "card",
        "c1",
        &serde_json::json!({
            "card": {"number": "4111-SECRET-1111", "brand": "visa"},
            "people": [{"email": "a-secret@example.com", "name": "Ann"}]
        }),
    )
    .unwrap()
    .headers([
        ("Authorization", "Bearer header-secret"),
        ("x-kind", "test"),
    ])
    .unwrap();
    let id = db.enqueue_events(&[event]).await[0];
    let dir = std::env::temp_dir().join(format!("postbox-redact-{}", Uuid::now_v7()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("postbox.toml");
    std::fs::write(
        &config,
        "[redact]\npaths = [\"card.number\", \"people[*].email\"]\nheaders = [\"authorization\"]\n",
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let id_text = id.to_string();

    for json in [true, false] {
        let mut args = vec!["--config", config, "show", &id_text];
        if json {
            args.push("--json");
        }
        let (out, _) = ok(dlq(&db, &args));
        for secret in ["4111-SECRET-1111", "a-secret@example.com", "header-secret"] {
            assert!(!out.contains(secret), "{secret} shown: {out}");
        }
        assert!(
            out.contains("visa") && out.contains("Ann") && out.contains("x-kind"),
            "{out}"
        );
        if json {
            let v: Value = serde_json::from_str(&out).unwrap();
            assert_eq!(v["payload"]["card"]["number"], "***");
            assert_eq!(v["payload"]["people"][0]["email"], "***");
        }
    }
    // The stored event is what the producer wrote.
    let stored: String = sqlx::query_scalar(trusted(
        &db.sql("SELECT payload::text FROM {schema}.outbox WHERE event_id = $1"),
    ))
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(stored.contains("4111-SECRET-1111"));

    // A bad path is refused, naming the field.
    std::fs::write(
        dir.join("bad.toml"),
        "[redact]\npaths = [\"card..number\"]\n",
    )
    .unwrap();
    let bad = dlq(
        &db,
        &[
            "--config",
            dir.join("bad.toml").to_str().unwrap(),
            "show",
            &id_text,
        ],
    );
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("redact.paths[0]"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

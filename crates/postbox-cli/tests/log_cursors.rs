//! Log mode's cursors through the real binary: a destination removed from
//! the configuration leaves its cursor behind, which keeps the log from
//! being truncated; `status`, `log cursors` and the relay say so, and
//! `log drop-cursor` drops it, audited.

use postbox::statements::trusted;
use postbox_testkit::{wait_for, TestDb};
use std::process::{Command, Output};
use std::time::Duration;

fn postbox(db: &TestDb, config: &std::path::Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_postbox"))
        .args(args)
        .env("DATABASE_URL", &db.url)
        .env("POSTBOX_SCHEMA", db.schema.name())
        .env("POSTBOX_LOG", "warn")
        .env("POSTBOX_CONFIG", config)
        .env_remove("POSTBOX_SINK")
        .env("NO_COLOR", "1")
        .output()
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

/// A configuration file delivering every event to the destinations named.
fn config(db: &TestDb, name: &str, destinations: &[&str]) -> std::path::PathBuf {
    let mut toml = String::from("[relay]\nmode = \"log\"\n");
    for d in destinations {
        toml.push_str(&format!("[destinations.{d}]\nurl = \"stdout\"\n"));
    }
    toml.push_str(&format!(
        "[[routes]]\nmatch = [\"*\"]\nto = [{}]\n",
        destinations
            .iter()
            .map(|d| format!("\"{d}\""))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let path = std::env::temp_dir().join(format!("{}_{name}.toml", db.schema.name()));
    std::fs::write(&path, toml).unwrap();
    path
}

#[tokio::test]
async fn a_removed_destinations_cursor_is_reported_and_dropped_audited() {
    let db = TestDb::new().await;
    let before = config(&db, "before", &["billing", "search"]);
    let after = config(&db, "after", &["search"]);
    // A relay delivering to both makes both cursors.
    let o = postbox(&db, &before, &["relay", "--drain"]);
    assert!(o.status.success(), "{}", text(&o));

    // billing is removed: nothing reads its cursor any more.
    wait_for(
        "status to say billing's cursor is not read",
        Duration::from_secs(30),
        || async {
            let o = postbox(&db, &after, &["status", "--inactive-warn", "1s"]);
            let t = text(&o);
            o.status.code() == Some(1)
                && t.contains("NOT READ for")
                && t.contains("postbox log drop-cursor billing")
        },
    )
    .await;
    let o = postbox(&db, &after, &["log", "cursors", "--inactive-warn", "1s"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(t.contains("NOT IN THE CONFIGURATION"), "{t}");
    let o = postbox(&db, &after, &["status", "--json"]);
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).expect("status --json");
    assert!(r["log_bytes"].as_i64().is_some(), "{r}");

    let o = postbox(
        &db,
        &after,
        &[
            "log",
            "drop-cursor",
            "billing",
            "--actor",
            "ops",
            "--reason",
            "billing moved to webhooks",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let (action, actor, reason): (String, String, Option<String>) = sqlx::query_as(trusted(
        &db.sql("SELECT action, actor, reason FROM {schema}.audit_log ORDER BY id DESC LIMIT 1"),
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (action.as_str(), actor.as_str(), reason.as_deref()),
        ("log.drop_cursor", "ops", Some("billing moved to webhooks"))
    );
    let left: Vec<String> = sqlx::query_scalar(trusted(
        &db.sql("SELECT DISTINCT destination FROM {schema}.log_cursors ORDER BY 1"),
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(left, ["search"]);
    let o = postbox(
        &db,
        &after,
        &["log", "drop-cursor", "billing", "--actor", "ops"],
    );
    assert!(
        !o.status.success() && text(&o).contains("no log cursor named billing"),
        "{}",
        text(&o)
    );

    let _ = std::fs::remove_file(before);
    let _ = std::fs::remove_file(after);
    db.drop_schema().await;
}

/// A consumer group through the binary: created (with a warning while
/// producers still write to the outbox table), listed with what it holds,
/// reported by `status` when no reader calls `receive` on it, dropped
/// audited.
#[tokio::test]
async fn a_consumer_group_is_created_listed_reported_and_dropped() {
    let db = TestDb::new().await;
    let cfg = config(&db, "groups", &["search"]);
    let o = postbox(
        &db,
        &cfg,
        &["group", "create", "billing", "--types", "order.*"],
    );
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("created consumer group billing"), "{t}");
    assert!(
        t.contains("postbox migrate --mode log"),
        "claim mode is named: {t}"
    );
    let o = postbox(&db, &cfg, &["group", "create", "billing"]);
    assert!(
        !o.status.success() && text(&o).contains("exists already"),
        "{}",
        text(&o)
    );
    let o = postbox(&db, &cfg, &["group", "create", "x", "--start", "yesterday"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));

    db.exec(
        "INSERT INTO {schema}.log (event_id, event_type, aggregate_type, aggregate_id, payload) \
         SELECT gen_random_uuid(), 'order.placed', 'order', i::text, '{}' FROM generate_series(1, 3) AS i",
    )
    .await;
    let taken: i64 = sqlx::query_scalar(trusted(
        &db.sql("SELECT count(*) FROM {schema}.receive('billing', 1)"),
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(taken, 1);
    let o = postbox(&db, &cfg, &["group", "list", "--json"]);
    let groups: serde_json::Value = serde_json::from_slice(&o.stdout).expect("group list --json");
    let g = &groups[0];
    assert_eq!(
        (&g["name"], &g["unread"], &g["in_flight"], &g["readers"]),
        (&"billing".into(), &2.into(), &1.into(), &1.into()),
        "{groups}"
    );
    let o = postbox(&db, &cfg, &["status"]);
    let t = text(&o);
    assert!(
        t.contains("consumer groups") && t.contains("unread 2, in flight 1"),
        "{t}"
    );
    wait_for(
        "status to say billing is not read",
        Duration::from_secs(30),
        || async {
            let o = postbox(&db, &cfg, &["status", "--inactive-warn", "1s"]);
            let t = text(&o);
            o.status.code() == Some(1) && t.contains("postbox group drop billing")
        },
    )
    .await;
    let o = postbox(&db, &cfg, &["group", "dead-letters", "billing"]);
    assert!(text(&o).contains("no dead letter"), "{}", text(&o));
    let o = postbox(&db, &cfg, &["group", "replay-dead", "billing"]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "--event-id or --all: {}",
        text(&o)
    );
    let o = postbox(
        &db,
        &cfg,
        &["group", "replay-dead", "billing", "--all", "--actor", "ops"],
    );
    assert!(
        text(&o).contains("0 dead letter(s) of billing"),
        "{}",
        text(&o)
    );
    let o = postbox(
        &db,
        &cfg,
        &[
            "group", "drop", "billing", "--reason", "moved", "--actor", "ops",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let o = postbox(&db, &cfg, &["group", "drop", "billing", "--actor", "ops"]);
    assert!(
        text(&o).contains("no consumer group named billing"),
        "{}",
        text(&o)
    );
    assert_eq!(
        db.count(
            "SELECT count(*) FROM {schema}.audit_log WHERE action = 'group_drop' AND actor = 'ops'"
        )
        .await,
        1
    );
    let _ = std::fs::remove_file(cfg);
    db.drop_schema().await;
}

/// A consumer group over HTTP through the binary: a token made once
/// (printed, never listed), `group serve` answering a reader that holds it
/// and refusing one that holds another group's, the token revoked
/// (audited), and SIGTERM ending the server.
#[tokio::test]
async fn a_group_is_served_over_http_with_its_token() {
    let db = TestDb::new().await;
    let cfg = config(&db, "serve", &["search"]);
    for name in ["billing", "shipping"] {
        let o = postbox(&db, &cfg, &["group", "create", name]);
        assert!(o.status.success(), "{}", text(&o));
    }
    let o = postbox(
        &db,
        &cfg,
        &[
            "group", "token", "create", "billing", "--label", "ledger", "--actor", "ops",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let token = String::from_utf8(o.stdout.clone())
        .unwrap()
        .trim()
        .to_owned();
    assert!(
        token.starts_with("pbg_") && token.len() == 68,
        "{}",
        text(&o)
    );
    let o = postbox(&db, &cfg, &["group", "token", "create", "shipping"]);
    let other = String::from_utf8(o.stdout.clone())
        .unwrap()
        .trim()
        .to_owned();
    let o = postbox(&db, &cfg, &["group", "token", "create", "nope"]);
    assert!(
        !o.status.success() && text(&o).contains("no consumer group named nope"),
        "{}",
        text(&o)
    );
    let o = postbox(&db, &cfg, &["group", "token", "list", "billing", "--json"]);
    let listed = text(&o);
    assert!(
        listed.contains("ledger") && !listed.contains(&token[4..]),
        "{listed}"
    );

    db.exec(
        "INSERT INTO {schema}.log (event_id, event_type, aggregate_type, aggregate_id, payload) \
         SELECT gen_random_uuid(), 'order.placed', 'order', i::text, '{}' FROM generate_series(1, 3) AS i",
    )
    .await;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut server = tokio::process::Command::new(env!("CARGO_BIN_EXE_postbox"))
        .args([
            "group",
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--token-cache",
            "0s",
        ])
        .env("DATABASE_URL", &db.url)
        .env("POSTBOX_SCHEMA", db.schema.name())
        .env("POSTBOX_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("run postbox group serve");
    let client = postbox_testkit::http().build().unwrap();
    let url = format!("http://127.0.0.1:{port}/groups/billing/receive");
    let call = |token: String| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            client
                .post(url)
                .bearer_auth(token)
                .body(r#"{"max_events": 10}"#)
                .send()
                .await
        }
    };
    wait_for("group serve to answer", Duration::from_secs(60), || async {
        call(token.clone()).await.is_ok()
    })
    .await;
    // The call that answered first took the three events (they are in
    // flight now); another group's token takes nothing.
    let got = call(other.clone()).await.unwrap();
    assert_eq!(got.status(), 403);
    let o = postbox(&db, &cfg, &["group", "list", "--json"]);
    let groups: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(groups[0]["name"], "billing");
    assert_eq!(
        groups[0]["in_flight"], 3,
        "the token's reader took them: {groups}"
    );

    let o = postbox(&db, &cfg, &["group", "token", "list", "billing", "--json"]);
    let tokens: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let id = tokens[0]["id"].to_string();
    let o = postbox(
        &db,
        &cfg,
        &["group", "token", "revoke", "billing", &id, "--actor", "ops"],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(call(token.clone()).await.unwrap().status(), 401);
    assert_eq!(
        db.count(
            "SELECT count(*) FROM {schema}.audit_log WHERE action IN ('group_token_create', 'group_token_revoke') AND actor = 'ops'"
        )
        .await,
        2
    );

    let pid = server.id().expect("the server runs") as i32;
    // SAFETY: signalling our own child by its pid.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
    let status = tokio::time::timeout(Duration::from_secs(30), server.wait())
        .await
        .expect("the server stops on SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
    let _ = std::fs::remove_file(cfg);
    db.drop_schema().await;
}

/// `[groups.NAME]` in the configuration: `postbox migrate` makes the
/// groups that do not exist, leaves the others, says when one differs, and
/// a bad entry names its field.
#[tokio::test]
async fn configured_groups_are_made_by_migrate() {
    let db = TestDb::new().await;
    let path = std::env::temp_dir().join(format!("{}_groups.toml", db.schema.name()));
    let write = |ordered: bool, start: &str| {
        std::fs::write(
            &path,
            format!(
                "[groups.billing]\ntypes = [\"order.*\"]\nordered = {ordered}\nmax_attempts = 7\n\
                 [groups.audit]\nstart = \"{start}\"\n"
            ),
        )
        .unwrap();
    };
    write(true, "beginning");
    let o = postbox(&db, &path, &["migrate", "--mode", "log"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("consumer group billing created") && t.contains("consumer group audit created"),
        "{t}"
    );
    let o = postbox(&db, &path, &["group", "list", "--json"]);
    let groups: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let billing = groups
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == "billing")
        .expect("billing");
    assert_eq!(
        (
            &billing["ordered"],
            &billing["max_attempts"],
            &billing["types"]
        ),
        (&true.into(), &7.into(), &serde_json::json!(["order.*"])),
        "{groups}"
    );
    // Again: nothing to do. Changed: said, not applied.
    let o = postbox(&db, &path, &["migrate"]);
    assert!(!text(&o).contains("created"), "{}", text(&o));
    write(false, "beginning");
    let o = postbox(&db, &path, &["migrate"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("consumer group billing exists with other ordered"),
        "{t}"
    );
    write(false, "yesterday");
    let o = postbox(&db, &path, &["migrate"]);
    let t = text(&o);
    assert!(
        !o.status.success() && t.contains("groups.audit.start"),
        "{t}"
    );
    let _ = std::fs::remove_file(&path);
    db.drop_schema().await;
}

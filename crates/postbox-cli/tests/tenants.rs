//! Many outboxes through the real binary: `migrate --schemas` (idempotent),
//! `relay --schemas --drain` serving them all from one process, `[[outboxes]]`
//! in the config file, `status --schemas`, and the relay's `/outboxes`.

use postbox::statements::trusted;
use postbox::Schema;
use postbox_testkit::{database_url, unique, wait_for};
use sqlx::PgPool;
use std::process::{Command, Output};
use std::time::Duration;

fn postbox(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_postbox"));
    c.args(args)
        .env("DATABASE_URL", database_url())
        .env("POSTBOX_LOG", "warn")
        .env_remove("POSTBOX_SCHEMA")
        .env_remove("POSTBOX_CONFIG")
        .env_remove("POSTBOX_SINK")
        .env_remove("POSTBOX_METRICS_LISTEN")
        .env("NO_COLOR", "1");
    c
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

async fn enqueue(pool: &PgPool, schema: &str, n: usize) {
    for i in 0..n {
        sqlx::query(trusted(&format!(
            "SELECT {schema}.enqueue('order.created', 'order', $1, jsonb_build_object('n', $2::int))"
        )))
        .bind(format!("o-{i}"))
        .bind(i as i32)
        .execute(pool)
        .await
        .unwrap();
    }
}

#[tokio::test]
async fn one_relay_migrates_serves_and_shows_every_matching_schema() {
    let pool = PgPool::connect(&database_url()).await.unwrap();
    let prefix = unique("tncli");
    let (a, b) = (format!("{prefix}_a"), format!("{prefix}_b"));
    let glob = format!("{prefix}_*");
    for s in [&a, &b] {
        sqlx::raw_sql(trusted(&format!("CREATE SCHEMA {s}")))
            .execute(&pool)
            .await
            .unwrap();
    }

    // migrate --schemas: every matching schema, and again: nothing to do.
    let first = ok(postbox(&["migrate", "--schemas", &glob]).output().unwrap());
    assert!(
        first.contains(&format!("postgres/{a}: applied migration(s) 1,")),
        "{first}"
    );
    assert!(first.contains("2 schema(s): 2 migrated"), "{first}");
    let again = ok(postbox(&["migrate", "--schemas", &glob]).output().unwrap());
    assert!(
        again.contains(&format!("postgres/{b} is up to date")),
        "{again}"
    );
    assert!(
        again.contains("0 migrated, 2 already up to date"),
        "{again}"
    );

    enqueue(&pool, &a, 3).await;
    enqueue(&pool, &b, 2).await;
    let out = ok(
        postbox(&["relay", "--schemas", &glob, "--sink", "stdout", "--drain"])
            .output()
            .unwrap(),
    );
    assert!(out.contains("drained 2 outboxes: 5 delivered"), "{out}");
    let sources = |schema: &str| {
        out.matches(&format!("\"source\":\"postbox/postgres/{schema}\""))
            .count()
    };
    assert_eq!((sources(&a), sources(&b)), (3, 2), "{out}");

    // [[outboxes]] in the config file, with its own CloudEvents source prefix.
    enqueue(&pool, &b, 1).await;
    let config = std::env::temp_dir().join(format!("{prefix}.toml"));
    std::fs::write(
        &config,
        format!(
            "[sink]\nurl = \"stdout\"\nsource = \"shop\"\n\n[[outboxes]]\nschema = \"{b}\"\n\n[tenants]\npool_size = 1\nmax_in_flight_batches = 2\n"
        ),
    )
    .unwrap();
    let out = ok(postbox(&["relay", "--drain"])
        .env("POSTBOX_CONFIG", &config)
        .output()
        .unwrap());
    assert!(out.contains("drained 1 outboxes: 1 delivered"), "{out}");
    assert!(
        out.contains(&format!("\"source\":\"shop/postgres/{b}\"")),
        "{out}"
    );
    let _ = std::fs::remove_file(&config);

    // status: all of them, or one by its exact name.
    let all = ok(postbox(&["status", "--schemas", &glob, "--json"])
        .output()
        .unwrap());
    let lines: serde_json::Value = serde_json::from_str(all.trim()).unwrap();
    let sent: Vec<(String, i64)> = lines
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l["outbox"].as_str().unwrap().to_owned(),
                l["sent"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        sent,
        vec![(format!("postgres/{a}"), 3), (format!("postgres/{b}"), 3)]
    );
    let one = ok(postbox(&["status", "--schemas", &a]).output().unwrap());
    assert!(
        one.contains(&format!("postgres/{a}")) && !one.contains(&b),
        "{one}"
    );

    // A log-mode outbox beside a claim-mode one: its line counts what its
    // consumer group has not read, not only the outbox table.
    ok(postbox(&["migrate", "--schema", &b, "--mode", "log"])
        .output()
        .unwrap());
    ok(postbox(&["group", "create", "g", "--schema", &b])
        .output()
        .unwrap());
    enqueue(&pool, &b, 2).await;
    let all = ok(postbox(&["status", "--schemas", &glob, "--json"])
        .output()
        .unwrap());
    let lines: serde_json::Value = serde_json::from_str(all.trim()).unwrap();
    let (la, lb) = (&lines[0], &lines[1]);
    assert_eq!(la["producers_write_into"], "outbox", "{la}");
    assert!(
        la["log_unread_events"].is_null() && la["group_unread_events"].is_null(),
        "{la}"
    );
    assert_eq!(lb["producers_write_into"], "log", "{lb}");
    assert_eq!(lb["group_unread_events"], 2, "{lb}");
    assert_eq!(lb["group_dead_letters"], 0, "{lb}");
    let text = ok(postbox(&["status", "--schemas", &glob]).output().unwrap());
    let line_b = text.lines().find(|l| l.contains(&b)).unwrap();
    assert!(
        line_b.contains(" log ") && line_b.trim_end().ends_with("2/0"),
        "{text}"
    );

    for s in [&a, &b] {
        assert!(Schema::new(s).is_ok());
        sqlx::raw_sql(trusted(&format!("DROP SCHEMA {s} CASCADE")))
            .execute(&pool)
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn purge_works_on_every_matching_outbox() {
    let pool = PgPool::connect(&database_url()).await.unwrap();
    let prefix = unique("tnpurge");
    let (a, b) = (format!("{prefix}_a"), format!("{prefix}_b"));
    let glob = format!("{prefix}_*");
    for s in [&a, &b] {
        sqlx::raw_sql(trusted(&format!("CREATE SCHEMA {s}")))
            .execute(&pool)
            .await
            .unwrap();
    }
    ok(postbox(&["migrate", "--schemas", &glob]).output().unwrap());
    enqueue(&pool, &a, 4).await;
    enqueue(&pool, &b, 3).await;
    // a: 3 events sent long ago, 1 pending; b: 2 sent long ago, 1 sent just now.
    sqlx::raw_sql(trusted(&format!(
        "UPDATE {a}.outbox SET status = 'sent', sent_at = now() - interval '10 days' WHERE id <= 3;
         UPDATE {b}.outbox SET status = 'sent', sent_at = now() - interval '10 days' WHERE id <= 2;
         UPDATE {b}.outbox SET status = 'sent', sent_at = now() WHERE id = 3;"
    )))
    .execute(&pool)
    .await
    .unwrap();

    let out = ok(
        postbox(&["purge", "--schemas", &glob, "--older-than", "7d"])
            .output()
            .unwrap(),
    );
    assert!(
        out.contains(&format!("postgres/{a}: 3 sent events deleted")),
        "{out}"
    );
    assert!(
        out.contains(&format!("postgres/{b}: 2 sent events deleted")),
        "{out}"
    );
    assert!(
        out.contains("purged 2 outboxes: 5 sent events deleted"),
        "{out}"
    );
    for (schema, left) in [(&a, 1), (&b, 1)] {
        let n: i64 = sqlx::query_scalar(trusted(&format!("SELECT count(*) FROM {schema}.outbox")))
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(n, left, "{schema}: only old sent events are purged");
    }
    for s in [&a, &b] {
        sqlx::raw_sql(trusted(&format!("DROP SCHEMA {s} CASCADE")))
            .execute(&pool)
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn dlq_lists_and_replays_across_outboxes() {
    let pool = PgPool::connect(&database_url()).await.unwrap();
    let prefix = unique("tndlq");
    let (a, b) = (format!("{prefix}_a"), format!("{prefix}_b"));
    let glob = format!("{prefix}_*");
    for s in [&a, &b] {
        sqlx::raw_sql(trusted(&format!("CREATE SCHEMA {s}")))
            .execute(&pool)
            .await
            .unwrap();
    }
    ok(postbox(&["migrate", "--schemas", &glob]).output().unwrap());
    enqueue(&pool, &a, 2).await;
    enqueue(&pool, &b, 2).await;
    // Dead letters: both of a's events, one of b's.
    sqlx::raw_sql(trusted(&format!(
        "UPDATE {a}.outbox SET status = 'failed', attempts = 5, last_error = 'rejected';
         UPDATE {b}.outbox SET status = 'failed', attempts = 5, last_error = 'rejected' WHERE id = 1;"
    )))
    .execute(&pool)
    .await
    .unwrap();

    let listed = ok(postbox(&["dlq", "list", "--schemas", &glob, "--json"])
        .output()
        .unwrap());
    let rows: serde_json::Value = serde_json::from_str(listed.trim()).unwrap();
    let mut outboxes: Vec<&str> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["outbox"].as_str().unwrap())
        .collect();
    outboxes.sort();
    let (name_a, name_b) = (format!("postgres/{a}"), format!("postgres/{b}"));
    assert_eq!(
        outboxes,
        vec![name_a.as_str(), &name_a, &name_b],
        "{listed}"
    );
    let table = ok(postbox(&["dlq", "list", "--schemas", &glob])
        .output()
        .unwrap());
    assert!(
        table.contains(&name_b) && table.contains("rejected"),
        "{table}"
    );

    let replayed = ok(postbox(&[
        "dlq",
        "replay",
        "--all",
        "--schemas",
        &glob,
        "--actor",
        "ops",
    ])
    .output()
    .unwrap());
    assert!(
        replayed.contains(&format!("{name_a}: replayed 2 dead letter(s)")),
        "{replayed}"
    );
    assert!(
        replayed.contains("replayed 3 dead letter(s) under their own event id")
            && replayed.contains("over 2 outbox(es), audited as ops"),
        "{replayed}"
    );
    for s in [&a, &b] {
        let failed: i64 = sqlx::query_scalar(trusted(&format!(
            "SELECT count(*) FROM {s}.outbox WHERE status = 'failed'"
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(failed, 0, "{s}: every dead letter is pending again");
    }
    // Each outbox's audit entry names the outbox, as the console's do.
    for (s, name, n) in [(&a, &name_a, 2_i64), (&b, &name_b, 1)] {
        let entries: Vec<(String, String, i64, Option<String>)> = sqlx::query_as(trusted(
            &format!("SELECT actor, action, count, selection->>'outbox' FROM {s}.audit_log"),
        ))
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(
            entries,
            [(
                "ops".to_owned(),
                "dlq.replay".to_owned(),
                n,
                Some(name.clone())
            )],
            "{s}"
        );
    }
    let none = ok(postbox(&["dlq", "list", "--schemas", &glob])
        .output()
        .unwrap());
    assert!(none.contains("no dead letters in 2 outbox(es)"), "{none}");
    for s in [&a, &b] {
        sqlx::raw_sql(trusted(&format!("DROP SCHEMA {s} CASCADE")))
            .execute(&pool)
            .await
            .unwrap();
    }
}

/// `GET /outboxes` of a relay serving many outboxes: the health watch's
/// findings per outbox, `503` while one is unhealthy; `status --schemas`
/// shows the same against the same `[health]` thresholds.
#[tokio::test]
async fn the_relay_and_status_report_which_outboxes_are_unhealthy() {
    let pool = PgPool::connect(&database_url()).await.unwrap();
    let prefix = unique("tnclihealth");
    let (fine, sick) = (format!("{prefix}_fine"), format!("{prefix}_sick"));
    let glob = format!("{prefix}_*");
    for s in [&fine, &sick] {
        sqlx::raw_sql(trusted(&format!("CREATE SCHEMA {s}")))
            .execute(&pool)
            .await
            .unwrap();
    }
    ok(postbox(&["migrate", "--schemas", &glob]).output().unwrap());
    // The sick outbox's table: 100 dead tuples, none alive, no autovacuum.
    sqlx::raw_sql(trusted(&format!(
        "ALTER TABLE {sick}.outbox SET (autovacuum_enabled = off)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    enqueue(&pool, &sick, 100).await;
    sqlx::raw_sql(trusted(&format!(
        "DELETE FROM {sick}.outbox; SELECT pg_stat_force_next_flush()"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let config = std::env::temp_dir().join(format!("{prefix}.toml"));
    // Only the outbox tables: other tests' transactions and slots are not ours.
    std::fs::write(
        &config,
        "[health]\ninterval = \"100ms\"\nmax_transaction_age = \"1day\"\nmax_slot_xmin_age = 9223372036854775807\nmin_dead_tuples = 50\n",
    )
    .unwrap();
    let mut child = postbox(&[
        "relay",
        "--schemas",
        &glob,
        "--sink",
        "stdout",
        "--metrics-listen",
        "127.0.0.1:0",
    ])
    .env("POSTBOX_CONFIG", &config)
    .env("POSTBOX_LOG", "info")
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let addr = crate::ops::metrics_addr(&mut child).await;
    let relay = crate::ops::Relay(child);
    let kinds = |outboxes: &serde_json::Value, schema: &str| -> Option<Vec<String>> {
        let o = outboxes
            .as_array()?
            .iter()
            .find(|o| o["schema"] == schema)?;
        Some(
            o["health"]
                .as_array()?
                .iter()
                .filter_map(|p| p["kind"].as_str().map(str::to_owned))
                .collect(),
        )
    };
    wait_for(
        "/outboxes?unhealthy names the sick outbox",
        Duration::from_secs(30),
        || async {
            let (code, body) = crate::ops::get(&addr, "/outboxes?unhealthy").await;
            let listed = serde_json::from_str(&body).unwrap_or_default();
            code == 503
                && kinds(&listed, &sick).is_some_and(|k| k.iter().any(|k| k == "dead_tuples"))
        },
    )
    .await;
    let (_, body) = crate::ops::get(&addr, "/outboxes").await;
    let all: serde_json::Value = serde_json::from_str(&body).unwrap();
    let fine_kinds = kinds(&all, &fine).expect("the fine outbox is listed");
    assert!(
        !fine_kinds.iter().any(|k| k == "dead_tuples"),
        "only the sick outbox's table is mostly dead tuples: {body}"
    );
    let sick_entry = all
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["schema"] == sick.as_str())
        .unwrap();
    assert_eq!(sick_entry["healthy"], false, "{body}");
    assert_eq!(sick_entry["name"], format!("postgres/{sick}"), "{body}");
    drop(relay);

    let status = |json: bool| {
        let mut args = vec!["status", "--schemas", &glob];
        if json {
            args.push("--json");
        }
        ok(postbox(&args)
            .env("POSTBOX_CONFIG", &config)
            .output()
            .unwrap())
    };
    let listed: serde_json::Value = serde_json::from_str(status(true).trim()).unwrap();
    let by_outbox = |name: &str| -> Vec<String> {
        listed
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["outbox"] == format!("postgres/{name}"))
            .unwrap()["health"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["kind"].as_str().unwrap().to_owned())
            .collect()
    };
    assert!(
        by_outbox(&sick).iter().any(|k| k == "dead_tuples"),
        "{listed}"
    );
    assert!(
        !by_outbox(&fine).iter().any(|k| k == "dead_tuples"),
        "{listed}"
    );
    let text = status(false);
    assert!(
        text.contains(&format!("unhealthy: postgres/{sick}: 100 dead tuples")),
        "{text}"
    );
    assert!(!text.contains(&format!("postgres/{fine}: ")), "{text}");
    let _ = std::fs::remove_file(&config);
    for s in [&fine, &sick] {
        sqlx::raw_sql(trusted(&format!("DROP SCHEMA {s} CASCADE")))
            .execute(&pool)
            .await
            .unwrap();
    }
}

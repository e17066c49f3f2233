//! Many outboxes through the real binary: `migrate --schemas` (idempotent),
//! `relay --schemas --drain` serving them all from one process, `[[outboxes]]`
//! in the config file, and `status --schemas`.

use postbox::statements::trusted;
use postbox::Schema;
use postbox_testkit::{database_url, unique};
use sqlx::PgPool;
use std::process::{Command, Output};

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

    for s in [&a, &b] {
        assert!(Schema::new(s).is_ok());
        sqlx::raw_sql(trusted(&format!("DROP SCHEMA {s} CASCADE")))
            .execute(&pool)
            .await
            .unwrap();
    }
}

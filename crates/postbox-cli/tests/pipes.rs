//! Closed pipes (issue 22): a relay whose log pipe closes keeps delivering and
//! stops on SIGTERM within its shutdown bound; `status --watch` into a pipe
//! whose reader went away exits 0 without a panic.

use postbox::statements::trusted;
use postbox_testkit::{redis, redis_url, unique, wait_for, TestDb};
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn command(db: &TestDb, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_postbox"));
    c.args(args)
        .env("DATABASE_URL", &db.url)
        .env("POSTBOX_SCHEMA", db.schema.name())
        .env_remove("POSTBOX_CONFIG")
        .env_remove("POSTBOX_SINK")
        .env_remove("POSTBOX_METRICS_LISTEN")
        .env_remove("RUST_LOG");
    c
}

/// Kills the child if a test fails before it exits.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn enqueue(db: &TestDb, from: usize, n: usize) {
    for i in from..from + n {
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

async fn stream_len(key: &str) -> usize {
    let mut r = redis().await;
    redis::cmd("XLEN")
        .arg(key)
        .query_async(&mut r)
        .await
        .unwrap()
}

/// Wait for the child to exit; None when it is still running after `bound`.
async fn exit_within(child: &mut Child, bound: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + bound;
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

#[tokio::test]
async fn a_relay_whose_log_pipe_closes_keeps_delivering_and_stops_on_sigterm() {
    let db = TestDb::new().await;
    let (a, b) = (unique("test:pipe:a:"), unique("test:pipe:b:"));
    let dir = std::env::temp_dir().join(unique("postbox-pipe-"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("relay.toml");
    // Fan-out to two streams, with a short shutdown bound.
    std::fs::write(
        &config,
        format!(
            "[relay]\nshutdown_timeout = \"5s\"\npoll_interval = \"100ms\"\n\
             [destinations.a]\nurl = \"{url}?mode=stream&key={a}\"\n\
             [destinations.b]\nurl = \"{url}?mode=stream&key={b}\"\n\
             [[routes]]\nmatch = [\"order.*\"]\nto = [\"a\", \"b\"]\n",
            url = redis_url()
        ),
    )
    .unwrap();
    enqueue(&db, 0, 50).await;
    let mut child = command(&db, &["--config", config.to_str().unwrap(), "relay"])
        // Debug: plenty of log lines, every one of them into the closed pipe.
        .env("POSTBOX_LOG", "debug")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the relay");
    // `postbox relay 2>&1 | head -1`: read one line, then the reader is gone.
    let mut stderr = child.stderr.take().unwrap();
    let mut first = [0u8; 1];
    let _ = stderr.read(&mut first);
    drop(stderr);
    let mut relay = Guard(child);

    wait_for(
        "the first 50 events in both streams",
        Duration::from_secs(60),
        || async { stream_len(&a).await == 50 && stream_len(&b).await == 50 },
    )
    .await;
    // Still delivering, long after its log pipe closed.
    enqueue(&db, 50, 30).await;
    wait_for(
        "80 events in both streams",
        Duration::from_secs(60),
        || async { stream_len(&a).await == 80 && stream_len(&b).await == 80 },
    )
    .await;
    assert!(
        relay.0.try_wait().unwrap().is_none(),
        "the relay is still running"
    );

    // SIGTERM: out within the shutdown bound (5s), plus start-up slack.
    unsafe { libc::kill(relay.0.id() as i32, libc::SIGTERM) };
    let status = exit_within(&mut relay.0, Duration::from_secs(15))
        .await
        .expect("the relay stops within its shutdown bound after SIGTERM");
    assert!(status.success(), "a clean exit, not a panic: {status:?}");

    let mut r = redis().await;
    let _: () = redis::cmd("DEL")
        .arg(&a)
        .arg(&b)
        .query_async(&mut r)
        .await
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    db.drop_schema().await;
}

#[tokio::test]
async fn status_watch_into_a_closed_pipe_exits_cleanly() {
    let db = TestDb::new().await;
    let mut child = command(&db, &["status", "--watch", "100ms"])
        .env("POSTBOX_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start status --watch");
    // `status --watch | head -5`: read a little, then the reader is gone.
    let mut stdout = child.stdout.take().unwrap();
    let mut some = [0u8; 64];
    let _ = stdout.read(&mut some);
    drop(stdout);
    let mut stderr = child.stderr.take().unwrap();
    let mut watch = Guard(child);
    let status = exit_within(&mut watch.0, Duration::from_secs(20))
        .await
        .expect("status --watch stops when its reader goes away");
    let mut err = String::new();
    let _ = stderr.read_to_string(&mut err);
    assert!(status.success(), "exit {status:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    db.drop_schema().await;
}

/// `postbox bench | head -1` with the reader gone before the results: the
/// workload's printing stops instead of panicking, and bench exits 0.
#[tokio::test]
async fn bench_into_a_closed_pipe_exits_cleanly() {
    let _alone = crate::cli::BENCH.lock().await;
    let db = TestDb::new().await;
    let schema = format!("{}_bench", db.schema.name());
    let sink = format!("{}?key={}", redis_url(), unique("test:bench:"));
    let mut child = command(
        &db,
        &[
            "bench",
            "--only",
            "drain",
            "--events",
            "300",
            "--naive-events",
            "30",
            "--bench-schema",
            &schema,
            "--sink",
            &sink,
        ],
    )
    .env("POSTBOX_LOG", "warn")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("start bench");
    // The reader goes away before bench prints anything.
    drop(child.stdout.take());
    let mut stderr = child.stderr.take().unwrap();
    let mut bench = Guard(child);
    let status = exit_within(&mut bench.0, Duration::from_secs(120))
        .await
        .expect("bench finishes");
    let mut err = String::new();
    let _ = stderr.read_to_string(&mut err);
    assert!(status.success(), "exit {status:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    db.drop_schema().await;
}

//! Logical mode's slot safety through the real binary: an invalidated slot
//! (on a throwaway cluster with a tiny `max_slot_wal_keep_size`) is reported
//! loudly by the relay, its metrics, `status` and `slot status`, naming the
//! LSN range that was lost, and is never re-created behind the operator's
//! back; a slot no relay has read for longer than the bound is reported.

use postbox::statements::trusted;
use postbox_harness::pgcluster::TempCluster;
use postbox_testkit::{wait_for, TestDb};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn postbox(url: &str, schema: &str, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_postbox"));
    c.args(args)
        .env("DATABASE_URL", url)
        .env("POSTBOX_SCHEMA", schema)
        .env("POSTBOX_LOG", "warn")
        .env_remove("POSTBOX_CONFIG")
        .env_remove("POSTBOX_SINK")
        .env_remove("POSTBOX_METRICS_LISTEN")
        .env("NO_COLOR", "1");
    c
}

fn output(url: &str, schema: &str, args: &[&str]) -> Output {
    postbox(url, schema, args).output().expect("run postbox")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A relay in logical mode whose stderr lines are kept; killed when dropped.
struct Relay {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Relay {
    fn start(url: &str, schema: &str, extra: &[&str]) -> Relay {
        let mut args = vec![
            "relay",
            "--mode",
            "logical",
            "--sink",
            "stdout",
            "--metrics-listen",
            "127.0.0.1:0",
        ];
        args.extend_from_slice(extra);
        let mut child = postbox(url, schema, &args)
            .env("POSTBOX_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the relay");
        let stderr = child.stderr.take().expect("piped stderr");
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let kept = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                kept.lock().unwrap().push(line);
            }
        });
        Relay { child, lines }
    }

    fn logged(&self, text: &str) -> bool {
        self.lines.lock().unwrap().iter().any(|l| l.contains(text))
    }

    /// The metrics address the relay announced.
    async fn metrics_addr(&self) -> String {
        wait_for(
            "the relay to announce its metrics address",
            Duration::from_secs(30),
            || async { self.logged("http://") },
        )
        .await;
        let lines = self.lines.lock().unwrap();
        let line = lines.iter().find(|l| l.contains("http://")).unwrap();
        let rest = line.split_once("http://").unwrap().1;
        rest.chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
            .collect()
    }

    fn stop(mut self) -> Vec<String> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::mem::take(&mut *self.lines.lock().unwrap())
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The body of `GET /metrics`.
async fn scrape(addr: &str) -> String {
    get(addr, "/metrics").await
}

/// Whether a relay session holds the slot's advisory lock.
async fn held(pool: &sqlx::PgPool, slot: &str) -> bool {
    sqlx::query_scalar::<_, bool>(
        "SELECT EXISTS (SELECT FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted \
         AND l.objid = (hashtextextended('postbox.logical.' || $1, 0) & 4294967295)::oid)",
    )
    .bind(slot)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Wait until a relay holds the slot's reader lock and the slot is made,
/// or until none holds it. A slot being made shows in
/// `pg_replication_slots` before it is: it waits there for the
/// transactions then running to end, with no confirmed position, and
/// ending its session then removes it (a test that ended reading sessions
/// at that moment lost its slot in CI).
async fn wait_held(pool: &sqlx::PgPool, slot: &str, want: bool) {
    wait_for(
        "the slot's reader lock",
        Duration::from_secs(60),
        || async { held(pool, slot).await == want && (!want || made(pool, slot).await) },
    )
    .await;
}

async fn made(pool: &sqlx::PgPool, slot: &str) -> bool {
    sqlx::query_scalar::<_, bool>(
        "SELECT EXISTS (SELECT FROM pg_replication_slots \
         WHERE slot_name = $1 AND confirmed_flush_lsn IS NOT NULL)",
    )
    .bind(slot)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn wal_status(pool: &sqlx::PgPool, slot: &str) -> Option<String> {
    sqlx::query_scalar::<_, Option<String>>(
        "SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .unwrap()
    .flatten()
}

#[tokio::test]
async fn an_invalidated_slot_is_reported_loudly_with_the_lost_range_and_never_recreated() {
    let cluster = TempCluster::start().await.expect("a throwaway cluster");
    let url = cluster.url().to_owned();
    let schema = "pbx_lost";
    let slot = format!("postbox_{schema}");
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    // A slot may keep at most 1 MB of WAL past its position.
    sqlx::query("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("SELECT pg_reload_conf()")
        .execute(&pool)
        .await
        .unwrap();
    let migrated = output(&url, schema, &["migrate"]);
    assert!(migrated.status.success(), "{migrated:?}");
    let emit = format!("SELECT {schema}.emit('order.placed', 'order', $1, '{{}}'::jsonb)");

    // A relay creates the slot and reads it; then it stops.
    let relay = Relay::start(&url, schema, &[]);
    wait_held(&pool, &slot, true).await;
    sqlx::query(trusted(&emit))
        .bind("read")
        .execute(&pool)
        .await
        .unwrap();
    drop(relay);
    wait_held(&pool, &slot, false).await;

    // While no relay reads it, events are emitted and the WAL moves on
    // far past 1 MB: the checkpoint invalidates the slot.
    let confirmed: String = sqlx::query_scalar(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(&slot)
    .fetch_one(&pool)
    .await
    .unwrap();
    sqlx::query(trusted(&emit))
        .bind("lost")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE wal_filler (x int)")
        .execute(&pool)
        .await
        .unwrap();
    wait_for(
        "the slot to be invalidated",
        Duration::from_secs(120),
        || {
            let (pool, slot) = (pool.clone(), slot.clone());
            async move {
                for _ in 0..3 {
                    sqlx::query("INSERT INTO wal_filler SELECT generate_series(1, 1000)")
                        .execute(&pool)
                        .await
                        .unwrap();
                    sqlx::query("SELECT pg_switch_wal()")
                        .execute(&pool)
                        .await
                        .unwrap();
                }
                sqlx::query("CHECKPOINT").execute(&pool).await.unwrap();
                wal_status(&pool, &slot).await.as_deref() == Some("lost")
            }
        },
    )
    .await;

    // slot status: exit 1, INVALIDATED, the range from the confirmed position.
    let o = output(&url, schema, &["slot", "status"]);
    let text = stdout(&o);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(
        text.contains("INVALIDATED") && text.contains(&format!("after {confirmed}")),
        "{text}"
    );
    assert!(text.contains("postbox slot drop"), "{text}");
    let o = output(&url, schema, &["status"]);
    let text = stdout(&o);
    assert!(
        text.contains("INVALIDATED") && text.contains(&confirmed),
        "{text}"
    );

    // A relay started now says so at ERROR, sets the metric, and reads
    // nothing: the slot stays the invalidated one.
    let relay = Relay::start(&url, schema, &[]);
    let addr = relay.metrics_addr().await;
    let series = format!("postbox_slot_invalidated{{slot=\"{slot}\"}} 1");
    wait_for(
        "the invalidation metric",
        Duration::from_secs(60),
        || async { scrape(&addr).await.lines().any(|l| l == series) },
    )
    .await;
    wait_for("the relay's error", Duration::from_secs(30), || async {
        relay.logged("ERROR") && relay.logged("was invalidated")
    })
    .await;
    let lines = relay.stop();
    let error = lines
        .iter()
        .find(|l| l.contains("was invalidated"))
        .unwrap();
    assert!(error.contains(&confirmed), "names the range: {error}");
    assert_eq!(wal_status(&pool, &slot).await.as_deref(), Some("lost"));

    // Recovery: drop the slot; the next relay creates a fresh one.
    let o = output(&url, schema, &["slot", "drop", &slot]);
    assert!(o.status.success(), "{o:?}");
    let relay = Relay::start(&url, schema, &[]);
    wait_held(&pool, &slot, true).await;
    assert_ne!(wal_status(&pool, &slot).await.as_deref(), Some("lost"));
    let o = output(&url, schema, &["slot", "status"]);
    assert!(o.status.success(), "{}", stdout(&o));
    assert!(stdout(&o).contains("read now"), "{}", stdout(&o));
    drop(relay);
    pool.close().await;
    cluster.stop().await.expect("stop the cluster");
}

#[tokio::test]
async fn a_slot_no_relay_reads_for_longer_than_the_bound_is_reported() {
    let db = TestDb::new().await;
    let schema = db.schema.name().to_owned();
    let slot = postbox_testkit::unique("pbx_unread_");
    // The slot goes whatever happens to the test (a failing run used to leave it).
    let _slot = postbox_testkit::SlotGuard(slot.clone());
    let relay = Relay::start(&db.url, &schema, &["--slot", &slot]);
    wait_held(&db.pool, &slot, true).await;
    // Read now: nothing to say, whatever the bound. The relay holds the slot
    // before it notes its first read: wait for the note (killed in between,
    // the relay would leave "no read noted", not a time unread).
    wait_for(
        "the relay to note a read",
        Duration::from_secs(30),
        || async {
            let o = output(
                &db.url,
                &schema,
                &["slot", "status", &slot, "--inactive-warn", "1s"],
            );
            o.status.success() && stdout(&o).contains("read now")
        },
    )
    .await;

    drop(relay);
    wait_held(&db.pool, &slot, false).await;
    // Within the default bound (5 minutes): not read, but no alarm.
    let o = output(&db.url, &schema, &["slot", "status", &slot]);
    assert!(o.status.success(), "{}", stdout(&o));
    assert!(stdout(&o).contains("NOT READ for"), "{}", stdout(&o));
    // Past a bound of one second: loud, exit 1, and in status --json.
    wait_for("the bound to pass", Duration::from_secs(30), || async {
        let o = output(
            &db.url,
            &schema,
            &["slot", "status", &slot, "--inactive-warn", "1s"],
        );
        o.status.code() == Some(1) && stdout(&o).contains("NOT READ for longer than 1s")
    })
    .await;
    let config = std::env::temp_dir().join(format!("{slot}.toml"));
    std::fs::write(
        &config,
        format!("[relay]\nlogical_slot = \"{slot}\"\nlogical_inactive_warn = \"1s\"\n"),
    )
    .unwrap();
    let o = postbox(&db.url, &schema, &["status", "--json"])
        .env("POSTBOX_CONFIG", &config)
        .output()
        .unwrap();
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).expect("status --json");
    assert_eq!(r["logical_slot_unread_too_long"], true, "{r}");
    assert_eq!(r["logical_slot"]["slot_name"], slot.as_str(), "{r}");
    assert!(r["logical_slot"]["reader_pid"].is_null(), "{r}");
    let _ = std::fs::remove_file(&config);

    let o = output(&db.url, &schema, &["slot", "drop", &slot]);
    assert!(o.status.success(), "{o:?}");
    db.drop_schema().await;
}

/// `GET path` on `addr`: the whole answer (status line, headers, body).
async fn get(addr: &str, path: &str) -> String {
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return String::new();
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if s.write_all(request.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw).await;
    raw
}

/// A slot reader that fails again and again is unready (`/readyz` 503, and
/// its failures in a row in the metrics) until it reads again: here ordered
/// routes and emits no longer numbered make every reopening of the slot
/// fail.
#[tokio::test]
async fn a_reader_that_keeps_failing_is_unready_until_it_reads_again() {
    let db = TestDb::new().await;
    let schema = db.schema.name().to_owned();
    let slot = postbox_testkit::unique("pbx_ready_");
    let _slot = postbox_testkit::SlotGuard(slot.clone());
    let o = output(&db.url, &schema, &["migrate", "--emit-sequence", "on"]);
    assert!(o.status.success(), "{o:?}");
    let relay = Relay::start(&db.url, &schema, &["--slot", &slot, "--ordered"]);
    wait_held(&db.pool, &slot, true).await;
    let addr = relay.metrics_addr().await;
    wait_for("ready", Duration::from_secs(30), || async {
        get(&addr, "/readyz").await.starts_with("HTTP/1.1 200")
    })
    .await;

    db.exec("UPDATE {schema}.logical_settings SET numbered_emits = false")
        .await;
    // The reading session is ended so that the next one checks the setting
    // again. The slot is active only while a read is under way, so a single
    // attempt can find no backend to end: end it at each look until the
    // relay reports the failing reader.
    wait_for("unready", Duration::from_secs(60), || async {
        sqlx::query(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
             WHERE slot_name = $1 AND active_pid IS NOT NULL",
        )
        .bind(&slot)
        .execute(&db.pool)
        .await
        .unwrap();
        let answer = get(&addr, "/readyz").await;
        answer.starts_with("HTTP/1.1 503") && answer.contains("keeps failing")
    })
    .await;
    let metrics = scrape(&addr).await;
    assert!(
        metrics.contains(&format!(
            "postbox_reader_consecutive_failures{{slot=\"{slot}\"}}"
        )),
        "{metrics}"
    );
    // Other processes see it too: `slot status` and `status` name the
    // failing reader and its error, and `slot status` exits 1.
    let o = output(&db.url, &schema, &["slot", "status", &slot]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(!o.status.success(), "{o:?}");
    assert!(
        text.contains("READER FAILING") && text.contains("numbered"),
        "{text}"
    );
    let config = std::env::temp_dir().join(format!("{slot}.toml"));
    std::fs::write(&config, format!("[relay]\nlogical_slot = \"{slot}\"\n")).unwrap();
    let o = output(
        &db.url,
        &schema,
        &["--config", config.to_str().unwrap(), "status"],
    );
    let _ = std::fs::remove_file(&config);
    assert!(stdout(&o).contains("READER FAILING"), "{o:?}");

    db.exec("UPDATE {schema}.logical_settings SET numbered_emits = true")
        .await;
    wait_for("ready again", Duration::from_secs(60), || async {
        get(&addr, "/readyz").await.starts_with("HTTP/1.1 200")
    })
    .await;
    let o = output(&db.url, &schema, &["slot", "status", &slot]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && !text.contains("READER FAILING"),
        "{o:?}"
    );
    drop(relay);
    wait_held(&db.pool, &slot, false).await;
    db.drop_schema().await;
}

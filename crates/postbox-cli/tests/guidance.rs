//! The CLI for a newcomer (issue 22): one-line explanations before `postbox
//! migrate`, a refused connection at once, where bad `--payload` JSON breaks,
//! configuration found the same way by every command (and a warning when
//! payloads are shown unredacted), output without colour or screen clearing
//! off a terminal, and errors that name the flag the user typed.

use postbox_testkit::{unique, TestDb};
use std::io::Read;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn command(db: &TestDb, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_postbox"));
    c.args(args)
        .env("DATABASE_URL", &db.url)
        .env("POSTBOX_SCHEMA", db.schema.name())
        .env("POSTBOX_LOG", "warn")
        .env_remove("POSTBOX_CONFIG")
        .env_remove("POSTBOX_SINK")
        .env_remove("NO_COLOR")
        .env_remove("RUST_LOG");
    c
}

fn run(db: &TestDb, args: &[&str]) -> Output {
    command(db, args).output().expect("run postbox")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

const ENQUEUE: &[&str] = &[
    "enqueue",
    "--type",
    "order.created",
    "--aggregate-type",
    "order",
    "--aggregate-id",
    "1",
];

#[tokio::test]
async fn commands_run_before_migrate_say_so_in_one_line() {
    let db = TestDb::empty().await;
    let mut enqueue = ENQUEUE.to_vec();
    enqueue.extend(["--payload", "{}"]);
    for args in [
        vec!["status"],
        vec!["status", "--json"],
        enqueue,
        vec!["dlq", "list"],
        vec!["purge", "--older-than", "7d"],
    ] {
        let out = run(&db, &args);
        assert!(!out.status.success(), "{args:?}");
        let err = stderr(&out);
        let want = format!(
            "error: schema `{}` has no postbox tables: run `postbox migrate` first",
            db.schema.name()
        );
        assert!(err.contains(&want), "{args:?}: {err}");
        assert!(!err.contains("does not exist"), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
    }
    db.drop_schema().await;
}

#[test]
fn a_wrong_port_is_refused_at_once() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .args(["status"])
        .env(
            "DATABASE_URL",
            format!("postgres://app:hunter2@127.0.0.1:{closed}/db"),
        )
        .env("POSTBOX_LOG", "warn")
        .env_remove("POSTBOX_CONFIG")
        .output()
        .unwrap();
    let took = started.elapsed();
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains(&format!(
            "cannot connect to PostgreSQL at 127.0.0.1:{closed}/db: connection refused"
        )),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");
    assert!(took < Duration::from_secs(5), "took {took:?}: {err}");
}

#[tokio::test]
async fn bad_payload_json_says_where() {
    let db = TestDb::new().await;
    for (payload, at) in [
        ("{oops", "(line 1, column 2)"),
        ("{\n  \"a\": 1,\n  \"b\": x\n}", "(line 3, column 8)"),
        ("", "(line 1, column 0)"),
    ] {
        let mut args = ENQUEUE.to_vec();
        args.extend(["--payload", payload]);
        let out = run(&db, &args);
        assert!(!out.status.success(), "{payload:?}");
        let err = stderr(&out);
        assert!(
            err.contains("--payload could not be parsed as JSON") && err.contains(at),
            "{payload:?}: {err}"
        );
    }
    db.drop_schema().await;
}

/// A directory with `postbox.toml` holding `text`, or none.
fn workdir(text: Option<&str>) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(unique("postbox-cwd-"));
    std::fs::create_dir_all(&dir).unwrap();
    if let Some(text) = text {
        std::fs::write(dir.join("postbox.toml"), text).unwrap();
    }
    dir
}

fn show_in(db: &TestDb, dir: &Path, config_env: Option<&Path>, id: &str) -> Output {
    let mut c = command(db, &["dlq", "show", id]);
    c.current_dir(dir);
    if let Some(path) = config_env {
        c.env("POSTBOX_CONFIG", path);
    }
    c.output().unwrap()
}

#[tokio::test]
async fn every_command_finds_the_configuration_the_same_way() {
    let db = TestDb::new().await;
    let mut args = ENQUEUE.to_vec();
    args.extend(["--payload", r#"{"card": {"number": "4111111111111111"}}"#]);
    let out = run(&db, &args);
    assert!(out.status.success(), "{}", stderr(&out));
    let id = stdout(&out).trim().to_owned();
    let redacting = "[redact]\npaths = [\"card.number\"]\n";

    // ./postbox.toml, found without --config.
    let with = workdir(Some(redacting));
    let out = show_in(&db, &with, None, &id);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        !stdout(&out).contains("4111111111111111"),
        "{}",
        stdout(&out)
    );
    assert!(!stderr(&out).contains("WARNING"), "{}", stderr(&out));

    // No file anywhere: the payload in full, and a loud warning saying why.
    let without = workdir(None);
    let out = show_in(&db, &without, None, &id);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("4111111111111111"));
    let err = stderr(&out);
    assert!(
        err.contains("WARNING: `postbox dlq show` shows payloads and headers in full")
            && err.contains("no --config, no POSTBOX_CONFIG, no ./postbox.toml"),
        "{err}"
    );

    // POSTBOX_CONFIG, from anywhere; and it beats ./postbox.toml.
    let out = show_in(&db, &without, Some(&with.join("postbox.toml")), &id);
    assert!(
        !stdout(&out).contains("4111111111111111"),
        "{}",
        stdout(&out)
    );
    let plain = workdir(Some("[relay]\nbatch_size = 10\n"));
    let out = show_in(&db, &with, Some(&plain.join("postbox.toml")), &id);
    assert!(stdout(&out).contains("4111111111111111"));
    let err = stderr(&out);
    assert!(
        err.contains("(POSTBOX_CONFIG) has no [redact] paths or headers"),
        "{err}"
    );

    // POSTBOX_CONFIG set and empty: no file at all, not even ./postbox.toml.
    let out = show_in(&db, &with, Some(Path::new("")), &id);
    assert!(stdout(&out).contains("4111111111111111"));
    assert!(
        stderr(&out).contains("no configuration file (POSTBOX_CONFIG is empty)"),
        "{}",
        stderr(&out)
    );

    // ./postbox.toml is read by the other commands too: a broken one is named.
    let broken = workdir(Some("[relay]\nbatch_sise = 5\n"));
    let out = command(&db, &["status"])
        .current_dir(&broken)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("config file postbox.toml: unknown field `batch_sise`"),
        "{}",
        stderr(&out)
    );
    for dir in [with, without, plain, broken] {
        let _ = std::fs::remove_dir_all(dir);
    }
    db.drop_schema().await;
}

#[tokio::test]
async fn no_colour_or_screen_clearing_off_a_terminal() {
    let db = TestDb::empty().await;
    // Info lines (one per migration) to a pipe: no escape codes.
    let out = command(&db, &["migrate"])
        .env("POSTBOX_LOG", "info")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("applied migration"),
        "{}",
        stderr(&out)
    );
    assert!(!out.stderr.contains(&0x1b), "{}", stderr(&out));

    // `status --watch` into a file: reports one after the other, no clearing.
    let mut child = command(&db, &["status", "--watch", "100ms"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while seen.windows(3).filter(|w| w == b"---").count() < 2 {
        let n = stdout.read(&mut buf).unwrap();
        assert!(n > 0, "status --watch ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(!seen.contains(&0x1b), "{}", String::from_utf8_lossy(&seen));
    db.drop_schema().await;
}

#[tokio::test]
async fn errors_name_the_flag_the_user_typed() {
    let db = TestDb::new().await;
    for (args, flag, key) in [
        (
            vec!["purge", "--older-than", "7d", "--batch-size", "0"],
            "--batch-size: must be between 1 and 100000",
            "retention.batch_size",
        ),
        (
            vec!["purge", "--older-than", "0s"],
            "--older-than: must be greater than zero",
            "retention.older_than",
        ),
        (
            vec!["relay", "--sink", "stdout", "--batch-size", "0"],
            "--batch-size: must be between 1 and 10000",
            "relay.batch_size",
        ),
        (
            vec!["relay", "--sink", "stdout", "--log-partitions", "0"],
            "--log-partitions: must be between 1 and 1024",
            "relay.log_partitions",
        ),
    ] {
        let out = run(&db, &args);
        assert!(!out.status.success(), "{args:?}");
        let err = stderr(&out);
        assert!(err.contains(flag), "{args:?}: {err}");
        assert!(!err.contains(key), "{args:?}: {err}");
    }
    // The workloads make their own schemas and take no config file.
    for (args, want) in [
        (
            vec!["bench", "--schema", "x_bench"],
            "`postbox bench` does not use --schema",
        ),
        (
            vec!["--config", "x.toml", "demo"],
            "`postbox demo` does not use --config",
        ),
        (
            vec!["verify", "--schema", "x"],
            "`postbox verify` does not use --schema",
        ),
    ] {
        let out = run(&db, &args);
        assert!(!out.status.success(), "{args:?}");
        assert!(stderr(&out).contains(want), "{args:?}: {}", stderr(&out));
    }
    db.drop_schema().await;
}

#[tokio::test]
async fn the_console_warns_at_start_up_when_nothing_is_redacted() {
    let db = TestDb::new().await;
    let dir = workdir(None);
    let mut child = command(&db, &["console", "--listen", "127.0.0.1:0"])
        .current_dir(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The console says where it listens once it is up: the warning came before.
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 16];
    let _ = stdout.read(&mut first);
    let _ = child.kill();
    let _ = child.wait();
    let mut err = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    assert!(
        err.contains("WARNING: the console shows payloads and headers in full"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
    db.drop_schema().await;
}

/// A sink whose broker answers that what the configuration names is not
/// there (here a RabbitMQ exchange nobody declared) stops the relay at
/// start-up with one plain line, as the README says, instead of retrying in
/// silence; the AMQP client's internal dumps stay out of the default log.
#[tokio::test]
async fn a_missing_exchange_stops_the_relay_at_start_up_in_plain_words() {
    let db = TestDb::new().await;
    let exchange = unique("missing.");
    let sink = format!("amqp://guest:guest@127.0.0.1:5672/%2f?exchange={exchange}&timeout=5s");
    let started = Instant::now();
    let out = command(&db, &["relay", "--sink", &sink])
        .env_remove("POSTBOX_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("run the relay");
    let err = stderr(&out);
    assert!(!out.status.success(), "the relay refuses to start: {err}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "at once, not after retries"
    );
    assert!(
        err.contains("misconfigured") && err.contains("does not exist") && err.contains(&exchange),
        "{err}"
    );
    assert!(!err.contains("ShortString"), "no client internals: {err}");
    assert!(!err.contains("guest:guest"), "no credentials: {err}");
    db.drop_schema().await;
}

//! The binary fits in: shell completions and manual pages generated from its
//! own definitions, JSON log lines for log pipelines, and progress shown on a
//! terminal but never in a pipe.

use postbox::statements::trusted;
use postbox_testkit::{unique, TestDb};
use serde_json::Value;
use std::process::{Command, Output, Stdio};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_postbox"));
    c.env_remove("POSTBOX_CONFIG")
        .env_remove("POSTBOX_SINK")
        .env_remove("POSTBOX_LOG_FORMAT")
        .env_remove("POSTBOX_PROGRESS")
        .env_remove("RUST_LOG")
        .env_remove("POSTBOX_LOG");
    c
}

fn on(db: &TestDb) -> Command {
    let mut c = bin();
    c.env("DATABASE_URL", &db.url)
        .env("POSTBOX_SCHEMA", db.schema.name());
    c
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[track_caller]
fn ok(o: Output) -> (String, String) {
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(
        o.status.success(),
        "exit {:?}\nstdout: {out}\nstderr: {err}",
        o.status
    );
    (out, err)
}

#[test]
fn completions_for_every_shell_know_the_commands_and_bash_can_load_them() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let (script, _) = ok(bin().args(["completions", shell]).output().unwrap());
        for word in ["relay", "dlq", "log-format"] {
            assert!(script.contains(word), "{shell}: no {word}");
        }
    }
    // bash itself loads the script and registers the completion.
    let (script, _) = ok(bin().args(["completions", "bash"]).output().unwrap());
    let path = std::env::temp_dir().join(unique("postbox-completion-"));
    std::fs::write(&path, script).unwrap();
    let registered = Command::new("bash")
        .arg("-c")
        .arg(format!("source {} && complete -p postbox", path.display()))
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(
        text(&registered.stdout).contains("postbox"),
        "{}",
        text(&registered.stderr)
    );

    let refused = bin().args(["completions", "tcsh"]).output().unwrap();
    assert_eq!(
        refused.status.code(),
        Some(2),
        "an unknown shell is a usage error"
    );
}

#[test]
fn the_manual_pages_render_and_cover_every_command() {
    let (page, _) = ok(bin().arg("man").output().unwrap());
    assert!(page.contains(".TH postbox 1"), "{page}");
    assert!(
        page.contains(".SH SYNOPSIS") && page.contains("relay"),
        "{page}"
    );

    let dir = std::env::temp_dir().join(unique("postbox-man-"));
    let (said, _) = ok(bin().args(["man", "--out-dir"]).arg(&dir).output().unwrap());
    assert!(said.contains("manual page(s)"), "{said}");
    for name in [
        "postbox",
        "postbox-relay",
        "postbox-dlq-replay",
        "postbox-completions",
    ] {
        let path = dir.join(format!("{name}.1"));
        assert!(path.is_file(), "{name}.1 missing");
        // man(1) formats it.
        let formatted = Command::new("man")
            .args(["-l", "-P", "cat"])
            .arg(&path)
            .env("MANWIDTH", "80")
            .output()
            .unwrap();
        assert!(
            formatted.status.success(),
            "{name}: {}",
            text(&formatted.stderr)
        );
        let shown = text(&formatted.stdout);
        assert!(
            shown.contains("SYNOPSIS") && shown.contains("OPTIONS"),
            "{name}: {shown}"
        );
    }
    let relay = std::fs::read_to_string(dir.join("postbox-relay.1")).unwrap();
    assert!(relay.contains("postbox relay"), "{relay}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every stderr line is a JSON object with a timestamp, a level and a message.
#[track_caller]
fn json_lines(err: &str) -> Vec<Value> {
    err.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
            assert!(v["timestamp"].is_string() && v["level"].is_string(), "{l}");
            assert!(v["fields"]["message"].is_string(), "{l}");
            v
        })
        .collect()
}

#[tokio::test]
async fn log_format_json_makes_every_log_line_a_json_object() {
    let db = TestDb::empty().await;
    let (_, err) = ok(on(&db)
        .args(["--log-format", "json", "migrate"])
        .output()
        .unwrap());
    let lines = json_lines(&err);
    assert!(
        lines
            .iter()
            .any(|l| l["fields"]["message"] == "applied migration"),
        "{err}"
    );

    // The relay, from the environment variable; its deliveries stay on stdout.
    sqlx::query(trusted(&db.sql(
        "SELECT {schema}.enqueue('order.created', 'order', 'o-1', '{}'::jsonb)",
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let (out, err) = ok(on(&db)
        .args(["relay", "--drain", "--sink", "stdout"])
        .env("POSTBOX_LOG_FORMAT", "json")
        .output()
        .unwrap());
    assert!(out.contains("order.created"), "{out}");
    let lines = json_lines(&err);
    assert!(!lines.is_empty(), "the relay logs its start and its drain");
    assert!(lines.iter().all(|l| l["level"] != "ERROR"), "{err}");

    // A failing command's error is a JSON line too.
    let failed = bin()
        .args(["--log-format", "json", "status"])
        .env(
            "DATABASE_URL",
            "postgres://postgres:hunter2@127.0.0.1:1/nowhere",
        )
        .output()
        .unwrap();
    assert!(!failed.status.success());
    let err = text(&failed.stderr);
    let lines = json_lines(&err);
    assert!(lines.iter().any(|l| l["level"] == "ERROR"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
    db.drop_schema().await;
}

/// Run `command` with its stdout and stderr on a pseudo-terminal (util-linux
/// `script`); what the terminal showed.
fn on_a_terminal(command: &Command) -> String {
    let mut line = vec![env!("CARGO_BIN_EXE_postbox").to_owned()];
    line.extend(command.get_args().map(|a| a.to_string_lossy().into_owned()));
    let quoted: Vec<String> = line.iter().map(|a| format!("'{a}'")).collect();
    let mut script = Command::new("script");
    script
        .args(["-q", "-e", "-c", &quoted.join(" "), "/dev/null"])
        .stdin(Stdio::null());
    for (k, v) in command.get_envs() {
        match v {
            Some(v) => script.env(k, v),
            None => script.env_remove(k),
        };
    }
    let o = script.output().expect("run script(1)");
    let shown = text(&o.stdout);
    assert!(o.status.success(), "exit {:?}: {shown}", o.status);
    shown
}

#[tokio::test]
async fn migrating_many_schemas_shows_progress_on_a_terminal_and_none_in_a_pipe() {
    let db = TestDb::empty().await;
    let names: Vec<String> = (0..3)
        .map(|i| format!("{}_{i}", db.schema.name()))
        .collect();
    // --schemas migrates every existing schema its glob matches.
    for name in &names {
        sqlx::raw_sql(trusted(&format!("CREATE SCHEMA {name}")))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let list = format!("{}_*", db.schema.name());
    let mut migrate = on(&db);
    migrate
        .args(["migrate", "--schemas", &list])
        .env("POSTBOX_LOG", "warn");

    // In a pipe: results on stdout, nothing at all on stderr.
    let (out, err) = ok(migrate.output().unwrap());
    for name in &names {
        assert!(
            out.contains(&format!("{name}: applied migration(s)")),
            "{out}"
        );
    }
    assert_eq!(err, "", "no progress in a pipe");

    // On a terminal: the progress line is drawn (and erased) as schemas go.
    let shown = on_a_terminal(&migrate);
    assert!(shown.contains("migrated 3/3 (100%)"), "{shown:?}");
    assert!(
        shown.contains(&format!("{} is up to date", names[2])),
        "{shown:?}"
    );

    // POSTBOX_PROGRESS=always puts it into a pipe too, one line per update.
    let (_, err) = ok(migrate.env("POSTBOX_PROGRESS", "always").output().unwrap());
    assert!(err.contains("migrated 3/3 (100%)"), "{err}");
    let (_, err) = ok(bin()
        .args(["migrate", "--schemas", &list])
        .env("DATABASE_URL", &db.url)
        .env("POSTBOX_LOG", "warn")
        .env("POSTBOX_PROGRESS", "never")
        .output()
        .unwrap());
    assert_eq!(err, "");

    for name in &names {
        sqlx::raw_sql(trusted(&format!("DROP SCHEMA {name} CASCADE")))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    db.drop_schema().await;
}

#[tokio::test]
async fn purge_is_quiet_in_a_pipe() {
    let db = TestDb::new().await;
    let (out, err) = ok(on(&db)
        .args(["purge", "--older-than", "1s"])
        .env("POSTBOX_LOG", "warn")
        .output()
        .unwrap());
    assert!(out.contains("purged: 0 sent events deleted"), "{out}");
    assert_eq!(err, "");
    db.drop_schema().await;
}

//! `postbox console`: the real binary — users from standard input, serving,
//! the config file's redaction, a graceful stop on SIGTERM, and one console
//! over the outboxes `--schemas` matches.

use postbox::statements::trusted;
use postbox_testkit::TestDb;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Output, Stdio};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn console(db: &TestDb, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_postbox"));
    c.arg("console")
        .args(args)
        .env("DATABASE_URL", &db.url)
        .env("POSTBOX_SCHEMA", db.schema.name())
        .env("POSTBOX_LOG", "warn")
        .env_remove("POSTBOX_CONFIG")
        .env_remove("POSTBOX_CONSOLE_LISTEN");
    c
}

fn add_user(db: &TestDb, name: &str, role: &str, password: &str) -> Output {
    add_user_with(db, &[name, "--role", role], password)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// One HTTP/1.1 exchange on a fresh connection: (status line and headers, body).
async fn http(addr: &str, request: String) -> (String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let out = text(&out);
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    (head.to_ascii_lowercase(), body.to_owned())
}

fn get(path: &str, cookie: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: x\r\nCookie: {cookie}\r\nConnection: close\r\n\r\n")
}

fn post(path: &str, cookie: &str, form: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nCookie: {cookie}\r\nContent-Type: application/x-www-form-urlencoded\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{form}",
        form.len()
    )
}

fn set_cookie(head: &str, name: &str) -> String {
    head.lines()
        .filter_map(|l| l.strip_prefix("set-cookie: "))
        .find(|c| c.starts_with(name))
        .unwrap_or_else(|| panic!("no {name} cookie in {head}"))
        .split(';')
        .next()
        .unwrap()
        .to_owned()
}

fn hidden(html: &str, name: &str) -> String {
    let marker = format!("name=\"{name}\" value=\"");
    let start = html.find(&marker).unwrap() + marker.len();
    html[start..].split('"').next().unwrap().to_owned()
}

#[tokio::test]
async fn users_come_from_standard_input_and_the_console_serves_them() {
    let db = TestDb::new().await;
    let created = add_user(&db, "alice", "operator", "correct horse battery");
    assert!(created.status.success(), "{}", text(&created.stderr));
    assert_eq!(
        text(&created.stdout),
        "created console user alice (operator)\n"
    );
    let updated = add_user(&db, "alice", "operator", "correct horse battery");
    assert_eq!(
        text(&updated.stdout),
        "updated console user alice (operator)\n"
    );
    let short = add_user(&db, "bob", "viewer", "short");
    assert!(!short.status.success());
    assert!(
        text(&short.stderr).contains("invalid password"),
        "{}",
        text(&short.stderr)
    );
    let bad = add_user(&db, "<bob>", "viewer", "long enough password");
    assert!(
        text(&bad.stderr).contains("invalid user name"),
        "{}",
        text(&bad.stderr)
    );
    let role = console(
        &db,
        &["add-user", "bob", "--role", "admin", "--password-stdin"],
    )
    .output()
    .unwrap();
    assert!(!role.status.success());
    let stored: String = sqlx::query_scalar(trusted(
        &db.sql("SELECT password_hash FROM {schema}.console_users"),
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(stored.starts_with("$argon2id$") && !stored.contains("correct horse"));

    // An event with a secret in its payload, masked by the config file.
    let id: uuid::Uuid = sqlx::query_scalar(trusted(&db.sql(
        r#"SELECT {schema}.enqueue('order.placed', 'order', '1', '{"card": {"number": "4111111111111111"}}')"#,
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let config = std::env::temp_dir().join(format!("{}-console.toml", db.schema.name()));
    std::fs::write(
        &config,
        "[redact]\npaths = [\"card.number\"]\n[console]\ntrusted_proxies = [\"127.0.0.1\"]\n\
         [sink]\nurl = \"stdout\"\ntransform = '{card: .payload.card.number}'\n",
    )
    .unwrap();

    let (mut child, addr) =
        listening(console(&db, &["--listen", "127.0.0.1:0", "--config"]).arg(&config)).await;

    let (head, _) = http(&addr, get("/", "")).await;
    assert!(head.starts_with("http/1.1 303"), "{head}");
    assert!(head.contains("location: /sign-in"), "{head}");
    let (head, body) = http(&addr, get("/sign-in", "")).await;
    let form_cookie = set_cookie(&head, "postbox_sign_in=");
    let token = hidden(&body, "csrf");
    // From a trusted proxy (the config file's [console]), the forwarded client counts.
    let sign_in = post(
        "/sign-in",
        &form_cookie,
        &format!("csrf={token}&name=alice&password=correct+horse+battery&next=%2F"),
    )
    .replacen(
        "Host: x\r\n",
        "Host: x\r\nX-Forwarded-For: 198.51.100.9, 203.0.113.50\r\n",
        1,
    );
    let (head, _) = http(&addr, sign_in).await;
    assert!(head.starts_with("http/1.1 303"), "{head}");
    let client: String = sqlx::query_scalar(trusted(&db.sql(
        "SELECT details->>'client' FROM {schema}.audit_log WHERE action = 'console.sign_in'",
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(client, "203.0.113.50");
    let session = set_cookie(&head, "postbox_session=");
    let (head, body) = http(&addr, get(&format!("/events/{id}"), &session)).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(body.contains("alice · operator"));
    // A whole card number: four digits alone can occur in the event's id.
    assert!(
        body.contains("***") && !body.contains("4111111111111111"),
        "{body}"
    );
    // What the config file's sink would receive, previewed from the masked
    // event: the transform's copy of the card number is masked too.
    assert!(body.contains("What each destination gets"), "{body}");
    assert!(body.contains("shaped by sink"), "{body}");
    assert!(
        body.contains("&quot;data&quot;:{&quot;card&quot;:&quot;***&quot;}"),
        "{body}"
    );

    // SIGTERM stops it cleanly.
    // SAFETY: signalling our own child process.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success(), "{status:?}");
    let _ = std::fs::remove_file(&config);
    db.drop_schema().await;
}

fn add_user_with(db: &TestDb, args: &[&str], password: &str) -> Output {
    let mut all = vec!["add-user"];
    all.extend_from_slice(args);
    all.push("--password-stdin");
    let mut child = console(db, &all)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("{password}\n").as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

async fn outboxes_of(db: &TestDb, name: &str) -> Vec<String> {
    sqlx::query_scalar(trusted(
        &db.sql("SELECT outboxes FROM {schema}.console_users WHERE name = $1"),
    ))
    .bind(name)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn add_user_limits_a_role_to_some_outboxes_and_running_it_again_changes_that() {
    let db = TestDb::new().await;
    let pw = "correct horse battery";
    let out = add_user_with(
        &db,
        &[
            "olga",
            "--role",
            "operator",
            "--outboxes",
            "tenant_a, tenant_b*,app_?/t_*",
        ],
        pw,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "created console user olga (operator, outboxes tenant_a,tenant_b*,app_?/t_*)\n"
    );
    assert_eq!(
        outboxes_of(&db, "olga").await,
        ["tenant_a", "tenant_b*", "app_?/t_*"]
    );

    // A session, ended by the next add-user.
    let session: Vec<u8> = vec![1, 2, 3];
    sqlx::query(trusted(&db.sql(
        "INSERT INTO {schema}.console_sessions (token_hash, user_name, csrf_token, expires_at) \
         VALUES ($1, 'olga', 'x', now() + interval '1 hour')",
    )))
    .bind(&session)
    .execute(&db.pool)
    .await
    .unwrap();

    // Again without --outboxes: the role and password change, the limit stays.
    let out = add_user_with(&db, &["olga", "--role", "viewer"], pw);
    assert_eq!(
        text(&out.stdout),
        "updated console user olga (viewer, outboxes tenant_a,tenant_b*,app_?/t_*)\n"
    );
    assert_eq!(
        outboxes_of(&db, "olga").await,
        ["tenant_a", "tenant_b*", "app_?/t_*"]
    );
    let sessions: i64 = sqlx::query_scalar(trusted(
        &db.sql("SELECT count(*) FROM {schema}.console_sessions WHERE user_name = 'olga'"),
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(sessions, 0, "add-user ends the user's sessions");

    // Another limit; then '*', every outbox.
    let out = add_user_with(
        &db,
        &["olga", "--role", "operator", "--outboxes", "db2/tenant_c"],
        pw,
    );
    assert_eq!(
        text(&out.stdout),
        "updated console user olga (operator, outboxes db2/tenant_c)\n"
    );
    let out = add_user_with(&db, &["olga", "--role", "operator", "--outboxes", "*"], pw);
    assert_eq!(text(&out.stdout), "updated console user olga (operator)\n");
    assert!(outboxes_of(&db, "olga").await.is_empty());

    // Malformed patterns are refused before anything is stored.
    for bad in ["", "Tenant_A", "a/b/c", "tenant a", "tenant_a,"] {
        let out = add_user_with(&db, &["olga", "--role", "operator", "--outboxes", bad], pw);
        assert!(!out.status.success(), "{bad:?}");
        let err = text(&out.stderr);
        assert!(err.contains("invalid outbox pattern"), "{bad:?}: {err}");
        assert!(
            err.contains("SCHEMA_GLOB or DATABASE_GLOB/SCHEMA_GLOB"),
            "{err}"
        );
    }
    assert!(outboxes_of(&db, "olga").await.is_empty());
    db.drop_schema().await;
}

#[tokio::test]
async fn an_unmigrated_schema_is_named_with_what_to_do() {
    let db = TestDb::empty().await;
    let out = console(&db, &["--listen", "127.0.0.1:0"]).output().unwrap();
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("run `postbox migrate` first"), "{err}");
    let out = add_user(&db, "alice", "viewer", "long enough password");
    assert!(
        text(&out.stderr).contains("run `postbox migrate` first"),
        "{}",
        text(&out.stderr)
    );
}

#[tokio::test]
async fn the_monitor_role_cannot_read_password_hashes_or_sessions() {
    let db = TestDb::new().await;
    let schema = db.schema.name().to_owned();
    let out = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .args(["migrate", "--create-roles"])
        .env("DATABASE_URL", &db.url)
        .env("POSTBOX_SCHEMA", &schema)
        .env("POSTBOX_LOG", "warn")
        .env_remove("POSTBOX_CONFIG")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Read each table as the monitor role, in a transaction of its own.
    let read_as_monitor = |table: &str| {
        let (pool, sql) = (
            db.pool.clone(),
            db.sql(&format!("SELECT count(*) FROM {{schema}}.{table}")),
        );
        let role = format!("SET LOCAL ROLE {schema}_monitor");
        async move {
            let mut tx = pool.begin().await.unwrap();
            sqlx::raw_sql(trusted(&role))
                .execute(&mut *tx)
                .await
                .unwrap();
            let read = sqlx::query(trusted(&sql)).execute(&mut *tx).await;
            tx.rollback().await.unwrap();
            read.err().and_then(|e| {
                e.as_database_error()
                    .and_then(|d| d.code().map(|c| c.into_owned()))
            })
        }
    };
    assert_eq!(
        read_as_monitor("audit_log").await,
        None,
        "the monitor reads the audit log"
    );
    for table in ["console_users", "console_sessions"] {
        assert_eq!(
            read_as_monitor(table).await.as_deref(),
            Some("42501"),
            "{table}"
        );
    }
    // The roles go with the schema (they are named after it).
    db.drop_schema().await;
}

#[test]
fn a_trusted_proxy_that_is_not_an_address_is_refused_by_its_flag() {
    let out = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .args(["console", "--trusted-proxy", "proxy.internal"])
        .env_remove("POSTBOX_CONFIG")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("--trusted-proxy") && err.contains("not an IP address or network"),
        "{err}"
    );
}

#[tokio::test]
async fn with_schemas_one_console_serves_every_matching_outbox() {
    let home = TestDb::new().await;
    let created = add_user(&home, "victor", "viewer", "correct horse battery");
    assert!(created.status.success(), "{}", text(&created.stderr));
    let prefix = postbox_testkit::unique("cnsl");
    let (a, b) = (format!("{prefix}_a"), format!("{prefix}_b"));
    let glob = format!("{prefix}_*");
    for s in [&a, &b] {
        sqlx::raw_sql(trusted(&format!("CREATE SCHEMA {s}")))
            .execute(&home.pool)
            .await
            .unwrap();
    }
    let migrated = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .args(["migrate", "--schemas", &glob])
        .env("DATABASE_URL", &home.url)
        .env("POSTBOX_LOG", "warn")
        .env_remove("POSTBOX_SCHEMA")
        .env_remove("POSTBOX_CONFIG")
        .output()
        .unwrap();
    assert!(migrated.status.success(), "{}", text(&migrated.stderr));
    sqlx::query(trusted(&format!(
        "SELECT {b}.enqueue('order.placed', 'order', '1', '{{}}')"
    )))
    .execute(&home.pool)
    .await
    .unwrap();
    let database: String = sqlx::query_scalar(trusted("SELECT current_database()"))
        .fetch_one(&home.pool)
        .await
        .unwrap();

    let (mut child, addr) = listening(&mut console(
        &home,
        &["--listen", "127.0.0.1:0", "--schemas", &glob],
    ))
    .await;

    // Signed in once, in the home schema.
    let (head, body) = http(&addr, get("/sign-in", "")).await;
    let form_cookie = set_cookie(&head, "postbox_sign_in=");
    let token = hidden(&body, "csrf");
    let sign_in = post(
        "/sign-in",
        &form_cookie,
        &format!("csrf={token}&name=victor&password=correct+horse+battery&next=%2F"),
    );
    let (head, _) = http(&addr, sign_in).await;
    assert!(head.starts_with("http/1.1 303"), "{head}");
    let session = set_cookie(&head, "postbox_session=");

    let (head, body) = http(&addr, get("/", &session)).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(body.contains("All outboxes"), "{body}");
    assert!(body.contains("<strong>2</strong> outbox(es)"), "{body}");
    for s in [&a, &b] {
        assert!(
            body.contains(&format!("data-outbox=\"{database}/{s}\"")),
            "{s} is listed: {body}"
        );
    }
    assert!(
        !body.contains(&format!("data-outbox=\"{database}/{}\"", home.schema)),
        "the home schema is not among them"
    );
    let (head, body) = http(&addr, get(&format!("/o/{database}/{b}/events"), &session)).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(body.contains("order.placed"), "{body}");

    // SAFETY: signalling our own child process.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success(), "{status:?}");
    for s in [&a, &b] {
        sqlx::raw_sql(trusted(&format!("DROP SCHEMA {s} CASCADE")))
            .execute(&home.pool)
            .await
            .unwrap();
    }
    home.drop_schema().await;
}

/// Start the console and read the address it says it listens on.
async fn listening(command: &mut std::process::Command) -> (std::process::Child, String) {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        line
    })
    .await
    .unwrap();
    let addr = line
        .trim()
        .strip_prefix("postbox console listening on http://")
        .unwrap_or_else(|| panic!("{line}"))
        .to_owned();
    (child, addr)
}

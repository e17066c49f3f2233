//! `postbox receive` over real HTTP against real PostgreSQL: the real binary on a
//! free port, a fresh schema per test, requests sent over plain TCP.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use postbox::statements::trusted;
use postbox::verify::{qstash, webhooks};
use postbox_testkit::{wait_for, TestDb};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
/// The key bytes of SECRET, base64 (must never appear in logs or responses).
const SECRET_KEY_TEXT: &str = "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const OTHER_SECRET: &str = "whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYX";
const CURRENT_KEY: &str = "sig_current_7kYjw48mhY7kAjqNGcy6cr29RJ6r";
const NEXT_KEY: &str = "sig_next_5ZB6DVzB1wjE8S6rZ7eenA8Pdnhs";
const WRONG_KEY: &str = "sig_wrong_0000000000000000000000000000";
const INSTALL_HINT: &str =
    "install the test dependencies with: python3 -m pip install standardwebhooks pyjwt";

// ---------------------------------------------------------------------------------
// The receiver process

/// A running `postbox receive`, killed when dropped.
struct Receiver {
    child: Child,
    port: u16,
    log: PathBuf,
}

/// What to start.
struct Setup<'a> {
    db: &'a TestDb,
    port: Option<u16>,
    database_url: Option<String>,
    verify: &'a str,
    args: Vec<String>,
    env: Vec<(&'static str, String)>,
}

impl<'a> Setup<'a> {
    fn new(db: &'a TestDb, verify: &'a str) -> Self {
        Self {
            db,
            port: None,
            database_url: None,
            verify,
            args: Vec::new(),
            env: Vec::new(),
        }
    }

    fn webhooks(db: &'a TestDb) -> Self {
        Self::new(db, "webhooks").env(
            "POSTBOX_WEBHOOK_SECRET",
            &format!("{OTHER_SECRET} {SECRET}"),
        )
    }

    fn qstash(db: &'a TestDb, url: &str) -> Self {
        Self::new(db, "qstash")
            .env("QSTASH_CURRENT_SIGNING_KEY", CURRENT_KEY)
            .env("QSTASH_NEXT_SIGNING_KEY", NEXT_KEY)
            .arg("--url")
            .arg(url)
    }

    fn arg(mut self, a: &str) -> Self {
        self.args.push(a.to_owned());
        self
    }

    fn env(mut self, name: &'static str, value: &str) -> Self {
        self.env.push((name, value.to_owned()));
        self
    }

    fn database_url(mut self, url: String) -> Self {
        self.database_url = Some(url);
        self
    }

    fn command(&self, port: u16) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_postbox"));
        cmd.arg("receive")
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--consumer")
            .arg("billing")
            .arg("--verify")
            .arg(self.verify)
            .args(&self.args)
            .env(
                "DATABASE_URL",
                self.database_url
                    .clone()
                    .unwrap_or_else(|| self.db.url.clone()),
            )
            .env("POSTBOX_SCHEMA", self.db.schema.name())
            .env("POSTBOX_LOG", "info")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        for name in [
            "POSTBOX_WEBHOOK_SECRET",
            "QSTASH_CURRENT_SIGNING_KEY",
            "QSTASH_NEXT_SIGNING_KEY",
            "POSTBOX_CONFIG",
            "POSTBOX_LISTEN",
            "POSTBOX_CONSUMER",
        ] {
            cmd.env_remove(name);
        }
        for (name, value) in &self.env {
            cmd.env(name, value);
        }
        cmd
    }

    /// Starts the receiver and waits until it answers `GET /healthz`.
    async fn start(self) -> Receiver {
        let port = self.port.unwrap_or_else(free_port);
        let log = std::env::temp_dir().join(format!(
            "{}.log",
            postbox_testkit::unique("postbox-receive-")
        ));
        let file = std::fs::File::create(&log).expect("create the receiver's log file");
        let mut cmd = self.command(port);
        cmd.stdout(Stdio::null()).stderr(file);
        let child = cmd.spawn().expect("start the postbox binary");
        let mut receiver = Receiver { child, port, log };
        let mut exited = None;
        wait_for("the receiver to answer /healthz", Duration::from_secs(30), || {
            let port = receiver.port;
            if exited.is_none() {
                exited = receiver.child.try_wait().ok().flatten();
            }
            let gone = exited.is_some();
            async move { gone || matches!(get(port, "/healthz").await, Some(r) if r.status == 200) }
        })
        .await;
        if let Some(status) = exited {
            panic!(
                "the receiver exited ({status}) before it was ready:\n{}",
                receiver.log_text()
            );
        }
        receiver
    }

    /// Runs the command expecting it to fail at start-up; returns its stderr.
    async fn fails_to_start(self) -> String {
        let out = self
            .command(free_port())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .await
            .expect("run the postbox binary");
        assert!(!out.status.success(), "the receiver should refuse to start");
        String::from_utf8_lossy(&out.stderr).into_owned()
    }
}

impl Receiver {
    async fn post(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
        request(self.port, "POST", path, headers, body)
            .await
            .unwrap_or_else(|e| panic!("POST {path}: {e}\n{}", self.log_text()))
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn assert_log_has_no_secret(&self) {
        let log = self.log_text();
        for secret in [SECRET_KEY_TEXT, CURRENT_KEY, NEXT_KEY, WRONG_KEY] {
            assert!(!log.contains(secret), "the log shows a secret:\n{log}");
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_file(&self.log);
    }
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address").port()
}

// ---------------------------------------------------------------------------------
// A minimal HTTP/1.1 client (one request per connection)

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

async fn get(port: u16, path: &str) -> Option<Reply> {
    request(port, "GET", path, &[], b"").await.ok()
}

async fn request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Reply> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await?;
    let mut raw = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    )
    .into_bytes();
    for (name, value) in headers {
        raw.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
    }
    raw.extend_from_slice(b"\r\n");
    raw.extend_from_slice(body);
    // One write: the server reads request and body together.
    stream.write_all(&raw).await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    parse_reply(&response).ok_or_else(|| {
        std::io::Error::other(format!(
            "unparsable response {:?}",
            String::from_utf8_lossy(&response)
        ))
    })
}

fn parse_reply(raw: &[u8]) -> Option<Reply> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    Some(Reply {
        status,
        headers,
        body: body.to_owned(),
    })
}

// ---------------------------------------------------------------------------------
// Signing helpers

fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

/// Standard Webhooks headers for `body`, signed by postbox's signer with `secret`.
fn webhooks_headers(secret: &str, id: &str, timestamp: i64, body: &[u8]) -> Vec<(String, String)> {
    let signature = webhooks::Signer::new(secret)
        .expect("valid secret")
        .sign(id, timestamp, body);
    vec![
        ("webhook-id".to_owned(), id.to_owned()),
        ("webhook-timestamp".to_owned(), timestamp.to_string()),
        ("webhook-signature".to_owned(), signature),
    ]
}

/// Header (name, value) pairs.
type Headers = Vec<(String, String)>;

fn as_refs(headers: &[(String, String)]) -> Vec<(&str, &str)> {
    headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

fn without(headers: &[(String, String)], name: &str) -> Vec<(String, String)> {
    headers.iter().filter(|(k, _)| k != name).cloned().collect()
}

fn replaced(headers: &[(String, String)], name: &str, value: &str) -> Vec<(String, String)> {
    headers
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                if k == name {
                    value.to_owned()
                } else {
                    v.clone()
                },
            )
        })
        .collect()
}

/// A JWT with any header and claims, its signature made with HMAC over `key` using
/// `alg` (HS256 / HS512), or empty for `none`.
fn forge_jwt(alg: &str, claims: &Value, key: &str) -> String {
    let header = URL_SAFE_NO_PAD.encode(json!({"alg": alg, "typ": "JWT"}).to_string());
    let payload = URL_SAFE_NO_PAD.encode(claims.to_string());
    let message = format!("{header}.{payload}");
    let signature = match alg {
        "HS256" => {
            let mut mac =
                Hmac::<sha2::Sha256>::new_from_slice(key.as_bytes()).expect("any key length");
            mac.update(message.as_bytes());
            URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
        }
        "HS512" => {
            let mut mac =
                Hmac::<sha2::Sha512>::new_from_slice(key.as_bytes()).expect("any key length");
            mac.update(message.as_bytes());
            URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
        }
        _ => String::new(),
    };
    format!("{message}.{signature}")
}

/// Claims QStash would send for `body` to `url`, as JSON to tweak.
fn qstash_claims(url: &str, body: &[u8]) -> Value {
    let t = now();
    json!({
        "iss": "Upstash",
        "sub": url,
        "iat": t,
        "nbf": t,
        "exp": t + 300,
        "jti": postbox_testkit::unique("jwt_"),
        "body": qstash::body_hash(body),
    })
}

fn cloudevent(id: &str) -> Vec<u8> {
    json!({"specversion": "1.0", "id": id, "type": "order.created", "source": "test", "data": {"n": 1}})
        .to_string()
        .into_bytes()
}

async fn stored(db: &TestDb) -> i64 {
    db.count("SELECT count(*) FROM {schema}.received").await
}

// ---------------------------------------------------------------------------------
// Tests

#[tokio::test]
async fn a_verified_delivery_is_stored_once_and_a_repeat_is_a_duplicate() {
    let db = TestDb::new().await;
    let metrics_port = free_port();
    let receiver = Setup::webhooks(&db)
        .arg("--metrics-listen")
        .arg(&format!("127.0.0.1:{metrics_port}"))
        .start()
        .await;
    let duplicates = |n: u32| {
        let series = format!("postbox_inbox_duplicates_total{{consumer=\"billing\"}} {n}");
        async move {
            let scrape = get(metrics_port, "/metrics")
                .await
                .expect("scrape /metrics");
            assert_eq!(scrape.status, 200);
            scrape.body.lines().any(|l| l == series)
        }
    };
    assert!(duplicates(0).await, "the counter starts at zero");
    let body = br#"{"type": "order.created", "order_id": 42}"#;
    let mut headers = webhooks_headers(SECRET, "msg_stored_once", now(), body);
    headers.push(("Authorization".to_owned(), "Bearer do-not-store".to_owned()));
    headers.push(("Content-Type".to_owned(), "application/json".to_owned()));

    let first = receiver
        .post("/hooks/orders", &as_refs(&headers), body)
        .await;
    assert_eq!(
        (first.status, first.body.as_str()),
        (200, "stored"),
        "{first:?}"
    );
    let again = receiver
        .post("/hooks/orders", &as_refs(&headers), body)
        .await;
    assert_eq!(
        (again.status, again.body.as_str()),
        (200, "duplicate"),
        "{again:?}"
    );
    assert_eq!(stored(&db).await, 1);
    assert!(duplicates(1).await, "the duplicate is counted");

    let row: (String, String, Vec<u8>, Value, bool) = sqlx::query_as(trusted(&db.sql(
        "SELECT consumer, event_id, body, headers, processed_at IS NULL FROM {schema}.received",
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(row.0, "billing");
    assert_eq!(row.1, "msg_stored_once");
    assert_eq!(row.2, body, "the exact bytes");
    assert_eq!(row.3["content-type"], "application/json");
    assert_eq!(row.3["webhook-id"], "msg_stored_once");
    assert!(
        row.3.get("authorization").is_none(),
        "credentials are not stored: {}",
        row.3
    );
    assert!(row.4, "unprocessed");
    receiver.assert_log_has_no_secret();
    drop(receiver);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_delivery_is_received_under_a_span_continuing_its_traceparent() {
    let db = TestDb::new().await;
    let otlp = crate::otlp::Receiver::start().await;
    let receiver = Setup::webhooks(&db)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp.endpoint)
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .start()
        .await;
    let id = "0193d4a6-7c1e-7000-8000-00000000002a";
    let body = cloudevent(id);
    let mut headers = webhooks_headers(SECRET, id, now(), &body);
    let (trace, parent) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    headers.push(("traceparent".to_owned(), format!("00-{trace}-{parent}-01")));
    let reply = receiver.post("/hooks", &as_refs(&headers), &body).await;
    assert_eq!((reply.status, reply.body.as_str()), (200, "stored"));

    let span =
        |spans: &[crate::otlp::Seen]| spans.iter().find(|s| s.name == "receive billing").cloned();
    wait_for(
        "the receive span to be exported",
        Duration::from_secs(30),
        || {
            let found = span(&otlp.spans()).is_some();
            async move { found }
        },
    )
    .await;
    let received = span(&otlp.spans()).unwrap();
    assert_eq!(received.trace_id, trace, "{received:#?}");
    assert_eq!(received.parent_span_id, parent, "{received:#?}");
    assert_eq!(received.attribute("messaging.message.id"), Some(id));
    assert_eq!(
        received.attribute("messaging.operation.type"),
        Some("receive")
    );
    drop(receiver);
    db.drop_schema().await;
}

#[tokio::test]
async fn fifty_concurrent_copies_of_one_delivery_make_exactly_one_row() {
    let db = TestDb::new().await;
    let receiver = std::sync::Arc::new(Setup::webhooks(&db).start().await);
    let body = cloudevent("evt_concurrent");
    let headers = webhooks_headers(SECRET, "msg_concurrent", now(), &body);
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (receiver, headers, body) = (receiver.clone(), headers.clone(), body.clone());
            tokio::spawn(async move { receiver.post("/", &as_refs(&headers), &body).await })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        let reply = t.await.unwrap();
        assert_eq!(reply.status, 200, "{reply:?}");
        answers.push(reply.body);
    }
    assert_eq!(
        answers.iter().filter(|b| *b == "stored").count(),
        1,
        "{answers:?}"
    );
    assert_eq!(answers.iter().filter(|b| *b == "duplicate").count(), 49);
    assert_eq!(stored(&db).await, 1);
    drop(receiver);
    db.drop_schema().await;
}

#[tokio::test]
async fn forged_standard_webhooks_deliveries_are_refused() {
    let db = TestDb::new().await;
    let receiver = Setup::webhooks(&db).start().await;
    let body = br#"{"order_id": 1}"#;
    let t = now();
    let good = webhooks_headers(SECRET, "msg_forged", t, body);
    let wrong_key = webhooks_headers(
        "whsec_dGhpcyBpcyBub3QgdGhlIHNlY3JldA==",
        "msg_forged",
        t,
        body,
    );
    let stale = webhooks_headers(SECRET, "msg_forged", t - 330, body);
    let future = webhooks_headers(SECRET, "msg_forged", t + 330, body);
    let qstash_token =
        qstash::sign(CURRENT_KEY, &qstash::Claims::new("http://x/", body, t, 60)).expect("signs");
    let signature = good[2].1.clone();

    let cases: Vec<(&str, Headers, &[u8])> = vec![
        ("tampered body", good.clone(), br#"{"order_id": 2}"#),
        (
            "body with one byte appended",
            good.clone(),
            br#"{"order_id": 1} "#,
        ),
        ("wrong key", wrong_key, body),
        ("stale timestamp (5 min + 1 s old)", stale, body),
        ("timestamp 5 min + 1 s in the future", future, body),
        (
            "missing webhook-signature",
            without(&good, "webhook-signature"),
            body,
        ),
        (
            "missing webhook-timestamp",
            without(&good, "webhook-timestamp"),
            body,
        ),
        ("missing webhook-id", without(&good, "webhook-id"), body),
        ("no headers at all", Vec::new(), body),
        (
            "id changed after signing",
            replaced(&good, "webhook-id", "msg_other"),
            body,
        ),
        (
            "timestamp changed after signing",
            replaced(&good, "webhook-timestamp", &(t + 1).to_string()),
            body,
        ),
        (
            "signature without version",
            replaced(&good, "webhook-signature", &signature[3..]),
            body,
        ),
        (
            "signature relabelled v1a",
            replaced(
                &good,
                "webhook-signature",
                &signature.replacen("v1,", "v1a,", 1),
            ),
            body,
        ),
        (
            "only bad signatures in the list",
            replaced(
                &good,
                "webhook-signature",
                "v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA= v1,Zm9v",
            ),
            body,
        ),
        (
            "empty signature",
            replaced(&good, "webhook-signature", ""),
            body,
        ),
        (
            "non-numeric timestamp",
            replaced(&good, "webhook-timestamp", "yesterday"),
            body,
        ),
        (
            "a QStash token instead",
            vec![("upstash-signature".to_owned(), qstash_token)],
            body,
        ),
    ];
    for (what, headers, body) in &cases {
        let reply = receiver.post("/", &as_refs(headers), body).await;
        assert_eq!(reply.status, 401, "{what}: {reply:?}");
        assert!(
            reply.body.is_empty(),
            "{what}: a 401 carries no detail: {reply:?}"
        );
    }
    assert_eq!(stored(&db).await, 0, "no forged delivery was stored");

    // Rotation: one good signature among bad ones, and the second configured secret.
    let list = format!("v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA= {signature} v1,Zm9v");
    let rotated = replaced(&good, "webhook-signature", &list);
    assert_eq!(
        receiver.post("/", &as_refs(&rotated), body).await.status,
        200
    );
    let other = webhooks_headers(OTHER_SECRET, "msg_other_secret", t, body);
    assert_eq!(receiver.post("/", &as_refs(&other), body).await.status, 200);
    assert_eq!(stored(&db).await, 2);
    receiver.assert_log_has_no_secret();
    drop(receiver);
    db.drop_schema().await;
}

#[tokio::test]
async fn forged_qstash_deliveries_are_refused() {
    let db = TestDb::new().await;
    let url = "https://receiver.example.com/hooks/qstash";
    let receiver = Setup::qstash(&db, url).start().await;
    let body = cloudevent("evt_qstash");
    let claims = qstash_claims(url, &body);
    let with = |mut c: Value, key: &str, v: Value| {
        c[key] = v;
        c
    };
    let drop_claim = |mut c: Value, key: &str| {
        c.as_object_mut().expect("object").remove(key);
        c
    };
    let t = now();
    let cases: Vec<(&str, String, Vec<u8>)> = vec![
        (
            "tampered body",
            forge_jwt("HS256", &claims, CURRENT_KEY),
            cloudevent("evt_other"),
        ),
        (
            "wrong key",
            forge_jwt("HS256", &claims, WRONG_KEY),
            body.clone(),
        ),
        ("alg none", forge_jwt("none", &claims, ""), body.clone()),
        (
            "alg HS512 with the right key",
            forge_jwt("HS512", &claims, CURRENT_KEY),
            body.clone(),
        ),
        (
            "alg RS256 header",
            forge_jwt("RS256", &claims, CURRENT_KEY),
            body.clone(),
        ),
        (
            "wrong sub",
            forge_jwt(
                "HS256",
                &with(claims.clone(), "sub", json!("https://evil.example.com/")),
                CURRENT_KEY,
            ),
            body.clone(),
        ),
        (
            "no sub",
            forge_jwt("HS256", &drop_claim(claims.clone(), "sub"), CURRENT_KEY),
            body.clone(),
        ),
        (
            "wrong iss",
            forge_jwt(
                "HS256",
                &with(claims.clone(), "iss", json!("NotUpstash")),
                CURRENT_KEY,
            ),
            body.clone(),
        ),
        (
            "expired",
            forge_jwt(
                "HS256",
                &with(claims.clone(), "exp", json!(t - 1)),
                CURRENT_KEY,
            ),
            body.clone(),
        ),
        (
            "nbf in the future",
            forge_jwt(
                "HS256",
                &with(claims.clone(), "nbf", json!(t + 120)),
                CURRENT_KEY,
            ),
            body.clone(),
        ),
        (
            "no exp",
            forge_jwt("HS256", &drop_claim(claims.clone(), "exp"), CURRENT_KEY),
            body.clone(),
        ),
        (
            "no body claim",
            forge_jwt("HS256", &drop_claim(claims.clone(), "body"), CURRENT_KEY),
            body.clone(),
        ),
        ("not a JWT", "not-a-jwt".to_owned(), body.clone()),
        ("empty header", String::new(), body.clone()),
    ];
    for (what, token, body) in &cases {
        let reply = receiver
            .post("/hooks/qstash", &[("Upstash-Signature", token)], body)
            .await;
        assert_eq!(reply.status, 401, "{what}: {reply:?}");
        assert!(reply.body.is_empty(), "{what}: {reply:?}");
    }
    let missing = receiver.post("/hooks/qstash", &[], &body).await;
    assert_eq!(
        missing.status, 401,
        "missing Upstash-Signature: {missing:?}"
    );
    let webhooks_signed = webhooks_headers(SECRET, "msg_x", t, &body);
    let reply = receiver.post("/", &as_refs(&webhooks_signed), &body).await;
    assert_eq!(
        reply.status, 401,
        "Standard Webhooks headers instead: {reply:?}"
    );
    assert_eq!(stored(&db).await, 0, "no forged delivery was stored");

    // QStash does not sign headers: a replay with an id header that contradicts the
    // signed CloudEvents id must not become a second delivery.
    let genuine = forge_jwt("HS256", &claims, CURRENT_KEY);
    for name in ["ce-id", "webhook-id"] {
        let reply = receiver
            .post(
                "/hooks/qstash",
                &[("Upstash-Signature", &genuine), (name, "evt_replayed")],
                &body,
            )
            .await;
        assert_eq!(reply.status, 400, "replay with a new {name}: {reply:?}");
    }
    assert_eq!(stored(&db).await, 0);

    // The genuine article, signed with the current and then the next key.
    let current = forge_jwt("HS256", &claims, CURRENT_KEY);
    let reply = receiver
        .post("/hooks/qstash", &[("Upstash-Signature", &current)], &body)
        .await;
    assert_eq!(
        (reply.status, reply.body.as_str()),
        (200, "stored"),
        "{reply:?}"
    );
    let next = forge_jwt("HS256", &claims, NEXT_KEY);
    let reply = receiver
        .post("/hooks/qstash", &[("Upstash-Signature", &next)], &body)
        .await;
    assert_eq!(
        (reply.status, reply.body.as_str()),
        (200, "duplicate"),
        "{reply:?}"
    );
    let event_id: String =
        sqlx::query_scalar(trusted(&db.sql("SELECT event_id FROM {schema}.received")))
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(event_id, "evt_qstash", "the CloudEvents id of the body");
    receiver.assert_log_has_no_secret();
    drop(receiver);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_body_over_the_limit_is_413() {
    let db = TestDb::new().await;
    let receiver = Setup::webhooks(&db)
        .arg("--max-body-bytes")
        .arg("64")
        .start()
        .await;
    let big = vec![b'x'; 65];
    let headers = webhooks_headers(SECRET, "msg_big", now(), &big);
    let reply = receiver.post("/", &as_refs(&headers), &big).await;
    assert_eq!(reply.status, 413, "{reply:?}");
    let fits = vec![b'y'; 64];
    let headers = webhooks_headers(SECRET, "msg_fits", now(), &fits);
    let reply = receiver.post("/", &as_refs(&headers), &fits).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(stored(&db).await, 1);
    drop(receiver);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_delivery_without_an_event_id_is_400() {
    let db = TestDb::new().await;
    let receiver = Setup::new(&db, "none").start().await;
    for (what, headers, body) in [
        (
            "plain JSON with an id field",
            vec![],
            br#"{"id": "order-7"}"#.to_vec(),
        ),
        ("nothing at all", vec![], Vec::new()),
        ("empty ce-id", vec![("ce-id", " ")], b"{}".to_vec()),
        (
            "CloudEvents body without id",
            vec![],
            br#"{"specversion": "1.0", "type": "t"}"#.to_vec(),
        ),
        (
            "event id over 255 bytes",
            vec![("ce-id", "x".repeat(256).leak() as &str)],
            b"{}".to_vec(),
        ),
    ] {
        let reply = receiver.post("/", &headers, &body).await;
        assert_eq!(reply.status, 400, "{what}: {reply:?}");
    }
    assert_eq!(stored(&db).await, 0);

    // Each source of an id, in order of precedence.
    let reply = receiver
        .post("/", &[("ce-id", "ce-1"), ("webhook-id", "wh-1")], b"{}")
        .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let reply = receiver.post("/", &[("ce-id", "ce-2")], b"{}").await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let reply = receiver.post("/", &[], &cloudevent("body-3")).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let ids: Vec<String> = sqlx::query_scalar(trusted(
        &db.sql("SELECT event_id FROM {schema}.received ORDER BY id"),
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(ids, ["wh-1", "ce-2", "body-3"]);
    drop(receiver);
    db.drop_schema().await;
}

#[tokio::test]
async fn an_unreachable_database_is_503_and_nothing_leaks() {
    let db = TestDb::new().await;
    let closed = free_port(); // nothing listens there
    let url = format!("postgres://postbox:hunter2-db-password@127.0.0.1:{closed}/postgres");
    let receiver = Setup::webhooks(&db)
        .database_url(url)
        .arg("--db-timeout")
        .arg("300ms")
        .start()
        .await;
    let body = cloudevent("evt_503");
    let headers = webhooks_headers(SECRET, "msg_503", now(), &body);
    let reply = receiver.post("/", &as_refs(&headers), &body).await;
    assert_eq!(reply.status, 503, "{reply:?}");
    assert!(reply.header("retry-after").is_some(), "{reply:?}");
    for leak in ["hunter2", "postgres://", &closed.to_string()] {
        assert!(
            !reply.body.contains(leak),
            "the 503 body shows {leak:?}: {reply:?}"
        );
    }
    // Verification still comes first.
    let forged = receiver.post("/", &as_refs(&headers), b"forged").await;
    assert_eq!(forged.status, 401);
    let log = receiver.log_text();
    assert!(
        !log.contains("hunter2"),
        "the log shows the database password:\n{log}"
    );
    receiver.assert_log_has_no_secret();
    drop(receiver);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_missing_or_bad_secret_stops_start_up_naming_the_variable() {
    let db = TestDb::new().await;
    let err = Setup::new(&db, "webhooks").fails_to_start().await;
    assert!(err.contains("POSTBOX_WEBHOOK_SECRET"), "{err}");
    let err = Setup::new(&db, "qstash").fails_to_start().await;
    assert!(err.contains("QSTASH_CURRENT_SIGNING_KEY"), "{err}");
    let err = Setup::new(&db, "webhooks")
        .env("POSTBOX_WEBHOOK_SECRET", "whsec_not*base64-topsecret")
        .fails_to_start()
        .await;
    assert!(err.contains("POSTBOX_WEBHOOK_SECRET"), "{err}");
    assert!(
        !err.contains("topsecret"),
        "the error repeats the secret: {err}"
    );
    let err = Setup::webhooks(&db)
        .arg("--url")
        .arg("https://x/")
        .fails_to_start()
        .await;
    assert!(err.contains("--url"), "{err}");
    db.drop_schema().await;
}

#[tokio::test]
async fn sigterm_stops_the_receiver_cleanly() {
    let db = TestDb::new().await;
    let mut receiver = Setup::new(&db, "none").start().await;
    let pid = receiver.child.id().expect("running") as i32;
    // SAFETY: sending a signal to our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = tokio::time::timeout(Duration::from_secs(20), receiver.child.wait())
        .await
        .expect("the receiver stops within 20 s of SIGTERM")
        .expect("wait");
    assert!(status.success(), "{status}\n{}", receiver.log_text());
    drop(receiver);
    db.drop_schema().await;
}

/// Slowloris and idle sockets: a client that sends half a head, or nothing,
/// is cut off after `--header-timeout`; a body that trickles is answered 408
/// after `--request-timeout`; meanwhile a real delivery is served.
#[tokio::test]
async fn slow_and_silent_clients_are_cut_off_and_deliveries_go_on() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let db = TestDb::new().await;
    let receiver = Setup::new(&db, "none")
        .arg("--header-timeout")
        .arg("300ms")
        .arg("--request-timeout")
        .arg("500ms")
        .start()
        .await;
    let connect = || tokio::net::TcpStream::connect(("127.0.0.1", receiver.port));
    let silent = connect().await.expect("connect");
    let mut slow_head = connect().await.expect("connect");
    slow_head
        .write_all(b"POST /x HTTP/1.1\r\nhost: r")
        .await
        .expect("write");
    let mut slow_body = connect().await.expect("connect");
    slow_body
        .write_all(b"POST /x HTTP/1.1\r\nhost: r\r\ncontent-length: 64\r\n\r\n{")
        .await
        .expect("write");
    let reply = receiver.post("/x", &[("ce-id", "fine")], b"{}").await;
    assert_eq!(reply.status, 200, "{}", receiver.log_text());
    let closed = |mut s: tokio::net::TcpStream| async move {
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out))
            .await
            .expect("the receiver closes the connection")
            .ok();
        String::from_utf8_lossy(&out).into_owned()
    };
    assert_eq!(
        closed(silent).await,
        "",
        "a silent socket is closed unanswered"
    );
    assert_eq!(
        closed(slow_head).await,
        "",
        "a slow head's socket is closed"
    );
    let answer = closed(slow_body).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert_eq!(stored(&db).await, 1);
    drop(receiver);
    db.drop_schema().await;
}

// ---------------------------------------------------------------------------------
// Independent implementations (issue 3's "Done when")

/// Runs tests/independent_signers.py; returns (headers, body) of a signed delivery.
fn independent_signature(args: &[&str], env: &[(&str, &str)]) -> (Vec<(String, String)>, Vec<u8>) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/independent_signers.py");
    let mut cmd = std::process::Command::new("python3");
    cmd.arg(script).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap_or_else(|e| {
        panic!("cannot run python3 ({e}): install Python 3, then {INSTALL_HINT}")
    });
    assert!(
        out.status.success(),
        "independent_signers.py {args:?} failed ({}); {INSTALL_HINT}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let signed: Value = serde_json::from_slice(&out.stdout).expect("the signer prints JSON");
    let headers = signed["headers"]
        .as_object()
        .expect("headers object")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().expect("string header").to_owned()))
        .collect();
    let body = signed["body"]
        .as_str()
        .expect("string body")
        .as_bytes()
        .to_vec();
    (headers, body)
}

#[tokio::test]
async fn a_delivery_signed_by_the_standardwebhooks_package_is_stored_once() {
    let db = TestDb::new().await;
    let (headers, body) =
        independent_signature(&["webhooks"], &[("POSTBOX_WEBHOOK_SECRET", SECRET)]);
    let receiver = Setup::webhooks(&db).start().await;
    let first = receiver.post("/hook", &as_refs(&headers), &body).await;
    assert_eq!(
        (first.status, first.body.as_str()),
        (200, "stored"),
        "{first:?}"
    );
    let again = receiver.post("/hook", &as_refs(&headers), &body).await;
    assert_eq!(
        (again.status, again.body.as_str()),
        (200, "duplicate"),
        "{again:?}"
    );
    let mut tampered = body.clone();
    tampered[1] ^= 1;
    assert_eq!(
        receiver
            .post("/hook", &as_refs(&headers), &tampered)
            .await
            .status,
        401
    );
    let row: (String, Vec<u8>) = sqlx::query_as(trusted(
        &db.sql("SELECT event_id, body FROM {schema}.received"),
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let expected_id = headers
        .iter()
        .find(|(k, _)| k == "webhook-id")
        .map(|(_, v)| v.clone());
    assert_eq!(Some(row.0), expected_id);
    assert_eq!(row.1, body);
    assert_eq!(stored(&db).await, 1);
    drop(receiver);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_qstash_token_made_with_pyjwt_is_stored_once() {
    let db = TestDb::new().await;
    let url = "https://receiver.example.com/hooks/pyjwt";
    let (headers, body) = independent_signature(
        &["qstash", url],
        &[("QSTASH_CURRENT_SIGNING_KEY", CURRENT_KEY)],
    );
    let receiver = Setup::qstash(&db, url).start().await;
    let first = receiver
        .post("/hooks/pyjwt", &as_refs(&headers), &body)
        .await;
    assert_eq!(
        (first.status, first.body.as_str()),
        (200, "stored"),
        "{first:?}"
    );
    let again = receiver
        .post("/hooks/pyjwt", &as_refs(&headers), &body)
        .await;
    assert_eq!(
        (again.status, again.body.as_str()),
        (200, "duplicate"),
        "{again:?}"
    );
    // The same token for another URL's receiver is refused (sub).
    let elsewhere = Setup::qstash(&db, "https://receiver.example.com/other")
        .start()
        .await;
    assert_eq!(
        elsewhere
            .post("/other", &as_refs(&headers), &body)
            .await
            .status,
        401
    );
    assert_eq!(stored(&db).await, 1);
    drop((receiver, elsewhere));
    db.drop_schema().await;
}

// ---------------------------------------------------------------------------------
// End to end: `postbox relay` → HTTP / QStash → a verifying receiver

/// Runs `postbox relay --drain` without blocking the test's runtime (which may
/// be serving the QStash test server the relay talks to).
async fn relay_drain(db: &TestDb, sink: &str, env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_postbox"));
    cmd.args(["relay", "--drain", "--sink", sink])
        .env("DATABASE_URL", &db.url)
        .env("POSTBOX_SCHEMA", db.schema.name())
        .env("POSTBOX_LOG", "warn");
    for name in [
        "POSTBOX_CONFIG",
        "POSTBOX_SINK",
        "POSTBOX_WEBHOOK_SECRET",
        "QSTASH_TOKEN",
        "QSTASH_URL",
    ] {
        cmd.env_remove(name);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().await.expect("run postbox relay");
    assert!(
        out.status.success(),
        "relay failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

async fn enqueue_orders(db: &TestDb, n: usize) -> std::collections::HashSet<String> {
    let events: Vec<postbox::NewEvent> = (0..n)
        .map(|i| {
            postbox::NewEvent::new(
                "order.created",
                "order",
                format!("o-{i}"),
                &json!({ "i": i }),
            )
            .unwrap()
        })
        .collect();
    db.enqueue_events(&events)
        .await
        .iter()
        .map(|id| id.to_string())
        .collect()
}

#[tokio::test]
async fn the_relay_publishes_through_qstash_and_receive_verifies_every_delivery() {
    let db = TestDb::new().await;
    let ids = enqueue_orders(&db, 25).await;
    let qstash = postbox_testkit::qstash::QstashServer::start_with(
        "qstash_token_e2e",
        CURRENT_KEY,
        NEXT_KEY,
    )
    .await;
    let port = free_port();
    let destination = format!("http://127.0.0.1:{port}/hooks/orders");
    let mut setup = Setup::qstash(&db, &destination);
    setup.port = Some(port);
    let receiver = setup.start().await;

    let out = relay_drain(
        &db,
        &format!("qstash:{destination}"),
        &[
            ("QSTASH_TOKEN", "qstash_token_e2e"),
            ("QSTASH_URL", &qstash.url()),
        ],
    )
    .await;
    assert!(String::from_utf8_lossy(&out.stdout).contains("drained: 25 delivered"));
    wait_for(
        "every delivery verified and stored",
        Duration::from_secs(60),
        || async { stored(&db).await == 25 },
    )
    .await;
    let rows: Vec<String> = sqlx::query_scalar(trusted(
        &db.sql("SELECT event_id::text FROM {schema}.received"),
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        rows.into_iter().collect::<std::collections::HashSet<_>>(),
        ids
    );
    assert!(
        qstash.deliveries().iter().all(|d| d.status == Some(200)
            || d.status == Some(204)
            || d.status == Some(201)
            || d.status == Some(202)),
        "{:?}",
        qstash.deliveries()
    );

    // Running the same events again (a relay that lost its acknowledgements)
    // is deduplicated by QStash: no second delivery reaches the receiver.
    db.exec("UPDATE {schema}.outbox SET status = 'pending', sent_at = NULL")
        .await;
    relay_drain(
        &db,
        &format!("qstash:{destination}"),
        &[
            ("QSTASH_TOKEN", "qstash_token_e2e"),
            ("QSTASH_URL", &qstash.url()),
        ],
    )
    .await;
    assert_eq!(
        qstash.deliveries().len(),
        25,
        "QStash answered 202 and delivered nothing twice"
    );
    receiver.assert_log_has_no_secret();
    db.drop_schema().await;
}

#[tokio::test]
async fn the_relay_signs_webhooks_that_the_standardwebhooks_package_verifies() {
    let db = TestDb::new().await;
    let ids = enqueue_orders(&db, 30).await;
    let port = free_port();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/independent_receiver.py");
    // The receiver knows only the new secret; the relay signs with old and new (rotation).
    let mut python = tokio::process::Command::new("python3")
        .arg(script)
        .arg(port.to_string())
        .env("POSTBOX_WEBHOOK_SECRET", SECRET)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot run python3 ({e}): install Python 3, then {INSTALL_HINT}")
        });
    let mut lines = tokio::io::BufReader::new(python.stdout.take().unwrap()).lines();
    match lines.next_line().await.unwrap() {
        Some(l) if l == "ready" => {}
        other => {
            let mut err = String::new();
            let _ = python
                .stderr
                .as_mut()
                .unwrap()
                .read_to_string(&mut err)
                .await;
            panic!("independent_receiver.py did not start ({other:?}): {err}; {INSTALL_HINT}");
        }
    }
    let sink = format!("http://127.0.0.1:{port}/webhooks");
    let secrets = format!("{OTHER_SECRET} {SECRET}");
    let out = relay_drain(&db, &sink, &[("POSTBOX_WEBHOOK_SECRET", &secrets)]).await;
    assert!(String::from_utf8_lossy(&out.stdout).contains("drained: 30 delivered"));
    let mut verified = std::collections::HashSet::new();
    while verified.len() < 30 {
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("a line from the receiver")
            .unwrap()
            .expect("the receiver is running");
        let parts: Vec<&str> = line.split(' ').collect();
        assert_eq!(parts[0], "ok", "{line}");
        assert_eq!(parts[1], parts[2], "webhook-id is the event id: {line}");
        verified.insert(parts[1].to_owned());
    }
    assert_eq!(verified, ids);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_signed_qstash_body_with_two_ids_is_refused_and_a_flood_of_forgeries_logs_one_line() {
    let db = TestDb::new().await;
    let url = "https://receiver.example.com/hooks/qstash";
    let metrics_port = free_port();
    let receiver = Setup::qstash(&db, url)
        .arg("--metrics-listen")
        .arg(&format!("127.0.0.1:{metrics_port}"))
        .start()
        .await;
    // Signed, with an id header agreeing with one of the body's two ids.
    let body = br#"{"specversion":"1.0","id":"evt_a","type":"order.created","source":"test","id":"evt_b"}"#;
    let token = forge_jwt("HS256", &qstash_claims(url, body), CURRENT_KEY);
    for id in ["evt_a", "evt_b"] {
        let reply = receiver
            .post(
                "/hooks/qstash",
                &[("Upstash-Signature", &token), ("ce-id", id)],
                body,
            )
            .await;
        assert_eq!(reply.status, 400, "ce-id {id}: {reply:?}");
        assert!(reply.body.contains("ambiguous"), "{reply:?}");
    }
    assert_eq!(stored(&db).await, 0);

    // Fifty forged deliveries: fifty counted, one WARN line.
    let genuine = cloudevent("evt_forged");
    for _ in 0..50 {
        let reply = receiver
            .post(
                "/hooks/qstash",
                &[("Upstash-Signature", "not.a.jwt")],
                &genuine,
            )
            .await;
        assert_eq!(reply.status, 401);
    }
    let scrape = get(metrics_port, "/metrics")
        .await
        .expect("scrape /metrics");
    for series in [
        "postbox_receive_rejected_total{reason=\"signature\"} 50",
        "postbox_receive_rejected_total{reason=\"ambiguous\"} 2",
    ] {
        assert!(
            scrape.body.lines().any(|l| l == series),
            "{series} in:\n{}",
            scrape.body
        );
    }
    let log = receiver.log_text();
    let warnings = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("refused a delivery"))
        .collect::<Vec<_>>();
    assert_eq!(
        warnings.len(),
        2,
        "one per reason (ambiguous, signature):\n{log}"
    );
    receiver.assert_log_has_no_secret();
    drop(receiver);
    db.drop_schema().await;
}

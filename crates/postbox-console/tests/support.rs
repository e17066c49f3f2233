//! Shared by the console's tests: a console on its own schema and port, users,
//! dead letters, and an HTTP agent that keeps its cookies and CSRF token.

use postbox::statements::trusted;
use postbox::NewEvent;
use postbox_console::{Console, ConsoleConfig, OutboxPatterns, Role};
use postbox_testkit::TestDb;
use reqwest::header::{COOKIE, LOCATION, SET_COOKIE};
use reqwest::StatusCode;
use std::net::SocketAddr;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub const PASSWORD: &str = "correct horse battery";

pub struct Harness {
    pub db: TestDb,
    pub addr: SocketAddr,
    /// The console being served (for what its API offers besides HTTP).
    pub console: Console,
    stop: CancellationToken,
}

impl Harness {
    pub async fn start() -> Harness {
        Self::with(|_| {}).await
    }

    /// A console on a fresh schema, its config adjusted by `tune`.
    pub async fn with(tune: impl FnOnce(&mut ConsoleConfig)) -> Harness {
        let db = TestDb::new().await;
        let mut config = ConsoleConfig::new(db.schema.clone());
        tune(&mut config);
        let console = Console::new(db.pool.clone(), config);
        console
            .check()
            .await
            .expect("the schema has the console tables");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        tokio::spawn(console.clone().serve(listener, stop.clone()));
        Harness {
            db,
            addr,
            console,
            stop,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub async fn user(&self, name: &str, role: Role) {
        postbox_console::add_user(&self.db.pool, &self.db.schema, name, role, PASSWORD)
            .await
            .unwrap();
    }

    /// User `name` with `role`, limited to the outboxes `patterns` names.
    pub async fn limited_user(&self, name: &str, role: Role, patterns: &str) {
        let patterns = OutboxPatterns::parse(patterns).unwrap();
        postbox_console::set_user(
            &self.db.pool,
            &self.db.schema,
            name,
            role,
            Some(&patterns),
            PASSWORD,
        )
        .await
        .unwrap();
    }

    /// A new agent signed in as `name`, who already exists; its CSRF token
    /// is the session's as the database keeps it (whatever pages it may see).
    pub async fn signed_in_as(&self, name: &str) -> Agent {
        let mut agent = Agent::new(self);
        let res = agent.sign_in(name, PASSWORD).await;
        assert_eq!(res.status, StatusCode::SEE_OTHER, "{}", res.body);
        let session = agent
            .cookies
            .iter()
            .find(|(k, _)| k == "postbox_session")
            .map(|(_, v)| v.clone())
            .expect("a session cookie");
        let hash = sha256(&session);
        agent.csrf =
            sqlx::query_scalar(trusted(&self.db.sql(
                "SELECT csrf_token FROM {schema}.console_sessions WHERE token_hash = $1",
            )))
            .bind(hash)
            .fetch_one(&self.db.pool)
            .await
            .unwrap();
        agent
    }

    /// A new agent signed in as `name` (created with `role` first).
    pub async fn signed_in(&self, name: &str, role: Role) -> Agent {
        self.user(name, role).await;
        let mut agent = Agent::new(self);
        let res = agent.sign_in(name, PASSWORD).await;
        assert_eq!(res.status, StatusCode::SEE_OTHER, "{}", res.body);
        agent.refresh_csrf().await;
        agent
    }

    /// `n` dead letters of `event_type`, oldest first.
    pub async fn dead_letters(&self, event_type: &str, n: usize) -> Vec<Uuid> {
        dead_letters(&self.db, event_type, n).await
    }

    pub async fn status(&self, id: Uuid) -> (String, i32, Option<String>) {
        sqlx::query_as(trusted(&self.db.sql(
            "SELECT status::text, attempts, resolution FROM {schema}.outbox WHERE event_id = $1",
        )))
        .bind(id)
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }

    /// (actor, action, count, reason) of every audit entry, oldest first.
    pub async fn audit(&self) -> Vec<(String, String, i64, Option<String>)> {
        sqlx::query_as(trusted(&self.db.sql(
            "SELECT actor, action, count, reason FROM {schema}.audit_log ORDER BY id",
        )))
        .fetch_all(&self.db.pool)
        .await
        .unwrap()
    }

    pub async fn finish(self) {
        self.stop.cancel();
        self.db.drop_schema().await;
    }
}

pub async fn dead_letters(db: &TestDb, event_type: &str, n: usize) -> Vec<Uuid> {
    let events: Vec<NewEvent> = (0..n)
        .map(|i| {
            NewEvent::new(
                event_type,
                "order",
                format!("o-{i}"),
                &serde_json::json!({"n": i, "card": {"number": "4111 1111 1111 1111"}}),
            )
            .unwrap()
        })
        .collect();
    let ids = db.enqueue_events(&events).await;
    sqlx::query(trusted(&db.sql(
        "UPDATE {schema}.outbox SET status = 'failed', attempts = 20, \
         last_error = 'sink rejected: 400 missing field customer_id' WHERE event_id = ANY($1)",
    )))
    .bind(&ids)
    .execute(&db.pool)
    .await
    .unwrap();
    ids
}

pub struct Reply {
    pub status: StatusCode,
    pub location: Option<String>,
    pub cookies: Vec<String>,
    pub headers: reqwest::header::HeaderMap,
    pub body: String,
}

/// A browser stand-in: keeps cookies by name, never follows redirects.
pub struct Agent {
    base: String,
    client: reqwest::Client,
    pub cookies: Vec<(String, String)>,
    pub csrf: String,
    pub extra: Vec<(String, String)>,
}

impl Agent {
    pub fn new(h: &Harness) -> Agent {
        Self::from_address(h, "127.0.0.1")
    }

    /// An agent of the console at `base` (`http://ADDR`).
    pub fn at(base: &str) -> Agent {
        Agent {
            base: base.to_owned(),
            client: postbox_testkit::http()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap(),
            cookies: Vec::new(),
            csrf: String::new(),
            extra: Vec::new(),
        }
    }

    /// An agent whose connections come from `local` (any of 127.0.0.0/8).
    pub fn from_address(h: &Harness, local: &str) -> Agent {
        Agent {
            base: h.url(""),
            client: postbox_testkit::http()
                .redirect(reqwest::redirect::Policy::none())
                .local_address(local.parse::<std::net::IpAddr>().unwrap())
                .build()
                .unwrap(),
            cookies: Vec::new(),
            csrf: String::new(),
            extra: Vec::new(),
        }
    }

    fn cookie_header(&self) -> String {
        self.cookies
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    async fn send(&mut self, req: reqwest::RequestBuilder) -> Reply {
        let mut req = req.header(COOKIE, self.cookie_header());
        for (k, v) in &self.extra {
            req = req.header(k.as_str(), v.as_str());
        }
        let res = req.send().await.unwrap();
        let status = res.status();
        let headers = res.headers().clone();
        let location = headers
            .get(LOCATION)
            .map(|v| v.to_str().unwrap().to_owned());
        let cookies: Vec<String> = headers
            .get_all(SET_COOKIE)
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect();
        for c in &cookies {
            let pair = c.split(';').next().unwrap();
            let (k, v) = pair.split_once('=').unwrap();
            self.cookies.retain(|(name, _)| name != k);
            if !v.is_empty() {
                self.cookies.push((k.to_owned(), v.to_owned()));
            }
        }
        let body = res.text().await.unwrap();
        Reply {
            status,
            location,
            cookies,
            headers,
            body,
        }
    }

    pub async fn get(&mut self, path: &str) -> Reply {
        let req = self.client.get(format!("{}{path}", self.base));
        self.send(req).await
    }

    /// POST a form; `fields` as given (add `("csrf", &agent.csrf)` yourself).
    pub async fn post(&mut self, path: &str, fields: &[(&str, &str)]) -> Reply {
        let body = url::form_urlencoded::Serializer::new(String::new())
            .extend_pairs(fields)
            .finish();
        let req = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body);
        self.send(req).await
    }

    pub async fn sign_in(&mut self, name: &str, password: &str) -> Reply {
        let form = self.get("/sign-in").await;
        let token = hidden(&form.body, "csrf");
        self.post(
            "/sign-in",
            &[
                ("csrf", &token),
                ("name", name),
                ("password", password),
                ("next", "/"),
            ],
        )
        .await
    }

    /// Read the session's CSRF token from a page.
    pub async fn refresh_csrf(&mut self) {
        let page = self.get("/").await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.body);
        self.csrf = hidden(&page.body, "csrf");
    }
}

/// SHA-256 of `s`, as the console stores a session token.
fn sha256(s: &str) -> Vec<u8> {
    use sha2::Digest;
    sha2::Sha256::digest(s.as_bytes()).to_vec()
}

/// The value of the first hidden input `name` in `html`.
pub fn hidden(html: &str, name: &str) -> String {
    let marker = format!("name=\"{name}\" value=\"");
    let start = html
        .find(&marker)
        .unwrap_or_else(|| panic!("no {name} field in {html}"))
        + marker.len();
    let end = html[start..].find('"').unwrap() + start;
    html[start..end].to_owned()
}

/// A bulk action's progress, as its page's script reads it.
pub async fn job_progress(url: String, cookies: Vec<(String, String)>) -> serde_json::Value {
    let cookie = cookies
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("; ");
    let r = postbox_testkit::http()
        .build()
        .unwrap()
        .get(url)
        .header(COOKIE, cookie)
        .send()
        .await
        .unwrap();
    serde_json::from_str(&r.text().await.unwrap()).unwrap()
}

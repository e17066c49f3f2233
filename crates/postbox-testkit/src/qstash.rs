//! A QStash-compatible server for tests: publish and batch endpoints,
//! deduplication, and signed deliveries to the destinations, on
//! `127.0.0.1:<random port>`.
//!
//! ```no_run
//! # async fn demo() {
//! let qstash = postbox_testkit::qstash::QstashServer::start().await;
//! // Point the code under test at qstash.url() with qstash.token();
//! // receivers verify with qstash.current_signing_key() / next_signing_key().
//! # }
//! ```
//!
//! # What it implements, and what is guessed
//!
//! Written from QStash's public documentation as far as it is known here, not
//! from its implementation. Every point marked *guess* may differ from the
//! real service.
//!
//! - **Authentication**: every `/v2/*` request needs `Authorization: Bearer
//!   <token>`; otherwise `401` with `{"error":"Unauthorized"}` (*guess*: the
//!   exact body).
//! - **`POST /v2/publish/{destination}`**: the destination is the rest of the
//!   path after `/v2/publish/`, as sent (not percent-decoded), plus `?query`
//!   when the request has one (*guess*: how QStash treats a query on the
//!   publish URL). It must be an `http://` or `https://` URL, else `400`
//!   (URL groups and queues are not implemented). A new message is answered
//!   `201` with `{"messageId":"msg_…"}` (*guess*: 201 rather than 200).
//! - **`POST /v2/batch`**: a JSON array of `{destination, headers, body}`
//!   (`headers` a string map holding the same `Upstash-*` headers as a
//!   publish, `body` a string). Answered `200` (*guess*) with an array in
//!   the same order: `{"messageId":…}`, `{"messageId":…,"deduplicated":true}`,
//!   or `{"error":"…"}` for an entry that was not accepted (an invalid
//!   destination, a body over the limit); the other entries are accepted
//!   anyway. A body that is not such an array is `400`.
//! - **Deduplication**: a message with an `Upstash-Deduplication-Id` seen in
//!   the last 10 minutes (*guess*: QStash documents a longer window; 10 minutes
//!   keeps tests honest about retries inside a short window) is not enqueued
//!   again: `202` with `{"messageId":<the first message's id>,
//!   "deduplicated":true}`. Ids are global to the server, not per destination
//!   (*guess*). Content-based deduplication is not implemented.
//! - **Limits**: a publish body over 2 MiB is answered `413` with
//!   `{"error":"message too large"}` after the body was read (*guess*:
//!   QStash's limit depends on the plan); a batch request may carry up to
//!   64 MiB, each entry's body at most 2 MiB (else that entry's `error`).
//! - **`GET /v2/keys`**: `{"current":…,"next":…}`, the signing keys.
//! - **Delivery**: each accepted message is delivered in the background with
//!   the method in `Upstash-Method` (default `POST`), the body as given, its
//!   `Content-Type`, every `Upstash-Forward-<name>` header as `<name>`,
//!   `Upstash-Message-Id`, `Upstash-Retried` (0 on the first attempt),
//!   `User-Agent: Upstash-QStash` and `Upstash-Signature`: an HS256 JWT
//!   ([`postbox::verify::qstash::sign`]) with the server's *current* signing
//!   key, `sub` = the destination, `body` = the body's hash, valid for 5
//!   minutes. `Upstash-Delay` (`10s`, `5m`, `2h`, `1d`) delays the first
//!   attempt. A non-2xx answer or a failed request is retried
//!   `Upstash-Retries` times (default 3, at most 5 here; *guess*: QStash's
//!   default), after 100 ms, 200 ms, 400 ms, … (QStash backs off for far
//!   longer). `Upstash-Timeout` bounds each attempt (default 30 s here).
//!   Callbacks, failure callbacks and flow control are recorded but not
//!   acted upon.
//! - **Failure switches** ([`QstashServer::fail_next`],
//!   [`QstashServer::fail_always`]) make publish and batch requests (after
//!   the token check) answer `401`, `500`, or `429` with
//!   `Burst-RateLimit-Limit`, `Burst-RateLimit-Remaining: 0` and
//!   `Burst-RateLimit-Reset` (a unix time in seconds, as QStash documents).

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use postbox::verify::qstash::{sign, Claims};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// How long a deduplication id is remembered.
pub const DEDUP_WINDOW: Duration = Duration::from_secs(600);
/// Largest body of one message.
pub const MAX_MESSAGE_BYTES: usize = 2 * 1024 * 1024;
/// Largest request read (bodies are read whole before any limit is applied,
/// so a client never sees a reset while it is still sending).
const MAX_REQUEST_BYTES: usize = 64 * 1024 * 1024;
const DEFAULT_RETRIES: u32 = 3;
const TOO_LARGE: &str = "message too large";
const MAX_RETRIES: u32 = 5;
const DEFAULT_DELIVERY_TIMEOUT: Duration = Duration::from_secs(30);

/// A failure the server answers publish and batch requests with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// `401 Unauthorized`, as for a wrong token.
    Unauthorized,
    /// `429 Too Many Requests`, with `Burst-RateLimit-Reset` = now + `reset_in`
    /// (rounded up to whole seconds).
    RateLimited { reset_in: Duration },
    /// `500 Internal Server Error`.
    ServerError,
}

/// Which endpoint a request went to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Publish,
    Batch,
    Keys,
}

/// What the server answered for one message of a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EntryAnswer {
    /// Accepted and enqueued under this message id.
    New(String),
    /// A duplicate of the message with this id: accepted, not enqueued.
    Duplicate(String),
    /// Not accepted.
    Error(String),
}

/// One request to the API.
#[derive(Clone, Debug)]
pub struct Call {
    pub endpoint: Endpoint,
    /// The HTTP status of the answer.
    pub status: u16,
    /// One answer per message (empty when the whole request failed).
    pub entries: Vec<EntryAnswer>,
}

/// A message the server accepted (duplicates are not listed again).
#[derive(Clone, Debug)]
pub struct Published {
    pub message_id: String,
    pub destination: String,
    /// Request headers (publish) or the entry's headers (batch); names in lower case.
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
    pub endpoint: Endpoint,
}

impl Published {
    /// A header's value (`name` in any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }
}

/// One delivery attempt to a destination.
#[derive(Clone, Debug)]
pub struct Delivery {
    pub message_id: String,
    pub destination: String,
    /// 0 for the first attempt (the `Upstash-Retried` value sent).
    pub attempt: u32,
    /// The destination's status, when it answered.
    pub status: Option<u16>,
    /// Why the request failed, when it got no answer.
    pub error: Option<String>,
}

#[derive(Default)]
struct Record {
    dedup: HashMap<String, (String, Instant)>,
    calls: Vec<Call>,
    published: Vec<Published>,
    deliveries: Vec<Delivery>,
    /// The failure to answer with, and how many more times (`None`: until healed).
    failure: Option<(Failure, Option<usize>)>,
}

struct Shared {
    token: String,
    keys: Mutex<(String, String)>,
    record: Mutex<Record>,
    client: reqwest::Client,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The running server; stops when dropped.
pub struct QstashServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for QstashServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

fn random(prefix: &str) -> String {
    format!("{prefix}{}", uuid::Uuid::new_v4().simple())
}

impl QstashServer {
    /// Start with a random token and random signing keys.
    pub async fn start() -> Self {
        Self::start_with(&random("qstash_token_"), &random("sig_"), &random("sig_")).await
    }

    /// Start with the given token and current/next signing keys.
    pub async fn start_with(token: &str, current_key: &str, next_key: &str) -> Self {
        let shared = Arc::new(Shared {
            token: token.to_owned(),
            keys: Mutex::new((current_key.to_owned(), next_key.to_owned())),
            record: Mutex::default(),
            client: crate::http()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .expect("build the delivery client"),
        });
        let app = Router::new()
            .route("/v2/publish/{*destination}", post(publish))
            .route("/v2/batch", post(batch))
            .route("/v2/keys", get(keys))
            .layer(DefaultBodyLimit::max(MAX_REQUEST_BYTES))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the QStash test server");
        let addr = listener.local_addr().expect("local address");
        let stop = crate::serve_http(listener, app);
        Self {
            addr,
            shared,
            stop: Some(stop),
        }
    }

    /// The base URL (`http://127.0.0.1:PORT`), for `QSTASH_URL`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The token the server accepts, for `QSTASH_TOKEN`.
    pub fn token(&self) -> &str {
        &self.shared.token
    }

    /// The key deliveries are signed with now.
    pub fn current_signing_key(&self) -> String {
        lock(&self.shared.keys).0.clone()
    }

    /// The key deliveries will be signed with after [`Self::rotate_signing_keys`].
    pub fn next_signing_key(&self) -> String {
        lock(&self.shared.keys).1.clone()
    }

    /// Roll the keys: the next key becomes current, and a new next key is made.
    pub fn rotate_signing_keys(&self) {
        let mut keys = lock(&self.shared.keys);
        keys.0 = std::mem::replace(&mut keys.1, random("sig_"));
    }

    /// Answer the next `times` publish/batch requests with `failure`.
    pub fn fail_next(&self, times: usize, failure: Failure) {
        lock(&self.shared.record).failure = Some((failure, Some(times)));
    }

    /// Answer every publish/batch request with `failure` until [`Self::heal`].
    pub fn fail_always(&self, failure: Failure) {
        lock(&self.shared.record).failure = Some((failure, None));
    }

    /// Answer normally again.
    pub fn heal(&self) {
        lock(&self.shared.record).failure = None;
    }

    /// Every API request so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        lock(&self.shared.record).calls.clone()
    }

    /// Every accepted (non-duplicate) message so far, in order.
    pub fn published(&self) -> Vec<Published> {
        lock(&self.shared.record).published.clone()
    }

    /// Every delivery attempt so far, in order of completion.
    pub fn deliveries(&self) -> Vec<Delivery> {
        lock(&self.shared.record).deliveries.clone()
    }
}

fn json(status: StatusCode, value: serde_json::Value) -> Response {
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        value.to_string(),
    )
        .into_response()
}

fn authorized(shared: &Shared, headers: &HeaderMap) -> bool {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| t == shared.token)
}

/// The answer for an unauthorized request or an active failure switch, if any.
fn refusal(shared: &Shared, headers: &HeaderMap, endpoint: Endpoint) -> Option<Response> {
    let mut record = lock(&shared.record);
    let failure = if !authorized(shared, headers) {
        Some(Failure::Unauthorized)
    } else if endpoint == Endpoint::Keys {
        None
    } else {
        match &mut record.failure {
            Some((failure, None)) => Some(*failure),
            Some((failure, Some(left))) if *left > 0 => {
                *left -= 1;
                Some(*failure)
            }
            _ => None,
        }
    };
    let response = match failure? {
        Failure::Unauthorized => json(
            StatusCode::UNAUTHORIZED,
            serde_json::json!({"error": "Unauthorized"}),
        ),
        Failure::ServerError => json(
            StatusCode::INTERNAL_SERVER_ERROR,
            serde_json::json!({"error": "internal server error"}),
        ),
        Failure::RateLimited { reset_in } => {
            let now = chrono::Utc::now().timestamp();
            let mut seconds = reset_in.as_secs() as i64;
            if reset_in.subsec_nanos() > 0 {
                seconds += 1;
            }
            let mut response = json(
                StatusCode::TOO_MANY_REQUESTS,
                serde_json::json!({"error": "burst rate limit exceeded"}),
            );
            let h = response.headers_mut();
            h.insert("Burst-RateLimit-Limit", 100.into());
            h.insert("Burst-RateLimit-Remaining", 0.into());
            h.insert("Burst-RateLimit-Reset", (now + seconds).into());
            response
        }
    };
    record.calls.push(Call {
        endpoint,
        status: response.status().as_u16(),
        entries: Vec::new(),
    });
    Some(response)
}

fn valid_destination(destination: &str) -> bool {
    reqwest::Url::parse(destination)
        .is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host_str().is_some())
}

/// A message waiting to be accepted: everything a delivery needs.
struct Incoming {
    destination: String,
    headers: BTreeMap<String, String>,
    body: Vec<u8>,
}

/// Accept (or deduplicate) one message; spawns its delivery when new.
fn accept(shared: &Arc<Shared>, incoming: Incoming, endpoint: Endpoint) -> EntryAnswer {
    if !valid_destination(&incoming.destination) {
        return EntryAnswer::Error("invalid destination url".into());
    }
    if incoming.body.len() > MAX_MESSAGE_BYTES {
        return EntryAnswer::Error(TOO_LARGE.into());
    }
    let mut record = lock(&shared.record);
    let now = Instant::now();
    record
        .dedup
        .retain(|_, (_, at)| now.duration_since(*at) < DEDUP_WINDOW);
    let dedup_id = incoming.headers.get("upstash-deduplication-id").cloned();
    if let Some(id) = &dedup_id {
        if let Some((message_id, _)) = record.dedup.get(id) {
            return EntryAnswer::Duplicate(message_id.clone());
        }
    }
    let message_id = random("msg_");
    if let Some(id) = dedup_id {
        record.dedup.insert(id, (message_id.clone(), now));
    }
    let published = Published {
        message_id: message_id.clone(),
        destination: incoming.destination,
        headers: incoming.headers,
        body: incoming.body,
        endpoint,
    };
    record.published.push(published.clone());
    drop(record);
    tokio::spawn(deliver(shared.clone(), published));
    EntryAnswer::New(message_id)
}

fn entry_json(answer: &EntryAnswer) -> serde_json::Value {
    match answer {
        EntryAnswer::New(id) => serde_json::json!({"messageId": id}),
        EntryAnswer::Duplicate(id) => serde_json::json!({"messageId": id, "deduplicated": true}),
        EntryAnswer::Error(e) => serde_json::json!({"error": e}),
    }
}

fn lowercase_headers(headers: &HeaderMap) -> BTreeMap<String, String> {
    headers
        .iter()
        .filter_map(|(n, v)| Some((n.as_str().to_ascii_lowercase(), v.to_str().ok()?.to_owned())))
        .collect()
}

async fn publish(
    State(shared): State<Arc<Shared>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(refused) = refusal(&shared, &headers, Endpoint::Publish) {
        return refused;
    }
    let mut destination = uri
        .path()
        .strip_prefix("/v2/publish/")
        .unwrap_or("")
        .to_owned();
    if let Some(query) = uri.query() {
        destination.push('?');
        destination.push_str(query);
    }
    let incoming = Incoming {
        destination,
        headers: lowercase_headers(&headers),
        body: body.to_vec(),
    };
    let answer = accept(&shared, incoming, Endpoint::Publish);
    let status = match &answer {
        EntryAnswer::New(_) => StatusCode::CREATED,
        EntryAnswer::Duplicate(_) => StatusCode::ACCEPTED,
        EntryAnswer::Error(e) if e == TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
        EntryAnswer::Error(_) => StatusCode::BAD_REQUEST,
    };
    lock(&shared.record).calls.push(Call {
        endpoint: Endpoint::Publish,
        status: status.as_u16(),
        entries: vec![answer.clone()],
    });
    json(status, entry_json(&answer))
}

#[derive(serde::Deserialize)]
struct BatchEntry {
    destination: String,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    body: String,
}

async fn batch(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Some(refused) = refusal(&shared, &headers, Endpoint::Batch) {
        return refused;
    }
    let entries: Vec<BatchEntry> = match serde_json::from_slice(&body) {
        Ok(entries) => entries,
        Err(_) => {
            lock(&shared.record).calls.push(Call {
                endpoint: Endpoint::Batch,
                status: 400,
                entries: Vec::new(),
            });
            return json(
                StatusCode::BAD_REQUEST,
                serde_json::json!({"error": "expected a JSON array of messages"}),
            );
        }
    };
    let answers: Vec<EntryAnswer> = entries
        .into_iter()
        .map(|entry| {
            let incoming = Incoming {
                destination: entry.destination,
                headers: entry
                    .headers
                    .into_iter()
                    .map(|(n, v)| (n.to_ascii_lowercase(), v))
                    .collect(),
                body: entry.body.into_bytes(),
            };
            accept(&shared, incoming, Endpoint::Batch)
        })
        .collect();
    lock(&shared.record).calls.push(Call {
        endpoint: Endpoint::Batch,
        status: 200,
        entries: answers.clone(),
    });
    json(
        StatusCode::OK,
        serde_json::Value::Array(answers.iter().map(entry_json).collect()),
    )
}

async fn keys(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if let Some(refused) = refusal(&shared, &headers, Endpoint::Keys) {
        return refused;
    }
    let (current, next) = lock(&shared.keys).clone();
    lock(&shared.record).calls.push(Call {
        endpoint: Endpoint::Keys,
        status: 200,
        entries: Vec::new(),
    });
    json(
        StatusCode::OK,
        serde_json::json!({"current": current, "next": next}),
    )
}

/// `10s`, `5m`, `2h`, `1d` (or a bare number of seconds).
fn parse_delay(value: &str) -> Option<Duration> {
    let value = value.trim();
    let (number, unit) = match value.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => value.split_at(i),
        None => (value, "s"),
    };
    let n: u64 = number.parse().ok()?;
    let factor = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return None,
    };
    Some(Duration::from_secs(n.saturating_mul(factor)))
}

async fn deliver(shared: Arc<Shared>, message: Published) {
    if let Some(delay) = message.header("upstash-delay").and_then(parse_delay) {
        tokio::time::sleep(delay).await;
    }
    let retries = message
        .header("upstash-retries")
        .and_then(|r| r.trim().parse().ok())
        .unwrap_or(DEFAULT_RETRIES)
        .min(MAX_RETRIES);
    let timeout = message
        .header("upstash-timeout")
        .and_then(parse_delay)
        .unwrap_or(DEFAULT_DELIVERY_TIMEOUT);
    let method = message
        .header("upstash-method")
        .and_then(|m| Method::from_bytes(m.as_bytes()).ok())
        .unwrap_or(Method::POST);
    for attempt in 0..=retries {
        let key = lock(&shared.keys).0.clone();
        let now = chrono::Utc::now().timestamp();
        let claims = Claims::new(message.destination.clone(), &message.body, now, 300);
        let token = sign(&key, &claims).expect("sign the delivery");
        let mut request = shared
            .client
            .request(method.clone(), &message.destination)
            .timeout(timeout)
            .header("Upstash-Signature", token)
            .header("Upstash-Message-Id", &message.message_id)
            .header("Upstash-Retried", attempt.to_string())
            .header("User-Agent", "Upstash-QStash")
            .body(message.body.clone());
        if let Some(content_type) = message.header("content-type") {
            request = request.header("Content-Type", content_type);
        }
        for (name, value) in &message.headers {
            if let Some(forwarded) = name.strip_prefix("upstash-forward-") {
                request = request.header(forwarded, value);
            }
        }
        let (status, error) = match request.send().await {
            Ok(response) => {
                let status = response.status().as_u16();
                let _ = response.bytes().await;
                (Some(status), None)
            }
            Err(e) => (None, Some(e.without_url().to_string())),
        };
        lock(&shared.record).deliveries.push(Delivery {
            message_id: message.message_id.clone(),
            destination: message.destination.clone(),
            attempt,
            status,
            error,
        });
        if status.is_some_and(|s| (200..300).contains(&s)) {
            return;
        }
        if attempt < retries {
            tokio::time::sleep(Duration::from_millis(100) * 2u32.pow(attempt)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_delay;
    use std::time::Duration;

    #[test]
    fn reads_delays() {
        assert_eq!(parse_delay("10s"), Some(Duration::from_secs(10)));
        assert_eq!(parse_delay("5m"), Some(Duration::from_secs(300)));
        assert_eq!(parse_delay("2"), Some(Duration::from_secs(2)));
        assert_eq!(parse_delay("soon"), None);
    }
}

//! An HTTP endpoint started by each test (axum on 127.0.0.1:0) that records
//! every request and answers by a script: the "broker" of the HTTP and
//! QStash sink tests.

// The HTTP sink's tests use all of it, the QStash sink's tests part.
#![cfg_attr(not(feature = "http"), allow(dead_code))]

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, Notify};

/// One request a [`Receiver`] got.
#[derive(Clone, Debug)]
pub struct Request {
    pub at: Instant,
    pub method: Method,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The delivery's id: `webhook-id`, `ce-id`, or the CloudEvents body's `id`.
    pub fn id(&self) -> Option<String> {
        self.header("webhook-id")
            .or_else(|| self.header("ce-id"))
            .map(str::to_owned)
            .or_else(|| {
                let body: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
                body["id"].as_str().map(str::to_owned)
            })
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }
}

/// What a receiver answers.
pub enum Reply {
    /// A status, extra headers and a body.
    Status(u16, Vec<(&'static str, String)>, String),
    /// Answer after a pause (a slow endpoint).
    Slow(Duration, Box<Reply>),
    /// Do not answer until a later request with the same id has been answered.
    HoldUntilRedelivered,
}

impl Reply {
    pub fn ok() -> Self {
        Reply::Status(200, Vec::new(), String::new())
    }

    pub fn status(code: u16) -> Self {
        Reply::Status(code, Vec::new(), String::new())
    }
}

/// `(request, how many earlier requests had the same id) -> reply`
type Script = dyn Fn(&Request, usize) -> Reply + Send + Sync;

struct ReceiverState {
    requests: Mutex<Vec<Request>>,
    /// Requests answered 2xx, in the order they were answered.
    accepted: Mutex<Vec<Request>>,
    script: Box<Script>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    answered: Notify,
    answered_ids: Mutex<HashMap<String, usize>>,
    /// Requests seen per id.
    seen_ids: Mutex<HashMap<String, usize>>,
}

/// An HTTP endpoint on 127.0.0.1 that records every request and answers by a script.
pub struct Receiver {
    addr: SocketAddr,
    state: Arc<ReceiverState>,
    _stop: oneshot::Sender<()>,
}

impl Receiver {
    pub async fn start(script: impl Fn(&Request, usize) -> Reply + Send + Sync + 'static) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a receiver");
        Self::serve(listener, script).await
    }

    pub async fn serve(
        listener: tokio::net::TcpListener,
        script: impl Fn(&Request, usize) -> Reply + Send + Sync + 'static,
    ) -> Self {
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(ReceiverState {
            requests: Mutex::default(),
            accepted: Mutex::default(),
            script: Box::new(script),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            answered: Notify::new(),
            answered_ids: Mutex::default(),
            seen_ids: Mutex::default(),
        });
        // Bodies are read whole (up to 64 MiB) before the script answers, so a
        // client never sees a reset while still sending.
        let app = axum::Router::new()
            .fallback(handle)
            .layer(axum::extract::DefaultBodyLimit::max(64 * 1024 * 1024))
            .with_state(state.clone());
        let stop = postbox_testkit::serve_http(listener, app);
        Self {
            addr,
            state,
            _stop: stop,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn requests(&self) -> Vec<Request> {
        self.state.requests.lock().unwrap().clone()
    }

    pub fn accepted(&self) -> Vec<Request> {
        self.state.accepted.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.state.requests.lock().unwrap().len()
    }

    pub fn max_in_flight(&self) -> usize {
        self.state.max_in_flight.load(Ordering::SeqCst)
    }
}

struct InFlight<'a>(&'a ReceiverState);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn handle(
    axum::extract::State(state): axum::extract::State<Arc<ReceiverState>>,
    method: Method,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let now = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    state.max_in_flight.fetch_max(now, Ordering::SeqCst);
    let _guard = InFlight(&state);
    let request = Request {
        at: Instant::now(),
        method,
        path: uri.path_and_query().map_or("/", |p| p.as_str()).to_owned(),
        headers,
        body,
    };
    let id = request.id();
    let before = match &id {
        Some(id) => {
            let mut seen = state.seen_ids.lock().unwrap();
            let count = seen.entry(id.clone()).or_default();
            *count += 1;
            *count - 1
        }
        None => 0,
    };
    state.requests.lock().unwrap().push(request.clone());
    let reply = (state.script)(&request, before);
    let mut reply = reply;
    loop {
        match reply {
            Reply::Slow(pause, inner) => {
                tokio::time::sleep(pause).await;
                reply = *inner;
            }
            Reply::HoldUntilRedelivered => {
                let Some(id) = id.clone() else {
                    reply = Reply::status(500);
                    continue;
                };
                let deadline = Instant::now() + Duration::from_secs(60);
                loop {
                    let notified = state.answered.notified();
                    if state
                        .answered_ids
                        .lock()
                        .unwrap()
                        .get(&id)
                        .copied()
                        .unwrap_or(0)
                        > 0
                        || Instant::now() > deadline
                    {
                        break;
                    }
                    let _ = tokio::time::timeout(Duration::from_secs(1), notified).await;
                }
                reply = Reply::ok();
            }
            Reply::Status(code, extra, body) => {
                let status = StatusCode::from_u16(code).unwrap();
                if status.is_success() {
                    state.accepted.lock().unwrap().push(request.clone());
                }
                if let Some(id) = &id {
                    *state
                        .answered_ids
                        .lock()
                        .unwrap()
                        .entry(id.clone())
                        .or_default() += 1;
                }
                state.answered.notify_waiters();
                let mut response = (status, body).into_response();
                for (name, value) in extra {
                    response
                        .headers_mut()
                        .insert(name, value.parse().expect("a header value"));
                }
                return response;
            }
        }
    }
}

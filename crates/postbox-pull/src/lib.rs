//! Consumer groups over HTTP: what `postbox group serve` serves.
//!
//! A consumer group (migration 26) reads the log over SQL with `receive`,
//! `ack` and `nack`. This crate puts the same three calls behind HTTP, for
//! readers that cannot or should not hold a database login:
//!
//! ```text
//! POST /groups/{group}/receive   {"max_events": 100, "visibility_seconds": 30, "wait_seconds": 10}
//!   200 {"events": [{"receipt": "…", "attempts": 1, "event": {CloudEvents JSON}}]}
//! POST /groups/{group}/ack       {"receipts": ["…", …]}
//!   200 {"acknowledged": 2}
//! POST /groups/{group}/nack      {"receipt": "…", "delay_seconds": 10, "error": "why"}
//!   200 {"returned": true}
//! ```
//!
//! Every call carries `Authorization: Bearer pbg_…`, a token made with
//! `postbox group token create GROUP` and stored only as its SHA-256; a
//! token opens its own group and no other (`403`). The token is checked
//! before the body is read. The event is the CloudEvents JSON document the
//! push sinks send, byte for byte.
//!
//! A long poll (`wait_seconds`) holds no database connection while it
//! waits: the server LISTENs on the outbox's channel once, on a connection
//! of its own ([`PullApi::wake_on_notifications`]), and a waiting poll
//! looks again when the log grows, when this server took an ack or a nack
//! that frees events, and every [`PullOptions::poll_every`] (an event whose
//! visibility ended, or a notification lost, comes back that way). Each
//! look first asks, read only, whether the group has anything to hand out
//! (`group_pending`), and only then calls `receive`, which locks the
//! group's row and writes; at most [`PullOptions::max_polls_per_group`]
//! polls of one group wait at once (the others answer at once).
//!
//! **Invariant:** an answer's body carries a fixed phrase or the client's
//! own input, never a database error's text; failures are logged through
//! `postbox::redact::sanitize_error`.

mod auth;
pub mod names;
mod wire;

use auth::{Refusal, TokenCache};
use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use postbox::Schema;
use postbox_store::Groups;
use sqlx::PgPool;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

pub use wire::{AckRequest, NackRequest, ReceiveRequest, MAX_RECEIPTS};

/// The longest long poll the SQL `receive` allows, and so this API.
pub const MAX_WAIT: Duration = Duration::from_secs(20);

/// The largest body of a receive or a nack (an ack may be larger).
const SMALL_BODY: usize = 64 * 1024;

/// A request's body, once its token was checked, must arrive within this.
const BODY_READ: Duration = Duration::from_secs(10);

/// How the API behaves; [`Default`] suits most servers.
#[derive(Clone, Debug)]
pub struct PullOptions {
    /// The CloudEvents `source` of every event handed out (the push sinks'
    /// default is `postbox`).
    pub source: String,
    /// The longest `wait_seconds` granted (at most [`MAX_WAIT`]); keep it
    /// below the server's request timeout.
    pub max_wait: Duration,
    /// How often a long poll looks again when nothing woke it.
    pub poll_every: Duration,
    /// How long a token's group is remembered after a look-up (a revoked
    /// token stops working within this time).
    pub token_cache_for: Duration,
    /// Failed bearer tokens a client address (an IPv6 /64) may send per
    /// minute before it is answered `429` without a look-up; the whole
    /// server takes ten times as many. A token that worked in the last
    /// ten minutes is never held back by either.
    pub failed_tokens_per_minute: u32,
    /// The largest ack body (10,000 receipts are about 500 kB); a receive
    /// or a nack takes 64 kB at most.
    pub max_body_bytes: usize,
    /// Long polls of one group that may wait at once; more answer at once
    /// with what there is.
    pub max_polls_per_group: usize,
}

impl Default for PullOptions {
    fn default() -> Self {
        Self {
            source: postbox_sink::cloudevents::DEFAULT_SOURCE.to_owned(),
            max_wait: MAX_WAIT,
            poll_every: Duration::from_millis(500),
            token_cache_for: Duration::from_secs(5),
            failed_tokens_per_minute: 30,
            max_body_bytes: 1 << 20,
            max_polls_per_group: 100,
        }
    }
}

/// The consumer groups' HTTP API over one schema.
#[derive(Clone)]
pub struct PullApi {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    groups: Groups,
    schema: Schema,
    options: PullOptions,
    tokens: TokenCache,
    /// Long polls wait on this; notifications, acks and nacks wake them.
    wake: Notify,
    /// Long polls waiting, per group.
    waiting: Mutex<HashMap<String, usize>>,
    /// Ends every long poll at once (the server is shutting down).
    stop: CancellationToken,
}

impl PullApi {
    /// The API over `schema`'s groups, through `pool` (a login with the
    /// `<schema>_consumer` role is enough). `stop` ends long polls early.
    pub fn new(
        pool: PgPool,
        schema: &Schema,
        options: PullOptions,
        stop: CancellationToken,
    ) -> Self {
        let options = PullOptions {
            max_wait: options.max_wait.min(MAX_WAIT),
            poll_every: options.poll_every.max(Duration::from_millis(10)),
            ..options
        };
        let tokens = TokenCache::new(options.token_cache_for, options.failed_tokens_per_minute);
        Self {
            inner: Arc::new(Inner {
                groups: Groups::new(pool.clone(), schema),
                pool,
                schema: schema.clone(),
                options,
                tokens,
                wake: Notify::new(),
                waiting: Mutex::new(HashMap::new()),
                stop,
            }),
        }
    }

    /// The routes: `POST /groups/{group}/{receive,ack,nack}` and
    /// `GET /healthz`. Serve it with `postbox::serve::serve`, which gives
    /// every request its peer's address (the failed-token bound is per
    /// address).
    pub fn router(&self) -> Router {
        Router::new()
            .route("/groups/{group}/receive", post(receive))
            .route("/groups/{group}/ack", post(ack))
            .route("/groups/{group}/nack", post(nack))
            .route("/healthz", get(|| async { "ok\n" }))
            .with_state(self.clone())
    }

    /// LISTEN on the outbox's channel, on a connection of its own (not one
    /// of the calls' pool), and wake the long polls whenever something is
    /// written, until `stop`; reconnects after a failure (the polls' own
    /// timer covers the gap).
    pub async fn wake_on_notifications(self, stop: CancellationToken) {
        let channel = self.inner.schema.notify_channel();
        let options = (*self.inner.pool.connect_options()).clone();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_lazy_with(options);
        let mut failures = 0_u32;
        while !stop.is_cancelled() {
            let listened = async {
                let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await?;
                listener.listen(&channel).await?;
                failures = 0;
                // Whatever was written while nobody listened.
                self.inner.wake.notify_waiters();
                loop {
                    listener.recv().await?;
                    self.inner.wake.notify_waiters();
                }
                #[allow(unreachable_code)]
                Ok::<(), sqlx::Error>(())
            };
            let outcome = tokio::select! {
                () = stop.cancelled() => break,
                outcome = listened => outcome,
            };
            if let Err(e) = outcome {
                failures = failures.saturating_add(1);
                if failures == 1 || failures.is_power_of_two() {
                    tracing::warn!(
                        error = %postbox::redact::sanitize_error(&e.to_string()),
                        failures,
                        "LISTEN for new events failed; long polls look again every {:?} until it is back",
                        self.inner.options.poll_every
                    );
                }
            }
            let pause = Duration::from_millis(250 * u64::from(failures.min(20)));
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(pause) => {}
            }
        }
        pool.close().await;
    }

    /// Check the bearer token of a request for `group` (a refusal is
    /// counted), then read its body (at most `limit` bytes, within
    /// [`BODY_READ`]).
    async fn admit(
        &self,
        call: &'static str,
        peer: SocketAddr,
        headers: &HeaderMap,
        group: &str,
        body: Body,
        limit: usize,
    ) -> Result<Bytes, Response> {
        let admitted = self
            .inner
            .tokens
            .admit(&self.inner.groups, peer.ip(), headers, group)
            .await;
        let admitted = match admitted {
            Ok(a) => a,
            Err(refusal) => {
                metrics::counter!(names::REFUSED, "reason" => refusal.reason()).increment(1);
                return Err(refusal.into_response());
            }
        };
        tracing::debug!(
            call,
            group,
            token_id = admitted.token_id,
            "consumer group call"
        );
        match tokio::time::timeout(BODY_READ, axum::body::to_bytes(body, limit)).await {
            Ok(Ok(bytes)) => Ok(bytes),
            Ok(Err(_)) => {
                count(call, group, "bad_request");
                Err(error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "the body is larger than this call takes",
                ))
            }
            Err(_) => {
                count(call, group, "bad_request");
                Err(error(
                    StatusCode::REQUEST_TIMEOUT,
                    "the body did not arrive in time",
                ))
            }
        }
    }

    /// Count a waiting long poll of `group`, if it may wait.
    fn start_waiting(&self, group: &str) -> Option<Waiting<'_>> {
        let mut waiting = self.inner.waiting.lock().unwrap_or_else(|p| p.into_inner());
        let n = waiting.entry(group.to_owned()).or_default();
        if *n >= self.inner.options.max_polls_per_group {
            return None;
        }
        *n += 1;
        Some(Waiting {
            api: self,
            group: group.to_owned(),
        })
    }
}

/// A long poll waiting (counted in `Inner::waiting` until dropped).
struct Waiting<'a> {
    api: &'a PullApi,
    group: String,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut waiting = self
            .api
            .inner
            .waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(n) = waiting.get_mut(&self.group) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                waiting.remove(&self.group);
            }
        }
    }
}

/// A JSON answer with a fixed or client-made phrase.
fn error(status: StatusCode, phrase: &str) -> Response {
    let body = serde_json::json!({ "error": phrase });
    (status, axum::Json(body)).into_response()
}

/// A `503` that asks to come back in a second.
fn unavailable(phrase: &str) -> Response {
    let mut response = error(StatusCode::SERVICE_UNAVAILABLE, phrase);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
    response
}

/// What a failed database call is answered, and the metric outcome.
fn failed(call: &'static str, group: &str, e: &sqlx::Error) -> Response {
    let code = e
        .as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
        .unwrap_or_default();
    let away = matches!(
        e,
        sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::PoolClosed
    ) || code.starts_with("08")
        || matches!(code.as_str(), "57P01" | "57P02" | "57P03" | "53300");
    let (outcome, response) = if code == "42704" {
        (
            "not_found",
            error(StatusCode::NOT_FOUND, "no such consumer group"),
        )
    } else if code.starts_with("22") {
        // The client's input, refused by the database (a receipt that is
        // not one, a character it does not store).
        (
            "bad_request",
            error(
                StatusCode::BAD_REQUEST,
                "an argument is out of range or a receipt is not one receive returned",
            ),
        )
    } else if away {
        (
            "unavailable",
            unavailable("the database is not reachable; try again"),
        )
    } else {
        (
            "error",
            error(StatusCode::INTERNAL_SERVER_ERROR, "internal error"),
        )
    };
    if outcome == "error" || outcome == "unavailable" {
        tracing::warn!(
            call,
            group,
            error = %postbox::redact::sanitize_error(&e.to_string()),
            "a consumer group call failed"
        );
    }
    count(call, group, outcome);
    response
}

fn count(call: &'static str, group: &str, outcome: &'static str) {
    metrics::counter!(names::REQUESTS, "group" => group.to_owned(), "call" => call, "outcome" => outcome)
        .increment(1);
}

/// Parse a request body (an empty one is the type's default), or the
/// phrase of its `400`.
fn parse<T: serde::de::DeserializeOwned + Default>(
    call: &'static str,
    body: &Bytes,
) -> Result<T, String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| {
        postbox::redact::sanitize_error(&format!("the body is not a {call} request: {e}"))
    })
}

/// The `400` of a request that is not one, counted.
fn bad(call: &'static str, group: &str, phrase: &str) -> Response {
    count(call, group, "bad_request");
    error(StatusCode::BAD_REQUEST, phrase)
}

async fn receive(
    State(api): State<PullApi>,
    Path(group): Path<String>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let body = match api
        .admit("receive", peer, &headers, &group, body, SMALL_BODY)
        .await
    {
        Ok(body) => body,
        Err(refused) => return refused,
    };
    let request: ReceiveRequest = match parse("receive", &body) {
        Ok(r) => r,
        Err(phrase) => return bad("receive", &group, &phrase),
    };
    let inner = &api.inner;
    let ask = match request.check(inner.options.max_wait) {
        Ok(ask) => ask,
        Err(phrase) => return bad("receive", &group, &phrase),
    };
    let take = || {
        inner
            .groups
            .receive(&group, ask.max_events, ask.visibility, Duration::ZERO)
    };
    let mut events = match take().await {
        Ok(events) => events,
        Err(e) => return failed("receive", &group, &e),
    };
    if events.is_empty() && !ask.wait.is_zero() {
        if let Some(_waiting) = api.start_waiting(&group) {
            let deadline = tokio::time::Instant::now() + ask.wait;
            loop {
                // Registered before the look, so a wake-up during it is
                // not missed.
                let woken = inner.wake.notified();
                tokio::pin!(woken);
                woken.as_mut().enable();
                let now = tokio::time::Instant::now();
                if now >= deadline || inner.stop.is_cancelled() {
                    break;
                }
                let next_look = (now + inner.options.poll_every).min(deadline);
                tokio::select! {
                    () = woken => {}
                    () = tokio::time::sleep_until(next_look) => {}
                    () = inner.stop.cancelled() => break,
                }
                match inner.groups.pending(&group).await {
                    Ok(false) => continue,
                    Ok(true) => {}
                    Err(e) => return failed("receive", &group, &e),
                }
                events = match take().await {
                    Ok(events) => events,
                    Err(e) => return failed("receive", &group, &e),
                };
                if !events.is_empty() {
                    break;
                }
            }
        }
    }
    count("receive", &group, "ok");
    metrics::counter!(names::EVENTS_RECEIVED, "group" => group.clone())
        .increment(events.len() as u64);
    wire::received_body(&events, &inner.options.source)
}

async fn ack(
    State(api): State<PullApi>,
    Path(group): Path<String>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let limit = api.inner.options.max_body_bytes;
    let body = match api.admit("ack", peer, &headers, &group, body, limit).await {
        Ok(body) => body,
        Err(refused) => return refused,
    };
    let request: AckRequest = match parse("ack", &body) {
        Ok(r) => r,
        Err(phrase) => return bad("ack", &group, &phrase),
    };
    if let Err(phrase) = request.check() {
        return bad("ack", &group, &phrase);
    }
    match api.inner.groups.ack(&group, &request.receipts).await {
        Ok(n) => {
            count("ack", &group, "ok");
            metrics::counter!(names::EVENTS_ACKNOWLEDGED, "group" => group.clone())
                .increment(u64::try_from(n).unwrap_or(0));
            if n > 0 {
                // An ordered group's next events may be free now.
                api.inner.wake.notify_waiters();
            }
            axum::Json(serde_json::json!({ "acknowledged": n })).into_response()
        }
        Err(e) => failed("ack", &group, &e),
    }
}

async fn nack(
    State(api): State<PullApi>,
    Path(group): Path<String>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let body = match api
        .admit("nack", peer, &headers, &group, body, SMALL_BODY)
        .await
    {
        Ok(body) => body,
        Err(refused) => return refused,
    };
    let request: NackRequest = match parse("nack", &body) {
        Ok(r) => r,
        Err(phrase) => return bad("nack", &group, &phrase),
    };
    let (delay, reason) = match request.check() {
        Ok(checked) => checked,
        Err(phrase) => return bad("nack", &group, &phrase),
    };
    match api
        .inner
        .groups
        .nack(&group, &request.receipt, delay, reason.as_deref())
        .await
    {
        Ok(returned) => {
            count("nack", &group, "ok");
            if returned {
                metrics::counter!(names::EVENTS_NACKED, "group" => group.clone()).increment(1);
                if delay.is_zero() {
                    api.inner.wake.notify_waiters();
                }
            }
            axum::Json(serde_json::json!({ "returned": returned })).into_response()
        }
        Err(e) => failed("nack", &group, &e),
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        if let Refusal::Unavailable = self {
            return unavailable(self.phrase());
        }
        let mut response = error(self.status(), self.phrase());
        match self {
            Refusal::NoToken | Refusal::UnknownToken => {
                response.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    header::HeaderValue::from_static("Bearer realm=\"postbox\""),
                );
            }
            Refusal::TooMany(wait) => {
                let secs = wait.as_secs().max(1).to_string();
                if let Ok(v) = header::HeaderValue::from_str(&secs) {
                    response.headers_mut().insert(header::RETRY_AFTER, v);
                }
            }
            Refusal::WrongGroup | Refusal::Unavailable => {}
        }
        response
    }
}

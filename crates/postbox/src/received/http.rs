//! The HTTP receiver (features `axum` and `sqlx`): verifies each delivery's
//! signature and stores it once per consumer in `{schema}.received`, for the
//! application to process later ([`take`](super::take)). `postbox receive`
//! serves exactly this router; an application can nest it in its own.
//!
//! ```no_run
//! # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use postbox::axum::SignatureVerifier;
//! use postbox::received::http::Receiver;
//! use postbox::verify::webhooks;
//!
//! let receiver = Receiver::new(pool, postbox::Outbox::default(), "billing")?
//!     .verify_with(SignatureVerifier::from(webhooks::Verifier::from_env()?));
//! let app = axum::Router::new().nest("/hooks", receiver.router());
//! let listener = tokio::net::TcpListener::bind("0.0.0.0:8080").await?;
//! postbox::serve::serve(listener, app, Default::default(), std::future::pending()).await?;
//! # Ok(()) }
//! ```
//!
//! Answers: 200 once the delivery is committed (also for a duplicate, which
//! adds no row); 401 for a missing or bad signature; 400 when the delivery has
//! no usable event id, or is ambiguous (a CloudEvents JSON body naming a
//! top-level key twice); 413 when the body exceeds the limit; 503 when the
//! database cannot be reached in time (so the sender retries); 500 for other
//! database failures. Error answers carry no detail beyond a fixed phrase.
//!
//! Refused deliveries are counted in [`RECEIVE_REJECTED`]`{reason}` and logged
//! at WARN at most once per reason every [`REJECTION_LOG_INTERVAL`] (with how
//! many were refused meanwhile), so a flood of forged requests cannot flood
//! the log.

use super::{NewDelivery, INBOX_DUPLICATES, RECEIVE_REJECTED};
use crate::axum::{Rejection, SignatureVerifier, Verified};
use crate::redact::error_chain;
use crate::{Error, InboxOutcome, Outbox};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, FromRef, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use sqlx::PgPool;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::Instrument;

/// Default body limit: 1 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1024 * 1024;
/// At most one WARN line per rejection reason in this interval.
pub const REJECTION_LOG_INTERVAL: Duration = Duration::from_secs(10);
/// Request headers never stored: they may carry credentials.
const NOT_STORED: [&str; 3] = ["authorization", "proxy-authorization", "cookie"];

/// The receiver's configuration; [`Receiver::router`] makes the service.
#[derive(Clone, Debug)]
pub struct Receiver {
    deliveries: Deliveries,
    verifier: Option<SignatureVerifier>,
    max_body_bytes: usize,
}

impl Receiver {
    /// Deliveries stored through `pool` under `consumer` (deduplication is per
    /// consumer) in `outbox`'s `received` table, accepted unsigned until
    /// [`verify_with`](Self::verify_with) says how to check them. Fails when
    /// the consumer name is not valid.
    pub fn new(pool: PgPool, outbox: Outbox, consumer: &str) -> Result<Self, Error> {
        super::check_consumer_name(consumer)?;
        Ok(Self {
            deliveries: Deliveries {
                pool,
                outbox,
                consumer: Arc::from(consumer),
                headers_signed: true,
                rejections: Arc::new(Rejections::new(REJECTION_LOG_INTERVAL)),
            },
            verifier: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        })
    }

    /// Require the signature `verifier` checks (401 without it). Without a
    /// verifier every delivery is accepted: only behind a trusted boundary.
    pub fn verify_with(mut self, verifier: SignatureVerifier) -> Self {
        self.deliveries.headers_signed = verifier.signs_headers();
        self.verifier = Some(verifier);
        self
    }

    /// Largest accepted body in bytes (at least 1); larger ones get 413.
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes.max(1);
        self
    }

    /// The routes: `GET /healthz`, and `POST` on any other path as a delivery.
    pub fn router(self) -> Router {
        let deliveries = match self.verifier {
            Some(verifier) => Router::new()
                .route("/", post(verified))
                .route("/{*path}", post(verified))
                .with_state(Checked {
                    store: self.deliveries,
                    verifier,
                }),
            None => Router::new()
                .route("/", post(unverified))
                .route("/{*path}", post(unverified))
                .with_state(self.deliveries),
        };
        deliveries
            .route("/healthz", get(|| async { "ok" }))
            .layer(DefaultBodyLimit::max(self.max_body_bytes))
    }
}

/// Where deliveries go: one consumer's rows in `{schema}.received`.
#[derive(Clone)]
struct Deliveries {
    pool: PgPool,
    outbox: Outbox,
    consumer: Arc<str>,
    /// Whether the signature covers the id headers (not so for QStash).
    headers_signed: bool,
    rejections: Arc<Rejections>,
}

impl std::fmt::Debug for Deliveries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deliveries")
            .field("outbox", &self.outbox)
            .field("consumer", &self.consumer)
            .field("headers_signed", &self.headers_signed)
            .finish_non_exhaustive()
    }
}

/// Counts refused deliveries and logs them at WARN at most once per reason
/// per interval, with how many of that reason were refused since.
struct Rejections {
    interval: Duration,
    /// Per reason: when its last WARN was written, and the refusals since.
    windows: Mutex<HashMap<&'static str, (Instant, u64)>>,
}

impl Rejections {
    fn new(interval: Duration) -> Self {
        Self {
            interval,
            windows: Mutex::default(),
        }
    }

    /// Count a refusal and log it (WARN when due, else DEBUG).
    fn record(&self, reason: &'static str, detail: &str) {
        metrics::counter!(RECEIVE_REJECTED, "reason" => reason).increment(1);
        match self.due(reason, Instant::now()) {
            Some(suppressed) => tracing::warn!(
                reason,
                detail,
                suppressed,
                "refused a delivery (suppressed: refusals for this reason since the last such line)"
            ),
            None => tracing::debug!(reason, detail, "refused a delivery"),
        }
    }

    /// `Some(refusals not logged since the last WARN)` when a WARN is due for `reason`.
    fn due(&self, reason: &'static str, now: Instant) -> Option<u64> {
        let mut windows = self
            .windows
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match windows.get_mut(reason) {
            None => {
                windows.insert(reason, (now, 0));
                Some(0)
            }
            Some((since, suppressed)) if now.duration_since(*since) >= self.interval => {
                let n = *suppressed;
                *since = now;
                *suppressed = 0;
                Some(n)
            }
            Some((_, suppressed)) => {
                *suppressed += 1;
                None
            }
        }
    }
}

/// Why a delivery was refused with a 400: a metric label and the fixed answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Refusal {
    reason: &'static str,
    text: &'static str,
}

impl Refusal {
    const fn new(reason: &'static str, text: &'static str) -> Self {
        Self { reason, text }
    }
}

/// State of the verifying routes.
#[derive(Clone)]
struct Checked {
    store: Deliveries,
    verifier: SignatureVerifier,
}

impl FromRef<Checked> for SignatureVerifier {
    fn from_ref(state: &Checked) -> Self {
        state.verifier.clone()
    }
}

async fn verified(State(state): State<Checked>, delivery: Result<Verified, Rejection>) -> Response {
    match delivery {
        Ok(Verified { headers, body }) => state.store.accept(&headers, body).await,
        Err(rejection) => {
            let reason = match rejection.status() {
                StatusCode::UNAUTHORIZED => "signature",
                StatusCode::PAYLOAD_TOO_LARGE => "too_large",
                _ => "malformed",
            };
            state
                .store
                .rejections
                .record(reason, &error_chain(&rejection));
            rejection.into_response()
        }
    }
}

async fn unverified(
    State(store): State<Deliveries>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body {
        Ok(body) => store.accept(&headers, body).await,
        Err(rejection) => {
            let reason = match rejection.status() {
                StatusCode::PAYLOAD_TOO_LARGE => "too_large",
                _ => "malformed",
            };
            store.rejections.record(reason, &rejection.body_text());
            rejection.status().into_response()
        }
    }
}

/// A response with a fixed text: never anything taken from an error.
fn answer(status: StatusCode, text: &'static str) -> Response {
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        )],
        text,
    )
        .into_response()
}

impl Deliveries {
    /// Stores a verified delivery once and answers only after the commit.
    async fn accept(&self, headers: &HeaderMap, body: Bytes) -> Response {
        let event_id = match event_id(headers, &body, self.headers_signed) {
            Ok(id) => id,
            Err(refusal) => {
                self.rejections.record(refusal.reason, refusal.text);
                return answer(StatusCode::BAD_REQUEST, refusal.text);
            }
        };
        let delivery = match NewDelivery::new(&*self.consumer, event_id, body.to_vec())
            .and_then(|d| d.headers(kept_headers(headers)))
        {
            Ok(d) => d,
            Err(e) => {
                self.rejections.record("malformed", &e.to_string());
                return answer(StatusCode::BAD_REQUEST, "malformed delivery");
            }
        };
        // The consumer's `receive` span, a child of the context the delivery
        // carries (exported when OpenTelemetry export is on).
        let stored = match uuid::Uuid::parse_str(delivery.event_id()) {
            Ok(id) => {
                let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
                let span = crate::otel::receive_span(
                    &self.consumer,
                    id,
                    text("traceparent"),
                    text("tracestate"),
                );
                self.store(&delivery).instrument(span).await
            }
            Err(_) => self.store(&delivery).await,
        };
        match stored {
            Ok(InboxOutcome::New) => {
                tracing::debug!(event_id = delivery.event_id(), "stored a delivery");
                answer(StatusCode::OK, "stored")
            }
            Ok(InboxOutcome::Duplicate) => {
                tracing::debug!(event_id = delivery.event_id(), "duplicate delivery");
                metrics::counter!(INBOX_DUPLICATES, "consumer" => self.consumer.to_string())
                    .increment(1);
                answer(StatusCode::OK, "duplicate")
            }
            Err(e) if unavailable(&e) => {
                tracing::warn!(error = %error_chain(&e), "database unavailable; answered 503");
                let mut response = answer(StatusCode::SERVICE_UNAVAILABLE, "unavailable");
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
                response
            }
            Err(e) => {
                tracing::error!(error = %error_chain(&e), "cannot store a delivery; answered 500");
                answer(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
            }
        }
    }

    async fn store(&self, delivery: &NewDelivery) -> Result<InboxOutcome, Error> {
        let mut conn = self.pool.acquire().await?;
        // One autocommitted statement: durable once it returns.
        super::store(&self.outbox, &mut conn, delivery).await
    }
}

/// The delivery's event id: the `webhook-id` header, else `ce-id`, else the `id` of a
/// structured CloudEvents JSON body (an object with `specversion`; a plain JSON `id`
/// is application data, not an event id).
///
/// With `headers_signed` false (QStash signs the body, not the headers), an id header
/// must agree with the body's CloudEvents id when there is one: otherwise whoever
/// replays a captured request could change the header and have the same delivery
/// stored twice. A CloudEvents body naming a top-level key twice is refused
/// whatever the headers: which `id` counts would depend on the parser.
fn event_id(headers: &HeaderMap, body: &[u8], headers_signed: bool) -> Result<String, Refusal> {
    if ambiguous_cloudevent(body) {
        return Err(Refusal::new(
            "ambiguous",
            "ambiguous CloudEvents body: a top-level key appears more than once",
        ));
    }
    for name in ["webhook-id", "ce-id"] {
        let Some(value) = headers.get(name) else {
            continue;
        };
        let id = match value.to_str().map(str::trim) {
            Ok(id) if !id.is_empty() => id,
            _ => return Err(Refusal::new("no_event_id", "malformed event id header")),
        };
        if !headers_signed {
            if let Some(signed) = cloudevent_id(body) {
                if signed != id {
                    return Err(Refusal::new(
                        "id_mismatch",
                        "the event id header contradicts the CloudEvents id of the body",
                    ));
                }
            }
        }
        return Ok(id.to_owned());
    }
    cloudevent_id(body).ok_or(Refusal::new(
        "no_event_id",
        "no event id: send a webhook-id or ce-id header, or a CloudEvents JSON body",
    ))
}

/// Whether `body` is a JSON object with a `specversion` member (a structured
/// CloudEvent) that names some top-level key more than once.
fn ambiguous_cloudevent(body: &[u8]) -> bool {
    use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
    struct TopLevelKeys;
    impl<'de> Visitor<'de> for TopLevelKeys {
        /// (a key repeats, `specversion` is one of them)
        type Value = (bool, bool);
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut seen = std::collections::HashSet::new();
            let mut repeated = false;
            while let Some(key) = map.next_key::<String>()? {
                map.next_value::<IgnoredAny>()?;
                repeated |= !seen.insert(key);
            }
            Ok((repeated, seen.contains("specversion")))
        }
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    matches!(de.deserialize_map(TopLevelKeys), Ok((true, true)))
}

/// The `id` of a structured CloudEvents JSON body.
fn cloudevent_id(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct CloudEvent {
        specversion: Option<serde_json::Value>,
        id: Option<serde_json::Value>,
    }
    match serde_json::from_slice::<CloudEvent>(body) {
        Ok(CloudEvent {
            specversion: Some(serde_json::Value::String(_)),
            id: Some(serde_json::Value::String(id)),
        }) if !id.trim().is_empty() => Some(id),
        _ => None,
    }
}

/// The headers stored with a delivery: all but those that may carry credentials.
fn kept_headers(headers: &HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(name, _)| !NOT_STORED.contains(&name.as_str()))
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                String::from_utf8_lossy(value.as_bytes()).into_owned(),
            )
        })
        .collect()
}

/// Whether a storage error means "the database is not there right now" (503, the
/// sender retries) rather than a fault to fix (500).
fn unavailable(e: &Error) -> bool {
    let Error::Sqlx(e) = e else {
        return false;
    };
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        // Connection exceptions, insufficient resources, operator intervention
        // (shutdown, restart), read-only standby.
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            ["08", "53", "57"]
                .iter()
                .any(|class| code.starts_with(class))
                || code == "25006"
        }),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn event_id_comes_from_webhook_id_then_ce_id_then_cloudevents_body() {
        let ce = br#"{"specversion":"1.0","id":"ce-body","type":"t","source":"s"}"#;
        assert_eq!(
            event_id(&headers(&[("webhook-id", "w"), ("ce-id", "c")]), ce, true),
            Ok("w".to_owned())
        );
        assert_eq!(
            event_id(&headers(&[("ce-id", "c")]), ce, true),
            Ok("c".to_owned())
        );
        assert_eq!(
            event_id(&HeaderMap::new(), ce, true),
            Ok("ce-body".to_owned())
        );
    }

    #[test]
    fn unsigned_id_headers_must_agree_with_the_signed_body() {
        let ce = br#"{"specversion":"1.0","id":"ce-body","type":"t","source":"s"}"#;
        assert!(event_id(&headers(&[("ce-id", "forged")]), ce, false).is_err());
        assert!(event_id(&headers(&[("webhook-id", "forged")]), ce, false).is_err());
        assert_eq!(
            event_id(&headers(&[("ce-id", "ce-body")]), ce, false),
            Ok("ce-body".to_owned())
        );
        // Without a CloudEvents id in the body, the header is all there is.
        assert_eq!(
            event_id(&headers(&[("ce-id", "h")]), b"{}", false),
            Ok("h".to_owned())
        );
    }

    #[test]
    fn no_usable_event_id_is_an_error() {
        for body in [
            &br#"{"id":"not-a-cloudevent"}"#[..],
            br#"{"specversion":"1.0"}"#,
            br#"{"specversion":"1.0","id":""}"#,
            br#"{"specversion":"1.0","id":42}"#,
            br#"[{"specversion":"1.0","id":"batch"}]"#,
            b"not json",
            b"",
        ] {
            assert!(event_id(&HeaderMap::new(), body, true).is_err(), "{body:?}");
        }
        assert!(event_id(&headers(&[("webhook-id", " ")]), b"", true).is_err());
    }

    #[test]
    fn a_cloudevents_body_with_a_repeated_key_is_refused() {
        let twice = br#"{"specversion":"1.0","id":"a","type":"t","id":"b"}"#;
        for signed in [true, false] {
            for h in [
                headers(&[("ce-id", "a")]),
                headers(&[("ce-id", "b")]),
                HeaderMap::new(),
            ] {
                assert_eq!(
                    event_id(&h, twice, signed).map_err(|r| r.reason),
                    Err("ambiguous")
                );
            }
        }
        let spec_twice = br#"{"specversion":"1.0","specversion":"1.0","id":"a"}"#;
        assert!(ambiguous_cloudevent(spec_twice));
        // Application JSON (no specversion) and nested repeats are not CloudEvents keys.
        assert!(!ambiguous_cloudevent(br#"{"a":1,"a":2}"#));
        assert!(!ambiguous_cloudevent(
            br#"{"specversion":"1.0","id":"a","data":{"x":1,"x":2}}"#
        ));
        assert!(!ambiguous_cloudevent(b"not json"));
    }

    #[test]
    fn rejections_are_logged_once_per_reason_per_interval() {
        let log = Rejections::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(log.due("signature", t0), Some(0));
        for i in 1..=5 {
            assert_eq!(log.due("signature", t0 + Duration::from_secs(i)), None);
        }
        // Another reason has its own window.
        assert_eq!(log.due("too_large", t0), Some(0));
        assert_eq!(log.due("signature", t0 + Duration::from_secs(10)), Some(5));
        assert_eq!(log.due("signature", t0 + Duration::from_secs(11)), None);
    }

    #[test]
    fn credentials_are_not_stored() {
        let kept = kept_headers(&headers(&[
            ("authorization", "Bearer x"),
            ("cookie", "a=b"),
            ("content-type", "application/json"),
        ]));
        assert_eq!(
            kept,
            vec![("content-type".to_owned(), "application/json".to_owned())]
        );
    }
}

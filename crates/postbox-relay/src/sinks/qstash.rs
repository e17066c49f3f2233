//! Upstash QStash: every event is handed to QStash, which stores it and
//! delivers it to one destination URL (with its own retries and signature).
//! Delivered means QStash accepted the message (a 2xx answer), not that the
//! destination received it yet.
//!
//! URL: `qstash:DESTINATION_URL`, e.g. `qstash:https://api.example.com/hooks/orders`.
//!
//! Environment, read when the sink is built:
//!
//! - `QSTASH_TOKEN` (required): the QStash token, sent as `Authorization:
//!   Bearer …`, never logged or put into an error.
//! - `QSTASH_URL` (optional, default `https://qstash.upstash.io`): the QStash
//!   API (a regional endpoint, or a local QStash-compatible server).
//!
//! Requests: a single event is `POST {QSTASH_URL}/v2/publish/{destination}`;
//! several are `POST {QSTASH_URL}/v2/batch` (a JSON array of `{destination,
//! headers, body}`, at most 100 entries per request, one request after the
//! other so QStash receives the events of an aggregate in input order; a
//! request that cannot start within half of `request_timeout` after the batch
//! began is not sent and answered `Deferred` (no attempt counted), so a publish call returns within
//! about 1.5 × `request_timeout`), whose
//! answer is an array with one entry per message in order. (QStash itself
//! delivers in parallel and retries independently: a destination that needs
//! order must use the `sequence` attribute, or flow control with
//! `parallelism = 1`, which still reorders around retries.) A destination
//! with a query string always goes through `/v2/batch`, where it is a JSON
//! string rather than part of a path.
//!
//! Each message: the body is the CloudEvents JSON document (`Content-Type:
//! application/cloudevents+json`); `Upstash-Deduplication-Id` is the event id,
//! so QStash accepts a retried publish without enqueueing it twice (answering
//! `202`); the producer's headers are forwarded as `Upstash-Forward-<name>`
//! (QStash strips the prefix when it delivers) where they are valid HTTP
//! headers, except `Content-Type`, hop-by-hop, `upstash-*`, `webhook-*` and
//! `ce-*` names; [`QstashOptions`] add `Upstash-Retries`, `Upstash-Delay`,
//! `Upstash-Callback`, `Upstash-Failure-Callback`, `Upstash-Timeout`,
//! `Upstash-Flow-Control-Key`/`-Value` and static `Upstash-Forward-*` headers.
//!
//! Outcomes:
//!
//! | answer | outcome |
//! |---|---|
//! | 2xx (201 new, 202 duplicate, …) | delivered |
//! | a batch entry with an `error` field | retry, for that entry only |
//! | 429 | retry after `Burst-RateLimit-Reset`, else `RateLimit-Reset`, else `Retry-After` |
//! | 401, 403 | reject: the token in `QSTASH_TOKEN` was refused |
//! | 408, 425, 5xx, timeouts, connection errors | retry |
//! | 3xx | retry (redirects are not followed) |
//! | other 4xx | reject, with the start of the answer; for a batch, each message is first published on its own so only the offending one is rejected |
//!
//! The rate-limit reset headers are documented by QStash as unix timestamps.
//! They are read as: a number of 10^12 or more is a unix time in
//! milliseconds, of 10^9 or more a unix time in seconds, anything smaller a
//! number of seconds from now; the delay is capped at one day (and by the
//! relay at `relay.backoff_max`).

use super::http::{
    classify, client, display_url, is_transient, parse_http_url, read_prefix, retry_after,
    status_text, transport_error, until, MAX_RETRY_AFTER,
};
use super::SinkOptions;
use crate::cloudevents;
use crate::redact::sanitize_error;
use crate::sink::{Message, Outcome, Sink, SinkError};
use async_trait::async_trait;
use chrono::{DateTime, Utc};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use reqwest::StatusCode;
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// The environment variable holding the QStash token.
pub const TOKEN_ENV: &str = "QSTASH_TOKEN";
/// The environment variable holding the QStash API URL.
pub const URL_ENV: &str = "QSTASH_URL";
/// The QStash API used when `QSTASH_URL` is not set.
pub const DEFAULT_URL: &str = "https://qstash.upstash.io";

/// Most messages in one `/v2/batch` request.
pub const MAX_BATCH_ENTRIES: usize = 100;
/// Idle connections kept to QStash.
const IDLE_CONNECTIONS: usize = 4;
const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_RETRIES: u32 = 100;
/// Bytes of a batch answer read (100 entries of a few dozen bytes each).
const MAX_BATCH_ANSWER: usize = 1024 * 1024;

/// QStash flow control: limits QStash applies to its deliveries of every
/// message carrying the same key.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct FlowControl {
    /// The flow-control key (`Upstash-Flow-Control-Key`); messages with the
    /// same key share the limits.
    pub key: String,
    /// Most deliveries of this key in flight at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallelism: Option<u32>,
    /// Most deliveries of this key started per `period`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<u32>,
    /// The window of `rate` (QStash's default is one second), in whole seconds.
    #[serde(
        default,
        with = "humantime_serde::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub period: Option<Duration>,
}

/// Settings of the QStash sink (`[sink.qstash]`).
#[derive(Clone, Debug, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct QstashOptions {
    /// How often QStash retries a delivery the destination did not accept
    /// (`Upstash-Retries`); QStash's default when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retries: Option<u32>,
    /// Delay before QStash delivers each message (`Upstash-Delay`), in whole seconds.
    #[serde(
        with = "humantime_serde::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub delay: Option<Duration>,
    /// A URL QStash calls with the destination's answer (`Upstash-Callback`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub callback: Option<String>,
    /// A URL QStash calls when a delivery has failed for good (`Upstash-Failure-Callback`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure_callback: Option<String>,
    /// Static headers QStash adds to every delivery (sent as `Upstash-Forward-<name>`).
    /// Values are never logged. They override producer headers of the same name.
    pub forward_headers: BTreeMap<String, String>,
    /// Rate and parallelism limits QStash applies to the deliveries.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flow_control: Option<FlowControl>,
    /// How long QStash waits for the destination to answer one delivery
    /// (`Upstash-Timeout`), in whole seconds; QStash's default when absent.
    #[serde(
        with = "humantime_serde::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub timeout: Option<Duration>,
    /// How long the relay waits for QStash's own answer to a publish (default `10s`).
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
}

impl Default for QstashOptions {
    fn default() -> Self {
        Self {
            retries: None,
            delay: None,
            callback: None,
            failure_callback: None,
            forward_headers: BTreeMap::new(),
            flow_control: None,
            timeout: None,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }
}

fn field_error(field: &str, why: impl fmt::Display) -> SinkError {
    SinkError::Config(format!("qstash.{field}: {why}"))
}

/// Whole seconds, rounded up (`"90s"`), as QStash's duration headers take them.
fn seconds(d: Duration) -> String {
    let mut s = d.as_secs();
    if d.subsec_nanos() > 0 {
        s += 1;
    }
    format!("{s}s")
}

fn printable(value: &str) -> bool {
    value
        .bytes()
        .all(|b| b == b'\t' || (0x20..0x7f).contains(&b))
}

impl QstashOptions {
    /// Check every field; the error names the field (`qstash.retries: …`).
    pub fn validate(&self) -> Result<(), SinkError> {
        self.headers().map(|_| ())
    }

    /// The `Upstash-*` headers these options add to every message, validated.
    fn headers(&self) -> Result<Vec<(String, String)>, SinkError> {
        let mut out = Vec::new();
        if let Some(retries) = self.retries {
            if retries > MAX_RETRIES {
                return Err(field_error(
                    "retries",
                    format!("must be at most {MAX_RETRIES}, got {retries}"),
                ));
            }
            out.push(("Upstash-Retries".to_owned(), retries.to_string()));
        }
        if let Some(delay) = self.delay {
            if !delay.is_zero() {
                out.push(("Upstash-Delay".to_owned(), seconds(delay)));
            }
        }
        for (field, header, value) in [
            ("callback", "Upstash-Callback", &self.callback),
            (
                "failure_callback",
                "Upstash-Failure-Callback",
                &self.failure_callback,
            ),
        ] {
            if let Some(url) = value {
                parse_http_url(url, &format!("qstash.{field}"))?;
                if !printable(url) {
                    return Err(field_error(field, "must be printable ASCII"));
                }
                out.push((header.to_owned(), url.clone()));
            }
        }
        if let Some(timeout) = self.timeout {
            if timeout < Duration::from_secs(1) {
                return Err(field_error("timeout", "must be at least 1s"));
            }
            out.push(("Upstash-Timeout".to_owned(), seconds(timeout)));
        }
        if self.request_timeout.is_zero() || self.request_timeout > Duration::from_secs(3600) {
            return Err(field_error(
                "request_timeout",
                format!(
                    "must be between 1ms and 1h, got {}",
                    humantime::format_duration(self.request_timeout)
                ),
            ));
        }
        if let Some(flow) = &self.flow_control {
            out.extend(flow.headers()?);
        }
        for (name, value) in &self.forward_headers {
            let shown = sanitize_error(name);
            let header = format!("Upstash-Forward-{name}");
            if HeaderName::from_bytes(header.as_bytes()).is_err() || name.is_empty() {
                return Err(field_error(
                    "forward_headers",
                    format!("{shown:?} is not a valid header name"),
                ));
            }
            if !forwardable(name) {
                return Err(field_error(
                    "forward_headers",
                    format!("{shown:?} cannot be forwarded (reserved name)"),
                ));
            }
            if !printable(value) {
                return Err(field_error(
                    "forward_headers",
                    format!("the value of {shown:?} must be printable ASCII"),
                ));
            }
            out.push((header, value.clone()));
        }
        Ok(out)
    }
}

impl FlowControl {
    fn headers(&self) -> Result<Vec<(String, String)>, SinkError> {
        let field = "flow_control";
        if self.key.is_empty() || !printable(&self.key) || self.key.contains(',') {
            return Err(field_error(
                &format!("{field}.key"),
                "must be non-empty printable ASCII without commas",
            ));
        }
        let mut parts = Vec::new();
        if let Some(p) = self.parallelism {
            if p == 0 {
                return Err(field_error(
                    &format!("{field}.parallelism"),
                    "must be at least 1",
                ));
            }
            parts.push(format!("parallelism={p}"));
        }
        if let Some(r) = self.rate {
            if r == 0 {
                return Err(field_error(&format!("{field}.rate"), "must be at least 1"));
            }
            parts.push(format!("rate={r}"));
        }
        if let Some(period) = self.period {
            if self.rate.is_none() {
                return Err(field_error(
                    &format!("{field}.period"),
                    "only applies together with rate",
                ));
            }
            if period < Duration::from_secs(1) {
                return Err(field_error(
                    &format!("{field}.period"),
                    "must be at least 1s",
                ));
            }
            parts.push(format!("period={}", seconds(period)));
        }
        if parts.is_empty() {
            return Err(field_error(field, "set parallelism, rate or both"));
        }
        Ok(vec![
            ("Upstash-Flow-Control-Key".to_owned(), self.key.clone()),
            ("Upstash-Flow-Control-Value".to_owned(), parts.join(", ")),
        ])
    }
}

/// Whether a header may be forwarded to the destination under its own name.
fn forwardable(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    !(super::http::is_reserved(&lower) || lower.starts_with("upstash-"))
}

/// The QStash token and API URL. `Debug` hides the token.
#[derive(Clone)]
pub struct QstashCredentials {
    token: String,
    base_url: String,
}

impl fmt::Debug for QstashCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QstashCredentials")
            .field("token", &"<redacted>")
            .field("base_url", &self.base_url)
            .finish()
    }
}

impl QstashCredentials {
    /// A token and an API URL (e.g. [`DEFAULT_URL`], or a test server's).
    pub fn new(token: impl Into<String>, base_url: impl Into<String>) -> Self {
        Self {
            token: token.into(),
            base_url: base_url.into(),
        }
    }

    /// `QSTASH_TOKEN` (required) and `QSTASH_URL` (default [`DEFAULT_URL`]).
    pub fn from_env() -> Result<Self, SinkError> {
        let read = |name: &str| match std::env::var(name) {
            Ok(v) => Ok(Some(v)),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(SinkError::Config(format!(
                "environment variable {name} is not valid Unicode"
            ))),
        };
        let token = read(TOKEN_ENV)?.ok_or_else(|| {
            SinkError::Config(format!(
                "environment variable {TOKEN_ENV} is not set: the qstash sink needs the QStash \
                 token (Upstash console → QStash → QSTASH_TOKEN)"
            ))
        })?;
        let base_url = read(URL_ENV)?
            .filter(|u| !u.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_URL.to_owned());
        Ok(Self::new(token, base_url))
    }
}

/// The QStash sink; see the module docs.
pub struct QstashSink {
    client: reqwest::Client,
    authorization: HeaderValue,
    base: String,
    destination: String,
    /// `{base}/v2/publish/{destination}`, unless the destination needs `/v2/batch`.
    publish_url: Option<reqwest::Url>,
    batch_url: reqwest::Url,
    keys_url: reqwest::Url,
    option_headers: Vec<(String, String)>,
    request_timeout: Duration,
    source: String,
    described: String,
}

/// One entry of a `/v2/batch` request.
#[derive(serde::Serialize)]
struct BatchEntry<'a> {
    destination: &'a str,
    headers: BTreeMap<String, String>,
    body: String,
}

impl QstashSink {
    /// Build the sink for `url` (`qstash:DESTINATION_URL`) with
    /// `options.qstash` and explicit credentials. Reads no environment.
    pub fn new(
        url: &str,
        options: SinkOptions,
        credentials: QstashCredentials,
    ) -> Result<Self, SinkError> {
        let destination = url
            .strip_prefix("qstash:")
            .ok_or_else(|| SinkError::Config("sink URL: expected qstash:DESTINATION_URL".into()))?
            .trim()
            .to_owned();
        let parsed = parse_http_url(&destination, "sink URL: the QStash destination")?;
        if !printable(&destination) {
            return Err(SinkError::Config(
                "sink URL: the QStash destination must be printable ASCII (percent-encode the rest)"
                    .into(),
            ));
        }
        let option_headers = options.qstash.headers()?;
        if credentials.token.trim().is_empty() {
            return Err(SinkError::Config(format!(
                "{TOKEN_ENV} is empty: the qstash sink needs the QStash token"
            )));
        }
        let mut authorization =
            HeaderValue::from_str(&format!("Bearer {}", credentials.token.trim())).map_err(
                |_| {
                    SinkError::Config(format!(
                        "{TOKEN_ENV} contains characters that cannot be sent in an HTTP header"
                    ))
                },
            )?;
        authorization.set_sensitive(true);
        let base_parsed = parse_http_url(credentials.base_url.trim(), URL_ENV)?;
        if base_parsed.query().is_some() || !base_parsed.username().is_empty() {
            return Err(SinkError::Config(format!(
                "{URL_ENV}: expected the API's base URL, without user-info or query"
            )));
        }
        let base = credentials.base_url.trim().trim_end_matches('/').to_owned();
        let endpoint = |path: &str| {
            reqwest::Url::parse(&format!("{base}{path}"))
                .map_err(|e| SinkError::Config(format!("{URL_ENV}: cannot append {path}: {e}")))
        };
        let publish_url = if destination.contains(['?', '#']) {
            None
        } else {
            Some(endpoint(&format!("/v2/publish/{destination}"))?)
        };
        let described = format!(
            "qstash {} → {}",
            display_url(&base_parsed),
            display_url(&parsed)
        );
        Ok(Self {
            client: client(options.qstash.request_timeout, IDLE_CONNECTIONS)?,
            authorization,
            batch_url: endpoint("/v2/batch")?,
            keys_url: endpoint("/v2/keys")?,
            publish_url,
            base,
            destination,
            option_headers,
            request_timeout: options.qstash.request_timeout,
            source: options.source,
            described,
        })
    }

    /// Build the sink with the credentials from `QSTASH_TOKEN` and `QSTASH_URL`.
    pub fn from_url(url: &str, options: SinkOptions) -> Result<Self, SinkError> {
        Self::new(url, options, QstashCredentials::from_env()?)
    }

    /// The QStash API this sink talks to.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// The headers QStash gets for one message (name, value), all valid.
    fn message_headers(&self, m: &Message) -> Vec<(String, String)> {
        let mut headers: Vec<(String, String)> = Vec::with_capacity(m.headers.len() + 12);
        headers.push((
            "Content-Type".to_owned(),
            cloudevents::STRUCTURED_CONTENT_TYPE.to_owned(),
        ));
        headers.push((
            "Upstash-Deduplication-Id".to_owned(),
            m.event_id.hyphenated().to_string(),
        ));
        for (name, value) in &m.headers {
            let forwarded = format!("Upstash-Forward-{name}");
            let static_override = self
                .option_headers
                .iter()
                .any(|(n, _)| n.eq_ignore_ascii_case(&forwarded));
            if name.is_empty()
                || static_override
                || !forwardable(name)
                || !printable(value)
                || HeaderName::from_bytes(forwarded.as_bytes()).is_err()
            {
                continue;
            }
            headers.push((forwarded, value.clone()));
        }
        headers.extend(self.option_headers.iter().cloned());
        headers
    }

    /// Publish one message: `/v2/publish`, or a batch of one when the
    /// destination cannot be put in a path.
    async fn publish_one(&self, m: &Message) -> Outcome {
        let Some(url) = &self.publish_url else {
            return match self.batch_request(std::slice::from_ref(m)).await {
                Ok(mut outcomes) => outcomes
                    .pop()
                    .unwrap_or_else(|| Outcome::retry("QStash: no answer")),
                Err(response) => request_outcome(response).await,
            };
        };
        let mut headers = HeaderMap::new();
        for (name, value) in self.message_headers(m) {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(&value),
            ) {
                headers.insert(name, value);
            }
        }
        headers.insert(AUTHORIZATION, self.authorization.clone());
        let request = self
            .client
            .post(url.clone())
            .headers(headers)
            .timeout(self.request_timeout)
            .body(cloudevents::to_json(m, &self.source));
        match request.send().await {
            Ok(response) => request_outcome(response).await,
            Err(e) => Outcome::retry(transport_error("QStash", e, self.request_timeout)),
        }
    }

    /// One `/v2/batch` request for `chunk` (≤ [`MAX_BATCH_ENTRIES`]): one
    /// outcome per message, or the answer when it was not a 2xx.
    async fn batch_request(&self, chunk: &[Message]) -> Result<Vec<Outcome>, reqwest::Response> {
        let entries: Vec<BatchEntry<'_>> = chunk
            .iter()
            .map(|m| BatchEntry {
                destination: &self.destination,
                headers: self.message_headers(m).into_iter().collect(),
                body: cloudevents::to_json(m, &self.source),
            })
            .collect();
        let body = match serde_json::to_vec(&entries) {
            Ok(body) => body,
            Err(e) => {
                let error = format!("QStash: cannot encode the batch: {e}");
                return Ok(vec![Outcome::retry(error); chunk.len()]);
            }
        };
        let request = self
            .client
            .post(self.batch_url.clone())
            .header(AUTHORIZATION, self.authorization.clone())
            .header(CONTENT_TYPE, "application/json")
            .timeout(self.request_timeout)
            .body(body);
        let mut response = match request.send().await {
            Ok(response) => response,
            Err(e) => {
                let error = transport_error("QStash", e, self.request_timeout);
                return Ok(vec![Outcome::retry(error); chunk.len()]);
            }
        };
        if response.status().is_success() {
            let body = read_prefix(&mut response, MAX_BATCH_ANSWER).await;
            return Ok(batch_outcomes(&body, chunk.len()));
        }
        Err(response)
    }

    /// Publish several messages with one `/v2/batch` request. On a 4xx other
    /// than 401/403/429, publish each message on its own instead, so only the
    /// offending one is rejected.
    async fn publish_batch(&self, chunk: &[Message]) -> Vec<Outcome> {
        let response = match self.batch_request(chunk).await {
            Ok(outcomes) => return outcomes,
            Err(response) => response,
        };
        let status = response.status();
        let per_message = status.is_client_error()
            && !matches!(status.as_u16(), 401 | 403)
            && !is_transient(status);
        if !per_message {
            return vec![request_outcome(response).await; chunk.len()];
        }
        drop(response);
        let mut outcomes = Vec::with_capacity(chunk.len());
        for m in chunk {
            outcomes.push(self.publish_one(m).await);
        }
        outcomes
    }

    async fn publish_chunk(&self, chunk: &[Message]) -> Vec<Outcome> {
        if chunk.len() == 1 {
            vec![self.publish_one(&chunk[0]).await]
        } else {
            self.publish_batch(chunk).await
        }
    }
}

/// The outcome of a QStash answer to a whole request (a publish, or a batch
/// that failed as a whole).
async fn request_outcome(mut response: reqwest::Response) -> Outcome {
    let status = response.status();
    match status.as_u16() {
        401 | 403 => Outcome::reject(format!(
            "QStash: HTTP {}: the token in {TOKEN_ENV} was refused; check it in the Upstash console",
            status.as_u16()
        )),
        429 => {
            let after = rate_limit_reset(response.headers(), Utc::now());
            let body = read_prefix(&mut response, 2048).await;
            Outcome::Retry {
                error: status_text("QStash: rate limited: ", StatusCode::TOO_MANY_REQUESTS, &body),
                after,
            }
        }
        _ => classify(response, "QStash: ").await,
    }
}

/// One outcome per message from a 2xx `/v2/batch` answer.
fn batch_outcomes(body: &[u8], expected: usize) -> Vec<Outcome> {
    let entries: Vec<serde_json::Value> = match serde_json::from_slice(body) {
        Ok(entries) => entries,
        Err(_) => {
            return vec![Outcome::retry("QStash: the batch answer is not a JSON array"); expected]
        }
    };
    if entries.len() != expected {
        let error = format!(
            "QStash: the batch answer has {} entries for {expected} messages",
            entries.len()
        );
        return vec![Outcome::retry(error); expected];
    }
    entries
        .iter()
        .map(|entry| match entry.get("error") {
            None | Some(serde_json::Value::Null) => Outcome::Delivered,
            Some(error) => {
                let text = match error {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                Outcome::retry(format!("QStash: {}", super::http::excerpt(text.as_bytes())))
            }
        })
        .collect()
}

/// The delay a QStash 429 asks for: `Burst-RateLimit-Reset`, then
/// `RateLimit-Reset` (see the module docs for how they are read), then `Retry-After`.
pub fn rate_limit_reset(headers: &HeaderMap, now: DateTime<Utc>) -> Option<Duration> {
    ["burst-ratelimit-reset", "ratelimit-reset"]
        .iter()
        .filter_map(|name| headers.get(*name)?.to_str().ok())
        .find_map(|value| parse_reset(value, now))
        .or_else(|| retry_after(headers, now))
}

/// Read a rate-limit reset value (see the module docs).
pub fn parse_reset(value: &str, now: DateTime<Utc>) -> Option<Duration> {
    let v: f64 = value.trim().parse().ok()?;
    if !v.is_finite() || v < 0.0 {
        return None;
    }
    // A time beyond chrono's range is far in the future: the longest delay.
    let at = |seconds: f64| {
        Some(
            DateTime::from_timestamp_millis((seconds * 1000.0) as i64)
                .map_or(MAX_RETRY_AFTER, |at| until(at, now)),
        )
    };
    if v >= 1e12 {
        at(v / 1000.0)
    } else if v >= 1e9 {
        at(v)
    } else {
        Some(Duration::try_from_secs_f64(v).map_or(MAX_RETRY_AFTER, |d| d.min(MAX_RETRY_AFTER)))
    }
}

#[async_trait]
impl Sink for QstashSink {
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        // One request after the other, so QStash receives the events of an
        // aggregate in input order. A request that cannot start within half
        // of request_timeout is not sent, so a slow QStash cannot make the
        // relay time out (and retry) chunks QStash already accepted.
        let start_by = tokio::time::Instant::now() + self.request_timeout / 2;
        let mut outcomes = Vec::with_capacity(batch.len());
        for chunk in batch.chunks(MAX_BATCH_ENTRIES) {
            if tokio::time::Instant::now() >= start_by {
                let reason = format!(
                    "QStash: not sent: the batch could not start it within {}",
                    humantime::format_duration(self.request_timeout / 2)
                );
                let deferred = Outcome::Deferred {
                    reason,
                    after: None,
                };
                outcomes.extend(vec![deferred; chunk.len()]);
                continue;
            }
            outcomes.extend(self.publish_chunk(chunk).await);
        }
        outcomes
    }

    async fn check(&self) -> Result<(), SinkError> {
        let request = self
            .client
            .get(self.keys_url.clone())
            .header(AUTHORIZATION, self.authorization.clone())
            .timeout(self.request_timeout);
        match request.send().await {
            Ok(response) if matches!(response.status().as_u16(), 401 | 403) => {
                Err(SinkError::Unreachable {
                    sink: self.describe(),
                    reason: format!(
                        "QStash refused the token in {TOKEN_ENV} (HTTP {})",
                        response.status().as_u16()
                    ),
                })
            }
            // Any other answer shows QStash is reachable.
            Ok(_) => Ok(()),
            Err(e) => Err(SinkError::Unreachable {
                sink: self.describe(),
                reason: transport_error("QStash", e, self.request_timeout),
            }),
        }
    }

    fn describe(&self) -> String {
        self.described.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn credentials() -> QstashCredentials {
        QstashCredentials::new("tok3n-value", "http://127.0.0.1:9/")
    }

    fn options(qstash: QstashOptions) -> SinkOptions {
        SinkOptions {
            qstash,
            ..SinkOptions::default()
        }
    }

    #[test]
    fn builds_urls_and_describes_without_secrets() {
        let s = QstashSink::new(
            "qstash:https://user:pw@example.com/hook",
            SinkOptions::default(),
            credentials(),
        )
        .unwrap();
        assert_eq!(
            s.publish_url.as_ref().unwrap().as_str(),
            "http://127.0.0.1:9/v2/publish/https://user:pw@example.com/hook"
        );
        assert_eq!(s.batch_url.as_str(), "http://127.0.0.1:9/v2/batch");
        let d = s.describe();
        assert_eq!(
            d,
            "qstash http://127.0.0.1:9/ → https://example.com:443/hook"
        );
        assert!(!format!("{:?}", credentials()).contains("tok3n"));
        let q = QstashSink::new(
            "qstash:https://example.com/hook?key=1",
            SinkOptions::default(),
            credentials(),
        )
        .unwrap();
        assert!(q.publish_url.is_none(), "a query goes through /v2/batch");
        assert!(!q.describe().contains("key=1"));
    }

    #[test]
    fn option_headers() {
        let o = QstashOptions {
            retries: Some(3),
            delay: Some(Duration::from_millis(1500)),
            callback: Some("https://example.com/cb".into()),
            failure_callback: Some("https://example.com/failed".into()),
            forward_headers: [("X-Tenant".to_owned(), "acme".to_owned())].into(),
            flow_control: Some(FlowControl {
                key: "orders".into(),
                parallelism: Some(2),
                rate: Some(10),
                period: Some(Duration::from_secs(60)),
            }),
            timeout: Some(Duration::from_secs(30)),
            request_timeout: Duration::from_secs(5),
        };
        let h: BTreeMap<String, String> = o.headers().unwrap().into_iter().collect();
        let want: BTreeMap<String, String> = [
            ("Upstash-Retries", "3"),
            ("Upstash-Delay", "2s"),
            ("Upstash-Callback", "https://example.com/cb"),
            ("Upstash-Failure-Callback", "https://example.com/failed"),
            ("Upstash-Timeout", "30s"),
            ("Upstash-Flow-Control-Key", "orders"),
            (
                "Upstash-Flow-Control-Value",
                "parallelism=2, rate=10, period=60s",
            ),
            ("Upstash-Forward-X-Tenant", "acme"),
        ]
        .into_iter()
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
        .collect();
        assert_eq!(h, want);
    }

    #[test]
    fn validates_options_naming_the_field() {
        let flow = |parallelism, rate, period| FlowControl {
            key: "k".into(),
            parallelism,
            rate,
            period,
        };
        let cases: Vec<(QstashOptions, &str)> = vec![
            (
                QstashOptions {
                    retries: Some(1000),
                    ..Default::default()
                },
                "qstash.retries: must be at most 100",
            ),
            (
                QstashOptions {
                    callback: Some("ftp://x".into()),
                    ..Default::default()
                },
                "qstash.callback",
            ),
            (
                QstashOptions {
                    flow_control: Some(flow(None, None, None)),
                    ..Default::default()
                },
                "qstash.flow_control: set parallelism, rate or both",
            ),
            (
                QstashOptions {
                    flow_control: Some(flow(Some(1), None, Some(Duration::from_secs(5)))),
                    ..Default::default()
                },
                "qstash.flow_control.period: only applies together with rate",
            ),
            (
                QstashOptions {
                    forward_headers: [("Upstash-Signature".to_owned(), "x".to_owned())].into(),
                    ..Default::default()
                },
                "qstash.forward_headers: \"Upstash-Signature\" cannot be forwarded",
            ),
            (
                QstashOptions {
                    timeout: Some(Duration::from_millis(10)),
                    ..Default::default()
                },
                "qstash.timeout: must be at least 1s",
            ),
        ];
        for (o, want) in cases {
            let err = o.validate().unwrap_err().to_string();
            assert!(err.contains(want), "{err} (wanted {want})");
        }
        let o: QstashOptions = serde_json::from_value(serde_json::json!({
            "retries": 2, "delay": "10s", "flow_control": {"key": "k", "rate": 5, "period": "1m"}
        }))
        .unwrap();
        assert!(o.validate().is_ok());
        assert!(serde_json::from_value::<QstashOptions>(serde_json::json!({"retry": 2})).is_err());
    }

    #[test]
    fn token_errors_never_show_the_token() {
        for token in ["", "  ", "bad\ntoken-value"] {
            let err = QstashSink::new(
                "qstash:https://example.com/hook",
                options(QstashOptions::default()),
                QstashCredentials::new(token, DEFAULT_URL),
            )
            .err()
            .unwrap()
            .to_string();
            assert!(err.contains("QSTASH_TOKEN"), "{err}");
            assert!(!err.contains("token-value"), "{err}");
        }
        let err = QstashSink::new(
            "https://example.com/hook",
            SinkOptions::default(),
            credentials(),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("qstash:DESTINATION_URL"), "{err}");
    }

    #[test]
    fn reads_rate_limit_resets() {
        let now = Utc.with_ymd_and_hms(2026, 1, 2, 3, 4, 5).unwrap();
        let ts = now.timestamp();
        let secs = |s| Some(Duration::from_secs(s));
        assert_eq!(parse_reset(&(ts + 3).to_string(), now), secs(3));
        assert_eq!(parse_reset(&((ts + 2) * 1000).to_string(), now), secs(2));
        assert_eq!(parse_reset(&(ts - 100).to_string(), now), secs(0));
        assert_eq!(parse_reset("5", now), secs(5));
        assert_eq!(parse_reset("1e300", now), Some(MAX_RETRY_AFTER));
        assert_eq!(parse_reset("99999999", now), Some(MAX_RETRY_AFTER));
        for garbage in ["", "-1", "NaN", "inf", "soon"] {
            assert_eq!(parse_reset(garbage, now), None, "{garbage:?}");
        }
        let mut headers = HeaderMap::new();
        headers.insert("Retry-After", HeaderValue::from_static("7"));
        assert_eq!(rate_limit_reset(&headers, now), secs(7));
        headers.insert("RateLimit-Reset", HeaderValue::from(ts + 9));
        assert_eq!(rate_limit_reset(&headers, now), secs(9));
        headers.insert("Burst-RateLimit-Reset", HeaderValue::from(ts + 1));
        assert_eq!(rate_limit_reset(&headers, now), secs(1));
    }

    #[test]
    fn batch_answers_map_to_outcomes() {
        let body =
            br#"[{"messageId":"a"},{"messageId":"b","deduplicated":true},{"error":"bad token=x"}]"#;
        let outcomes = batch_outcomes(body, 3);
        assert_eq!(outcomes[0], Outcome::Delivered);
        assert_eq!(outcomes[1], Outcome::Delivered);
        match &outcomes[2] {
            Outcome::Retry { error, .. } => {
                assert!(error.starts_with("QStash: bad"), "{error}");
                assert!(!error.contains("token=x"), "{error}");
            }
            other => panic!("{other:?}"),
        }
        assert!(batch_outcomes(body, 2).iter().all(
            |o| matches!(o, Outcome::Retry { error, .. } if error.contains("3 entries for 2"))
        ));
        assert!(batch_outcomes(b"{}", 1)
            .iter()
            .all(|o| matches!(o, Outcome::Retry { .. })));
    }
}

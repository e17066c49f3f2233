//! HTTP webhooks: every event is one HTTP request to a fixed URL; a 2xx answer
//! is the only thing that counts as delivered.
//!
//! URL: `http://HOST[:PORT]/PATH[?QUERY]` or `https://…`. User-info in the URL
//! (`https://user:password@host/…`) is sent as HTTP Basic authentication and
//! never printed; the query is sent as given and never printed either (it
//! often carries a token). Everything else is set in [`HttpOptions`] (the
//! `[sink.http]` table of the configuration).
//!
//! Each request:
//!
//! - **Structured mode** (default): the body is the CloudEvents JSON document,
//!   `Content-Type: application/cloudevents+json`.
//! - **Binary mode**: the body is the event's payload, `Content-Type:
//!   application/json`, and the CloudEvents attributes travel as `ce-*`
//!   headers (`ce-specversion`, `ce-id`, `ce-source`, `ce-type`, `ce-subject`,
//!   `ce-time`, `ce-aggregatetype`, `ce-schemaversion`, `ce-sequence`),
//!   percent-encoded as the CloudEvents HTTP binding requires.
//! - The producer's headers are sent as HTTP headers when their name is a
//!   valid header name and their value is printable ASCII; others are skipped.
//!   They never replace a header the sink sets itself (`Content-Type`,
//!   `webhook-*`, `ce-*`, hop-by-hop headers) nor one from
//!   [`HttpOptions::headers`].
//! - `webhook-id` is the event id, the same on every retry and replay, so
//!   receivers deduplicate on it (sent whether or not requests are signed).
//! - **Signing** ([Standard Webhooks](https://www.standardwebhooks.com/)),
//!   when signing secrets are configured: `webhook-timestamp`
//!   the sending time in unix seconds, and `webhook-signature` one `v1,…`
//!   signature per secret, space-separated, so receivers holding either the
//!   old or the new secret accept deliveries during a rotation. Secrets are
//!   read once, when the sink is built, from `POSTBOX_WEBHOOK_SECRET` (or the
//!   variable [`HttpOptions::secret_env`] names): `whsec_…` values separated
//!   by whitespace or commas. Without that variable deliveries are unsigned.
//!
//! Outcomes, per request:
//!
//! | answer | outcome |
//! |---|---|
//! | 2xx | delivered |
//! | 408, 425, 429, 5xx | retry, after `Retry-After` when the answer has one |
//! | timeout, connection refused or reset, TLS failure | retry |
//! | 3xx | retry: redirects are **not** followed (fix the URL) |
//! | 410 and every other 4xx | reject (dead letter), with `HTTP <status>` and the start of the answer's body |
//!
//! `Retry-After` is read as delta-seconds or an HTTP date; the relay caps the
//! delay at `relay.backoff_max`, and any value above one day is read as one day.
//!
//! A batch is sent as concurrent requests, at most [`HttpOptions::concurrency`]
//! in flight across the whole sink, the events of one aggregate one after the
//! other in input order (different aggregates in parallel), and optionally at most
//! [`HttpOptions::rate_per_second`] started per second. A request that cannot
//! start within half of [`HttpOptions::timeout`] after the batch began (the
//! endpoint is slow, or the rate limit is reached) is not sent and answered
//! `Deferred` (tried again later without counting an attempt), so a publish call returns within about 1.5 × `timeout`: keep
//! `relay.publish_timeout` above that, and `relay.batch_size` near what the
//! endpoint takes in that time.

use super::rate::RateLimit;
use super::SinkOptions;
use crate::cloudevents;
use crate::redact::sanitize_error;
use crate::sink::{Message, Outcome, Sink, SinkError};
use async_trait::async_trait;
use chrono::{DateTime, NaiveDateTime, Utc};
use futures::StreamExt;
use postbox::verify::webhooks::{Secret, Signer, SECRET_ENV};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, LOCATION, RETRY_AFTER};
use reqwest::{Method, StatusCode};
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::Instant;

/// How events are put into requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HttpMode {
    /// The body is the CloudEvents JSON document (`application/cloudevents+json`).
    #[default]
    Structured,
    /// The body is the payload (`application/json`); attributes are `ce-*` headers.
    Binary,
}

/// Settings of the HTTP webhook sink (`[sink.http]`).
#[derive(Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpOptions {
    /// The request method: `POST` (default), `PUT` or `PATCH`.
    pub method: String,
    /// `structured` (default): the body is the CloudEvents JSON document;
    /// `binary`: the body is the payload and the attributes are `ce-*` headers.
    pub mode: HttpMode,
    /// Longest wait for one request, from connecting to the end of the answer
    /// (default `10s`). A request that cannot start within half of it is not
    /// sent and retried later.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Most requests in flight at once, across the whole sink (1–1024, default 16).
    pub concurrency: u32,
    /// Most requests started per second, across the whole sink, in bursts of
    /// up to one second's worth (rounded down, at least one) after a quiet
    /// spell; unlimited when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate_per_second: Option<f64>,
    /// Extra headers sent with every request (e.g. an `Authorization` the
    /// endpoint expects). Values are never logged. They override producer
    /// headers of the same name; they cannot set `Content-Type`, `Host`,
    /// `Content-Length`, hop-by-hop, `webhook-*` or `ce-*` headers.
    pub headers: BTreeMap<String, String>,
    /// The environment variable holding the signing secrets (`whsec_…`,
    /// separated by whitespace or commas), read when the sink is built.
    /// Default `POSTBOX_WEBHOOK_SECRET`, whose absence means unsigned
    /// deliveries; a variable named here must be set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret_env: Option<String>,
}

impl Default for HttpOptions {
    fn default() -> Self {
        Self {
            method: "POST".to_owned(),
            mode: HttpMode::Structured,
            timeout: DEFAULT_TIMEOUT,
            concurrency: DEFAULT_CONCURRENCY,
            rate_per_second: None,
            headers: BTreeMap::new(),
            secret_env: None,
        }
    }
}

impl fmt::Debug for HttpOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Header values may be credentials.
        let headers: Vec<&str> = self.headers.keys().map(String::as_str).collect();
        f.debug_struct("HttpOptions")
            .field("method", &self.method)
            .field("mode", &self.mode)
            .field("timeout", &self.timeout)
            .field("concurrency", &self.concurrency)
            .field("rate_per_second", &self.rate_per_second)
            .field("headers", &headers)
            .field("secret_env", &self.secret_env)
            .finish()
    }
}

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_CONCURRENCY: u32 = 16;
const MAX_CONCURRENCY: u32 = 1024;
const MAX_TIMEOUT: Duration = Duration::from_secs(3600);
const MIN_RATE: f64 = 0.01;
const MAX_RATE: f64 = 1_000_000.0;
/// Longest excerpt of an answer's body put into an outcome.
pub(crate) const MAX_EXCERPT_CHARS: usize = 200;
/// Bytes of a non-2xx answer read for the excerpt.
const EXCERPT_READ_BYTES: usize = 2048;
/// Bytes of a 2xx answer read (and discarded) so the connection can be reused.
const DRAIN_BYTES: usize = 64 * 1024;
/// Longest delay taken from a `Retry-After` (or rate-limit reset) header.
pub(crate) const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);

/// Header names the sink sets itself, or that describe the connection: never
/// taken from producer headers or [`HttpOptions::headers`].
pub(crate) fn is_reserved(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    matches!(
        lower.as_str(),
        "content-type"
            | "content-length"
            | "content-encoding"
            | "transfer-encoding"
            | "host"
            | "connection"
            | "keep-alive"
            | "te"
            | "trailer"
            | "upgrade"
            | "expect"
    ) || lower.starts_with("proxy-")
        || lower.starts_with("webhook-")
        || lower.starts_with("ce-")
}

fn field_error(field: &str, why: impl fmt::Display) -> SinkError {
    SinkError::Config(format!("http.{field}: {why}"))
}

impl HttpOptions {
    /// Check every field; the error names the field (`http.concurrency: …`).
    pub fn validate(&self) -> Result<(), SinkError> {
        self.method()?;
        if self.timeout.is_zero() || self.timeout > MAX_TIMEOUT {
            return Err(field_error(
                "timeout",
                format!(
                    "must be between 1ms and 1h, got {}",
                    humantime::format_duration(self.timeout)
                ),
            ));
        }
        if !(1..=MAX_CONCURRENCY).contains(&self.concurrency) {
            return Err(field_error(
                "concurrency",
                format!(
                    "must be between 1 and {MAX_CONCURRENCY}, got {}",
                    self.concurrency
                ),
            ));
        }
        if let Some(rate) = self.rate_per_second {
            if !rate.is_finite() || !(MIN_RATE..=MAX_RATE).contains(&rate) {
                return Err(field_error(
                    "rate_per_second",
                    format!("must be between {MIN_RATE} and {MAX_RATE}, got {rate}"),
                ));
            }
        }
        self.static_headers()?;
        if let Some(name) = &self.secret_env {
            if name.is_empty() || name.contains(['=', '\0']) {
                // Not echoed: a value with `=` here is likely the secret itself
                // (base64 padding), put where its variable's name belongs.
                return Err(field_error(
                    "secret_env",
                    "is not an environment variable name (it is empty or holds '=' or NUL): \
                     name the variable that holds the secrets, not a secret",
                ));
            }
        }
        Ok(())
    }

    fn method(&self) -> Result<Method, SinkError> {
        match self.method.to_ascii_uppercase().as_str() {
            "POST" => Ok(Method::POST),
            "PUT" => Ok(Method::PUT),
            "PATCH" => Ok(Method::PATCH),
            _ => Err(field_error(
                "method",
                format!(
                    "must be POST, PUT or PATCH, got {:?}",
                    sanitize_error(&self.method)
                ),
            )),
        }
    }

    fn static_headers(&self) -> Result<HeaderMap, SinkError> {
        let mut map = HeaderMap::new();
        for (name, value) in &self.headers {
            let shown = sanitize_error(name);
            let header = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                field_error("headers", format!("{shown:?} is not a valid header name"))
            })?;
            if is_reserved(name) {
                return Err(field_error(
                    "headers",
                    format!(
                        "{shown:?} is set by the sink or the connection and cannot be configured"
                    ),
                ));
            }
            let mut value = HeaderValue::from_str(value).map_err(|_| {
                field_error(
                    "headers",
                    format!("the value of {shown:?} is not a valid header value (no control characters)"),
                )
            })?;
            value.set_sensitive(true);
            map.insert(header, value);
        }
        Ok(map)
    }

    /// The environment variable the signing secrets are read from.
    pub fn secret_env_name(&self) -> &str {
        self.secret_env.as_deref().unwrap_or(SECRET_ENV)
    }
}

/// Parse a list of Standard Webhooks secrets (`whsec_…` or bare base64)
/// separated by whitespace or commas. `what` names their origin in errors
/// (e.g. the environment variable); no error contains a secret.
pub fn parse_secrets(value: &str, what: &str) -> Result<Vec<Secret>, SinkError> {
    let secrets = value
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter(|s| !s.is_empty())
        .enumerate()
        .map(|(i, s)| {
            Secret::parse(s)
                .map_err(|e| SinkError::Config(format!("{what}: secret number {}: {e}", i + 1)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if secrets.is_empty() {
        return Err(SinkError::Config(format!(
            "{what} is set but holds no secret; unset it to send unsigned deliveries"
        )));
    }
    Ok(secrets)
}

/// The signing secrets `options` call for, from the process environment: the
/// variable [`HttpOptions::secret_env`] names (which must be set), or
/// `POSTBOX_WEBHOOK_SECRET` (none when unset: deliveries are unsigned).
pub fn secrets_from_env(options: &HttpOptions) -> Result<Vec<Secret>, SinkError> {
    let name = options.secret_env_name();
    match std::env::var_os(name) {
        None if options.secret_env.is_some() => Err(field_error(
            "secret_env",
            format!("the environment variable {name} is not set"),
        )),
        None => Ok(Vec::new()),
        Some(value) => match value.to_str() {
            Some(value) => parse_secrets(value, &format!("environment variable {name}")),
            None => Err(SinkError::Config(format!(
                "environment variable {name} is not valid Unicode"
            ))),
        },
    }
}

/// Parse and check an `http://` / `https://` URL; the error never shows user-info or query.
pub(crate) fn parse_http_url(raw: &str, what: &str) -> Result<reqwest::Url, SinkError> {
    let url = reqwest::Url::parse(raw).map_err(|e| {
        SinkError::Config(format!(
            "{what} is not a valid http:// or https:// URL: {e}"
        ))
    })?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(SinkError::Config(format!(
            "{what}: the scheme must be http or https, got {:?}",
            sanitize_error(url.scheme())
        )));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(SinkError::Config(format!("{what}: the host is missing")));
    }
    Ok(url)
}

/// `scheme://host:port/path`, plus `?…` when the URL has a query: no
/// user-info, no query values.
pub(crate) fn display_url(url: &reqwest::Url) -> String {
    let host = url.host_str().unwrap_or("");
    let mut out = match url.port_or_known_default() {
        Some(port) => format!("{}://{host}:{port}{}", url.scheme(), url.path()),
        None => format!("{}://{host}{}", url.scheme(), url.path()),
    };
    if url.query().is_some() {
        out.push_str("?…");
    }
    sanitize_error(&out)
}

/// The HTTP webhook sink; see the module docs.
pub struct HttpSink {
    client: reqwest::Client,
    url: reqwest::Url,
    basic: Option<(String, Option<String>)>,
    method: Method,
    mode: HttpMode,
    timeout: Duration,
    concurrency: usize,
    permits: Semaphore,
    rate: Option<RateLimit>,
    headers: HeaderMap,
    signer: Option<Signer>,
    source: String,
    described: String,
}

/// Build the reqwest client every HTTP-speaking sink uses: rustls, no
/// redirects, bounded connect time.
pub(crate) fn client(
    timeout: Duration,
    idle_per_host: usize,
) -> Result<reqwest::Client, SinkError> {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(timeout.min(Duration::from_secs(10)))
        .pool_max_idle_per_host(idle_per_host)
        .tcp_nodelay(true)
        .user_agent(concat!("postbox/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| {
            SinkError::Config(format!(
                "cannot set up the HTTP client: {}",
                sanitize_error(&error_chain(&e.without_url()))
            ))
        })
}

impl HttpSink {
    /// Build the sink for `url` with `options.http`, signing with `secrets`
    /// (none: unsigned). Reads no environment; connects lazily.
    pub fn new(url: &str, options: SinkOptions, secrets: Vec<Secret>) -> Result<Self, SinkError> {
        let http = &options.http;
        http.validate()?;
        let mut url = parse_http_url(url, "sink URL")?;
        url.set_fragment(None);
        let basic = if !url.username().is_empty() || url.password().is_some() {
            let decode = |s: &str| {
                percent_encoding::percent_decode_str(s)
                    .decode_utf8()
                    .map(|c| c.into_owned())
                    .map_err(|_| {
                        SinkError::Config(
                            "sink URL: the user-info is not valid percent-encoded UTF-8".into(),
                        )
                    })
            };
            let user = decode(url.username())?;
            let password = url.password().map(decode).transpose()?;
            let _ = url.set_username("");
            let _ = url.set_password(None);
            Some((user, password))
        } else {
            None
        };
        let method = http.method()?;
        let headers = http.static_headers()?;
        let concurrency = http.concurrency as usize;
        let secret_count = secrets.len();
        let signer = if secrets.is_empty() {
            None
        } else {
            Some(Signer::from_secrets(secrets).map_err(|e| SinkError::Config(e.to_string()))?)
        };
        let mut described = format!(
            "http {method} {} {}",
            display_url(&url),
            match http.mode {
                HttpMode::Structured => "structured",
                HttpMode::Binary => "binary",
            }
        );
        if basic.is_some() {
            described.push_str(" basic-auth");
        }
        if signer.is_some() {
            described.push_str(&format!(" signed({secret_count})"));
        }
        described.push_str(&format!(" concurrency {concurrency}"));
        if let Some(rate) = http.rate_per_second {
            described.push_str(&format!(" rate {rate}/s"));
        }
        Ok(Self {
            client: client(http.timeout, concurrency)?,
            url,
            basic,
            method,
            mode: http.mode,
            timeout: http.timeout,
            concurrency,
            permits: Semaphore::new(concurrency),
            rate: http.rate_per_second.map(RateLimit::per_second),
            headers,
            signer,
            source: options.source,
            described,
        })
    }

    /// Build the sink, reading the signing secrets from the environment
    /// (see [`secrets_from_env`]).
    pub fn from_url(url: &str, options: SinkOptions) -> Result<Self, SinkError> {
        options.http.validate()?;
        let secrets = secrets_from_env(&options.http)?;
        Self::new(url, options, secrets)
    }

    /// The request for one message.
    fn request(&self, m: &Message) -> reqwest::RequestBuilder {
        let (body, content_type) = match self.mode {
            HttpMode::Structured => (
                cloudevents::to_json(m, &self.source).into_bytes(),
                cloudevents::STRUCTURED_CONTENT_TYPE,
            ),
            HttpMode::Binary => (
                m.payload.get().as_bytes().to_vec(),
                cloudevents::BINARY_CONTENT_TYPE,
            ),
        };
        let mut headers = HeaderMap::with_capacity(m.headers.len() + self.headers.len() + 12);
        for (name, value) in &m.headers {
            if let Some((name, value)) = producer_header(name, value) {
                headers.insert(name, value);
            }
        }
        for (name, value) in &self.headers {
            headers.insert(name.clone(), value.clone());
        }
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        if self.mode == HttpMode::Binary {
            for (name, value) in cloudevents::binary_headers(m, &self.source) {
                // Percent-encoded: always printable ASCII.
                if let Ok(value) = HeaderValue::from_str(&value) {
                    headers.insert(name, value);
                }
            }
        }
        // The id goes out signed or not: receivers deduplicate on it.
        let id = m.event_id.hyphenated().to_string();
        if let Some(signer) = &self.signer {
            let timestamp = Utc::now().timestamp();
            let signature = signer.sign(&id, timestamp, &body);
            for (name, value) in [
                ("webhook-timestamp", timestamp.to_string()),
                ("webhook-signature", signature),
            ] {
                if let Ok(value) = HeaderValue::from_str(&value) {
                    headers.insert(name, value);
                }
            }
        }
        if let Ok(value) = HeaderValue::from_str(&id) {
            headers.insert("webhook-id", value);
        }
        let mut request = self
            .client
            .request(self.method.clone(), self.url.clone())
            .headers(headers)
            .timeout(self.timeout)
            .body(body);
        if let Some((user, password)) = &self.basic {
            request = request.basic_auth(user, password.as_ref());
        }
        request
    }

    async fn deliver(&self, m: &Message, start_by: Instant) -> Outcome {
        if Instant::now() >= start_by {
            return Outcome::Deferred {
                reason: format!(
                    "http: not sent: the batch could not start it within {}",
                    humantime::format_duration(self.timeout / 2)
                ),
                after: None,
            };
        }
        if let Some(rate) = &self.rate {
            if let Err(wait) = rate.start_by(start_by).await {
                return Outcome::Deferred {
                    reason: "http: not sent: rate_per_second reached for this batch".into(),
                    after: Some(wait),
                };
            }
        }
        let Ok(Ok(_permit)) = tokio::time::timeout_at(start_by, self.permits.acquire()).await
        else {
            return Outcome::Deferred {
                reason: format!(
                    "http: not sent: {} requests were still in flight {} after the batch began",
                    self.concurrency,
                    humantime::format_duration(self.timeout / 2)
                ),
                after: None,
            };
        };
        match self.request(m).send().await {
            Ok(response) => classify(response, "").await,
            Err(e) => Outcome::retry(transport_error("http", e, self.timeout)),
        }
    }
}

/// The positions of `batch` grouped by aggregate, each group in input order,
/// groups in order of their first event.
pub(crate) fn lanes(batch: &[Message]) -> Vec<Vec<usize>> {
    let mut index: std::collections::HashMap<(&str, &str), usize> =
        std::collections::HashMap::new();
    let mut lanes: Vec<Vec<usize>> = Vec::new();
    for (i, m) in batch.iter().enumerate() {
        let key = (m.aggregate_type.as_str(), m.aggregate_id.as_str());
        let lane = *index.entry(key).or_insert_with(|| {
            lanes.push(Vec::new());
            lanes.len() - 1
        });
        lanes[lane].push(i);
    }
    lanes
}

/// A producer header as an HTTP header, or `None` when it cannot or must not be sent.
fn producer_header(name: &str, value: &str) -> Option<(HeaderName, HeaderValue)> {
    if is_reserved(name)
        || !value
            .bytes()
            .all(|b| b == b'\t' || (0x20..0x7f).contains(&b))
    {
        return None;
    }
    let name = HeaderName::from_bytes(name.as_bytes()).ok()?;
    let value = HeaderValue::from_str(value).ok()?;
    Some((name, value))
}

/// A reqwest error and its sources, joined with `: ` (reqwest's own text is terse).
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

/// Why a request got no answer, without the URL and sanitized.
pub(crate) fn transport_error(prefix: &str, e: reqwest::Error, timeout: Duration) -> String {
    let e = e.without_url();
    if e.is_timeout() {
        format!(
            "{prefix}: no answer within {}",
            humantime::format_duration(timeout)
        )
    } else if e.is_connect() {
        format!(
            "{prefix}: cannot connect: {}",
            sanitize_error(&error_chain(&e))
        )
    } else {
        format!(
            "{prefix}: request failed: {}",
            sanitize_error(&error_chain(&e))
        )
    }
}

/// Read at most `limit` bytes of an answer's body (bounded by the request's timeout).
pub(crate) async fn read_prefix(response: &mut reqwest::Response, limit: usize) -> Vec<u8> {
    let mut body = Vec::new();
    while body.len() < limit {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let take = chunk.len().min(limit - body.len());
                body.extend_from_slice(&chunk[..take]);
            }
            Ok(None) | Err(_) => break,
        }
    }
    body
}

/// A short, sanitized, single-line excerpt of an answer's body (≤ 200 characters).
pub(crate) fn excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let collapsed = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let clean = sanitize_error(&collapsed);
    if clean.chars().count() <= MAX_EXCERPT_CHARS {
        clean
    } else {
        let mut cut: String = clean.chars().take(MAX_EXCERPT_CHARS - 1).collect();
        cut.push('…');
        cut
    }
}

/// `HTTP 503` or `HTTP 503: <excerpt>`.
pub(crate) fn status_text(prefix: &str, status: StatusCode, body: &[u8]) -> String {
    let excerpt = excerpt(body);
    if excerpt.is_empty() {
        format!("{prefix}HTTP {}", status.as_u16())
    } else {
        format!("{prefix}HTTP {}: {excerpt}", status.as_u16())
    }
}

/// Whether a status means "try again later".
pub(crate) fn is_transient(status: StatusCode) -> bool {
    status.is_server_error() || matches!(status.as_u16(), 408 | 425 | 429)
}

/// Turn an answer into an outcome (see the module docs). `prefix` starts
/// every error text (e.g. `"QStash: "`).
pub(crate) async fn classify(mut response: reqwest::Response, prefix: &str) -> Outcome {
    let status = response.status();
    if status.is_success() {
        // Read (a bounded part of) the body so the connection can be reused.
        read_prefix(&mut response, DRAIN_BYTES).await;
        return Outcome::Delivered;
    }
    if status.is_redirection() {
        let location = response
            .headers()
            .get(LOCATION)
            .and_then(|v| v.to_str().ok())
            .map(|l| match reqwest::Url::parse(l) {
                Ok(url) => display_url(&url),
                Err(_) => sanitize_error(l.split('?').next().unwrap_or("")),
            });
        let mut error = format!(
            "{prefix}HTTP {}: redirects are not followed; point the sink at the final URL",
            status.as_u16()
        );
        if let Some(location) = location {
            error.push_str(&format!(" (Location: {location})"));
        }
        return Outcome::retry(error);
    }
    let after = retry_after(response.headers(), Utc::now());
    let body = read_prefix(&mut response, EXCERPT_READ_BYTES).await;
    let error = status_text(prefix, status, &body);
    if is_transient(status) || !status.is_client_error() {
        Outcome::Retry { error, after }
    } else {
        Outcome::reject(error)
    }
}

/// The delay a `Retry-After` header asks for, if it has a readable one.
pub(crate) fn retry_after(headers: &HeaderMap, now: DateTime<Utc>) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?;
    parse_retry_after(value, now)
}

/// Read a `Retry-After` value: delta-seconds (`120`) or an HTTP date (IMF-fixdate,
/// RFC 850 or asctime). A date in the past means now; anything above one day
/// (or unreadable numbers) is capped at one day; garbage is `None`.
pub fn parse_retry_after(value: &str, now: DateTime<Utc>) -> Option<Duration> {
    let value = value.trim();
    if value.is_empty() {
        return None;
    }
    if value.bytes().all(|b| b.is_ascii_digit()) {
        let seconds = value.parse::<u64>().unwrap_or(u64::MAX);
        return Some(Duration::from_secs(seconds).min(MAX_RETRY_AFTER));
    }
    let date = DateTime::parse_from_rfc2822(value)
        .map(|d| d.with_timezone(&Utc))
        .ok()
        .or_else(|| {
            ["%A, %d-%b-%y %H:%M:%S GMT", "%a %b %e %H:%M:%S %Y"]
                .iter()
                .find_map(|f| NaiveDateTime::parse_from_str(value, f).ok())
                .map(|d| d.and_utc())
        })?;
    Some(until(date, now))
}

/// From `now` to `at`, at least zero and at most one day.
pub(crate) fn until(at: DateTime<Utc>, now: DateTime<Utc>) -> Duration {
    (at - now)
        .to_std()
        .unwrap_or(Duration::ZERO)
        .min(MAX_RETRY_AFTER)
}

#[async_trait]
impl Sink for HttpSink {
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        let start_by = Instant::now() + self.timeout / 2;
        // Events of one aggregate go one after the other, in input order;
        // aggregates go concurrently. The futures are built first (they do
        // nothing until polled): a closure inside the stream would not be
        // general enough for `Send`.
        let lanes: Vec<_> = lanes(batch)
            .into_iter()
            .map(|lane| async move {
                let mut outcomes = Vec::with_capacity(lane.len());
                for i in lane {
                    outcomes.push((i, self.deliver(&batch[i], start_by).await));
                }
                outcomes
            })
            .collect();
        let done: Vec<Vec<(usize, Outcome)>> = futures::stream::iter(lanes)
            .buffer_unordered(self.concurrency)
            .collect()
            .await;
        let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
        for (i, outcome) in done.into_iter().flatten() {
            outcomes[i] = Some(outcome);
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Outcome::retry("http: not sent")))
            .collect()
    }

    async fn check(&self) -> Result<(), SinkError> {
        // Any HTTP answer (404 and 405 included) shows the endpoint is reachable.
        let mut request = self.client.head(self.url.clone()).timeout(self.timeout);
        for (name, value) in &self.headers {
            request = request.header(name, value);
        }
        if let Some((user, password)) = &self.basic {
            request = request.basic_auth(user, password.as_ref());
        }
        match request.send().await {
            Ok(_) => Ok(()),
            Err(e) => Err(SinkError::Unreachable {
                sink: self.describe(),
                reason: transport_error("http", e, self.timeout),
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

    fn options(http: HttpOptions) -> SinkOptions {
        SinkOptions {
            http,
            ..SinkOptions::default()
        }
    }

    #[test]
    fn describes_without_credentials() {
        let s = HttpSink::new(
            "https://hook:s3cret@example.com:8443/in?token=abc#frag",
            SinkOptions::default(),
            Vec::new(),
        )
        .unwrap();
        let d = s.describe();
        assert_eq!(
            d,
            "http POST https://example.com:8443/in?… structured basic-auth concurrency 16"
        );
        assert!(s.url.username().is_empty() && s.url.password().is_none());
        assert_eq!(s.url.query(), Some("token=abc"));
        let secrets = parse_secrets("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "test").unwrap();
        let s = HttpSink::new(
            "http://127.0.0.1/",
            options(HttpOptions {
                mode: HttpMode::Binary,
                rate_per_second: Some(5.0),
                ..HttpOptions::default()
            }),
            secrets,
        )
        .unwrap();
        assert_eq!(
            s.describe(),
            "http POST http://127.0.0.1:80/ binary signed(1) concurrency 16 rate 5/s"
        );
    }

    #[test]
    fn validates_options_naming_the_field() {
        let cases: Vec<(HttpOptions, &str)> = vec![
            (
                HttpOptions {
                    concurrency: 0,
                    ..Default::default()
                },
                "http.concurrency: must be between 1 and 1024, got 0",
            ),
            (
                HttpOptions {
                    method: "GET".into(),
                    ..Default::default()
                },
                "http.method: must be POST, PUT or PATCH",
            ),
            (
                HttpOptions {
                    timeout: Duration::ZERO,
                    ..Default::default()
                },
                "http.timeout: must be between 1ms and 1h",
            ),
            (
                HttpOptions {
                    rate_per_second: Some(f64::NAN),
                    ..Default::default()
                },
                "http.rate_per_second: must be between",
            ),
            (
                HttpOptions {
                    headers: [("Content-Type".to_owned(), "text/plain".to_owned())].into(),
                    ..Default::default()
                },
                "http.headers: \"Content-Type\" is set by the sink",
            ),
            (
                HttpOptions {
                    headers: [("bad name".to_owned(), "x".to_owned())].into(),
                    ..Default::default()
                },
                "http.headers: \"bad name\" is not a valid header name",
            ),
            (
                HttpOptions {
                    headers: [("Authorization".to_owned(), "Bearer a\nb".to_owned())].into(),
                    ..Default::default()
                },
                "http.headers: the value of \"Authorization\" is not a valid header value",
            ),
            (
                HttpOptions {
                    secret_env: Some(String::new()),
                    ..Default::default()
                },
                "http.secret_env:",
            ),
        ];
        for (o, want) in cases {
            let err = o.validate().unwrap_err().to_string();
            assert!(err.contains(want), "{err} (wanted {want})");
            assert!(!err.contains("Bearer a"), "{err}");
        }
        assert!(HttpOptions::default().validate().is_ok());
    }

    #[test]
    fn options_deserialize_with_defaults_and_deny_unknown_fields() {
        let o: HttpOptions =
            serde_json::from_value(serde_json::json!({"mode": "binary", "timeout": "2s"})).unwrap();
        assert_eq!(o.mode, HttpMode::Binary);
        assert_eq!(o.timeout, Duration::from_secs(2));
        assert_eq!(o.concurrency, 16);
        assert_eq!(o.method, "POST");
        let err = serde_json::from_value::<HttpOptions>(serde_json::json!({"colour": 1}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `colour`"), "{err}");
        let debug = format!(
            "{:?}",
            HttpOptions {
                headers: [("Authorization".to_owned(), "Bearer hunter2".to_owned())].into(),
                ..Default::default()
            }
        );
        assert!(!debug.contains("hunter2"), "{debug}");
    }

    #[test]
    fn rejects_bad_urls_and_secrets_without_echoing_them() {
        for (url, want) in [
            ("ftp://h/x", "scheme must be http or https"),
            ("http://", "not a valid"),
            ("not a url", "not a valid"),
        ] {
            let err = HttpSink::new(url, SinkOptions::default(), Vec::new())
                .err()
                .unwrap()
                .to_string();
            assert!(err.contains(want), "{url}: {err}");
        }
        let err = parse_secrets(
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw, whsec_!!notbase64",
            "X",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("X: secret number 2"), "{err}");
        assert!(!err.contains("notbase64"), "{err}");
        assert_eq!(
            parse_secrets(
                " whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw,whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYX ",
                "X"
            )
            .unwrap()
            .len(),
            2
        );
        assert!(parse_secrets(" , ", "X")
            .unwrap_err()
            .to_string()
            .contains("holds no secret"));
    }

    #[test]
    fn reads_retry_after() {
        let now = Utc.with_ymd_and_hms(2026, 1, 2, 3, 4, 5).unwrap();
        let secs = |s| Some(Duration::from_secs(s));
        assert_eq!(parse_retry_after("120", now), secs(120));
        assert_eq!(parse_retry_after(" 0 ", now), secs(0));
        assert_eq!(
            parse_retry_after("99999999999999999999999999", now),
            Some(MAX_RETRY_AFTER)
        );
        assert_eq!(
            parse_retry_after("Fri, 02 Jan 2026 03:04:35 GMT", now),
            secs(30)
        );
        assert_eq!(
            parse_retry_after("Friday, 02-Jan-26 03:05:05 GMT", now),
            secs(60)
        );
        assert_eq!(parse_retry_after("Fri Jan  2 03:04:15 2026", now), secs(10));
        assert_eq!(
            parse_retry_after("Thu, 01 Jan 2026 00:00:00 GMT", now),
            secs(0)
        );
        assert_eq!(
            parse_retry_after("Fri, 02 Jan 2099 03:04:35 GMT", now),
            Some(MAX_RETRY_AFTER)
        );
        for garbage in ["", "-5", "1.5", "soon", "Fri, 99 Jan 2026 03:04:35 GMT"] {
            assert_eq!(parse_retry_after(garbage, now), None, "{garbage:?}");
        }
    }

    #[test]
    fn producer_headers_are_filtered() {
        assert!(producer_header("x-tenant", "acme").is_some());
        assert!(producer_header("Content-Type", "text/plain").is_none());
        assert!(producer_header("ce-id", "x").is_none());
        assert!(producer_header("webhook-id", "x").is_none());
        assert!(producer_header("bad name", "x").is_none());
        assert!(producer_header("x-a", "line\nbreak").is_none());
        assert!(producer_header("x-a", "café").is_none());
        assert!(producer_header("", "x").is_none());
    }

    #[test]
    fn excerpts_are_short_and_sanitized() {
        let long = format!("error token=abc {}", "x".repeat(1000));
        let e = excerpt(long.as_bytes());
        assert!(e.chars().count() <= MAX_EXCERPT_CHARS, "{}", e.len());
        assert!(!e.contains("abc"), "{e}");
        assert_eq!(excerpt(b"line one\n\n  line two"), "line one line two");
        assert_eq!(excerpt(&[0xff, b'o', b'k']), "\u{fffd}ok");
    }
}

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
//!   valid header name and their value is printable ASCII; others are skipped,
//!   and so are credential headers (`Authorization`, `Cookie`, `Set-Cookie`)
//!   unless `forward_credentials = true`, and the names in `drop_headers`.
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

mod config;
#[cfg(test)]
mod tests;

pub use crate::shared::http::parse_retry_after;
pub use config::{parse_secrets, secrets_from_env, HttpMode, HttpOptions};

use crate::shared::http::{
    classify, client, display_url, is_reserved, printable, transport_error, CREDENTIAL_HEADERS,
};
use crate::shared::rate::RateLimit;
use crate::{BuiltSink, SinkOptions};
use async_trait::async_trait;
use chrono::Utc;
use config::Endpoint;
use futures::StreamExt;
use postbox::verify::webhooks::{Secret, Signer};
use postbox_sink::cloudevents;
use postbox_sink::{Message, Outcome, Secrets, Sink, SinkError};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE};
use reqwest::Method;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::Instant;

/// The registry's entry for this sink.
pub(crate) const SINK: BuiltSink = BuiltSink {
    usage: "http://HOST[:PORT]/PATH[?QUERY] or https://…  webhooks; settings in [sink.http]",
    build: |url, options| Ok(Arc::new(HttpSink::from_url(url, options.clone())?)),
};

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
    secrets: Secrets,
    /// Producer headers not forwarded: the credential headers unless
    /// `forward_credentials`, and `drop_headers` (lower case).
    dropped: Vec<String>,
}

impl HttpSink {
    /// Build the sink for `url` with the options table [`HttpOptions`], signing with `secrets`
    /// (none: unsigned). Reads no environment; connects lazily.
    pub fn new(url: &str, options: SinkOptions, secrets: Vec<Secret>) -> Result<Self, SinkError> {
        let http = options.get::<HttpOptions>();
        http.validate()?;
        let mut held = Secrets::new();
        held.add_url(url, false);
        let Endpoint { url, basic } = Endpoint::from_url(url)?;
        let method = http.method()?;
        let headers = http.static_headers()?;
        // Configured header values are credentials more often than not.
        for value in headers.values() {
            if let Ok(value) = value.to_str() {
                held.add(value);
            }
        }
        if let Some((user, password)) = &basic {
            held.add_basic(user, password.as_deref());
        }
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
            secrets: held,
            dropped: CREDENTIAL_HEADERS
                .iter()
                .filter(|_| !http.forward_credentials)
                .map(|h| (*h).to_owned())
                .chain(http.drop_headers.iter().map(|h| h.to_ascii_lowercase()))
                .collect(),
        })
    }

    /// Build the sink, reading the signing secrets from the environment
    /// (see [`secrets_from_env`]).
    pub fn from_url(url: &str, options: SinkOptions) -> Result<Self, SinkError> {
        let http = options.get::<HttpOptions>();
        http.validate()?;
        let secrets = secrets_from_env(&http)?;
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
            if self.dropped.iter().any(|d| d.eq_ignore_ascii_case(name)) {
                continue;
            }
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
    if is_reserved(name) || !printable(value) {
        return None;
    }
    let name = HeaderName::from_bytes(name.as_bytes()).ok()?;
    let value = HeaderValue::from_str(value).ok()?;
    Some((name, value))
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

    fn secrets(&self) -> &Secrets {
        &self.secrets
    }
}

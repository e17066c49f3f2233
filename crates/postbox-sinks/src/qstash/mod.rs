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
//! headers, except `Content-Type`, hop-by-hop, credential headers
//! (`Authorization`, `Cookie`, `Set-Cookie`), `upstash-*`, `webhook-*` and
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

mod config;
#[cfg(test)]
mod tests;

pub use config::{FlowControl, QstashCredentials, QstashOptions, DEFAULT_URL, TOKEN_ENV, URL_ENV};

use crate::shared::http::{
    classify, client, display_url, excerpt, is_transient, printable, read_prefix, retry_after,
    status_text, transport_error, until, EXCERPT_READ_BYTES, MAX_RETRY_AFTER,
};
use crate::{BuiltSink, SinkOptions};
use async_trait::async_trait;
use chrono::{DateTime, Utc};
use config::forwardable;
use postbox_sink::cloudevents;
use postbox_sink::{Message, Outcome, Secrets, Sink, SinkError};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use reqwest::StatusCode;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// The registry's entry for this sink.
pub(crate) const SINK: BuiltSink = BuiltSink {
    usage: "qstash:DESTINATION_URL  Upstash QStash (QSTASH_TOKEN, QSTASH_URL); settings in [sink.qstash]",
    build: |url, options| Ok(Arc::new(QstashSink::from_url(url, options.clone())?)),
};

/// Most messages in one `/v2/batch` request.
pub const MAX_BATCH_ENTRIES: usize = 100;
/// Idle connections kept to QStash.
const IDLE_CONNECTIONS: usize = 4;
/// Bytes of a batch answer read (100 entries of a few dozen bytes each).
const MAX_BATCH_ANSWER: usize = 1024 * 1024;

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
    secrets: Secrets,
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
    /// the options table [`QstashOptions`] and explicit credentials. Reads no
    /// environment.
    pub fn new(
        url: &str,
        options: SinkOptions,
        credentials: QstashCredentials,
    ) -> Result<Self, SinkError> {
        let (destination, parsed) = config::destination(url)?;
        let qstash = options.get::<QstashOptions>();
        let option_headers = qstash.headers()?;
        let authorization = credentials.authorization()?;
        let (base, base_parsed) = credentials.api()?;
        let endpoint = |path: &str| {
            reqwest::Url::parse(&format!("{base}{path}"))
                .map_err(|e| SinkError::Config(format!("{URL_ENV}: cannot append {path}: {e}")))
        };
        let publish_url = if destination.contains(['?', '#']) {
            None
        } else {
            Some(endpoint(&format!("/v2/publish/{destination}"))?)
        };
        let mut secrets = credentials.secrets();
        secrets.add_url(&destination, false);
        for url in [&qstash.callback, &qstash.failure_callback]
            .into_iter()
            .flatten()
        {
            secrets.add_url(url, false);
        }
        for value in qstash.forward_headers.values() {
            secrets.add(value);
        }
        let described = format!(
            "qstash {} → {}",
            display_url(&base_parsed),
            display_url(&parsed)
        );
        Ok(Self {
            client: client(qstash.request_timeout, IDLE_CONNECTIONS)?,
            authorization,
            batch_url: endpoint("/v2/batch")?,
            keys_url: endpoint("/v2/keys")?,
            publish_url,
            base,
            destination,
            option_headers,
            request_timeout: qstash.request_timeout,
            source: options.source,
            described,
            secrets,
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
            let body = read_prefix(&mut response, EXCERPT_READ_BYTES).await;
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
                Outcome::retry(format!("QStash: {}", excerpt(text.as_bytes())))
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

    fn secrets(&self) -> &Secrets {
        &self.secrets
    }
}

//! What the AWS sinks (`sqs`, `sns`, `kinesis`) share: their URL form
//! (`SCHEME://NAME?region=…&endpoint=…&timeout=…`), loading the SDK's
//! configuration from the standard AWS environment, the HTTPS client (hyper
//! on rustls with ring), the mapping of SDK errors to outcomes, and how a
//! batch is cut into ordered lanes of calls. What only SQS and SNS share
//! (message attributes, batch-request entries, batch answers) is `batch`,
//! built with either of them.
//!
//! Credentials and region come from the standard chain (environment
//! variables, the shared config and credentials files, web identity, the ECS
//! and EC2 instance metadata endpoints); `AWS_ENDPOINT_URL` (and the
//! service-specific `AWS_ENDPOINT_URL_SQS`, …) override the endpoint as the
//! SDK documents. The URL's `region` and `endpoint` parameters take
//! precedence over the environment.

use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_credential_types::Credentials;
use aws_smithy_runtime_api::client::orchestrator::HttpResponse;
use aws_smithy_runtime_api::client::result::SdkError;
use aws_smithy_types::error::display::DisplayErrorContext;
use aws_smithy_types::error::metadata::ProvideErrorMetadata;
use aws_smithy_types::retry::RetryConfig;
use aws_smithy_types::timeout::TimeoutConfig;
use postbox::redact::{display_url, sanitize_error};
use postbox_sink::{Message, Outcome, Secrets, SinkError};
use std::hash::{Hash, Hasher};
use std::time::Duration;
use tokio::sync::OnceCell;

#[cfg(any(feature = "sqs", feature = "sns"))]
mod batch;
#[cfg(all(test, feature = "sqs"))]
pub(crate) use batch::attributes;
#[cfg(any(feature = "sqs", feature = "sns"))]
pub(crate) use batch::{
    batch_answer, check_fifo_name, entry, failed_call, request_entries, Entry, Plan,
};

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// A parsed AWS sink URL.
pub(crate) struct AwsUrl {
    /// The queue, topic or stream name.
    pub name: String,
    pub target: AwsTarget,
    /// `sqs://orders.fifo region eu-west-1 endpoint http://127.0.0.1:5000`.
    pub described: String,
}

/// Where and how an AWS sink connects.
#[derive(Clone, Debug)]
pub(crate) struct AwsTarget {
    pub region: Option<String>,
    pub endpoint: Option<String>,
    pub timeout: Duration,
}

impl AwsUrl {
    /// Parse `SCHEME://NAME[?region=R&endpoint=URL&timeout=D]`; `check_name`
    /// says why a name is not valid for the service.
    pub(crate) fn parse(
        raw: &str,
        scheme: &str,
        what: &str,
        check_name: fn(&str) -> Result<(), String>,
    ) -> Result<Self, SinkError> {
        let rest = raw
            .strip_prefix(scheme)
            .and_then(|r| r.strip_prefix("://"))
            .ok_or_else(|| {
                SinkError::Config(format!(
                    "sink URL: expected {scheme}://{}",
                    what.to_uppercase().replace(' ', "_")
                ))
            })?;
        let (name, query) = rest.split_once('?').unwrap_or((rest, ""));
        let name = name.strip_suffix('/').unwrap_or(name);
        if name.is_empty() {
            return Err(SinkError::Config(format!(
                "sink URL: the {what} name is missing ({scheme}://NAME)"
            )));
        }
        check_name(name).map_err(|why| {
            SinkError::Config(format!(
                "sink URL: {:?} is not a valid {what} name: {why}",
                sanitize_error(name)
            ))
        })?;
        let mut target = AwsTarget {
            region: None,
            endpoint: None,
            timeout: DEFAULT_TIMEOUT,
        };
        for (key, value) in url::form_urlencoded::parse(query.as_bytes()) {
            match key.as_ref() {
                "region" => {
                    let ok = !value.is_empty()
                        && value.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
                    if !ok {
                        return Err(SinkError::Config(format!(
                            "sink URL parameter region: expected an AWS region like eu-west-1, got {:?}",
                            sanitize_error(&value)
                        )));
                    }
                    target.region = Some(value.into_owned());
                }
                "endpoint" => {
                    let url = url::Url::parse(&value).ok().filter(|u| {
                        matches!(u.scheme(), "http" | "https") && u.host_str().is_some()
                    });
                    if url.is_none() {
                        return Err(SinkError::Config(format!(
                            "sink URL parameter endpoint: expected an http:// or https:// URL, got {:?}",
                            display_url(&value)
                        )));
                    }
                    target.endpoint = Some(value.into_owned());
                }
                "timeout" => target.timeout = super::params::timeout(&value)?,
                other => {
                    return Err(super::params::unknown(
                        other,
                        &["region", "endpoint", "timeout"],
                    ))
                }
            }
        }
        let mut described = format!("{scheme}://{name}");
        if let Some(region) = &target.region {
            described.push_str(&format!(" region {region}"));
        }
        if let Some(endpoint) = &target.endpoint {
            described.push_str(&format!(" endpoint {}", display_url(endpoint)));
        }
        Ok(Self {
            name: name.to_owned(),
            target,
            described,
        })
    }
}

/// The SDK configuration of one sink, loaded at first use.
pub(crate) struct AwsConfig {
    target: AwsTarget,
    credentials: Option<Credentials>,
    loaded: OnceCell<SdkConfig>,
    secrets: Secrets,
}

impl AwsConfig {
    pub(crate) fn new(target: AwsTarget) -> Self {
        let mut secrets = Secrets::new();
        // The standard chain's literal secrets, when they come from the
        // environment: masked in every error, whatever echoes them.
        for var in ["AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"] {
            if let Ok(value) = std::env::var(var) {
                if !value.is_empty() {
                    secrets.add(&value);
                }
            }
        }
        Self {
            target,
            credentials: None,
            loaded: OnceCell::new(),
            secrets,
        }
    }

    /// Use these credentials instead of the standard chain's.
    pub(crate) fn set_credentials(&mut self, access_key_id: &str, secret_access_key: &str) {
        self.secrets.add(secret_access_key);
        self.credentials = Some(Credentials::new(
            access_key_id,
            secret_access_key,
            None,
            None,
            "postbox",
        ));
    }

    pub(crate) fn secrets(&self) -> &Secrets {
        &self.secrets
    }

    /// The timeout of each call (the SQS sink's tests read it).
    #[cfg(all(test, feature = "sqs"))]
    pub(crate) fn timeout(&self) -> Duration {
        self.target.timeout
    }

    /// The SDK configuration: the standard chain, then the URL's overrides.
    pub(crate) async fn sdk(&self) -> &SdkConfig {
        self.loaded
            .get_or_init(|| async {
                let http = aws_smithy_http_client::Builder::new()
                    .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                        aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
                    ))
                    .build_https();
                let timeout = self.target.timeout;
                let mut loader = aws_config::defaults(BehaviorVersion::latest())
                    .http_client(http)
                    .timeout_config(
                        TimeoutConfig::builder()
                            .connect_timeout(timeout)
                            .operation_timeout(timeout)
                            .build(),
                    )
                    // The relay retries with its own backoff and budget.
                    .retry_config(RetryConfig::disabled());
                if let Some(region) = &self.target.region {
                    loader = loader.region(Region::new(region.clone()));
                }
                if let Some(endpoint) = &self.target.endpoint {
                    loader = loader.endpoint_url(endpoint.clone());
                }
                if let Some(credentials) = &self.credentials {
                    loader = loader.credentials_provider(credentials.clone());
                }
                loader.load().await
            })
            .await
    }

    /// A configuration error that retrying cannot fix (no region).
    pub(crate) async fn missing_setting(&self) -> Option<String> {
        if self.sdk().await.region().is_none() {
            return Some(
                "no AWS region: set AWS_REGION (or a profile's region), or add ?region= to the sink URL"
                    .to_owned(),
            );
        }
        None
    }
}

/// What an SDK call's failure means.
#[derive(Debug)]
pub(crate) struct CallError {
    /// The service's error code (`QueueDoesNotExist`, `ThrottlingException`), if it answered one.
    pub code: Option<String>,
    /// The HTTP status, if the service answered.
    pub status: Option<u16>,
    /// The error with its causes, sanitized.
    pub text: String,
}

impl CallError {
    pub(crate) fn new<E>(e: &SdkError<E, HttpResponse>) -> Self
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
    {
        let status = match e {
            SdkError::ServiceError(s) => Some(s.raw().status().as_u16()),
            SdkError::ResponseError(r) => Some(r.raw().status().as_u16()),
            _ => None,
        };
        let text = match (e.code(), e.message()) {
            (Some(code), Some(message)) => format!("{code}: {message}"),
            (Some(code), None) => code.to_owned(),
            _ => DisplayErrorContext(e).to_string(),
        };
        Self {
            code: e.code().map(str::to_owned),
            status,
            text: sanitize_error(&text),
        }
    }

    /// Whether the service said the named resource does not exist.
    pub(crate) fn is_missing(&self, codes: &[&str]) -> bool {
        self.code.as_deref().is_some_and(|c| codes.contains(&c))
    }
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// The lane of a message: the same aggregate always gets the same lane, so
/// each aggregate's events are sent in order, one call after the other.
pub(crate) fn lane_of(m: &Message, lanes: usize) -> usize {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    m.aggregate_type.hash(&mut h);
    m.aggregate_id.hash(&mut h);
    (h.finish() % lanes.max(1) as u64) as usize
}

/// Cut `items` (index, size) into calls of at most `max_entries` entries and
/// `max_bytes` bytes, in order.
pub(crate) fn pack(
    items: &[(usize, usize)],
    max_entries: usize,
    max_bytes: usize,
) -> Vec<Vec<usize>> {
    let mut calls: Vec<Vec<usize>> = Vec::new();
    let mut bytes = 0;
    for &(i, size) in items {
        match calls.last_mut() {
            Some(call) if call.len() < max_entries && bytes + size <= max_bytes => {
                call.push(i);
                bytes += size;
            }
            _ => {
                calls.push(vec![i]);
                bytes = size;
            }
        }
    }
    calls
}

/// The calls of each lane: the messages (index, size) grouped by lane, in
/// input order, then cut by [`pack`].
pub(crate) fn lanes(
    batch: &[Message],
    sizes: &[(usize, usize)],
    lanes: usize,
    max_entries: usize,
    max_bytes: usize,
) -> Vec<Vec<Vec<usize>>> {
    let mut by_lane: Vec<Vec<(usize, usize)>> = vec![Vec::new(); lanes.max(1)];
    for &(i, size) in sizes {
        by_lane[lane_of(&batch[i], lanes)].push((i, size));
    }
    by_lane
        .into_iter()
        .filter(|l| !l.is_empty())
        .map(|l| pack(&l, max_entries, max_bytes))
        .collect()
}

/// Run every lane at once, each lane's calls one after the other; a lane
/// stops at a call that answers "do not go on" (a retry in it), and its
/// later calls are retried unsent, so an aggregate's events keep their order.
pub(crate) async fn send_in_lanes<F, Fut>(
    lanes: Vec<Vec<Vec<usize>>>,
    service: &str,
    send: F,
) -> Vec<(usize, Outcome)>
where
    F: Fn(Vec<usize>) -> Fut,
    Fut: std::future::Future<Output = (Vec<(usize, Outcome)>, bool)>,
{
    let send = &send;
    let runs = lanes.into_iter().map(|calls| async move {
        let mut out = Vec::new();
        let mut calls = calls.into_iter();
        for call in calls.by_ref() {
            let (outcomes, go_on) = send(call).await;
            out.extend(outcomes);
            if !go_on {
                break;
            }
        }
        for call in calls {
            out.extend(retry_all_of(
                &call,
                service,
                "not sent: an earlier message of its lane is being retried",
            ));
        }
        out
    });
    futures::future::join_all(runs)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// The outcomes of one call from the service's per-entry answers (keyed by
/// the entry's position in the call); an entry without an answer is a retry.
/// The lane goes on only when no entry is to be retried.
pub(crate) fn collect_call(
    call: &[usize],
    mut answers: std::collections::HashMap<usize, Outcome>,
    service: &str,
) -> (Vec<(usize, Outcome)>, bool) {
    let outcomes: Vec<(usize, Outcome)> = call
        .iter()
        .enumerate()
        .map(|(n, &i)| {
            let o = answers.remove(&n).unwrap_or_else(|| {
                Outcome::retry(format!("{service}: no answer for this message"))
            });
            (i, o)
        })
        .collect();
    let go_on = !outcomes
        .iter()
        .any(|(_, o)| matches!(o, Outcome::Retry { .. }));
    (outcomes, go_on)
}

/// A retry of each message of `call`.
pub(crate) fn retry_all_of(call: &[usize], service: &str, why: &str) -> Vec<(usize, Outcome)> {
    let o = Outcome::retry(format!("{service}: {}", sanitize_error(why)));
    call.iter().map(|&i| (i, o.clone())).collect()
}

/// A retry of every message, for a failure before anything was sent.
pub(crate) fn retry_all(n: usize, service: &str, why: &str) -> Vec<Outcome> {
    vec![Outcome::retry(format!("{service}: {}", sanitize_error(why))); n]
}

/// The outcome of one entry the service refused in a batch call: the
/// sender's fault is a reject (the message will never be accepted as it is),
/// anything else (throttling, an internal error) a retry.
pub(crate) fn entry_failure(
    service: &str,
    sender_fault: bool,
    code: &str,
    message: &str,
) -> Outcome {
    let text = sanitize_error(&format!("{code}: {message}"));
    if sender_fault {
        Outcome::reject(format!("{service}: refused: {text}"))
    } else {
        Outcome::retry(format!("{service}: {text}"))
    }
}

/// The unreachable/misconfigured error of a start-up check.
pub(crate) fn check_error(described: &str, e: &CallError, missing: bool, what: &str) -> SinkError {
    if missing {
        SinkError::Misconfigured {
            sink: described.to_owned(),
            reason: format!("{what} does not exist (create it first; the service said: {e})"),
        }
    } else if matches!(e.status, Some(400..=499)) && !is_throttling(e) {
        SinkError::Misconfigured {
            sink: described.to_owned(),
            reason: format!("the service refused the check of {what}: {e}"),
        }
    } else {
        SinkError::Unreachable {
            sink: described.to_owned(),
            reason: e.text.clone(),
        }
    }
}

/// Throttling codes of the AWS services (retried).
pub(crate) fn is_throttling(e: &CallError) -> bool {
    e.status == Some(429)
        || e.code.as_deref().is_some_and(|c| {
            matches!(
                c,
                "Throttling"
                    | "ThrottlingException"
                    | "ThrottledException"
                    | "RequestThrottled"
                    | "RequestThrottledException"
                    | "TooManyRequestsException"
                    | "ProvisionedThroughputExceededException"
                    | "RequestLimitExceeded"
                    | "SlowDown"
                    | "KMSThrottlingException"
                    | "LimitExceededException"
            )
        })
}

/// A message for the AWS sinks' unit tests.
#[cfg(test)]
pub(crate) fn test_message(aggregate_id: &str) -> Message {
    Message {
        event_id: uuid::Uuid::now_v7(),
        event_type: "order.created".into(),
        aggregate_type: "order".into(),
        aggregate_id: aggregate_id.into(),
        schema_version: 2,
        payload: serde_json::value::RawValue::from_string(r#"{"total":5}"#.into())
            .expect("valid JSON"),
        headers: [
            ("traceparent".to_owned(), "00-abc-def-01".to_owned()),
            ("x-tenant".to_owned(), "acme".to_owned()),
        ]
        .into(),
        created_at: chrono::Utc::now(),
        attempt: 1,
        sequence: Some(1),
        source: None,
    }
}

//! The QStash sink's options (`[sink.qstash]`), its URL
//! (`qstash:DESTINATION_URL`) and its credentials (`QSTASH_TOKEN`,
//! `QSTASH_URL`), validated before anything is sent.

use crate::shared::http::{is_credential, is_reserved, parse_http_url, printable};
use crate::OptionsTable;
use postbox::redact::sanitize_error;
use postbox_sink::SinkError;
use reqwest::header::{HeaderName, HeaderValue};
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// The environment variable holding the QStash token.
pub const TOKEN_ENV: &str = "QSTASH_TOKEN";
/// The environment variable holding the QStash API URL.
pub const URL_ENV: &str = "QSTASH_URL";
/// The QStash API used when `QSTASH_URL` is not set.
pub const DEFAULT_URL: &str = "https://qstash.upstash.io";

const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_RETRIES: u32 = 100;

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

impl QstashOptions {
    /// Check every field; the error names the field (`qstash.retries: …`).
    pub fn validate(&self) -> Result<(), SinkError> {
        self.headers().map(|_| ())
    }

    /// The `Upstash-*` headers these options add to every message, validated.
    pub(crate) fn headers(&self) -> Result<Vec<(String, String)>, SinkError> {
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
pub(crate) fn forwardable(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    !(is_reserved(&lower) || is_credential(&lower) || lower.starts_with("upstash-"))
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

impl OptionsTable for QstashOptions {
    const SINK: &'static str = "qstash";

    fn validate(&self) -> Result<(), SinkError> {
        QstashOptions::validate(self)
    }
}

impl QstashCredentials {
    /// The `Authorization` header the token makes; the error names the
    /// variable, never the token.
    pub(crate) fn authorization(&self) -> Result<HeaderValue, SinkError> {
        if self.token.trim().is_empty() {
            return Err(SinkError::Config(format!(
                "{TOKEN_ENV} is empty: the qstash sink needs the QStash token"
            )));
        }
        let mut authorization = HeaderValue::from_str(&format!("Bearer {}", self.token.trim()))
            .map_err(|_| {
                SinkError::Config(format!(
                    "{TOKEN_ENV} contains characters that cannot be sent in an HTTP header"
                ))
            })?;
        authorization.set_sensitive(true);
        Ok(authorization)
    }

    /// The token (as sent: raw and in `Bearer …`) and whatever the API URL carries.
    pub(crate) fn secrets(&self) -> postbox_sink::Secrets {
        let mut secrets = postbox_sink::Secrets::new();
        secrets
            .add(self.token.trim())
            .add(&self.token)
            .add_url(&self.base_url, false);
        secrets
    }

    /// The QStash API's base URL, checked: as written without a trailing
    /// `/`, and parsed.
    pub(crate) fn api(&self) -> Result<(String, reqwest::Url), SinkError> {
        let parsed = parse_http_url(self.base_url.trim(), URL_ENV)?;
        if parsed.query().is_some() || !parsed.username().is_empty() {
            return Err(SinkError::Config(format!(
                "{URL_ENV}: expected the API's base URL, without user-info or query"
            )));
        }
        let base = self.base_url.trim().trim_end_matches('/').to_owned();
        Ok((base, parsed))
    }
}

/// The destination a `qstash:DESTINATION_URL` sink URL names: as written
/// (trimmed), and parsed.
pub(crate) fn destination(url: &str) -> Result<(String, reqwest::Url), SinkError> {
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
    Ok((destination, parsed))
}

//! The HTTP sink's options (`[sink.http]`), its URL and its signing secrets,
//! validated before anything is sent.

use crate::shared::http::{is_reserved, parse_http_url};
use crate::shared::params::percent_decode;
use crate::OptionsTable;
use postbox::redact::sanitize_error;
use postbox::verify::webhooks::{Secret, SECRET_ENV};
use postbox_sink::SinkError;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::Method;
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

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
    /// Forward the producer's credential headers (`Authorization`,
    /// `Cookie`, `Set-Cookie`) to this endpoint. Off by default: a
    /// credential a producer put in an event's headers is meant for the
    /// producer's side, not for a third party's webhook.
    pub forward_credentials: bool,
    /// More producer header names never forwarded to this endpoint
    /// (compared case-insensitively), e.g. `x-internal-token`.
    pub drop_headers: Vec<String>,
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
            forward_credentials: false,
            drop_headers: Vec::new(),
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

    pub(crate) fn method(&self) -> Result<Method, SinkError> {
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

    pub(crate) fn static_headers(&self) -> Result<HeaderMap, SinkError> {
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

impl OptionsTable for HttpOptions {
    const SINK: &'static str = "http";

    fn validate(&self) -> Result<(), SinkError> {
        HttpOptions::validate(self)
    }
}

/// Where requests go: the sink URL without its fragment, and the user-info
/// it carried, as HTTP Basic credentials.
pub(crate) struct Endpoint {
    pub url: reqwest::Url,
    pub basic: Option<(String, Option<String>)>,
}

impl Endpoint {
    /// Parse and check the sink URL; errors never show user-info or query.
    pub(crate) fn from_url(raw: &str) -> Result<Self, SinkError> {
        let mut url = parse_http_url(raw, "sink URL")?;
        url.set_fragment(None);
        let basic = if !url.username().is_empty() || url.password().is_some() {
            let decode = |s: &str| {
                percent_decode(s).ok_or_else(|| {
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
        Ok(Self { url, basic })
    }
}

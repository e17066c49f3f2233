//! The NATS sink's URL: `nats://…?subject=…&stream=…&timeout=…&tls=…`, and
//! the subject rules, checked before anything is sent. The sink has no
//! options table.

use crate::shared::{params, with_placeholders_filled};
use crate::KeyTemplate;
use params::percent_decode;
use postbox::redact::sanitize_error;
use postbox_sink::SinkError;
use std::time::Duration;

const DEFAULT_SUBJECT: &str = "postbox.{event_type}";
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest subject published (the server's control line is 4 KiB by default).
const MAX_SUBJECT_BYTES: usize = 1024;

/// How the sink authenticates (never printed).
#[derive(Clone)]
pub(crate) enum Auth {
    None,
    UserPassword(String, String),
    Token(String),
}

/// What a sink URL asks for.
pub(crate) struct NatsConfig {
    /// `nats://HOST:PORT`, without credentials.
    pub server: String,
    pub auth: Auth,
    pub tls: bool,
    pub subject: KeyTemplate,
    /// The subject filter that captures every subject the template renders.
    pub capture: String,
    pub stream: Option<String>,
    pub timeout: Duration,
    pub described: String,
}

impl NatsConfig {
    /// Parse and check the sink URL.
    pub(crate) fn from_url(raw: &str) -> Result<Self, SinkError> {
        let url = url::Url::parse(raw).map_err(|e| {
            SinkError::Config(format!(
                "sink URL is not a valid nats:// URL: {}",
                sanitize_error(&e.to_string())
            ))
        })?;
        if url.scheme() != "nats" {
            return Err(SinkError::Config(format!(
                "sink URL scheme {:?} is not nats",
                url.scheme()
            )));
        }
        let host = url
            .host_str()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| SinkError::Config("sink URL: the NATS host is missing".into()))?
            .to_owned();
        let port = url.port().unwrap_or(4222);
        if !matches!(url.path(), "" | "/") {
            return Err(SinkError::Config(
                "sink URL: a nats:// URL has no path; put the subject in ?subject=".into(),
            ));
        }
        let auth = parse_auth(&url)?;

        let mut subject = DEFAULT_SUBJECT.to_owned();
        let mut stream = None;
        let mut timeout = DEFAULT_TIMEOUT;
        let mut tls = false;
        for (name, value) in url.query_pairs() {
            match name.as_ref() {
                "subject" => subject = value.into_owned(),
                "stream" => stream = Some(value.into_owned()),
                "timeout" => timeout = params::timeout(&value)?,
                "tls" => tls = params::boolean("tls", &value)?,
                other => {
                    return Err(params::unknown(
                        other,
                        &["subject", "stream", "timeout", "tls"],
                    ))
                }
            }
        }
        check_subject_template(&subject)?;
        let template = KeyTemplate::parse("sink URL parameter subject", &subject)?;
        let capture = capture_subject(&subject);
        if let Some(name) = &stream {
            check_stream_name(name)?;
            if capture == ">" {
                return Err(SinkError::Config(format!(
                    "sink URL parameter subject: {subject:?} must start with a literal token \
                     (like events.{{event_type}}) when stream= is given, so the stream can capture \
                     its subjects without capturing every subject"
                )));
            }
        }
        let mut described = format!("nats://{host}:{port} subject {subject}");
        if let Some(name) = &stream {
            described.push_str(&format!(" stream {name}"));
        }
        if tls {
            described.push_str(" tls");
        }
        Ok(Self {
            server: format!("nats://{host}:{port}"),
            auth,
            tls,
            subject: template,
            capture,
            stream,
            timeout,
            described,
        })
    }
}

fn parse_auth(url: &url::Url) -> Result<Auth, SinkError> {
    let decode = |s: &str, what: &str| {
        percent_decode(s).ok_or_else(|| {
            SinkError::Config(format!(
                "sink URL: the {what} is not valid percent-encoded UTF-8"
            ))
        })
    };
    let user = decode(url.username(), "user name")?;
    Ok(match url.password() {
        Some(password) => Auth::UserPassword(user, decode(password, "password")?),
        None if !user.is_empty() => Auth::Token(user),
        None => Auth::None,
    })
}

/// The literal parts of the template must form a valid subject by themselves.
fn check_subject_template(template: &str) -> Result<(), SinkError> {
    // Each placeholder becomes one token, so the literal text can be checked.
    check_subject(&with_placeholders_filled(template))
        .map_err(|why| SinkError::Config(format!("sink URL parameter subject: {template:?} {why}")))
}

/// Why `subject` is not a subject a message can be published to.
pub(crate) fn check_subject(subject: &str) -> Result<(), &'static str> {
    if subject.is_empty() {
        return Err("is empty");
    }
    if subject.len() > MAX_SUBJECT_BYTES {
        // The server closes a connection whose control line is too long, which
        // would fail every message of the batch on every attempt.
        return Err("is longer than 1024 bytes");
    }
    if subject.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("contains whitespace or control characters, which NATS subjects cannot");
    }
    for token in subject.split('.') {
        if token.is_empty() {
            return Err("has an empty token (a leading, trailing or doubled '.')");
        }
        if token == "*" || token == ">" {
            return Err("contains a wildcard token ('*' or '>'); messages need a literal subject");
        }
    }
    Ok(())
}

/// The subject filter capturing every subject `template` can render: the
/// literal tokens before the first placeholder, then `>`.
pub(crate) fn capture_subject(template: &str) -> String {
    match template.find('{') {
        None => template.to_owned(),
        Some(open) => match template[..open].rfind('.') {
            Some(dot) => format!("{}.>", &template[..dot]),
            None => ">".to_owned(),
        },
    }
}

fn check_stream_name(name: &str) -> Result<(), SinkError> {
    let bad = name.is_empty()
        || name.chars().any(|c| {
            c.is_whitespace() || c.is_control() || matches!(c, '.' | '*' | '>' | '/' | '\\')
        });
    if bad {
        return Err(SinkError::Config(format!(
            "sink URL parameter stream: {name:?} is not a valid stream name \
             (no spaces, '.', '*', '>', '/' or '\\')"
        )));
    }
    Ok(())
}

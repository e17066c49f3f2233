//! The HTTP plumbing the HTTP webhook sink and the QStash sink share: the
//! client, URL checks and display, reserved header names, and turning an
//! answer (or its absence) into an [`Outcome`] — see the table in the HTTP
//! sink's docs.

use chrono::{DateTime, NaiveDateTime, Utc};
use postbox::redact::{error_chain, sanitize_error};
use postbox_sink::{Outcome, SinkError};
use reqwest::header::{HeaderMap, LOCATION, RETRY_AFTER};
use reqwest::StatusCode;
use std::time::Duration;

/// Longest excerpt of an answer's body put into an outcome.
pub(crate) const MAX_EXCERPT_CHARS: usize = 200;
/// Bytes of a non-2xx answer read for the excerpt.
pub(crate) const EXCERPT_READ_BYTES: usize = 2048;
/// Bytes of a 2xx answer read (and discarded) so the connection can be reused.
const DRAIN_BYTES: usize = 64 * 1024;
/// Longest delay taken from a `Retry-After` (or rate-limit reset) header.
pub(crate) const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);

/// Producer headers that carry credentials: not carried to an endpoint
/// unless a destination says so (the HTTP sink's `forward_credentials`;
/// QStash never forwards them).
pub(crate) const CREDENTIAL_HEADERS: [&str; 3] = ["authorization", "cookie", "set-cookie"];

/// Whether `name` is one of [`CREDENTIAL_HEADERS`].
#[cfg(feature = "qstash")]
pub(crate) fn is_credential(name: &str) -> bool {
    CREDENTIAL_HEADERS
        .iter()
        .any(|c| c.eq_ignore_ascii_case(name))
}

/// Header names the sinks set themselves, or that describe the connection:
/// never taken from producer headers or configured headers.
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

/// Whether `value` is printable ASCII (tabs allowed): what a header value
/// forwarded from a producer or a configuration may hold.
pub(crate) fn printable(value: &str) -> bool {
    value
        .bytes()
        .all(|b| b == b'\t' || (0x20..0x7f).contains(&b))
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
/// user-info, no query values, and secret-looking path segments masked (see
/// [`redact::display_url`](postbox::redact::display_url)).
pub(crate) fn display_url(url: &reqwest::Url) -> String {
    let host = url.host_str().unwrap_or("");
    let mut out = match url.port_or_known_default() {
        Some(port) => format!("{}://{host}:{port}{}", url.scheme(), url.path()),
        None => format!("{}://{host}{}", url.scheme(), url.path()),
    };
    if let Some(query) = url.query() {
        out.push('?');
        out.push_str(query);
    }
    postbox::redact::display_url(&out)
}

/// Build the reqwest client every HTTP-speaking sink uses: rustls, no
/// redirects, bounded connect time.
pub(crate) fn client(
    timeout: Duration,
    idle_per_host: usize,
) -> Result<reqwest::Client, SinkError> {
    // reqwest takes the process's rustls provider; install ring unless the
    // embedding application has installed one already.
    let _ = rustls::crypto::ring::default_provider().install_default();
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

/// Turn an answer into an outcome (see the HTTP sink's docs). `prefix`
/// starts every error text (e.g. `"QStash: "`).
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

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

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
    fn excerpts_are_short_and_sanitized() {
        let long = format!("error token=abc {}", "x".repeat(1000));
        let e = excerpt(long.as_bytes());
        assert!(e.chars().count() <= MAX_EXCERPT_CHARS, "{}", e.len());
        assert!(!e.contains("abc"), "{e}");
        assert_eq!(excerpt(b"line one\n\n  line two"), "line one line two");
        assert_eq!(excerpt(&[0xff, b'o', b'k']), "\u{fffd}ok");
    }
}

//! How a request is answered: a page, a redirect, or a refusal or failure.
//! No response carries an error's text: failures are logged (sanitized) and
//! answered with fixed phrases.

use crate::outboxes::{self, Outbox};
use crate::views;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use maud::Markup;
use std::time::Duration;
use uuid::Uuid;

/// A refused or failed request, answered with a fixed phrase.
pub(crate) enum Fail {
    Internal,
    NotFound,
    /// A prefix naming no outbox the console serves.
    NoOutbox,
    /// An outbox that cannot be read now (missing tables, database down).
    Unreadable {
        outbox: String,
        why: &'static str,
    },
    Forbidden(&'static str),
    BadRequest(String),
    TooMany(Duration, &'static str),
}

impl IntoResponse for Fail {
    fn into_response(self) -> Response {
        let (status, title, text, retry) = match self {
            Fail::Internal => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "Something went wrong",
                "The console could not complete this request; its log says why. Try again in a moment.".to_owned(),
                None,
            ),
            Fail::NotFound => (
                StatusCode::NOT_FOUND,
                "Not found",
                "There is nothing at this address.".to_owned(),
                None,
            ),
            Fail::NoOutbox => (
                StatusCode::NOT_FOUND,
                "No such outbox",
                "The console serves no outbox at this address: its schema or database is not among those it was started for, or no longer holds an outbox. The overview lists those it serves.".to_owned(),
                None,
            ),
            Fail::Unreadable { outbox, why } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "This outbox cannot be read",
                format!("Outbox {outbox}: {why} The other outboxes are not affected."),
                None,
            ),
            Fail::Forbidden(why) => (StatusCode::FORBIDDEN, "Not allowed", why.to_owned(), None),
            Fail::BadRequest(why) => (StatusCode::BAD_REQUEST, "Cannot do that", why, None),
            Fail::TooMany(wait, what) => (
                StatusCode::TOO_MANY_REQUESTS,
                "Too many requests",
                format!("{what} Try again in {} s.", wait.as_secs().max(1)),
                Some(wait),
            ),
        };
        let mut res = (status, page(views::error_page(title, &text))).into_response();
        if let Some(wait) = retry {
            if let Ok(v) = HeaderValue::from_str(&wait.as_secs().max(1).to_string()) {
                res.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        res
    }
}

/// Log a failure without its secrets and answer 500.
pub(crate) fn internal(e: &dyn std::fmt::Display) -> Fail {
    tracing::error!(
        error = %postbox::redact::sanitize_error(&e.to_string()),
        "console request failed"
    );
    Fail::Internal
}

/// A failed read or action of `outbox`: a clear page when the outbox is
/// missing or out of reach (the others are not affected), else 500.
pub(crate) fn failed(outbox: &Outbox, e: &(dyn std::error::Error + 'static)) -> Fail {
    let mut cause = Some(e);
    while let Some(err) = cause {
        if let Some(why) = err
            .downcast_ref::<sqlx::Error>()
            .and_then(outboxes::unreadable)
        {
            tracing::warn!(
                outbox = %outbox.name,
                error = %postbox::redact::sanitize_error(&e.to_string()),
                "console: cannot read the outbox"
            );
            return Fail::Unreadable {
                outbox: outbox.name.clone(),
                why,
            };
        }
        cause = err.source();
    }
    internal(&e)
}

/// 303 See Other to a local path (the overview if it cannot be a header).
pub(crate) fn see_other(location: &str) -> Response {
    let location =
        HeaderValue::from_str(location).unwrap_or_else(|_| HeaderValue::from_static("/"));
    (StatusCode::SEE_OTHER, [(header::LOCATION, location)]).into_response()
}

/// An HTML page.
pub(crate) fn page(markup: Markup) -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        markup.into_string(),
    )
        .into_response()
}

/// The router's answer where no route is mounted.
pub(crate) async fn not_found() -> Fail {
    Fail::NotFound
}

/// An id in a path: a UUID, or there is nothing at this address.
pub(crate) fn parse_id(s: &str) -> Result<Uuid, Fail> {
    s.parse().map_err(|_| Fail::NotFound)
}

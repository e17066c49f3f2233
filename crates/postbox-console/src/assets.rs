//! The stylesheet and script, embedded in the binary.

use axum::http::header;
use axum::response::{IntoResponse, Response};

pub(crate) const CSS: &str = include_str!("../assets/console.css");
pub(crate) const JS: &str = include_str!("../assets/console.js");

pub(crate) async fn css() -> Response {
    asset("text/css; charset=utf-8", CSS)
}

pub(crate) async fn js() -> Response {
    asset("text/javascript; charset=utf-8", JS)
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "public, max-age=3600"),
        ],
        body,
    )
        .into_response()
}

//! What more than one sink uses, in one place: destination-name templates
//! ([`KeyTemplate`]), sink-URL parameters (`params`), the HTTP plumbing of the
//! HTTP and QStash sinks (`http`: the client, URL checks, answers to
//! outcomes, `Retry-After`) and the request rate limit (`rate`, on
//! `governor`).

pub(crate) mod http;
pub(crate) mod params;
pub(crate) mod rate;
mod template;

pub(crate) use template::with_placeholders_filled;
pub use template::KeyTemplate;

//! What more than one sink uses, in one place: destination-name templates
//! ([`KeyTemplate`]), sink-URL parameters (`params`), the HTTP plumbing of the
//! HTTP and QStash sinks (`http`: the client, URL checks, answers to
//! outcomes, `Retry-After`), the AWS sinks' configuration and batching
//! (`aws`) and the request rate limit (`rate`, on
//! `governor`). Each part is built only with the sinks that use it.

#[cfg(feature = "aws")]
pub(crate) mod aws;
#[cfg(any(feature = "http", feature = "qstash"))]
pub(crate) mod http;
#[cfg(any(
    feature = "redis",
    feature = "nats",
    feature = "amqp",
    feature = "kafka",
    feature = "http",
    feature = "aws"
))]
pub(crate) mod params;
#[cfg(feature = "http")]
pub(crate) mod rate;
mod template;

#[cfg(any(feature = "nats", feature = "kafka"))]
pub(crate) use template::with_placeholders_filled;
pub use template::KeyTemplate;

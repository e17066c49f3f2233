//! The metric names `postbox group serve` exports (beside the server's
//! `/metrics` endpoint, like the relay's). The `group` label is always the
//! group a checked token opens, never a name from a refused request, so a
//! stranger cannot grow the label set.

/// Calls answered, by `group`, `call` (receive, ack, nack) and `outcome`
/// (ok, bad_request, not_found, unavailable, error).
pub const REQUESTS: &str = "postbox_pull_requests_total";
/// Requests refused before their call ran, by `reason` (no_token,
/// unknown_token, wrong_group, rate_limited, unavailable).
pub const REFUSED: &str = "postbox_pull_refused_total";
/// Events handed out over HTTP, by `group`.
pub const EVENTS_RECEIVED: &str = "postbox_pull_events_received_total";
/// Events acknowledged over HTTP, by `group`.
pub const EVENTS_ACKNOWLEDGED: &str = "postbox_pull_events_acknowledged_total";
/// Events given back (nacked) over HTTP, by `group`.
pub const EVENTS_NACKED: &str = "postbox_pull_events_nacked_total";

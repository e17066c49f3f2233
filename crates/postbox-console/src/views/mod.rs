//! What the pages share to render: the frame every page is drawn in
//! ([`layout`], [`Frame`]), small formatting helpers, and the parts more than
//! one page shows (`charts`, `audit`). maud templates: every value is
//! HTML-escaped unless it is markup built here.

pub(crate) mod audit;
pub(crate) mod charts;

use crate::auth::Session;
use chrono::{DateTime, Utc};
use maud::{html, Markup, DOCTYPE};
use postbox_store::Status;

/// Which navigation entry is current.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Nav {
    Outboxes,
    Overview,
    Events,
    DeadLetters,
    Replays,
    Audit,
    None,
}

/// Who is looking, and at which outbox. Every link of an outbox's pages is
/// made with [`Frame::at`], under the outbox's prefix.
pub(crate) struct Frame<'a> {
    pub session: &'a Session,
    /// The outbox's path prefix: empty above the outboxes, or when the
    /// console serves one outbox at `/`.
    pub base: &'a str,
    /// The outbox's name, when the console serves many and the page is one
    /// outbox's.
    pub outbox: Option<&'a str>,
    /// Whether the console serves many outboxes.
    pub many: bool,
}

impl Frame<'_> {
    /// `path` (starting with `/`) inside the current outbox's pages.
    pub fn at(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

impl std::ops::Deref for Frame<'_> {
    type Target = Session;

    fn deref(&self) -> &Session {
        self.session
    }
}

pub(crate) fn layout(title: &str, here: Option<&Frame<'_>>, nav: Nav, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · postbox console" }
                link rel="stylesheet" href="/static/console.css";
                script src="/static/console.js" defer {}
            }
            body {
                header.top {
                    a.brand href="/" { "postbox" }
                    @if let Some(h) = here {
                        nav {
                            @if h.many {
                                a href="/" aria-current=[current(nav == Nav::Outboxes)] { "All outboxes" }
                            }
                            @if let Some(name) = h.outbox {
                                span.outbox #outbox-name { (name) }
                            }
                            @if h.outbox.is_some() || !h.many {
                                a href=(h.at("/")) aria-current=[current(nav == Nav::Overview)] { "Overview" }
                                a href=(h.at("/events")) aria-current=[current(nav == Nav::Events)] { "Events" }
                                a href=(h.at("/dead-letters")) aria-current=[current(nav == Nav::DeadLetters)] { "Dead letters" }
                                a href=(h.at("/replays")) aria-current=[current(nav == Nav::Replays)] { "Replays" }
                            }
                            a href=(h.at("/audit")) aria-current=[current(nav == Nav::Audit)] {
                                @if h.many && h.outbox.is_none() { "Sign-in log" } @else { "Audit log" }
                            }
                        }
                        div.who {
                            span.user { (h.user) " · " (h.role.as_str()) }
                            form.inline method="post" action="/sign-out" {
                                input type="hidden" name="csrf" value=(h.csrf);
                                button.link type="submit" { "Sign out" }
                            }
                        }
                    }
                }
                main { (body) }
            }
        }
    }
}

pub(crate) fn current(yes: bool) -> Option<&'static str> {
    yes.then_some("page")
}

pub(crate) fn time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

pub(crate) fn opt_time(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(|| "—".to_owned(), time)
}

/// A duration in seconds, for people: `45s`, `12m 03s`, `3h 20m`, `2d 4h`.
pub(crate) fn age(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m {:02}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h {:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {}h", s / 86_400, (s % 86_400) / 3600),
    }
}

/// At most `max` characters on one line, a cut marked with `…`.
pub(crate) fn clip(s: &str, max: usize) -> String {
    let line = s.replace(['\n', '\r'], " ");
    if line.chars().count() <= max {
        return line;
    }
    let mut out: String = line.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

pub(crate) fn status_badge(status: Status, resolution: Option<&str>) -> Markup {
    let (class, label) = match (status, resolution) {
        (Status::Failed, Some("discarded")) => ("muted", "discarded"),
        (Status::Failed, Some("replaced")) => ("muted", "replaced"),
        (Status::Failed, _) => ("bad", "dead letter"),
        (Status::Sent, _) => ("good", "sent"),
        (Status::Processing, _) => ("busy", "processing"),
        (Status::Pending, _) => ("wait", "pending"),
    };
    html! { span class={"badge " (class)} { (label) } }
}

/// The line that says a page keeps itself up to date, and how often; the
/// script refreshes the page's `data-live` parts in place (see console.js).
pub(crate) fn live_status(refresh_ms: u64) -> Markup {
    html! {
        p.live.muted.small #live-status data-refresh-ms=(refresh_ms) {
            "Updates by itself every " (refresh_ms.div_ceil(1000)) " s (with scripts on)."
        }
    }
}

pub(crate) fn notice(text: Option<&str>) -> Markup {
    html! {
        @if let Some(t) = text {
            p.notice role="status" { (t) }
        }
    }
}

/// The sentence a page's `notice` code stands for (after a replay, a
/// discard, or an action that did nothing).
pub(crate) fn notice_text(code: Option<&str>) -> Option<&'static str> {
    match code? {
        "replayed" => Some("Replayed: the event is pending again under the same id, with its attempts reset, due now."),
        "discarded" => Some("Discarded: the event stays in the table, resolved as discarded with your reason."),
        "not-dead" => Some("Nothing was done: the event is not an unresolved dead letter (any more)."),
        "none-selected" => Some("Nothing was done: select at least one dead letter first."),
        "group-gone" => Some("Nothing was done: that group has no unresolved dead letters any more."),
        "replay-cancelled" => Some("Cancelled, and recorded in the audit log: a runner still delivering it stops after its current page, and retention no longer keeps its events for it."),
        "replay-not-open" => Some("Nothing was done: the replay job had already ended (done or cancelled)."),
        _ => None,
    }
}

/// `path?query&key=cursor`: the link to a list's next page.
pub(crate) fn with_cursor(path: &str, query: &str, key: &str, cursor: i64) -> String {
    if query.is_empty() {
        format!("{path}?{key}={cursor}")
    } else {
        format!("{path}?{query}&{key}={cursor}")
    }
}

pub(crate) fn error_page(title: &str, text: &str) -> Markup {
    layout(
        title,
        None,
        Nav::None,
        html! {
            h1 { (title) }
            p { (text) }
            p { a href="/" { "Back to the overview" } }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_naturally() {
        assert_eq!(age(0.4), "0s");
        assert_eq!(age(75.0), "1m 15s");
        assert_eq!(age(3600.0 * 3.0 + 120.0), "3h 02m");
        assert_eq!(age(86_400.0 * 2.0 + 3600.0), "2d 1h");
    }

    #[test]
    fn user_data_is_escaped() {
        let page = error_page("<b>x</b>", "\"quoted\" & <script>alert(1)</script>");
        let s = page.into_string();
        assert!(!s.contains("<script>alert"), "{s}");
        assert!(s.contains("&lt;script&gt;"), "{s}");
        assert!(s.contains("&lt;b&gt;x&lt;/b&gt;"), "{s}");
    }
}

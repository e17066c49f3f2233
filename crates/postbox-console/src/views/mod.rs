//! The pages, as maud templates: every value is HTML-escaped unless it is
//! markup built here.

use crate::auth::Session;
use crate::jobs::{Job, JobState};
use crate::samples::Sample;
use chrono::{DateTime, Utc};
use maud::{html, Markup, DOCTYPE};
use postbox_store::{
    AuditEntry, Backlog, CursorLag, DeliveryRecord, DestinationCounts, ErrorGroup, EventRecord,
    EventRow, GroupOf, ProducerTarget, RecentDeliveries, RelaySeen, Status, StatusCounts,
};
use serde_json::Value;
use uuid::Uuid;

/// Which navigation entry is current.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Nav {
    Outboxes,
    Overview,
    Events,
    DeadLetters,
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

fn current(yes: bool) -> Option<&'static str> {
    yes.then_some("page")
}

pub(crate) fn time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

fn opt_time(t: Option<DateTime<Utc>>) -> String {
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

/// A list row's state in words that say what is true now: a pending event
/// that failed before is retrying (with its next attempt's time), a claimed
/// one is held by a relay (or its lease ran out).
fn row_state(r: &EventRow) -> Markup {
    let now = Utc::now();
    match r.status {
        Status::Pending if r.attempts > 0 => html! {
            span.badge.retry { "retrying" }
            br;
            span.small.muted.next-attempt {
                @if r.available_at > now {
                    "attempt " (r.attempts) " failed; next at " (r.available_at.format("%H:%M:%S UTC"))
                } @else {
                    "attempt " (r.attempts) " failed; next one due now"
                }
            }
        },
        Status::Processing => html! {
            span.badge.busy { "claimed" }
            br;
            span.small.muted {
                @match r.lease_expires_at {
                    Some(t) if t < now => { "lease expired; will be put back" }
                    _ => { "by a relay, attempt " (r.attempts) }
                }
            }
        },
        _ => status_badge(r.status, r.resolution.as_deref()),
    }
}

fn status_badge(status: Status, resolution: Option<&str>) -> Markup {
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
fn live_status(refresh_ms: u64) -> Markup {
    html! {
        p.live.muted.small #live-status data-refresh-ms=(refresh_ms) {
            "Updates by itself every " (refresh_ms.div_ceil(1000)) " s (with scripts on)."
        }
    }
}

fn notice(text: Option<&str>) -> Markup {
    html! {
        @if let Some(t) = text {
            p.notice role="status" { (t) }
        }
    }
}

pub(crate) struct SignInView<'a> {
    pub csrf: &'a str,
    pub next: &'a str,
    pub name: &'a str,
    pub error: Option<&'a str>,
}

pub(crate) fn sign_in(v: &SignInView<'_>) -> Markup {
    layout(
        "Sign in",
        None,
        Nav::None,
        html! {
            section.signin {
                h1 { "Sign in" }
                @if let Some(e) = v.error {
                    p.error role="alert" { (e) }
                }
                form method="post" action="/sign-in" {
                    input type="hidden" name="csrf" value=(v.csrf);
                    input type="hidden" name="next" value=(v.next);
                    label for="name" { "User" }
                    input #name type="text" name="name" value=(v.name) autocomplete="username"
                        autocapitalize="none" required autofocus;
                    label for="password" { "Password" }
                    input #password type="password" name="password" autocomplete="current-password" required;
                    button.primary type="submit" { "Sign in" }
                }
            }
        },
    )
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

pub(crate) struct OverviewView<'a> {
    /// The schema's name, or serving many, the outbox's.
    pub schema: &'a str,
    pub counts: &'a StatusCounts,
    pub destinations: &'a [DestinationCounts],
    /// (minute, delivered) for each of the last minutes, oldest first, zeros included.
    pub rate: &'a [(DateTime<Utc>, i64)],
    pub relays: &'a [RelaySeen],
    pub jobs: &'a [Job],
    /// The backlog's samples, oldest first, the last one taken now.
    pub history: &'a [Sample],
    /// Log mode: which table producers write to, and each cursor's lag.
    pub producers: ProducerTarget,
    pub cursors: &'a [CursorLag],
    /// Deliveries per destination and reading mode over the rate's window.
    pub recent: &'a [RecentDeliveries],
    pub refresh_ms: u64,
}

pub(crate) fn overview(here: &Frame<'_>, v: &OverviewView<'_>) -> Markup {
    let c = v.counts;
    let now = v.history.last().map(|s| s.backlog).unwrap_or_default();
    let delivered: i64 = v.rate.iter().map(|(_, n)| n).sum();
    let minutes = v.rate.len();
    layout(
        "Overview",
        Some(here),
        Nav::Overview,
        html! {
            h1 { "Overview " span.sub { @if here.many { "outbox " } @else { "schema " } (v.schema) } }
            (live_status(v.refresh_ms))
            div #overview-live data-live {
            div.cards {
                a.card href=(here.at("/events?status=pending")) {
                    span.label { "Pending" } span.value #pending { (c.pending) }
                    span.hint { (now.retrying) " of them retrying" }
                }
                div.card {
                    span.label { "Scheduled" } span.value #scheduled { (c.scheduled) }
                    span.hint {
                        @if let Some(next) = c.next_scheduled_in_seconds {
                            "the first due in " (age(next))
                        } @else {
                            "for later delivery"
                        }
                    }
                }
                div.card.(if c.oldest_pending_age_seconds.unwrap_or(0.0) > 300.0 { "warn" } else { "" }) {
                    span.label { "Oldest pending" }
                    span.value #oldest-pending {
                        (c.oldest_pending_age_seconds.map_or_else(|| "—".to_owned(), age))
                    }
                }
                a.card href=(here.at("/events?status=processing")) {
                    span.label { "Claimed by a relay" } span.value #processing { (c.processing) }
                }
                a.card href=(here.at("/events?status=sent")) {
                    span.label { "Sent" } span.value { (c.sent) }
                    span.hint { "outbox rows (claim mode, hand-offs)" }
                }
                a.card.(if c.failed > 0 { "bad" } else { "" }) href=(here.at("/dead-letters")) {
                    span.label { "Dead letters" } span.value #dead-letters { (c.failed) }
                }
                div.card {
                    span.label { "Delivered, last " (minutes) " min" }
                    span.value { (delivered) }
                }
            }
            div.charts {
                section {
                    h2 { "Backlog" }
                    (backlog_chart(v.history))
                }
                section {
                    h2 { "Oldest pending event" }
                    (age_chart(v.history))
                }
                section {
                    h2 { "Delivered per minute" }
                    (rate_chart(v.rate))
                }
            }
            section {
                h2 { "Delivered by destination " span.sub { "last " (minutes) " min, every reading mode" } }
                @if v.recent.is_empty() {
                    p.muted { "No delivery counted in this window (relays count their deliveries by minute)." }
                } @else {
                    div.scroll { table #delivered-by-destination {
                        thead { tr { th { "Destination" } th { "Read from" } th.num { "Delivered" } } }
                        tbody {
                            @for r in v.recent {
                                tr {
                                    td { (r.destination) }
                                    td { (match r.mode.as_str() { "claim" => "the outbox", "log" => "the log", "logical" => "the slot", other => other }) }
                                    td.num { (r.delivered) }
                                }
                            }
                        }
                    } }
                }
            }
            section {
                h2 { "Destinations" }
                @if v.destinations.is_empty() {
                    p.muted { "No per-destination state recorded: fan-out events that reached every destination at the first try leave none." }
                } @else {
                    div.scroll { table {
                        thead { tr { th { "Destination" } th.num { "Retrying" } th.num { "Dead letters" } th.num { "Delivered after retry" } th.num { "Most attempts" } } }
                        tbody {
                            @for d in v.destinations {
                                tr {
                                    td { (d.destination) }
                                    td.num { (d.retrying) }
                                    td.num { (d.dead_letters) }
                                    td.num { (d.delivered_after_retry) }
                                    td.num { (d.max_attempts) }
                                }
                            }
                        }
                    } }
                }
            }
            @if v.producers == ProducerTarget::Log || !v.cursors.is_empty() {
                section {
                    h2 { "Log cursors " span.sub { "producers write to the " (v.producers.as_str()) } }
                    @if v.cursors.is_empty() {
                        p.muted { "No cursor yet: a relay in log mode creates one per destination when it starts." }
                    } @else {
                        div.scroll { table #log-cursors {
                            thead { tr { th { "Destination" } th { "Held by a relay" } th.num { "Behind (events)" } th { "Oldest unread" } th.num { "Delivered" } } }
                            tbody {
                                @for c in v.cursors {
                                    tr.(if c.lag_seconds.unwrap_or(0.0) > 60.0 || c.unread_seconds > 300.0 { "warn" } else { "" }) {
                                        td { (c.destination) }
                                        td {
                                            @if c.held { "yes" }
                                            @else if c.unread_seconds > 300.0 {
                                                "NOT READ for " (age(c.unread_seconds)) ": it keeps the log from being truncated (postbox log drop-cursor " (c.destination) " if the destination was removed)"
                                            } @else { "no" }
                                        }
                                        td.num { (c.lag_events) }
                                        td { (c.lag_seconds.map_or_else(|| "caught up".to_owned(), age)) }
                                        td.num { (c.delivered) }
                                    }
                                }
                            }
                        } }
                    }
                }
            }
            section {
                h2 { "Relays connected now" }
                @if v.relays.is_empty() {
                    p.warn-text { "No relay is connected to this database (no session named postbox-relay)." }
                } @else {
                    div.scroll { table #relays {
                        thead { tr { th { "Client" } th.num { "Connections" } th { "Connected since" } th { "Last active" } } }
                        tbody {
                            @for r in v.relays {
                                tr {
                                    td { (r.client) }
                                    td.num { (r.connections) }
                                    td { (opt_time(r.connected_since)) }
                                    td { (opt_time(r.last_active)) }
                                }
                            }
                        }
                    } }
                }
                p.muted.small { "Relays of every schema in this database are listed; other roles' addresses show only with pg_monitor." }
            }
            section {
                h2 { "Lost acknowledgements" }
                p.muted { "Not kept in the database: each relay counts them in "
                    code { "postbox_acks_lost_total" } " on its " code { "/metrics" }
                    " endpoint (a settlement refused because a newer lease held the event: a duplicate delivery, never a loss)." }
            }
            @if !v.jobs.is_empty() {
                section {
                    h2 { "Recent bulk actions" }
                    (jobs_table(here, v.jobs))
                }
            }
            }
        },
    )
}

/// How the all-outboxes overview is ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OutboxOrder {
    /// Most dead letters first (the default).
    DeadLetters,
    Pending,
    Retrying,
    OldestPending,
    Name,
}

impl OutboxOrder {
    pub const ALL: [OutboxOrder; 5] = [
        OutboxOrder::DeadLetters,
        OutboxOrder::Pending,
        OutboxOrder::Retrying,
        OutboxOrder::OldestPending,
        OutboxOrder::Name,
    ];

    pub fn key(self) -> &'static str {
        match self {
            OutboxOrder::DeadLetters => "dead",
            OutboxOrder::Pending => "pending",
            OutboxOrder::Retrying => "retrying",
            OutboxOrder::OldestPending => "age",
            OutboxOrder::Name => "name",
        }
    }

    pub fn parse(key: Option<&str>) -> Self {
        Self::ALL
            .into_iter()
            .find(|o| Some(o.key()) == key)
            .unwrap_or(OutboxOrder::DeadLetters)
    }
}

pub(crate) struct OutboxesView<'a> {
    /// This page's lines, in order.
    pub lines: &'a [crate::outboxes::Line],
    /// Servers or databases whose outboxes could not be listed.
    pub problems: &'a [crate::outboxes::Problem],
    /// Outboxes in all, and how many could not be read.
    pub outboxes: usize,
    pub unreadable: usize,
    /// The backlog of every readable outbox together.
    pub total: Backlog,
    pub order: OutboxOrder,
    /// 1-based.
    pub page: usize,
    pub pages: usize,
    /// How long reading every outbox's backlog took.
    pub took: std::time::Duration,
    /// How long ago that read was (the overview's counts are shared for a
    /// few seconds).
    pub age: std::time::Duration,
    pub refresh_ms: u64,
}

fn outboxes_link(order: OutboxOrder, page: usize) -> String {
    let mut q = url::form_urlencoded::Serializer::new(String::new());
    if order != OutboxOrder::DeadLetters {
        q.append_pair("sort", order.key());
    }
    if page > 1 {
        q.append_pair("page", &page.to_string());
    }
    let q = q.finish();
    if q.is_empty() {
        "/".to_owned()
    } else {
        format!("/?{q}")
    }
}

/// The landing page of a console serving many outboxes: one line per
/// outbox, those that cannot be read first, then by the chosen order.
pub(crate) fn outboxes(here: &Frame<'_>, v: &OutboxesView<'_>) -> Markup {
    let heading = |order: OutboxOrder, label: &str, num: bool| {
        html! {
            th.num[num] {
                @if v.order == order {
                    span aria-current="true" { (label) " ▾" }
                } @else {
                    a href=(outboxes_link(order, 1)) { (label) }
                }
            }
        }
    };
    layout(
        "All outboxes",
        Some(here),
        Nav::Outboxes,
        html! {
            h1 { "All outboxes" }
            (live_status(v.refresh_ms))
            div #outboxes-live data-live {
                p #outboxes-summary {
                    strong { (v.outboxes) } " outbox(es)"
                    @if v.unreadable > 0 { ", " strong.warn-text { (v.unreadable) } " that cannot be read" }
                    ": " strong { (v.total.pending) } " pending (" (v.total.retrying) " retrying), "
                    strong { (v.total.dead_letters) } " dead letter(s). "
                    span.muted.small {
                        "Read in " (v.took.as_millis()) " ms"
                        @if v.age.as_secs() >= 1 { ", " (v.age.as_secs()) " s ago" }
                        "."
                    }
                }
                @for p in v.problems {
                    p.error.problem role="alert" { strong { (p.what) } ": " (p.why) }
                }
                @if v.lines.is_empty() {
                    p.muted { "No outbox matches the console's selection (yet): outboxes are listed again every few seconds." }
                } @else {
                    div.scroll { table.outboxes.stack #outboxes {
                        thead { tr {
                            (heading(OutboxOrder::Name, "Outbox", false))
                            (heading(OutboxOrder::Pending, "Pending", true))
                            (heading(OutboxOrder::Retrying, "Retrying", true))
                            (heading(OutboxOrder::DeadLetters, "Dead letters", true))
                            (heading(OutboxOrder::OldestPending, "Oldest pending", false))
                        } }
                        tbody {
                            @for line in v.lines {
                                @let o = &line.outbox;
                                @match &line.backlog {
                                    Ok(b) => {
                                        tr data-outbox=(o.name) class=[(b.dead_letters > 0).then_some("bad")] {
                                            td { a href=(o.at("/")) { (o.name) } }
                                            td.num.pending { a href=(o.at("/events?status=pending")) { (b.pending + b.retrying) } }
                                            td.num.retrying { (b.retrying) }
                                            td.num.dead { a href=(o.at("/dead-letters")) { (b.dead_letters) } }
                                            td.age { (b.oldest_pending_age_seconds.map_or_else(|| "—".to_owned(), age)) }
                                        }
                                    }
                                    Err(why) => {
                                        tr.error data-outbox=(o.name) {
                                            td { a href=(o.at("/")) { (o.name) } }
                                            td.error-text colspan="4" { "Cannot be read: " (why) }
                                        }
                                    }
                                }
                            }
                        }
                    } }
                }
                @if v.pages > 1 {
                    p.pager {
                        @if v.page > 1 { a href=(outboxes_link(v.order, v.page - 1)) { "← Previous" } " " }
                        "Page " (v.page) " of " (v.pages)
                        @if v.page < v.pages { " " a href=(outboxes_link(v.order, v.page + 1)) { "Next →" } }
                    }
                }
            }
            p.muted.small { "Pending counts every due event (retrying ones included); scheduled events are left out until due. Outboxes that cannot be read are listed first." }
        },
    )
}

/// A chart's drawing area inside its 600×200 view box: room on the left for
/// the value axis's labels and at the bottom for the time axis's.
const CHART_W: f64 = 600.0;
const CHART_H: f64 = 200.0;
const PLOT_LEFT: f64 = 76.0;
const PLOT_RIGHT: f64 = 592.0;
const PLOT_TOP: f64 = 12.0;
const PLOT_BOTTOM: f64 = 170.0;

/// The smallest "round" number (1, 2 or 5 × 10ⁿ) at or above `max`, at least 1.
fn nice_ceiling(max: f64) -> f64 {
    if max <= 1.0 {
        return 1.0;
    }
    let magnitude = 10_f64.powf(max.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|v| *v >= max)
        .unwrap_or(10.0 * magnitude)
}

/// The axes of a chart: value labels (0, half, top) and time labels (start,
/// middle, end), with light grid lines.
fn axes(
    top: f64,
    label: &dyn Fn(f64) -> String,
    start: DateTime<Utc>,
    end: DateTime<Utc>,
) -> Markup {
    let mid = start + (end - start) / 2;
    html! {
        @for (value, y) in [(0.0, PLOT_BOTTOM), (top / 2.0, (PLOT_TOP + PLOT_BOTTOM) / 2.0), (top, PLOT_TOP)] {
            line.grid x1=(PLOT_LEFT) y1=(y) x2=(PLOT_RIGHT) y2=(y) {}
            text.tick x=(PLOT_LEFT - 8.0) y=(y + 6.0) text-anchor="end" { (label(value)) }
        }
        line.axis x1=(PLOT_LEFT) y1=(PLOT_TOP) x2=(PLOT_LEFT) y2=(PLOT_BOTTOM) {}
        line.axis x1=(PLOT_LEFT) y1=(PLOT_BOTTOM) x2=(PLOT_RIGHT) y2=(PLOT_BOTTOM) {}
        @for (t, x, anchor) in [(start, PLOT_LEFT, "start"), (mid, (PLOT_LEFT + PLOT_RIGHT) / 2.0, "middle"), (end, PLOT_RIGHT, "end")] {
            text.tick x=(x) y=(CHART_H - 6.0) text-anchor=(anchor) { (t.format("%H:%M")) }
        }
    }
}

/// One line of a line chart.
struct Series<'a> {
    name: &'a str,
    class: &'a str,
    points: Vec<(DateTime<Utc>, f64)>,
}

/// Lines over the last [`crate::samples::HISTORY`], up to the last sample.
fn line_chart(
    id: &str,
    label: &str,
    series: &[Series<'_>],
    value: &dyn Fn(f64) -> String,
) -> Markup {
    let end = series
        .iter()
        .filter_map(|s| s.points.last().map(|p| p.0))
        .max()
        .unwrap_or_else(Utc::now);
    let start = end - chrono::Duration::from_std(crate::samples::HISTORY).unwrap_or_default();
    let span = (end - start).num_milliseconds().max(1) as f64;
    let max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0_f64, f64::max);
    let top = nice_ceiling(max);
    let x = |t: DateTime<Utc>| {
        PLOT_LEFT + (t - start).num_milliseconds().max(0) as f64 / span * (PLOT_RIGHT - PLOT_LEFT)
    };
    let y = |v: f64| PLOT_BOTTOM - v / top * (PLOT_BOTTOM - PLOT_TOP);
    html! {
        figure.chart {
            svg #(id) viewBox={"0 0 " (CHART_W) " " (CHART_H)} role="img" aria-label=(label) {
                (axes(top, value, start, end))
                @for s in series {
                    @let pts: Vec<String> = s.points.iter().map(|(t, v)| format!("{:.1},{:.1}", x(*t), y(*v))).collect();
                    @if pts.len() == 1 {
                        circle class=(s.class) data-series=(s.name) cx=(format!("{:.1}", x(s.points[0].0))) cy=(format!("{:.1}", y(s.points[0].1))) r="3" {}
                    } @else {
                        polyline class=(s.class) data-series=(s.name) points=(pts.join(" ")) {}
                    }
                }
            }
            figcaption.legend {
                @for s in series {
                    span { i class={"swatch " (s.class)} {} (s.name) ": " strong { (s.points.last().map_or_else(String::new, |p| value(p.1))) } }
                }
            }
        }
    }
}

fn backlog_chart(history: &[Sample]) -> Markup {
    let series = |name, class, f: fn(&Sample) -> i64| Series {
        name,
        class,
        points: history.iter().map(|s| (s.at, f(s) as f64)).collect(),
    };
    line_chart(
        "backlog-chart",
        "Pending, retrying and dead-letter events over the last 30 minutes",
        &[
            series("pending", "s-pending", |s| s.backlog.pending),
            series("retrying", "s-retrying", |s| s.backlog.retrying),
            series("dead letters", "s-dead", |s| s.backlog.dead_letters),
        ],
        &|v| format!("{v:.0}"),
    )
}

fn age_chart(history: &[Sample]) -> Markup {
    line_chart(
        "age-chart",
        "Age of the oldest pending event over the last 30 minutes",
        &[Series {
            name: "oldest pending",
            class: "s-age",
            points: history
                .iter()
                .map(|s| (s.at, s.backlog.oldest_pending_age_seconds.unwrap_or(0.0)))
                .collect(),
        }],
        &age,
    )
}

fn rate_chart(rate: &[(DateTime<Utc>, i64)]) -> Markup {
    let peak = rate.iter().map(|(_, n)| *n).max().unwrap_or(0);
    let top = nice_ceiling(peak as f64);
    let n = rate.len().max(1);
    let slot = (PLOT_RIGHT - PLOT_LEFT) / n as f64;
    let bar = (slot * 0.8).max(1.0);
    let label = format!(
        "Events delivered per minute over the last {} minutes; peak {} per minute",
        rate.len(),
        peak
    );
    let start = rate.first().map_or_else(Utc::now, |r| r.0);
    let end = rate.last().map_or_else(Utc::now, |r| r.0);
    html! {
        figure.chart {
            svg #rate-chart viewBox={"0 0 " (CHART_W) " " (CHART_H)} role="img" aria-label=(label) {
                (axes(top, &|v| format!("{v:.0}"), start, end))
                @for (i, (minute, count)) in rate.iter().enumerate() {
                    @let h = if *count == 0 { 0.0 } else { (*count as f64 / top * (PLOT_BOTTOM - PLOT_TOP)).max(2.0) };
                    rect x=(format!("{:.1}", PLOT_LEFT + i as f64 * slot + (slot - bar) / 2.0)) y=(format!("{:.1}", PLOT_BOTTOM - h))
                        width=(format!("{bar:.1}")) height=(format!("{h:.1}")) {
                        title { (minute.format("%H:%M UTC")) ": " (count) }
                    }
                }
            }
            figcaption {
                "Events delivered per minute (UTC); peak " strong { (peak) } " per minute."
            }
        }
    }
}

fn jobs_table(here: &Frame<'_>, jobs: &[Job]) -> Markup {
    html! {
        div.scroll { table {
            thead { tr { th { "Started" } th { "By" } th { "Action" } th { "Progress" } th { "State" } } }
            tbody {
                @for j in jobs {
                    tr {
                        td { a href=(here.at(&format!("/jobs/{}", j.id))) { (time(j.started_at)) } }
                        td { (j.owner) }
                        td { (j.verb) " " (j.what) }
                        td.num { (j.done) " / " (j.total) }
                        td { (j.state.as_str()) }
                    }
                }
            }
        } }
    }
}

/// The search form's values, echoed back.
#[derive(Default)]
pub(crate) struct EventSearch {
    pub event_id: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub status: String,
    pub from: String,
    pub to: String,
}

impl EventSearch {
    /// The query string of this search (without the page cursor).
    pub fn query(&self) -> String {
        let mut q = url::form_urlencoded::Serializer::new(String::new());
        for (k, v) in [
            ("event_id", &self.event_id),
            ("aggregate_type", &self.aggregate_type),
            ("aggregate_id", &self.aggregate_id),
            ("type", &self.event_type),
            ("status", &self.status),
            ("from", &self.from),
            ("to", &self.to),
        ] {
            if !v.is_empty() {
                q.append_pair(k, v);
            }
        }
        q.finish()
    }
}

const STATUSES: &[(&str, &str)] = &[
    ("", "any"),
    ("pending", "pending"),
    ("processing", "processing"),
    ("sent", "sent"),
    ("dead", "dead letter"),
    ("discarded", "discarded"),
    ("replaced", "replaced"),
    ("failed", "failed (any resolution)"),
];

pub(crate) fn events(
    here: &Frame<'_>,
    search: &EventSearch,
    rows: &[EventRow],
    next: Option<String>,
    error: Option<&str>,
    refresh_ms: u64,
) -> Markup {
    layout(
        "Events",
        Some(here),
        Nav::Events,
        html! {
            h1 { "Events" }
            form.search method="get" action=(here.at("/events")) {
                div.fields {
                    label.wide { "Event id" input type="text" name="event_id" value=(search.event_id) placeholder="0190f3c2-…" autocapitalize="none"; }
                    label { "Event type" input type="text" name="type" value=(search.event_type) autocapitalize="none"; }
                    label { "Aggregate type" input type="text" name="aggregate_type" value=(search.aggregate_type) autocapitalize="none"; }
                    label { "Aggregate id" input type="text" name="aggregate_id" value=(search.aggregate_id) autocapitalize="none"; }
                    label { "Status"
                        select name="status" {
                            @for (value, text) in STATUSES {
                                option value=(value) selected[search.status == *value] { (text) }
                            }
                        }
                    }
                    label { "Created from" input type="text" name="from" value=(search.from) placeholder="2h or 2026-05-01T12:00"; }
                    label { "Created before" input type="text" name="to" value=(search.to) placeholder="UTC"; }
                }
                button.primary type="submit" { "Search" }
                " " a href=(here.at("/events")) { "Clear" }
            }
            @if let Some(e) = error {
                p.error role="alert" { (e) }
            }
            (live_status(refresh_ms))
            div #events-live data-live {
                @if rows.is_empty() {
                    p.muted { "No events match." }
                } @else {
                    (event_table(here, rows))
                }
                @if let Some(n) = next {
                    p.pager { a href=(n) { "Older events →" } }
                }
            }
        },
    )
}

fn event_table(here: &Frame<'_>, rows: &[EventRow]) -> Markup {
    html! {
        div.scroll { table.events.stack {
            thead { tr { th { "Created" } th { "Event" } th { "Aggregate" } th { "Status" } th.num { "Attempts" } th { "Last error" } } }
            tbody {
                @for r in rows {
                    tr {
                        td.nowrap { (time(r.created_at)) }
                        td { a href=(here.at(&format!("/events/{}", r.event_id))) { (r.event_type) } br; span.id { (r.event_id) } }
                        td { (r.aggregate_type) "/" (r.aggregate_id) }
                        td.state { (row_state(r)) }
                        td.num.attempts { (r.attempts) }
                        td.error-text { (clip(r.last_error.as_deref().unwrap_or(""), 120)) }
                    }
                }
            }
        } }
    }
}

pub(crate) struct EventView<'a> {
    pub event: &'a EventRecord,
    pub deliveries: &'a [DeliveryRecord],
    pub audit: &'a [AuditEntry],
    pub redacted: bool,
    pub notice: Option<&'a str>,
}

/// What happened to an event, from what the database keeps.
fn timeline(v: &EventView<'_>) -> Vec<(DateTime<Utc>, String)> {
    let e = v.event;
    let mut items = vec![(
        e.created_at,
        match e.sequence {
            Some(n) => format!("Enqueued (number {n} of its aggregate)"),
            None => "Enqueued".to_owned(),
        },
    )];
    for d in v.deliveries {
        let what = match (d.status, &d.last_error) {
            (Status::Sent, _) => format!(
                "Delivered to {} after {} attempt(s)",
                d.destination, d.attempts
            ),
            (Status::Failed, Some(err)) => format!(
                "Destination {} gave up after {} attempt(s): {}",
                d.destination, d.attempts, err
            ),
            (_, Some(err)) => format!(
                "Destination {} failed attempt {}: {}",
                d.destination, d.attempts, err
            ),
            (s, None) => format!("Destination {}: {s}", d.destination),
        };
        items.push((d.sent_at.unwrap_or(d.updated_at), what));
    }
    for a in v.audit {
        let verb = match a.action.as_str() {
            "dlq.replay" => "Replayed under the same id",
            "dlq.replay_new_id" => "Replayed as a new event",
            "dlq.discard" => "Discarded",
            other => other,
        };
        let mut text = format!("{verb} by {}", a.actor);
        if let Some(r) = &a.reason {
            text.push_str(&format!(" (reason: {r})"));
        }
        items.push((a.at, text));
    }
    if let Some(at) = e.sent_at {
        items.push((at, "Delivered and acknowledged".to_owned()));
    }
    match e.status {
        Status::Pending if e.attempts > 0 => items.push((
            e.available_at,
            format!(
                "Attempt {} failed; next attempt due{}",
                e.attempts,
                e.last_error
                    .as_deref()
                    .map(|er| format!(" (last error: {er})"))
                    .unwrap_or_default()
            ),
        )),
        Status::Failed => items.push((
            e.available_at,
            format!(
                "Last attempt ({}) due; the relay gave up and made it a dead letter{}",
                e.attempts,
                e.last_error
                    .as_deref()
                    .map(|er| format!(": {er}"))
                    .unwrap_or_default()
            ),
        )),
        Status::Processing => {
            if let Some(until) = e.lease_expires_at {
                items.push((
                    until,
                    format!("Claimed by a relay (attempt {}); lease expires", e.attempts),
                ));
            }
        }
        _ => {}
    }
    if let (Some(at), Some(res)) = (e.resolved_at, &e.resolution) {
        items.push((at, format!("Resolved as {res}")));
    }
    items.sort_by_key(|(t, _)| *t);
    items
}

/// One sentence on where the event stands and why.
fn diagnosis(e: &EventRecord) -> String {
    let now = Utc::now();
    match (e.status, e.resolution.as_deref()) {
        (Status::Sent, _) => "Delivered.".to_owned(),
        (Status::Failed, Some("discarded")) => format!(
            "Discarded by an operator{}.",
            e.resolution_note
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default()
        ),
        (Status::Failed, Some("replaced")) => "Replayed as a new event (see “replaced by”).".to_owned(),
        (Status::Failed, _) => format!(
            "Dead letter after {} attempt(s): the relay gave up on it. Fix the cause shown in the last error, then replay it, or discard it with a reason.",
            e.attempts
        ),
        (Status::Processing, _) => match e.lease_expires_at {
            Some(t) if t < now => "Claimed, but its lease has expired: the relay that held it stopped or stalled; the rescuer will put it back.".to_owned(),
            Some(t) => format!(
                "Claimed by a relay for attempt {} (lease until {}): it is publishing the event, or recording the outcome.{}",
                e.attempts,
                time(t),
                if e.attempts > 1 { " The attempts before it failed (last error below)." } else { "" }
            ),
            None => format!("Claimed by a relay for attempt {}.", e.attempts),
        },
        (Status::Pending, _) if e.attempts > 0 && e.available_at > now => format!(
            "Retrying: attempt {} failed; the next attempt is at {} (in {}). No relay holds it until then.",
            e.attempts,
            time(e.available_at),
            age((e.available_at - now).num_milliseconds() as f64 / 1000.0)
        ),
        (Status::Pending, _) if e.attempts > 0 => format!(
            "Retrying: attempt {} failed; the next attempt is due now and waits for a relay to claim it.",
            e.attempts
        ),
        (Status::Pending, _) if e.available_at > now => format!(
            "Scheduled: not due before {}.",
            time(e.available_at)
        ),
        (Status::Pending, _) => "Due now, waiting for a relay to claim it. If it stays here, check that a relay is connected (Overview) and, for ordered routes, whether an earlier event of its aggregate is stuck.".to_owned(),
    }
}

pub(crate) fn event(here: &Frame<'_>, v: &EventView<'_>) -> Markup {
    let e = v.event;
    let pretty = |value: &Value| serde_json::to_string_pretty(value).unwrap_or_default();
    layout(
        &format!("Event {}", e.event_id),
        Some(here),
        Nav::Events,
        html! {
            p.crumbs { a href=(here.at("/events")) { "Events" } " / " span.id { (e.event_id) } }
            h1 { (e.event_type) " " (status_badge(e.status, e.resolution.as_deref())) }
            (notice(v.notice))
            p.diagnosis #diagnosis { (diagnosis(e)) }
            @if let Some(err) = &e.last_error {
                div.last-error {
                    h2 { "Last error" }
                    pre #last-error { (err) }
                }
            }
            @if e.is_dead_letter() && here.is_operator() {
                div.actions {
                    form method="post" action=(here.at(&format!("/events/{}/replay", e.event_id))) {
                        input type="hidden" name="csrf" value=(here.csrf);
                        button.primary #replay type="submit" { "Replay" }
                        span.muted.small { " same event id, attempts reset, due now" }
                    }
                    form.discard method="post" action=(here.at(&format!("/events/{}/discard", e.event_id))) {
                        input type="hidden" name="csrf" value=(here.csrf);
                        input type="text" name="reason" placeholder="Why discard it?" required maxlength="2000";
                        button.danger type="submit" { "Discard" }
                    }
                }
            }
            section {
                h2 { "Envelope" }
                dl.envelope {
                    dt { "Event id" } dd.id { (e.event_id) }
                    dt { "Type" } dd { (e.event_type) " (schema version " (e.schema_version) ")" }
                    dt { "Aggregate" } dd {
                        a href=(here.at(&format!("/events?{}", agg_query(&e.aggregate_type, &e.aggregate_id)))) { (e.aggregate_type) "/" (e.aggregate_id) }
                        @if let Some(n) = e.sequence { " · number " (n) }
                    }
                    dt { "Status" } dd #status { (e.status) @if let Some(r) = &e.resolution { " (" (r) ")" } }
                    dt { "Attempts" } dd #attempts { (e.attempts) }
                    dt { "Created" } dd { (time(e.created_at)) }
                    @if let Some(t) = e.deliver_at { dt { "Scheduled for" } dd #scheduled { (time(t)) } }
                    dt { "Due" } dd { (time(e.available_at)) }
                    dt { "Sent" } dd { (opt_time(e.sent_at)) }
                    @if let Some(t) = e.lease_expires_at { dt { "Lease until" } dd { (time(t)) } }
                    @if let Some(t) = e.resolved_at { dt { "Resolved" } dd { (time(t)) } }
                    @if let Some(n) = &e.resolution_note { dt { "Reason" } dd { (n) } }
                    @if let Some(id) = e.replaced_by { dt { "Replaced by" } dd { a href=(here.at(&format!("/events/{}", id))) { (id) } } }
                    @if let Some(id) = e.replay_of { dt { "Replay of" } dd { a href=(here.at(&format!("/events/{}", id))) { (id) } } }
                }
            }
            section {
                h2 { "Timeline" }
                ol.timeline #timeline {
                    @for (at, what) in timeline(v) {
                        li { time { (time(at)) } " " span { (what) } }
                    }
                }
                p.muted.small { "postbox keeps the attempt count and the last error of each event, not every attempt." }
            }
            @if !v.deliveries.is_empty() {
                section {
                    h2 { "Destinations" }
                    div.scroll { table {
                        thead { tr { th { "Destination" } th { "Status" } th.num { "Attempts" } th { "Due" } th { "Sent" } th { "Last error" } } }
                        tbody {
                            @for d in v.deliveries {
                                tr {
                                    td { (d.destination) }
                                    td { (d.status) }
                                    td.num { (d.attempts) }
                                    td.nowrap { (time(d.available_at)) }
                                    td.nowrap { (opt_time(d.sent_at)) }
                                    td.error-text { (d.last_error.as_deref().unwrap_or("")) }
                                }
                            }
                        }
                    } }
                }
            }
            section {
                h2 { "Payload" }
                @if v.redacted { p.muted.small { "Configured paths and headers are masked as ***." } }
                pre.json #payload { (pretty(&e.payload)) }
                h2 { "Headers" }
                pre.json { (pretty(&e.headers)) }
            }
            @if !v.audit.is_empty() {
                section {
                    h2 { "Audit entries" }
                    (audit_table(here, v.audit, true))
                }
            }
        },
    )
}

fn agg_query(t: &str, id: &str) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .append_pair("aggregate_type", t)
        .append_pair("aggregate_id", id)
        .finish()
}

pub(crate) struct DeadLettersView<'a> {
    pub event_type: &'a str,
    pub since: &'a str,
    pub matching: u64,
    pub rows: &'a [EventRow],
    pub next: Option<String>,
    pub error: Option<&'a str>,
    pub notice: Option<&'a str>,
    pub refresh_ms: u64,
}

pub(crate) fn dead_letters(here: &Frame<'_>, v: &DeadLettersView<'_>) -> Markup {
    layout(
        "Dead letters",
        Some(here),
        Nav::DeadLetters,
        html! {
            h1 { "Dead letters" }
            p.tabs {
                a href=(here.at("/dead-letters")) aria-current="page" { "All dead letters" } " · "
                a href=(here.at("/groups")) { "Dead letters by cause" } " · "
                a href=(here.at("/groups?status=retrying")) { "Retrying by cause" }
            }
            (notice(v.notice))
            form.search method="get" action=(here.at("/dead-letters")) {
                div.fields {
                    label { "Event type" input type="text" name="type" value=(v.event_type) autocapitalize="none"; }
                    label { "Created since" input type="text" name="since" value=(v.since) placeholder="2h or 2026-05-01T12:00"; }
                }
                button.primary type="submit" { "Filter" }
                " " a href=(here.at("/dead-letters")) { "Clear" }
            }
            @if let Some(e) = v.error {
                p.error role="alert" { (e) }
            }
            (live_status(v.refresh_ms))
            p #matching data-live { strong { (v.matching) } " unresolved dead letter(s) match." }
            @if !v.rows.is_empty() {
                form #bulk method="post" action=(here.at("/dead-letters/action")) {
                    input type="hidden" name="csrf" value=(here.csrf);
                    input type="hidden" name="type" value=(v.event_type);
                    input type="hidden" name="since" value=(v.since);
                    @if here.is_operator() {
                        fieldset.bulk.toolbar #bulk-toolbar {
                            legend { "Act on dead letters " span.muted.small #selected-count data-of="ids" {} }
                            div.row {
                                button.primary type="submit" name="do" value="replay-selected" { "Replay selected" }
                                button type="submit" name="do" value="replay-all"
                                    data-confirm={"Replay all " (v.matching) " matching dead letters?"} { "Replay all " (v.matching) " matching" }
                                input type="text" name="reason" placeholder="Reason (required to discard)" maxlength="2000" aria-label="Reason to discard";
                                button.danger type="submit" name="do" value="discard-selected" { "Discard selected" }
                                button.danger type="submit" name="do" value="discard-all"
                                    data-confirm={"Discard all " (v.matching) " matching dead letters?"} { "Discard all " (v.matching) " matching" }
                            }
                            p.muted.small { "Replays keep each event's id, reset its attempts and make it due now. Bulk actions run in batches, each with its own audit entry, and can be cancelled. On a wide screen this bar stays in view while you scroll." }
                        }
                    }
                    div.scroll { table.events.stack {
                        thead { tr {
                            @if here.is_operator() {
                                th { input type="checkbox" data-select-all="ids" aria-label="Select all on this page"; }
                            }
                            th { "Created" } th { "Event" } th { "Aggregate" } th.num { "Attempts" } th { "Last error" }
                        } }
                        tbody #dead-letter-rows data-live {
                            @for r in v.rows {
                                tr.has-select[here.is_operator()] {
                                    @if here.is_operator() {
                                        td.select { input type="checkbox" name="ids" value=(r.event_id) aria-label={"Select " (r.event_id)}; }
                                    }
                                    td.nowrap { (time(r.created_at)) }
                                    td { a href=(here.at(&format!("/events/{}", r.event_id))) { (r.event_type) } br; span.id { (r.event_id) } }
                                    td { (r.aggregate_type) "/" (r.aggregate_id) }
                                    td.num.attempts { (r.attempts) }
                                    td.error-text { (clip(r.last_error.as_deref().unwrap_or(""), 160)) }
                                }
                            }
                        }
                    } }
                    div #dead-letter-pager data-live {
                        @if let Some(n) = &v.next {
                            p.pager { a href=(n) { "More →" } }
                        }
                    }
                }
            }
        },
    )
}

pub(crate) struct GroupsView<'a> {
    pub of: GroupOf,
    pub groups: &'a [ErrorGroup],
    pub notice: Option<&'a str>,
    pub refresh_ms: u64,
}

/// Events grouped by cause: one line per (last error, destinations), with
/// its count and, for dead letters, a replay or discard of the whole group.
pub(crate) fn groups(here: &Frame<'_>, v: &GroupsView<'_>) -> Markup {
    let dead = v.of == GroupOf::DeadLetters;
    let total: i64 = v.groups.iter().map(|g| g.events).sum();
    layout(
        "By cause",
        Some(here),
        Nav::DeadLetters,
        html! {
            h1 { @if dead { "Dead letters by cause" } @else { "Retrying events by cause" } }
            p.tabs {
                a href=(here.at("/dead-letters")) { "All dead letters" } " · "
                a href=(here.at("/groups")) aria-current=[current(dead)] { "Dead letters by cause" } " · "
                a href=(here.at("/groups?status=retrying")) aria-current=[current(!dead)] { "Retrying by cause" }
            }
            (notice(v.notice))
            (live_status(v.refresh_ms))
            div #groups-live data-live {
                p #group-summary {
                    strong { (total) } @if dead { " unresolved dead letter(s)" } @else { " event(s) waiting for their next attempt" }
                    " in " strong { (v.groups.len()) } " group(s) by last error and destination."
                }
                @if v.groups.is_empty() {
                    p.muted { "Nothing to group." }
                } @else {
                    div.scroll { table.groups.stack #groups {
                        thead { tr {
                            th.num { "Events" } th { "Last error" } th { "Destination" } th { "Types" } th { "Created" }
                            @if dead && here.is_operator() { th { "Act on the whole group" } }
                        } }
                        tbody {
                            @for g in v.groups {
                                tr data-key=(g.key) {
                                    td.num.count { (g.events) }
                                    td.error-text title=(g.last_error.as_deref().unwrap_or("")) {
                                        (clip(g.last_error.as_deref().unwrap_or("(no error recorded)"), 200))
                                        br; a.small href=(here.at(&format!("/events/{}", g.example))) { "oldest event" }
                                    }
                                    td { (g.destinations.as_deref().unwrap_or("—")) }
                                    td { (g.event_types.as_deref().unwrap_or("")) }
                                    td.nowrap { (time(g.oldest)) br; "to " (time(g.newest)) }
                                    @if dead && here.is_operator() {
                                        td.group-actions {
                                            form method="post" action=(here.at("/groups/action")) {
                                                input type="hidden" name="csrf" value=(here.csrf);
                                                input type="hidden" name="key" value=(g.key);
                                                button.primary type="submit" name="do" value="replay"
                                                    data-confirm={"Replay the " (g.events) " dead letters of this group?"} { "Replay " (g.events) }
                                            }
                                            form method="post" action=(here.at("/groups/action")) {
                                                input type="hidden" name="csrf" value=(here.csrf);
                                                input type="hidden" name="key" value=(g.key);
                                                input type="text" name="reason" placeholder="Reason to discard" required maxlength="2000" aria-label="Reason to discard this group";
                                                button.danger type="submit" name="do" value="discard"
                                                    data-confirm={"Discard the " (g.events) " dead letters of this group?"} { "Discard " (g.events) }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    } }
                }
            }
            p.muted.small {
                @if dead {
                    "A group's replay or discard is a bulk action on the dead letters in it when you click (in batches, each with its own audit entry, cancellable)."
                } @else {
                    "Retrying events are pending: the relay tries them again at their next attempt time; those that run out of attempts become dead letters."
                }
            }
        },
    )
}

pub(crate) fn job(here: &Frame<'_>, job: &Job) -> Markup {
    let running = job.state == JobState::Running;
    let verb = if job.verb == "discard" {
        "Discarding"
    } else {
        "Replaying"
    };
    layout(
        "Bulk action",
        Some(here),
        Nav::DeadLetters,
        html! {
            h1 { (verb) " " (job.what) }
            div.job #job data-progress-url=(here.at(&format!("/jobs/{}/progress", job.id))) data-state=(job.state.as_str()) {
                progress #job-progress value=(job.done) max=(job.total.max(1)) {}
                p { span #job-done { (job.done) } " of " span #job-total { (job.total) } " done · "
                    strong #job-state { (job.state.as_str()) } }
                p.muted.small { "Started by " (job.owner) " at " (time(job.started_at)) }
                @if job.skipped > 0 {
                    p.warn-text { (job.skipped) " selected event(s) were no longer unresolved dead letters and were left alone." }
                }
            }
            div.actions {
                @if running && here.is_operator() {
                    form method="post" action=(here.at(&format!("/jobs/{}/cancel", job.id))) {
                        input type="hidden" name="csrf" value=(here.csrf);
                        button.danger #cancel type="submit" { "Cancel" }
                        span.muted.small { " stops after the current batch" }
                    }
                }
                @if running { a.noscript-refresh href=(here.at(&format!("/jobs/{}", job.id))) { "Refresh" } }
            }
            p { a href=(here.at("/dead-letters")) { "Dead letters" } " · " a href=(here.at("/audit")) { "Audit log" } }
        },
    )
}

pub(crate) struct AuditView<'a> {
    pub entries: &'a [AuditEntry],
    /// Show who failed to sign in and why (operators only: the name tried
    /// and whether it exists are for those who administer the console).
    pub sign_in_details: bool,
    pub action: &'a str,
    pub actor: &'a str,
    pub next: Option<String>,
}

const ACTIONS: &[&str] = &[
    "",
    "dlq.replay",
    "dlq.replay_new_id",
    "dlq.discard",
    "console.sign_in",
    "console.sign_in_failed",
    "console.sign_out",
];

pub(crate) fn audit(here: &Frame<'_>, v: &AuditView<'_>) -> Markup {
    layout(
        "Audit log",
        Some(here),
        Nav::Audit,
        html! {
            h1 { "Audit log" }
            p.muted { "Every replay, discard and sign-in attempt, newest first. Kept in the database; the console cannot change it." }
            @if !v.sign_in_details {
                p.muted.small #sign-in-details-hidden { "Failed sign-ins are listed without the name tried, the address or the reason: operators see those." }
            }
            form.search method="get" action=(here.at("/audit")) {
                div.fields {
                    label { "Action"
                        select name="action" {
                            @for a in ACTIONS {
                                option value=(a) selected[v.action == *a] { @if a.is_empty() { "any" } @else { (a) } }
                            }
                        }
                    }
                    label { "Actor" input type="text" name="actor" value=(v.actor) autocapitalize="none"; }
                }
                button.primary type="submit" { "Filter" }
            }
            @if v.entries.is_empty() {
                p.muted { "No entries." }
            } @else {
                (audit_table(here, v.entries, v.sign_in_details))
            }
            @if let Some(n) = &v.next {
                p.pager { a href=(n) { "Older entries →" } }
            }
        },
    )
}

fn audit_table(here: &Frame<'_>, entries: &[AuditEntry], sign_in_details: bool) -> Markup {
    html! {
        div.scroll { table.audit.stack #audit {
            thead { tr { th { "When" } th { "Actor" } th { "Action" } th.num { "Count" } th { "What" } th { "Reason" } } }
            tbody {
                @for a in entries {
                    @let hidden = !sign_in_details && a.action == crate::handlers::ACTION_SIGN_IN_FAILED;
                    tr {
                        td.nowrap { (time(a.at)) }
                        @if hidden {
                            td.muted { "(hidden)" }
                        } @else {
                            td { (a.actor) }
                        }
                        td { (a.action) }
                        td.num.count { (a.count) }
                        @if hidden {
                            td.muted { "details for operators" }
                        } @else {
                            td { (audit_what(here, a)) }
                        }
                        td.reason { (a.reason.as_deref().unwrap_or("")) }
                    }
                }
            }
        } }
    }
}

/// The selection, and up to five of the events an entry touched, linked.
fn audit_what(here: &Frame<'_>, a: &AuditEntry) -> Markup {
    let events: Vec<Uuid> = a
        .details
        .as_array()
        .map(|d| {
            d.iter()
                .filter_map(|x| x.get("event_id")?.as_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let selection = if a.selection.get("all").is_some() {
        clip(&a.selection.to_string(), 120)
    } else {
        String::new()
    };
    let field = |k: &str| a.details.get(k).and_then(Value::as_str);
    let other = match (events.is_empty(), field("outcome"), field("client")) {
        (false, _, _) => String::new(),
        (true, Some(outcome), Some(client)) => format!("{outcome} · from {client}"),
        (true, None, Some(client)) => format!("from {client}"),
        (true, _, _) => clip(&a.details.to_string(), 160),
    };
    html! {
        @if !selection.is_empty() { code { (selection) } br; }
        @for id in events.iter().take(5) {
            a.id href=(here.at(&format!("/events/{}", id))) { (id) } br;
        }
        @if events.len() > 5 { span.muted { "and " (events.len() - 5) " more" } }
        @if events.is_empty() && other != "[]" && other != "{}" { span.details { (other) } }
    }
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

//! `/events`: the event search, a page of events at a time, kept up to date
//! in place.

use crate::auth::Session;
use crate::form::{parse_when, FormData};
use crate::http::outbox::{frame, Here};
use crate::http::reply::{failed, page, Fail};
use crate::views::{clip, layout, live_status, status_badge, time, with_cursor, Frame, Nav};
use crate::Console;
use axum::extract::{RawQuery, State};
use axum::response::Response;
use chrono::Utc;
use maud::{html, Markup};
use postbox_store::{EventQuery, EventRow, Status};

pub(super) async fn events(
    State(console): State<Console>,
    session: Session,
    outbox: Here,
    RawQuery(query): RawQuery,
) -> Result<Response, Fail> {
    let q = FormData::parse(query.unwrap_or_default().as_bytes());
    let text = |k: &str| q.get(k).unwrap_or("").to_owned();
    let search = EventSearch {
        event_id: text("event_id"),
        aggregate_type: text("aggregate_type"),
        aggregate_id: text("aggregate_id"),
        event_type: text("type"),
        status: text("status"),
        from: text("from"),
        to: text("to"),
    };
    let page_size = console.inner.config.page_size;
    let mut error = None;
    let mut query = EventQuery {
        aggregate_type: q.get("aggregate_type").map(str::to_owned),
        aggregate_id: q.get("aggregate_id").map(str::to_owned),
        event_type: q.get("type").map(str::to_owned),
        before_row: q.get("before").and_then(|b| b.parse().ok()),
        limit: page_size + 1,
        ..EventQuery::default()
    };
    if let Some(id) = q.get("event_id") {
        match id.parse() {
            Ok(id) => query.event_id = Some(id),
            Err(_) => error = Some(format!("“{id}” is not an event id (a UUID).")),
        }
    }
    if let Some(status) = q.get("status") {
        match status.parse() {
            Ok(status) => query.status = Some(status),
            Err(_) => error = Some(format!("“{status}” is not a status.")),
        }
    }
    for (key, slot) in [
        ("from", &mut query.created_from),
        ("to", &mut query.created_before),
    ] {
        if let Some(s) = q.get(key) {
            match parse_when(s) {
                Ok(t) => *slot = Some(t),
                Err(e) => error = Some(e),
            }
        }
    }
    let mut rows = if error.is_some() {
        Vec::new()
    } else {
        outbox
            .console
            .events(&query)
            .await
            .map_err(|e| failed(&outbox, &e))?
    };
    let next = if rows.len() as i64 > page_size {
        rows.truncate(page_size as usize);
        rows.last()
            .map(|r| with_cursor(&outbox.at("/events"), &search.query(), "before", r.row))
    } else {
        None
    };
    Ok(page(render(
        &frame(&console, &session, &outbox),
        &search,
        &rows,
        next,
        error.as_deref(),
        console.inner.refresh_ms(),
    )))
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

fn render(
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

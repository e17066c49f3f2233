//! `/dead-letters`: the unresolved dead letters, filtered, a page at a time,
//! and a replay or discard of those selected or of all that match, as a bulk
//! action in the background.

use crate::auth::Session;
use crate::form::{check_reason, parse_when, FormData};
use crate::http::guard::{limit_actions, Checked};
use crate::http::outbox::{frame, Here};
use crate::http::reply::{failed, page, see_other, Fail};
use crate::views::{clip, layout, live_status, notice, notice_text, time, with_cursor, Frame, Nav};
use crate::Console;
use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::response::Response;
use maud::{html, Markup};
use postbox_store::{Action, EventQuery, EventRow, Filter, Selection, StatusFilter};
use std::time::Duration;
use uuid::Uuid;

/// Event ids one bulk request may name.
const MAX_SELECTED: usize = 10_000;

/// The dead-letter filter of a query or form: (type, since text, filter).
fn dlq_filter(q: &FormData) -> Result<(String, String, Filter), String> {
    let event_type = q.get("type").unwrap_or("").to_owned();
    let since_text = q.get("since").unwrap_or("").to_owned();
    let since = match q.get("since") {
        Some(s) => Some(parse_when(s)?),
        None => None,
    };
    let filter = Filter {
        event_type: q.get("type").map(str::to_owned),
        since,
    };
    Ok((event_type, since_text, filter))
}

pub(super) async fn dead_letters(
    State(console): State<Console>,
    session: Session,
    outbox: Here,
    RawQuery(query): RawQuery,
) -> Result<Response, Fail> {
    let q = FormData::parse(query.unwrap_or_default().as_bytes());
    let o = &outbox;
    let page_size = console.inner.config.page_size;
    let (event_type, since, filter, error) = match dlq_filter(&q) {
        Ok((t, s, f)) => (t, s, Some(f), None),
        Err(e) => (
            q.get("type").unwrap_or("").to_owned(),
            q.get("since").unwrap_or("").to_owned(),
            None,
            Some(e),
        ),
    };
    let (matching, mut rows) = match &filter {
        Some(f) => {
            let matching = o.dlq.count(f).await.map_err(|e| failed(o, &e))?;
            let rows = o
                .console
                .events(&EventQuery {
                    event_type: f.event_type.clone(),
                    status: Some(StatusFilter::Dead),
                    created_from: f.since,
                    before_row: q.get("before").and_then(|b| b.parse().ok()),
                    limit: page_size + 1,
                    ..EventQuery::default()
                })
                .await
                .map_err(|e| failed(o, &e))?;
            (matching, rows)
        }
        None => (0, Vec::new()),
    };
    let next = if rows.len() as i64 > page_size {
        rows.truncate(page_size as usize);
        let mut base = url::form_urlencoded::Serializer::new(String::new());
        if !event_type.is_empty() {
            base.append_pair("type", &event_type);
        }
        if !since.is_empty() {
            base.append_pair("since", &since);
        }
        rows.last()
            .map(|r| with_cursor(&o.at("/dead-letters"), &base.finish(), "before", r.row))
    } else {
        None
    };
    Ok(page(render(
        &frame(&console, &session, o),
        &DeadLettersView {
            event_type: &event_type,
            since: &since,
            matching,
            rows: &rows,
            next,
            error: error.as_deref(),
            notice: notice_text(q.get("notice")),
            refresh_ms: console.inner.refresh_ms(),
        },
    )))
}

pub(super) async fn bulk_action(
    State(console): State<Console>,
    session: Checked,
    outbox: Here,
    body: Bytes,
) -> Result<Response, Fail> {
    let form = FormData::parse(&body);
    let (event_type, since_text, filter) = dlq_filter(&form).map_err(Fail::BadRequest)?;
    let (verb, all) = match form.get("do") {
        Some("replay-selected") => ("replay", false),
        Some("replay-all") => ("replay", true),
        Some("discard-selected") => ("discard", false),
        Some("discard-all") => ("discard", true),
        _ => return Err(Fail::BadRequest("Unknown action.".to_owned())),
    };
    let action = if verb == "discard" {
        Action::Discard {
            reason: check_reason(form.get("reason")).map_err(Fail::BadRequest)?,
        }
    } else {
        Action::Replay
    };
    let i = &console.inner;
    let (selection, total, what) = if all {
        let total = outbox
            .dlq
            .count(&filter)
            .await
            .map_err(|e| failed(&outbox, &e))?;
        let mut what = format!("all {total} dead letter(s)");
        if !event_type.is_empty() {
            what.push_str(&format!(" of type {event_type}"));
        }
        if !since_text.is_empty() {
            what.push_str(&format!(" created since {since_text}"));
        }
        (Selection::All(filter), total, what)
    } else {
        let ids = form
            .all("ids")
            .map(|s| s.trim().parse::<Uuid>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| Fail::BadRequest("A selected event id is not a UUID.".to_owned()))?;
        if ids.is_empty() {
            let mut back = url::form_urlencoded::Serializer::new(String::new());
            back.append_pair("notice", "none-selected");
            if !event_type.is_empty() {
                back.append_pair("type", &event_type);
            }
            if !since_text.is_empty() {
                back.append_pair("since", &since_text);
            }
            return Ok(see_other(
                &outbox.at(&format!("/dead-letters?{}", back.finish())),
            ));
        }
        if ids.len() > MAX_SELECTED {
            return Err(Fail::BadRequest(format!(
                "Select at most {MAX_SELECTED} events at once, or act on all that match a filter."
            )));
        }
        let n = ids.len() as u64;
        (
            Selection::Ids(ids),
            n,
            format!("{n} selected dead letter(s)"),
        )
    };
    limit_actions(&console, &session)?;
    let id = i
        .jobs
        .start(
            outbox.name.clone(),
            outbox.dlq.clone(),
            selection,
            action,
            session.actor(),
            session.user.clone(),
            what,
            total,
            i.config.batch_size,
        )
        .map_err(|_| {
            Fail::TooMany(
                Duration::from_secs(5),
                "Several bulk actions are running already; wait for one to finish.",
            )
        })?;
    Ok(see_other(&outbox.at(&format!("/jobs/{id}"))))
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

fn render(here: &Frame<'_>, v: &DeadLettersView<'_>) -> Markup {
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

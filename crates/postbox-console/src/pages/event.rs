//! `/events/{id}`: one event (its diagnosis, envelope, timeline,
//! destinations, payload redacted, audit entries), and its replay and
//! discard.

use crate::auth::Session;
use crate::form::{check_reason, FormData};
use crate::http::guard::{limit_actions, Checked};
use crate::http::outbox::{frame, Here};
use crate::http::reply::{failed, page, parse_id, see_other, Fail};
use crate::outboxes::Outbox;
use crate::preview::{DestinationPreview, StoredEvent, Verdict};
use crate::views::audit::audit_table;
use crate::views::{age, layout, notice, notice_text, opt_time, status_badge, time, Frame, Nav};
use crate::Console;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::response::Response;
use chrono::{DateTime, Utc};
use maud::{html, Markup};
use postbox_store::{Action, AuditEntry, DeliveryRecord, EventRecord, Selection, Status};
use serde_json::Value;
use uuid::Uuid;

pub(super) async fn event_page(
    State(console): State<Console>,
    session: Session,
    outbox: Here,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, Fail> {
    let id = parse_id(&id)?;
    let o = &outbox;
    let Some(mut event) = o.console.event(id).await.map_err(|e| failed(o, &e))? else {
        return Err(Fail::NotFound);
    };
    let redactor = &console.inner.config.redactor;
    redactor.redact(&mut event.payload);
    redactor.redact_headers(&mut event.headers);
    let deliveries = o
        .console
        .deliveries(event.row)
        .await
        .map_err(|e| failed(o, &e))?;
    let audit = o
        .dlq
        .audit_log(50, Some(id))
        .await
        .map_err(|e| failed(o, &e))?;
    // Previewed from the event as shown: with [redact] on, from its masked
    // payload and headers, so that nothing masked reaches the page.
    let preview = match (
        &console.inner.config.route_preview,
        console.inner.serves_many(),
    ) {
        (Some(p), false) => match preview_event(&event) {
            Some(e) => Preview::Shown(p.preview(&e).await),
            None => Preview::None,
        },
        (Some(_), true) => Preview::Many,
        (None, _) => Preview::None,
    };
    let q = FormData::parse(query.unwrap_or_default().as_bytes());
    Ok(page(render(
        &frame(&console, &session, o),
        &EventView {
            event: &event,
            deliveries: &deliveries,
            audit: &audit,
            redacted: !redactor.is_empty(),
            notice: notice_text(q.get("notice")),
            preview: &preview,
        },
    )))
}

async fn act_on_one(
    outbox: &Outbox,
    session: &Session,
    id: Uuid,
    action: Action,
) -> Result<Response, Fail> {
    let applied = outbox
        .dlq
        .apply(
            &Selection::Ids(vec![id]),
            &action,
            &session.actor(),
            1,
            |_| {},
        )
        .await
        .map_err(|e| failed(outbox, &e))?;
    let notice = match (applied.count, action) {
        (0, _) => "not-dead",
        (_, Action::Discard { .. }) => "discarded",
        _ => "replayed",
    };
    Ok(see_other(
        &outbox.at(&format!("/events/{id}?notice={notice}")),
    ))
}

pub(super) async fn replay_one(
    State(console): State<Console>,
    session: Checked,
    outbox: Here,
    Path(id): Path<String>,
) -> Result<Response, Fail> {
    let id = parse_id(&id)?;
    limit_actions(&console, &session)?;
    act_on_one(&outbox, &session, id, Action::Replay).await
}

pub(super) async fn discard_one(
    State(console): State<Console>,
    session: Checked,
    outbox: Here,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, Fail> {
    let form = FormData::parse(&body);
    let id = parse_id(&id)?;
    let reason = check_reason(form.get("reason")).map_err(Fail::BadRequest)?;
    limit_actions(&console, &session)?;
    act_on_one(&outbox, &session, id, Action::Discard { reason }).await
}

pub(crate) struct EventView<'a> {
    pub event: &'a EventRecord,
    pub deliveries: &'a [DeliveryRecord],
    pub audit: &'a [AuditEntry],
    pub redacted: bool,
    pub notice: Option<&'a str>,
    pub preview: &'a Preview,
}

/// The "What each destination gets" section.
pub(crate) enum Preview {
    Shown(Vec<DestinationPreview>),
    /// Serving many outboxes (each may route its own way): not shown.
    Many,
    /// No preview configured.
    None,
}

fn preview_event(e: &EventRecord) -> Option<StoredEvent> {
    Some(StoredEvent {
        event_id: e.event_id,
        event_type: e.event_type.clone(),
        aggregate_type: e.aggregate_type.clone(),
        aggregate_id: e.aggregate_id.clone(),
        schema_version: e.schema_version,
        sequence: e.sequence,
        created_at: e.created_at,
        payload: serde_json::to_string(&e.payload).ok()?,
        headers: e.headers.clone(),
        place: "outbox".to_owned(),
    })
}

fn preview_section(v: &EventView<'_>) -> Markup {
    html! {
        section #route-preview {
            h2 { "What each destination gets" }
            @match v.preview {
                Preview::None => p.muted.small { "No route preview here: the console was started without the relay's configuration (its [sink] or [destinations] and [[routes]])." },
                Preview::Many => p.muted.small { "Not shown when the console serves many outboxes: run postbox route test --event-id " (v.event.event_id) " with the outbox's configuration." },
                Preview::Shown(lines) => {
                    p.muted.small {
                        "Through the relay's routes, filters and transforms as configured now; nothing is sent."
                        @if v.redacted { " Computed from the event as shown here, masked fields masked." }
                    }
                    div.scroll { table {
                        thead { tr { th { "Destination" } th { "Gets it?" } th { "Body and headers, or why not" } } }
                        tbody {
                            @for line in lines {
                                tr {
                                    td { (line.destination) }
                                    @match &line.verdict {
                                        Verdict::Sends { body, headers, by } => {
                                            td { "yes" @if let Some(by) = by { span.muted.small { " shaped by " (by) } } }
                                            td {
                                                pre.json.body { (body) }
                                                @if !headers.is_empty() {
                                                    pre.json { @for (k, val) in headers { (k) ": " (val) "\n" } }
                                                }
                                            }
                                        }
                                        Verdict::Filtered { by } => { td { "no" } td { "filtered out by the filter of " (by) } }
                                        Verdict::NotRouted => { td { "no" } td { "no route sends " (v.event.event_type) " here" } }
                                        Verdict::Fails { error } => { td.error-text { "dead letter" } td.error-text { (error) } }
                                    }
                                }
                            }
                        }
                    } }
                }
            }
        }
    }
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

fn render(here: &Frame<'_>, v: &EventView<'_>) -> Markup {
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
            (preview_section(v))
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

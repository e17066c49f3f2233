//! `/groups`: dead letters, or retrying events, grouped by cause (last error
//! and destinations), and a replay or discard of a whole dead-letter group
//! as a bulk action.

use crate::auth::Session;
use crate::form::{check_reason, FormData};
use crate::http::guard::{limit_actions, Checked};
use crate::http::outbox::{frame, Here};
use crate::http::reply::{failed, page, see_other, Fail};
use crate::views::{clip, current, layout, live_status, notice, notice_text, time, Frame, Nav};
use crate::Console;
use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::response::Response;
use maud::{html, Markup};
use postbox_store::{Action, ErrorGroup, GroupOf, Selection};
use std::time::Duration;
use uuid::Uuid;

/// Groups shown on the by-cause page, and dead letters one group action takes.
const MAX_GROUPS: i64 = 200;
const MAX_GROUP_EVENTS: i64 = 100_000;

pub(super) async fn groups(
    State(console): State<Console>,
    session: Session,
    outbox: Here,
    RawQuery(query): RawQuery,
) -> Result<Response, Fail> {
    let q = FormData::parse(query.unwrap_or_default().as_bytes());
    let of = match q.get("status") {
        Some("retrying") => GroupOf::Retrying,
        _ => GroupOf::DeadLetters,
    };
    let groups = outbox
        .console
        .error_groups(of, MAX_GROUPS)
        .await
        .map_err(|e| failed(&outbox, &e))?;
    Ok(page(render(
        &frame(&console, &session, &outbox),
        &GroupsView {
            of,
            groups: &groups,
            notice: notice_text(q.get("notice")),
            refresh_ms: console.inner.refresh_ms(),
        },
    )))
}

/// Replay or discard every dead letter of one group (same last error, same
/// destinations), as a bulk action in the background.
pub(super) async fn group_action(
    State(console): State<Console>,
    session: Checked,
    outbox: Here,
    body: Bytes,
) -> Result<Response, Fail> {
    let form = FormData::parse(&body);
    let action = match form.get("do") {
        Some("replay") => Action::Replay,
        Some("discard") => Action::Discard {
            reason: check_reason(form.get("reason")).map_err(Fail::BadRequest)?,
        },
        _ => return Err(Fail::BadRequest("Unknown action.".to_owned())),
    };
    let key = form
        .get("key")
        .filter(|k| k.len() == 32 && k.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| Fail::BadRequest("No group was named.".to_owned()))?;
    let i = &console.inner;
    let found = outbox
        .console
        .error_group_ids(key, MAX_GROUP_EVENTS)
        .await
        .map_err(|e| failed(&outbox, &e))?;
    let Some((_, error)) = found.first().cloned() else {
        return Ok(see_other(&outbox.at("/groups?notice=group-gone")));
    };
    let ids: Vec<Uuid> = found.into_iter().map(|(id, _)| id).collect();
    let total = ids.len() as u64;
    let what = match error {
        Some(e) => format!("{total} dead letter(s) that failed with “{}”", clip(&e, 80)),
        None => format!("{total} dead letter(s) without an error"),
    };
    limit_actions(&console, &session)?;
    let id = i
        .jobs
        .start(
            outbox.name.clone(),
            outbox.dlq.clone(),
            Selection::Ids(ids),
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

pub(crate) struct GroupsView<'a> {
    pub of: GroupOf,
    pub groups: &'a [ErrorGroup],
    pub notice: Option<&'a str>,
    pub refresh_ms: u64,
}

/// Events grouped by cause: one line per (last error, destinations), with
/// its count and, for dead letters, a replay or discard of the whole group.
fn render(here: &Frame<'_>, v: &GroupsView<'_>) -> Markup {
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

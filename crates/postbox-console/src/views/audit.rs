//! The table of audit entries: the audit page's, and an event's own on its page.

use crate::auth::ACTION_SIGN_IN_FAILED;
use crate::views::{clip, time, Frame};
use maud::{html, Markup};
use postbox_store::AuditEntry;
use serde_json::Value;
use uuid::Uuid;

pub(crate) fn audit_table(
    here: &Frame<'_>,
    entries: &[AuditEntry],
    sign_in_details: bool,
) -> Markup {
    html! {
        div.scroll { table.audit.stack #audit {
            thead { tr { th { "When" } th { "Actor" } th { "Action" } th.num { "Count" } th { "What" } th { "Reason" } } }
            tbody {
                @for a in entries {
                    @let hidden = !sign_in_details && a.action == ACTION_SIGN_IN_FAILED;
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
    // A replay job's entry (`postbox replay`, or a cancel in the console).
    let replay = a.selection.get("replay").and_then(Value::as_i64);
    let field = |k: &str| a.details.get(k).and_then(Value::as_str);
    let other = match (events.is_empty(), field("outcome"), field("client")) {
        (false, _, _) => String::new(),
        (true, Some(outcome), Some(client)) => format!("{outcome} · from {client}"),
        (true, None, Some(client)) => format!("from {client}"),
        (true, _, _) => clip(&a.details.to_string(), 160),
    };
    html! {
        @if let Some(id) = replay {
            a href=(here.at(&format!("/replays/{id}"))) { "replay " (id) }
            @if let Some(d) = a.selection.get("destination").and_then(Value::as_str) { " to " (d) }
            br;
        }
        @if !selection.is_empty() { code { (selection) } br; }
        @for id in events.iter().take(5) {
            a.id href=(here.at(&format!("/events/{}", id))) { (id) } br;
        }
        @if events.len() > 5 { span.muted { "and " (events.len() - 5) " more" } }
        @if events.is_empty() && other != "[]" && other != "{}" { span.details { (other) } }
    }
}

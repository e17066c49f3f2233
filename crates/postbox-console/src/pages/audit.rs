//! `/audit`: an outbox's audit log, filtered, a page at a time; serving many
//! outboxes, without a prefix, the home schema's (sign-ins and sign-outs).

use crate::auth::{Session, ACTION_SIGN_IN_FAILED, CONSOLE_ACTIONS};
use crate::form::FormData;
use crate::http::outbox::{frame, Place};
use crate::http::reply::{failed, internal, page, Fail};
use crate::views::audit::audit_table;
use crate::views::{layout, with_cursor, Frame, Nav};
use crate::Console;
use axum::extract::{RawQuery, State};
use axum::response::Response;
use maud::{html, Markup};
use postbox_store::AuditEntry;

/// `/audit`: an outbox's audit log; serving many outboxes, without a prefix,
/// the home schema's (sign-ins and sign-outs).
pub(super) async fn audit(
    State(console): State<Console>,
    session: Session,
    place: Place,
    RawQuery(query): RawQuery,
) -> Result<Response, Fail> {
    let q = FormData::parse(query.unwrap_or_default().as_bytes());
    let page_size = console.inner.config.page_size;
    let outbox = match place {
        Place::Outbox(outbox) => Some(outbox),
        Place::All => None,
    };
    let log = outbox.as_ref().map_or(&console.inner.home, |o| &o.console);
    // Above the outboxes, a user limited to some of them reads the sign-in
    // log alone: the home schema's other entries are about its own outbox.
    let console_only =
        (outbox.is_none() && !session.outboxes.is_every()).then_some(CONSOLE_ACTIONS);
    let mut entries = log
        .audit_page(
            q.get("before").and_then(|b| b.parse().ok()),
            q.get("action"),
            q.get("actor"),
            (!session.is_operator()).then_some(ACTION_SIGN_IN_FAILED),
            console_only,
            page_size + 1,
        )
        .await
        .map_err(|e| match &outbox {
            Some(o) => failed(o, &e),
            None => internal(&e),
        })?;
    let action = q.get("action").unwrap_or("");
    let here = match &outbox {
        Some(o) => frame(&console, &session, o),
        None => Frame {
            session: &session,
            base: "",
            outbox: None,
            many: true,
        },
    };
    let actor = q.get("actor").unwrap_or("");
    let next = if entries.len() as i64 > page_size {
        entries.truncate(page_size as usize);
        let mut base = url::form_urlencoded::Serializer::new(String::new());
        if !action.is_empty() {
            base.append_pair("action", action);
        }
        if !actor.is_empty() {
            base.append_pair("actor", actor);
        }
        entries
            .last()
            .map(|e| with_cursor(&here.at("/audit"), &base.finish(), "before", e.id))
    } else {
        None
    };
    Ok(page(render(
        &here,
        &AuditView {
            entries: &entries,
            sign_in_details: session.is_operator(),
            action,
            actor,
            next,
        },
    )))
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
    "replay_start",
    "replay_cancel",
    "console.sign_in",
    "console.sign_in_failed",
    "console.sign_out",
];

fn render(here: &Frame<'_>, v: &AuditView<'_>) -> Markup {
    layout(
        "Audit log",
        Some(here),
        Nav::Audit,
        html! {
            h1 { "Audit log" }
            p.muted { "Every replay, discard, replay job started or cancelled and sign-in attempt, newest first. Kept in the database; the console cannot change it." }
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

//! `/replays`: an outbox's replay jobs (`postbox replay`), newest first with
//! every open one, `/replays/{id}` one job in full, and the cancellation of
//! an open job (operators; audited through `Replays::cancel`).

use crate::auth::Session;
use crate::form::FormData;
use crate::http::guard::{limit_actions, Checked};
use crate::http::outbox::{frame, Here};
use crate::http::reply::{failed, page, see_other, Fail};
use crate::views::{clip, layout, live_status, notice, notice_text, opt_time, time, Frame, Nav};
use crate::Console;
use axum::extract::{Path, RawQuery, State};
use axum::response::Response;
use maud::{html, Markup};
use postbox_store::ReplayJob;

/// A job's id in a path: a positive integer, or there is nothing here.
fn job_id(s: &str) -> Result<i64, Fail> {
    match s.parse::<i64>() {
        Ok(id) if id > 0 => Ok(id),
        _ => Err(Fail::NotFound),
    }
}

/// Events a job has delivered, filtered out or had refused so far.
fn handled(job: &ReplayJob) -> i64 {
    job.delivered + job.filtered + job.rejected
}

/// How far a job has come, in whole percent.
fn percent(job: &ReplayJob) -> i64 {
    if job.total <= 0 {
        return 100;
    }
    (handled(job).saturating_mul(100) / job.total).clamp(0, 100)
}

/// A job's state as a badge.
fn state_badge(state: &str) -> Markup {
    let class = match state {
        "running" => "busy",
        "paused" => "wait",
        "failed" => "bad",
        "done" => "good",
        _ => "muted",
    };
    html! { span class={"badge " (class)} { (state) } }
}

pub(super) async fn replays(
    State(console): State<Console>,
    session: Session,
    outbox: Here,
    RawQuery(query): RawQuery,
) -> Result<Response, Fail> {
    let q = FormData::parse(query.unwrap_or_default().as_bytes());
    let o = &outbox;
    let shown = console.inner.config.page_size;
    let mut jobs = o.replays.list(shown).await.map_err(|e| failed(o, &e))?;
    // Open jobs older than the newest page are listed too: each still holds
    // retention back.
    let open = o.store.open_replays().await.map_err(|e| failed(o, &e))?;
    let older_open: Vec<ReplayJob> = open
        .into_iter()
        .filter(|j| !jobs.iter().any(|k| k.id == j.id))
        .collect();
    jobs.extend(older_open);
    jobs.sort_by_key(|j| std::cmp::Reverse(j.id));
    Ok(page(render_list(
        &frame(&console, &session, o),
        &ListView {
            jobs: &jobs,
            shown,
            notice: notice_text(q.get("notice")),
            refresh_ms: console.inner.refresh_ms(),
        },
    )))
}

pub(super) async fn replay_page(
    State(console): State<Console>,
    session: Session,
    outbox: Here,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, Fail> {
    let id = job_id(&id)?;
    let o = &outbox;
    let Some(job) = o.replays.get(id).await.map_err(|e| failed(o, &e))? else {
        return Err(Fail::NotFound);
    };
    let q = FormData::parse(query.unwrap_or_default().as_bytes());
    Ok(page(render_job(
        &frame(&console, &session, o),
        &job,
        notice_text(q.get("notice")),
        console.inner.refresh_ms(),
    )))
}

/// Cancel an open job, audited with the console user as the actor; a runner
/// still delivering it stops after its current page.
pub(super) async fn replay_cancel(
    State(console): State<Console>,
    session: Checked,
    outbox: Here,
    Path(id): Path<String>,
) -> Result<Response, Fail> {
    let id = job_id(&id)?;
    limit_actions(&console, &session)?;
    let o = &outbox;
    if o.replays
        .get(id)
        .await
        .map_err(|e| failed(o, &e))?
        .is_none()
    {
        return Err(Fail::NotFound);
    }
    let was = o
        .replays
        .cancel(id, &session.actor())
        .await
        .map_err(|e| failed(o, &e))?;
    let notice = if was.is_some() {
        "replay-cancelled"
    } else {
        "replay-not-open"
    };
    Ok(see_other(&o.at(&format!("/replays/{id}?notice={notice}"))))
}

pub(crate) struct ListView<'a> {
    pub jobs: &'a [ReplayJob],
    /// How many of the newest jobs are listed (open ones besides).
    pub shown: i64,
    pub notice: Option<&'a str>,
    pub refresh_ms: u64,
}

/// An operator's cancel button for an open job.
fn cancel_form(here: &Frame<'_>, job: &ReplayJob, id: &str) -> Markup {
    html! {
        @if job.is_open() && here.is_operator() {
            form.inline method="post" action=(here.at(&format!("/replays/{}/cancel", job.id))) {
                input type="hidden" name="csrf" value=(here.csrf);
                button.danger id=(id) type="submit"
                    data-confirm={"Cancel replay " (job.id) " to " (job.destination) "? A runner stops after its current page; the job cannot be resumed."} { "Cancel" }
            }
        }
    }
}

fn range(job: &ReplayJob) -> Markup {
    html! {
        span.nowrap { (time(job.from_at)) } " → " span.nowrap { (time(job.to_at)) }
        @if let Some(types) = &job.types { br; span.muted.small { "types " (types) } }
        @if let (Some(t), Some(i)) = (&job.aggregate_type, &job.aggregate_id) {
            br; span.muted.small { "aggregate " (t) ":" (i) }
        }
    }
}

fn progress(job: &ReplayJob) -> Markup {
    html! {
        progress value=(handled(job).clamp(0, job.total.max(1))) max=(job.total.max(1)) {}
        span.nowrap { (handled(job)) "/" (job.total) " (" (percent(job)) "%)" }
    }
}

fn render_list(here: &Frame<'_>, v: &ListView<'_>) -> Markup {
    let open = v.jobs.iter().filter(|j| j.is_open()).count();
    layout(
        "Replays",
        Some(here),
        Nav::Replays,
        html! {
            h1 { "Replays" }
            p.muted { "Jobs of " code { "postbox replay" } ": retained events delivered again to one destination, through its filter and transform. The newest " (v.shown) " jobs, newest first, and every open one." }
            (notice(v.notice))
            (live_status(v.refresh_ms))
            p #replays-open data-live {
                strong { (open) } " open job(s)."
                @if open > 0 { " An open job (running, paused or failed) holds retention back until it is done or cancelled." }
            }
            @if v.jobs.is_empty() {
                p.muted #no-replays { "No replay jobs yet. Start one with " code { "postbox replay --destination NAME --from 2h" } "." }
            } @else {
                div.scroll { table.replays.stack {
                    thead { tr {
                        th { "Job" } th { "State" } th { "Destination" } th { "Source" } th { "Range" }
                        th { "Progress" } th.num { "Delivered / filtered / refused" } th { "Made" } th { "Last error" }
                        @if here.is_operator() { th { "" } }
                    } }
                    tbody #replay-rows data-live {
                        @for j in v.jobs {
                            tr #{"replay-" (j.id)} {
                                td { a href=(here.at(&format!("/replays/{}", j.id))) { (j.id) } }
                                td { (state_badge(&j.state)) }
                                td { (j.destination) }
                                td { (j.source) }
                                td { (range(j)) }
                                td { (progress(j)) }
                                td.num { (j.delivered) " / " (j.filtered) " / " (j.rejected) }
                                td { span.nowrap { (time(j.created_at)) } br; span.muted.small { "by " (j.created_by) } }
                                td.error-text { (clip(j.last_error.as_deref().unwrap_or(""), 160)) }
                                @if here.is_operator() { td { (cancel_form(here, j, &format!("cancel-{}", j.id))) } }
                            }
                        }
                    }
                } }
            }
            p.muted.small { "Start, resume and list jobs with " code { "postbox replay" } "; cancelling is recorded in the " a href=(here.at("/audit?action=replay_cancel")) { "audit log" } "." }
        },
    )
}

fn render_job(
    here: &Frame<'_>,
    job: &ReplayJob,
    notice_line: Option<&str>,
    refresh_ms: u64,
) -> Markup {
    layout(
        &format!("Replay {}", job.id),
        Some(here),
        Nav::Replays,
        html! {
            p.crumbs { a href=(here.at("/replays")) { "Replays" } " / " (job.id) }
            h1 { "Replay " (job.id) " to " (job.destination) " " (state_badge(&job.state)) }
            (notice(notice_line))
            (live_status(refresh_ms))
            div #replay-job data-live {
                p.diagnosis #replay-diagnosis {
                    @match job.state.as_str() {
                        "running" => { "Running: a postbox replay process delivers it page by page (or died doing so: resume it with postbox replay resume " (job.id) ")." }
                        "paused" => { "Paused (stopped by Ctrl-C or SIGTERM): resume it with postbox replay resume " (job.id) ", or cancel it." }
                        "failed" => { "Failed: the destination kept refusing. Fix the cause in the last error, then resume it with postbox replay resume " (job.id) ", or cancel it." }
                        "done" => { "Done: every event of its range was handled." }
                        _ => { "Cancelled." }
                    }
                    @if job.is_open() { " While it is open it holds retention back: the purge and log truncation keep what it still reads until it is done or cancelled." }
                }
                progress #replay-progress value=(handled(job).clamp(0, job.total.max(1))) max=(job.total.max(1)) {}
                p { span #replay-handled { (handled(job)) } " of " span #replay-total { (job.total) } " events handled (" (percent(job)) "%)" }
                @if let Some(err) = &job.last_error {
                    div.last-error {
                        h2 { "Last error" }
                        pre #replay-last-error { (err) }
                    }
                }
                dl.envelope {
                    dt { "State" } dd #replay-state { (job.state) }
                    dt { "Destination" } dd { (job.destination) }
                    dt { "Source" } dd { (job.source) @if job.source == "log" { " (the log and the archive)" } @else { " (the outbox and its archive)" } }
                    dt { "Range" } dd { (time(job.from_at)) " → " (time(job.to_at)) }
                    @if let Some(types) = &job.types { dt { "Event types" } dd { (types) } }
                    @if let (Some(t), Some(i)) = (&job.aggregate_type, &job.aggregate_id) { dt { "Aggregate" } dd { (t) ":" (i) } }
                    dt { "Rate" } dd { @if let Some(r) = job.rate { (r) " events/s" } @else { "unpaced" } }
                    dt { "Event ids" } dd { @if job.new_ids { "new ids (consumers apply them again)" } @else { "their own (inboxes drop what they applied)" } }
                    dt { "Events" } dd { (job.total) }
                    dt { "Delivered" } dd #replay-delivered { (job.delivered) }
                    dt { "Filtered out" } dd { (job.filtered) }
                    dt { "Refused" } dd { (job.rejected) }
                    dt { "Made" } dd { (time(job.created_at)) " by " (job.created_by) }
                    dt { "Last change" } dd { (time(job.updated_at)) }
                    dt { "Ended" } dd { (opt_time(job.finished_at)) }
                }
            }
            @if job.is_open() && here.is_operator() {
                div.actions {
                    (cancel_form(here, job, "cancel"))
                    span.muted.small { " a runner stops after its current page; recorded in the audit log" }
                }
            }
            p { a href=(here.at("/replays")) { "All replays" } " · " a href=(here.at("/audit?action=replay_cancel")) { "Audit log" } }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_id_is_a_positive_integer() {
        assert_eq!(job_id("7").ok(), Some(7));
        for bad in ["0", "-1", "x", "", "9999999999999999999999"] {
            assert!(job_id(bad).is_err(), "{bad}");
        }
    }
}

//! `/jobs/{id}`: a bulk action's progress (also as JSON, which the page's
//! script polls), and its cancellation.

use crate::auth::Session;
use crate::http::guard::Checked;
use crate::http::outbox::{frame, Here};
use crate::http::reply::{page, parse_id, see_other, Fail};
use crate::jobs::{Job, JobState};
use crate::outboxes::Outbox;
use crate::views::{layout, time, Frame, Nav};
use crate::Console;
use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use maud::{html, Markup};

/// The bulk action `id` names on `outbox`'s dead letters, or 404.
fn find_job(console: &Console, outbox: &Outbox, id: &str) -> Result<Job, Fail> {
    console
        .inner
        .jobs
        .get(parse_id(id)?)
        .filter(|job| job.outbox == outbox.name)
        .ok_or(Fail::NotFound)
}

pub(super) async fn job_page(
    State(console): State<Console>,
    session: Session,
    outbox: Here,
    Path(id): Path<String>,
) -> Result<Response, Fail> {
    let job = find_job(&console, &outbox, &id)?;
    Ok(page(render(&frame(&console, &session, &outbox), &job)))
}

pub(super) async fn job_progress(
    State(console): State<Console>,
    _session: Session,
    outbox: Here,
    Path(id): Path<String>,
) -> Result<Response, Fail> {
    let job = find_job(&console, &outbox, &id)?;
    let body = serde_json::json!({
        "done": job.done,
        "total": job.total,
        "state": job.state.as_str(),
        "finished": job.state != JobState::Running,
    });
    Ok((
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response())
}

pub(super) async fn job_cancel(
    State(console): State<Console>,
    _session: Checked,
    outbox: Here,
    Path(id): Path<String>,
) -> Result<Response, Fail> {
    let job = find_job(&console, &outbox, &id)?;
    console.inner.jobs.cancel(job.id);
    Ok(see_other(&outbox.at(&format!("/jobs/{}", job.id))))
}

fn render(here: &Frame<'_>, job: &Job) -> Markup {
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

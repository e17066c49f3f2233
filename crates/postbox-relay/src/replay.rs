//! Running a replay job (migration 29): page by page from the job's
//! position, each page shaped for the job's one destination (its routes,
//! filters, transforms and start time), delivered through that
//! destination's sink with a backoff on what it does not take, then the
//! job's position moved past it. A runner killed between delivering and
//! moving sends that page again (at least once), never skips one.
//!
//! Two runners use it: `postbox replay` (a job an operator starts) and the
//! relay (a job it starts for a destination added with `start =
//! "beginning"` or a time in claim and logical mode, see
//! [`crate::relay::Relay::run`]). One runner per job: [`run`] holds the
//! job's advisory lock while it runs.

use crate::router::Router;
use crate::shape::{reshaped, Shaped};
use crate::sink::{Message, Outcome, Sink};
use postbox::redact::{sanitize_error, Secrets};
use postbox_store::{PageDone, ReplayJob, Replays, StoredEvent};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// How many times a page's undelivered events are tried before the job
/// stops as failed (resumable).
pub const ATTEMPTS: u32 = 8;

/// How a run of a job ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// Every event of the range went.
    Done,
    /// `stop` came first: the job stays open at its position.
    Stopped,
    /// The destination kept refusing a page ([`ATTEMPTS`] tries): the job
    /// is `failed` with this error, and resumes from its position.
    Failed(String),
    /// The job was cancelled meanwhile.
    Cancelled,
    /// Another runner holds the job.
    Busy,
}

/// What a run needs besides the job: the jobs' store, the router whose
/// destination `d` the job delivers to, the expression budget and the page
/// size.
pub struct Runner<'a> {
    pub replays: &'a Replays,
    pub router: Arc<Router>,
    pub d: usize,
    pub steps: u64,
    pub batch_size: i64,
}

impl Runner<'_> {
    /// Run `job` until it ends, `stop` is cancelled, or the destination
    /// keeps refusing. `on_page` is called after each page with the job as
    /// it now stands and how many events this run has handled.
    /// `paused_on_stop`: a stopped job is marked paused (an operator's
    /// Ctrl-C) rather than left running for its runner to take up again.
    pub async fn run(
        &self,
        job: &mut ReplayJob,
        stop: &CancellationToken,
        paused_on_stop: bool,
        on_page: &mut (dyn FnMut(&ReplayJob, i64) + Send),
    ) -> Result<Ended, sqlx::Error> {
        let replays = self.replays;
        let Some(_lock) = replays.lock(job.id).await? else {
            return Ok(Ended::Busy);
        };
        if job.state != "running"
            && replays
                .set_state(job.id, "running", &["paused", "failed"], None)
                .await?
                .is_none()
        {
            return Ok(Ended::Cancelled);
        }
        let sink = self.router.destinations()[self.d].sink.clone();
        let secrets = sink.secrets().clone();
        let started = Instant::now();
        let handled_at_start = job.delivered + job.filtered + job.rejected;
        // With a rate, a page is at most a second's worth, so pacing stays even.
        let page_size = job
            .rate
            .map_or(self.batch_size, |r| i64::from(r).min(self.batch_size));
        loop {
            if stop.is_cancelled() {
                if paused_on_stop {
                    replays
                        .set_state(job.id, "paused", &["running"], None)
                        .await?;
                }
                return Ok(Ended::Stopped);
            }
            let page = replays.page(job, page_size).await?;
            let Some(last) = page.last() else {
                replays
                    .set_state(job.id, "done", &["running"], None)
                    .await?;
                return Ok(Ended::Done);
            };
            let mut done = PageDone {
                after_id: last.id,
                after_event: last.event.event_id,
                ..PageDone::default()
            };
            let mut messages = Vec::with_capacity(page.len());
            for e in &page {
                match stored_message(&e.event) {
                    Ok(mut m) => {
                        if job.new_ids {
                            m.event_id = Uuid::now_v7();
                        }
                        messages.push(m);
                    }
                    Err(error) => {
                        done.rejected += 1;
                        done.error = Some(sanitize_error(&error));
                    }
                }
            }
            let messages = Arc::new(messages);
            let Some(shaped) = self
                .router
                .shape_for(self.d, messages.clone(), self.steps)
                .await
            else {
                return Err(sqlx::Error::Protocol(
                    "the expression evaluator could not start".into(),
                ));
            };
            let mut send = Vec::with_capacity(messages.len());
            for (m, s) in messages.iter().zip(shaped) {
                match s {
                    None | Some(Shaped::Filtered { .. }) => done.filtered += 1,
                    Some(failed @ Shaped::Failed { .. }) => {
                        done.rejected += 1;
                        done.error = failed.error().map(|e| sanitize_error(&e));
                    }
                    Some(Shaped::Send {
                        payload, headers, ..
                    }) => send.push(reshaped(m, payload, headers)),
                }
            }
            if crate::failpoint::hit(crate::failpoint::points::REPLAY_SKIP_PAGE).await {
                send.clear();
            }
            match deliver(&*sink, &secrets, send, stop).await {
                Delivery::Done {
                    delivered,
                    rejected,
                    error,
                } => {
                    done.delivered += delivered;
                    done.rejected += rejected;
                    if error.is_some() {
                        done.error = error;
                    }
                }
                Delivery::Failed(error) => {
                    replays
                        .set_state(job.id, "failed", &["running"], Some(&error))
                        .await?;
                    return Ok(Ended::Failed(error));
                }
                // The page goes again when the job runs next.
                Delivery::Interrupted => continue,
            }
            if !replays.advance(job.id, &done).await? {
                return Ok(Ended::Cancelled);
            }
            job.after_id = done.after_id;
            job.after_event = done.after_event;
            job.delivered += done.delivered;
            job.filtered += done.filtered;
            job.rejected += done.rejected;
            let this_run = job.delivered + job.filtered + job.rejected - handled_at_start;
            on_page(job, this_run);
            if let Some(rate) = job.rate {
                // Pace to the rate since this runner started.
                let due = Duration::from_secs_f64(this_run as f64 / f64::from(rate));
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = stop.cancelled() => {}
                    }
                }
            }
        }
    }
}

/// A retained event as the sinks take it; an error (for the job's
/// `last_error`) when its headers or payload are not what an event holds.
pub fn stored_message(event: &StoredEvent) -> Result<Message, String> {
    let headers: BTreeMap<String, String> = match &event.headers {
        serde_json::Value::Null => BTreeMap::new(),
        h => serde_json::from_value(h.clone())
            .map_err(|_| "the event's headers are not an object of strings".to_owned())?,
    };
    let payload = serde_json::value::RawValue::from_string(event.payload.clone())
        .map_err(|e| format!("the event's payload is not JSON: {e}"))?;
    Ok(Message {
        event_id: event.event_id,
        event_type: event.event_type.clone(),
        aggregate_type: event.aggregate_type.clone(),
        aggregate_id: event.aggregate_id.clone(),
        schema_version: event.schema_version,
        payload,
        headers,
        created_at: event.created_at,
        attempt: 1,
        sequence: event.sequence,
        source: None,
    })
}

enum Delivery {
    Done {
        delivered: i64,
        rejected: i64,
        error: Option<String>,
    },
    /// Not all delivered after [`ATTEMPTS`] tries: the last error.
    Failed(String),
    /// Stopped before the page was delivered: it goes again.
    Interrupted,
}

/// Deliver `send`, trying what the sink did not take again with a backoff.
async fn deliver(
    sink: &dyn Sink,
    secrets: &Secrets,
    mut send: Vec<Message>,
    stop: &CancellationToken,
) -> Delivery {
    let (mut delivered, mut rejected, mut error) = (0, 0, None);
    let mut wait = Duration::from_millis(200);
    for attempt in 1..=ATTEMPTS {
        if send.is_empty() {
            break;
        }
        let outcomes = sink.publish(&send).await;
        let mut again = Vec::new();
        let mut last = None;
        for (m, outcome) in send.into_iter().zip(outcomes) {
            match outcome.masked(secrets) {
                Outcome::Delivered => delivered += 1,
                Outcome::Reject { error: e } => {
                    rejected += 1;
                    error = Some(sanitize_error(&e));
                }
                Outcome::Retry { error: e, .. } => {
                    last = Some(sanitize_error(&e));
                    again.push(m);
                }
                Outcome::Deferred { reason, .. } => {
                    last = Some(sanitize_error(&reason));
                    again.push(m);
                }
            }
        }
        send = again;
        if send.is_empty() {
            break;
        }
        if attempt == ATTEMPTS {
            return Delivery::Failed(last.unwrap_or_else(|| "not delivered".into()));
        }
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = stop.cancelled() => return Delivery::Interrupted,
        }
        wait = (wait * 2).min(Duration::from_secs(10));
    }
    Delivery::Done {
        delivered,
        rejected,
        error,
    }
}

//! Where a destination added to a running outbox starts, in claim and
//! logical mode: at start the relay records its destinations (migration
//! 30), makes a replay job for each one new to the outbox and given `start
//! = "beginning"` or a time (the retained events since then, read from the
//! outbox and its archive), and runs the open jobs relays made, one at a
//! time, beside live delivery (see `crate::replay`). Live events routed to
//! the new destination go to it as they always do; the job sends what was
//! delivered before it was added. Log mode records its destinations too,
//! and makes no job: there a new cursor starts where `start` says.

use crate::backoff;
use crate::config::ReadMode;
use crate::engine::{Shared, DB_RETRY_BASE, DB_RETRY_MAX};
use crate::redact::sanitize_error;
use crate::replay::{Ended, Runner};
use postbox_store::{GroupStart, ReplaySource};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How long the task waits before looking again at a job another relay
/// runs (it takes the job over if that relay dies) or one that failed.
const LOOK_AGAIN: Duration = Duration::from_secs(10);

/// Record the destinations, make the jobs new ones need, and run the open
/// jobs relays made until none is left or `stop` is cancelled. `drain`: a
/// job another relay runs, or one that failed, is left (the run ends).
pub(crate) async fn replay_loop(shared: Arc<Shared>, stop: CancellationToken, drain: bool) {
    let replays = shared.store.replays();
    let stream = shared.config.mode != ReadMode::Log;
    let destinations: Vec<(String, Option<GroupStart>)> = shared
        .router
        .destinations()
        .iter()
        .map(|d| (d.name.clone(), if stream { d.start.clone() } else { None }))
        .collect();
    // The configured pace, for the jobs made now and those taken up again.
    let rate = i32::try_from(shared.config.replay_rate)
        .ok()
        .filter(|r| *r > 0);
    let made = retrying(&stop, "recording the relay's destinations", || {
        replays.start_new_destinations(&destinations, ReplaySource::Outbox, rate)
    })
    .await;
    let Some(made) = made else { return };
    for id in made {
        tracing::info!(
            job = id,
            "a destination was added with a start in the past: replay job {id} sends it the retained events since then (postbox replay show {id})"
        );
    }
    if !stream {
        return;
    }
    let names: Vec<&str> = destinations.iter().map(|(n, _)| n.as_str()).collect();
    let mut left: HashSet<i64> = HashSet::new();
    loop {
        let Some(jobs) = retrying(&stop, "reading the relay's replay jobs", || {
            replays.relay_open(&names)
        })
        .await
        else {
            return;
        };
        let jobs: Vec<_> = jobs.into_iter().filter(|j| !left.contains(&j.id)).collect();
        let mut ran = false;
        for mut job in jobs {
            let Some(d) = names.iter().position(|n| *n == job.destination) else {
                continue;
            };
            let runner = Runner {
                replays: &replays,
                router: shared.router.clone(),
                d,
                steps: shared.config.expression_steps,
                batch_size: i64::from(shared.config.batch_size),
            };
            job.rate = rate;
            let (id, destination) = (job.id, job.destination.clone());
            tracing::info!(job = id, destination = %destination, events = job.total, "running replay job");
            match runner.run(&mut job, &stop, false, &mut |_, _| {}).await {
                Ok(Ended::Done) => {
                    ran = true;
                    tracing::info!(job = id, destination = %destination, delivered = job.delivered, filtered = job.filtered, refused = job.rejected, "replay job done");
                }
                Ok(Ended::Stopped) => return,
                Ok(Ended::Cancelled) => {
                    ran = true;
                    tracing::info!(job = id, destination = %destination, "replay job cancelled");
                }
                Ok(Ended::Busy) => {
                    left.insert(id);
                }
                Ok(Ended::Failed(error)) => {
                    left.insert(id);
                    tracing::warn!(job = id, destination = %destination, %error, "replay job failed: the destination kept refusing; it is tried again later (postbox replay show {id})");
                }
                Err(e) => {
                    left.insert(id);
                    tracing::warn!(job = id, destination = %destination, error = %sanitize_error(&e.to_string()), "replay job stopped on a database error; it is tried again later");
                }
            }
        }
        if ran {
            continue;
        }
        if left.is_empty() || drain {
            return;
        }
        // Only jobs another relay runs, or that failed: look again later.
        tokio::select! {
            () = tokio::time::sleep(LOOK_AGAIN) => left.clear(),
            () = stop.cancelled() => return,
        }
    }
}

/// `call` until it succeeds (None: `stop` came first, or the database
/// refused it for good), warning with `what` and backing off between
/// failures. A missing grant or table (SQLSTATE class 42: a relay role
/// from before migration 30's grants) is said once, and live delivery goes
/// on without replay jobs.
async fn retrying<T, F, Fut>(stop: &CancellationToken, what: &str, mut call: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let mut failures = 0;
    loop {
        match call().await {
            Ok(v) => return Some(v),
            Err(sqlx::Error::Database(e)) if e.code().is_some_and(|c| c.starts_with("42")) => {
                tracing::warn!(error = %sanitize_error(&e.to_string()), "{what} failed: the relay makes and runs no replay job for a destination added with a start in the past (run `postbox migrate --create-roles` again for the relay role's grants)");
                return None;
            }
            Err(e) => {
                failures += 1;
                let delay = backoff::full_jitter(failures, DB_RETRY_BASE, DB_RETRY_MAX);
                tracing::warn!(error = %sanitize_error(&e.to_string()), retry_in = ?delay, "{what} failed");
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = stop.cancelled() => return None,
                }
            }
        }
    }
}

//! Log mode's reader: one task per destination, reading that destination's
//! cursor over the append-only log (see `postbox_store::Log`).
//!
//! Each round reads one page of the cursor's window, publishes the events
//! that route to the destination, and then — in one transaction — moves the
//! cursor past the page and hands the events the destination did not take to
//! the outbox, where the claim loop (running alongside) retries them with
//! backoff or keeps them as dead letters. So a poison event never stops the
//! cursor, a slow destination never holds a fast one back, and a crash
//! between publishing and moving redelivers at most one page. Within a
//! window the reader keeps the window it moved (opening it once) and reads
//! the next page while the current one publishes: the page read is the same
//! whatever publishing does, since a window's events are fixed by its two
//! snapshots. An event scheduled for later (`deliver_at` still ahead) is not
//! published: it is handed to the outbox, due at its time, so the cursor
//! never waits for it.

use crate::backoff;
use crate::metrics as m;
use crate::redact::sanitize_error;
use crate::relay::{publish_to, RunMode, Shared};
use crate::sink::{Message, Outcome};
use postbox_store::{Handoff, Log, LogEvent, LogWindow};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use uuid::Uuid;

const DB_RETRY_BASE: Duration = Duration::from_millis(100);
const DB_RETRY_MAX: Duration = Duration::from_secs(10);

/// Read destination `d`'s cursor until shutdown (or, draining, until a
/// window comes back empty).
pub(crate) async fn read_loop(shared: Arc<Shared>, d: usize, owner: Uuid, mode: RunMode) {
    let log = shared.store.log();
    let name = shared.router.destinations()[d].name.clone();
    let names = [name.clone()];
    let config = &shared.config;
    let mut reader = Reader {
        held_until: None,
        window: None,
        ahead: None,
    };
    let mut failures = 0;
    let mut wake = shared.log_wake.subscribe();
    while !shared.shutdown.is_cancelled() {
        match reader.round(&shared, &log, d, owner, &names).await {
            Ok(Round::More) => failures = 0,
            // A window that ended short holds everything committed when it
            // opened; anything committed since sent a notification (or the
            // poll finds it): wait for that instead of opening an empty window
            // right away, which would cost two more cursor writes per wake-up.
            // A drain goes on until a window comes back empty.
            Ok(Round::WindowDone) if mode == RunMode::Forever => {
                failures = 0;
                wait(&shared, &mut wake, config.poll_interval).await;
            }
            Ok(Round::WindowDone) => failures = 0,
            Ok(Round::Idle) => {
                failures = 0;
                if mode == RunMode::Drain {
                    break;
                }
                wait(&shared, &mut wake, config.poll_interval).await;
            }
            Ok(Round::NotHeld) => {
                // Another relay holds this cursor: try again after a while.
                wait(&shared, &mut wake, config.poll_interval).await;
            }
            Err(e) => {
                // Start again from what the database says.
                reader.forget();
                failures += 1;
                let delay = backoff::full_jitter(failures, DB_RETRY_BASE, DB_RETRY_MAX);
                tracing::warn!(destination = %name, error = %sanitize_error(&e.to_string()), retry_in = ?delay, "reading the log failed");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shared.shutdown.cancelled() => {}
                }
            }
        }
    }
    if let Err(e) = log.release(owner, &names).await {
        tracing::debug!(error = %sanitize_error(&e.to_string()), "could not release the log cursors' leases; they expire by themselves");
    }
}

/// One destination's reader between rounds.
struct Reader {
    /// The lease is renewed when this passes.
    held_until: Option<Instant>,
    /// The cursor's open window as this reader last moved it (while it holds
    /// the lease nobody else moves it), so a window read page by page opens
    /// once rather than once per page.
    window: Option<LogWindow>,
    /// The window's next page, read while the previous one was published.
    ahead: Option<Vec<LogEvent>>,
}

impl Reader {
    fn forget(&mut self) {
        self.held_until = None;
        self.window = None;
        self.ahead = None;
    }

    /// Read a page, publish it (reading the next page of the window
    /// meanwhile), then settle it: move the cursor and hand off what the
    /// destination did not take.
    async fn round(
        &mut self,
        shared: &Shared,
        log: &Log,
        d: usize,
        owner: Uuid,
        names: &[String; 1],
    ) -> Result<Round, sqlx::Error> {
        let config = &shared.config;
        let batch = i64::from(config.batch_size);
        if self.held_until.is_none_or(|t| Instant::now() >= t) {
            if log.acquire(owner, names, config.lease).await?.is_empty() {
                self.forget();
                return Ok(Round::NotHeld);
            }
            self.held_until = Some(Instant::now() + config.lease / 3);
        }
        let (window, page) = match self.window.take() {
            Some(w) => {
                let page = match self.ahead.take() {
                    Some(page) => page,
                    None => log.page(&w, batch).await?,
                };
                (w, page)
            }
            None => {
                self.ahead = None;
                let Some(w) = log.window(&names[0], owner).await? else {
                    self.forget();
                    return Ok(Round::NotHeld);
                };
                // A window read from its start begins at its first event;
                // an empty one needs no read at all.
                match log.from_floor(w.clone()).await? {
                    Some(from) => {
                        let page = log.page(&from, batch).await?;
                        (from, page)
                    }
                    None => (w, Vec::new()),
                }
            }
        };
        let done = (page.len() as i64) < batch;
        let last = page.last().map_or(window.after_id, |e| e.id);
        let next = LogWindow {
            after_id: last,
            ..window.clone()
        };
        // The next page of the window does not depend on how this one is
        // published: read it meanwhile. A failed read-ahead is read again.
        let ((delivered, handoffs), ahead) = if done {
            (publish_page(shared, d, &page).await, None)
        } else {
            let (published, ahead) =
                tokio::join!(publish_page(shared, d, &page), log.page(&next, batch));
            (published, ahead.ok())
        };
        let delivered_at: Vec<_> = delivered
            .iter()
            .map(|&i| page[i].event.created_at)
            .collect();
        let delivered = delivered.len();
        let handoffs: Vec<Handoff<'_>> = handoffs
            .into_iter()
            .map(|(i, h)| h.into_handoff(&page[i]))
            .collect();
        let kept = log
            .settle_page(&window, owner, last, delivered as i64, done, &handoffs)
            .await?;
        if !kept {
            tracing::warn!(destination = %names[0], "lost the log cursor's lease; another relay reads it now");
            self.forget();
            return Ok(Round::NotHeld);
        }
        count(shared, delivered, &handoffs);
        m::record_commit_to_delivery(delivered_at.into_iter());
        if !done {
            self.window = Some(next);
            self.ahead = ahead;
        }
        Ok(if !done {
            Round::More
        } else if page.is_empty() {
            Round::Idle
        } else {
            Round::WindowDone
        })
    }
}

enum Round {
    /// The window has more events.
    More,
    /// The window is done; the next one may hold more.
    WindowDone,
    /// Nothing new was committed.
    Idle,
    /// Another relay holds the cursor.
    NotHeld,
}

async fn wait(shared: &Shared, wake: &mut tokio::sync::watch::Receiver<u64>, delay: Duration) {
    tokio::select! {
        _ = tokio::time::sleep(delay) => {}
        _ = wake.changed() => {}
        _ = shared.shutdown.cancelled() => {}
    }
}

/// What to do with an event the destination did not take.
struct Pending {
    dead: bool,
    delay: Duration,
    attempts: i32,
    error: String,
    others: Vec<String>,
}

impl Pending {
    fn into_handoff(self, event: &LogEvent) -> Handoff<'_> {
        Handoff {
            event,
            dead: self.dead,
            delay: self.delay,
            attempts: self.attempts,
            error: self.error,
            others: self.others,
        }
    }
}

/// Publish the page's events that route to `d`; returns the page indices of
/// those delivered and, by page index, the ones to hand off.
async fn publish_page(
    shared: &Shared,
    d: usize,
    page: &[LogEvent],
) -> (Vec<usize>, Vec<(usize, Pending)>) {
    let router = &shared.router;
    let config = &shared.config;
    let mut mine = Vec::with_capacity(page.len());
    let mut targets_of = Vec::with_capacity(page.len());
    let mut handoffs = Vec::new();
    let others = |targets: &[usize]| -> Vec<String> {
        targets
            .iter()
            .filter(|&&t| t != d)
            .map(|&t| router.destinations()[t].name.clone())
            .collect()
    };
    for (i, e) in page.iter().enumerate() {
        let targets = router.targets(&e.event.event_type);
        if !targets.contains(&d) {
            continue;
        }
        if e.scheduled {
            // Not due yet: the outbox keeps it until its time (the hand-off
            // makes it due then), so the cursor moves on.
            handoffs.push((
                i,
                Pending {
                    dead: false,
                    delay: Duration::ZERO,
                    attempts: 0,
                    error: String::new(),
                    others: others(&targets),
                },
            ));
            continue;
        }
        mine.push(i);
        targets_of.push(targets);
    }
    if mine.is_empty() {
        return (Vec::new(), handoffs);
    }
    let messages: Vec<Message> = mine
        .iter()
        .map(|&i| Message::from(&page[i].event))
        .collect();
    let outcomes = publish_to(shared, d, &messages).await;
    let mut delivered = Vec::new();
    for ((&i, outcome), targets) in mine.iter().zip(outcomes).zip(targets_of) {
        let others = || others(&targets);
        let pending = match outcome {
            Outcome::Delivered => {
                delivered.push(i);
                continue;
            }
            Outcome::Retry { error, after } => Pending {
                dead: config.max_attempts <= 1,
                delay: after
                    .unwrap_or_else(|| {
                        backoff::full_jitter(1, config.backoff_base, config.backoff_max)
                    })
                    .min(config.backoff_max),
                attempts: 1,
                error: sanitize_error(&error),
                others: others(),
            },
            Outcome::Deferred { reason, after } => Pending {
                dead: false,
                delay: after.unwrap_or(config.backoff_base).min(config.backoff_max),
                attempts: 0,
                error: sanitize_error(&reason),
                others: others(),
            },
            Outcome::Reject { error } => {
                let error = sanitize_error(&error);
                tracing::warn!(event_id = %page[i].event.event_id, event_type = %page[i].event.event_type, %error, "rejected by the sink; dead-lettered");
                Pending {
                    dead: true,
                    delay: Duration::ZERO,
                    attempts: 1,
                    error,
                    others: others(),
                }
            }
        };
        handoffs.push((i, pending));
    }
    (delivered, handoffs)
}

fn count(shared: &Shared, delivered: usize, handoffs: &[Handoff<'_>]) {
    let dead = handoffs.iter().filter(|h| h.dead).count();
    let scheduled = handoffs.iter().filter(|h| h.event.scheduled).count();
    let stats = &shared.stats;
    stats
        .delivered
        .fetch_add(delivered as u64, Ordering::Relaxed);
    stats.retried.fetch_add(
        (handoffs.len() - dead - scheduled) as u64,
        Ordering::Relaxed,
    );
    stats
        .dead_lettered
        .fetch_add(dead as u64, Ordering::Relaxed);
    if dead > 0 {
        metrics::counter!(m::DEAD_LETTERED).increment(dead as u64);
    }
}

/// Retention without vacuum: rotate the ring of segments and empty the ones
/// every cursor has read past, until shutdown.
pub(crate) async fn maintain_loop(shared: Arc<Shared>, archive: bool) {
    let log = shared.store.log();
    let age = shared.config.log_segment_age;
    let every = (age / 4).max(Duration::from_millis(50));
    while !shared.shutdown.is_cancelled() {
        match log.maintain(age, archive).await {
            Ok((rotated, removed)) => {
                if removed > 0 {
                    metrics::counter!(m::RETENTION_PURGED, "table" => "log").increment(removed);
                }
                if rotated || removed > 0 {
                    tracing::debug!(rotated, removed, "log segments maintained");
                }
            }
            Err(e) => {
                tracing::warn!(error = %sanitize_error(&e.to_string()), "log maintenance failed; trying again later");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shared.shutdown.cancelled() => {}
        }
    }
}

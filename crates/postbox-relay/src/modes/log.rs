//! Log mode's reader: one task per destination and partition, reading that
//! partition of the destination's cursor over the append-only log (see
//! `postbox_store::Log`). A destination's cursor is split by a hash of the
//! aggregate into `relay.log_partitions` partitions, each under its own
//! lease; relays sharing a log take about an equal share of them each (see
//! `Log::acquire`), so one aggregate is read by one reader, in order.
//!
//! Each round reads one page of the cursor's window, publishes the events
//! that route to the destination, and then moves the cursor past the page.
//! The events the destination did not take are handed to the outbox in the
//! transaction that moves the cursor, where the claim loop (running
//! alongside) retries them with backoff or keeps them as dead letters. So a
//! poison event never stops the cursor, and a slow destination never holds
//! a fast one back.
//!
//! Nothing an event waits for before it is read writes: a window is opened
//! with its first page in one read (`Log::open`: its upper snapshot is
//! taken, not stored); a page with nothing to hand off moves the cursor
//! behind the reader (see [`Behind`]), committing while the next pages are
//! read and published; a lease renewal commits without waiting for the WAL
//! flush, and without waiting for the moves in flight unless it gives the
//! partition back to another relay (`Log::renew`, then `Log::acquire`); and a new window with nothing in it is not written at all unless
//! the cursor has stood still for a second. A crash between publishing and
//! moving redelivers at most the pages whose moves were in flight — three
//! pages at most. Within a window the reader reads the next page while the
//! current one publishes: the page read is the same whatever publishing
//! does, since a window's events are fixed by its two snapshots. When the
//! pages run dense (a page of n events spanning n ids, as a log written by
//! one partition's producers is), it reads the page after that too, on a
//! second connection, from where the next page ends if it is dense as well
//! — and drops that read unread when it is not (see [`Ahead`]). An event
//! scheduled for later (`deliver_at` still ahead) is not published: it is
//! handed to the outbox, due at its time, so the cursor never waits for it.
//!
//! Under a relay serving many outboxes, each round takes one of the shared
//! batch permits (see `crate::engine::permits`) before it reads and gives it
//! back once its page is settled, so log-mode outboxes keep the same global
//! cap on batches in flight and the same fairness as claim-mode ones.

use crate::backoff;
use crate::engine::page_publisher::{Item, Pending, Published};
use crate::engine::{spawn, RunMode, Shared, DB_RETRY_BASE, DB_RETRY_MAX};
use crate::redact::sanitize_error;
use crate::telemetry::metrics as m;
use postbox_store::{Handoff, Log, LogEvent, LogWindow};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;
use uuid::Uuid;

/// How often a reader renews its lease (and heartbeat) at most: also how
/// soon a relay gives back partitions beyond its share when another joins.
const RENEW_MAX: Duration = Duration::from_secs(1);

/// How long an idle reader leaves its cursor unmoved at most: a window with
/// nothing in it moves the cursor only when it last moved this long ago.
const IDLE_MOVE: Duration = Duration::from_secs(1);

/// Start log mode: a cursor per destination (split into partitions), a
/// reader task for each partition, and (running forever) the ring's
/// maintenance; `archive`: truncated segments are archived first.
pub(crate) async fn start(
    shared: &Arc<Shared>,
    mode: RunMode,
    archive: bool,
) -> Vec<AbortOnDropHandle<()>> {
    let names: Vec<String> = shared
        .router
        .destinations()
        .iter()
        .map(|d| d.name.clone())
        .collect();
    let starts: Vec<_> = shared
        .router
        .destinations()
        .iter()
        .map(|d| d.cursor_start())
        .collect();
    let wanted = i32::from(shared.config.log_partitions);
    let mut failures = 0;
    let split = loop {
        match shared
            .store
            .log()
            .ensure_split_from(&names, &starts, wanted)
            .await
        {
            Ok(split) => break split,
            Err(e) => {
                failures += 1;
                let delay = backoff::full_jitter(failures, DB_RETRY_BASE, DB_RETRY_MAX);
                tracing::warn!(error = %sanitize_error(&e.to_string()), retry_in = ?delay, "creating the log cursors failed");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shared.shutdown.cancelled() => return Vec::new(),
                }
            }
        }
    };
    let owner = uuid::Uuid::new_v4();
    let mut tasks = Vec::new();
    for (d, name) in names.iter().enumerate() {
        let parts = split
            .iter()
            .find(|(n, _)| n == name)
            .map_or(wanted, |&(_, p)| p);
        if parts != wanted {
            tracing::warn!(destination = %name, partitions = parts, log_partitions = wanted, "the destination's log cursor is split differently and a relay reads it: reading the existing partitions (stop every relay reading it to re-split)");
        }
        for part in 0..parts {
            tasks.push(spawn(read_loop(shared.clone(), d, part, owner, mode)));
        }
    }
    if mode == RunMode::Forever {
        tasks.push(spawn(maintain_loop(shared.clone(), archive)));
    }
    tasks
}

/// How often the maintenance task looks for cursors of destinations this
/// relay does not deliver to.
const STRAY_CHECK: Duration = Duration::from_secs(60);

/// Say (every [`STRAY_CHECK`]) which log cursors belong to no destination of
/// this relay's configuration and are read by no other relay: such a cursor
/// keeps every log segment from truncation (a removed destination's cursor
/// stays behind). `postbox_log_cursor_unread` is 1 for each.
async fn warn_of_stray_cursors(shared: &Shared, log: &Log) {
    let Ok(cursors) = log.cursor_lag().await else {
        return;
    };
    let ours: Vec<&str> = shared
        .router
        .destinations()
        .iter()
        .map(|d| d.name.as_str())
        .collect();
    for c in cursors {
        // Unread for a whole check: not a relay of another configuration
        // restarting, which takes its partitions back within seconds.
        let stray =
            !ours.contains(&c.destination.as_str()) && c.unread_seconds > STRAY_CHECK.as_secs_f64();
        metrics::gauge!(m::LOG_CURSOR_UNREAD, "destination" => c.destination.clone())
            .set(if stray { 1.0 } else { 0.0 });
        if stray {
            let bytes = log.log_bytes().await.unwrap_or(0);
            tracing::warn!(
                destination = %c.destination,
                unread_events = c.lag_events,
                unread_for = %humantime::format_duration(Duration::from_secs(c.unread_seconds as u64)),
                log_bytes = bytes,
                "a log cursor belongs to no destination of this relay and no relay reads it: it keeps the log from being truncated; if the destination was removed for good, drop it (postbox log drop-cursor NAME); said again every minute"
            );
        }
    }
}

/// Read partition `part` of destination `d`'s cursor until shutdown (or,
/// draining, until a window comes back empty).
pub(crate) async fn read_loop(
    shared: Arc<Shared>,
    d: usize,
    part: i32,
    owner: Uuid,
    mode: RunMode,
) {
    let log = shared.store.log();
    let name = shared.router.destinations()[d].name.clone();
    let config = &shared.config;
    let mut reader = Reader {
        held_until: None,
        window: None,
        ahead: VecDeque::new(),
        ordered: shared.router.claim_order().is_some(),
        moved_at: None,
        behind: None,
        next_lo: None,
        give_back: false,
        leases_seen: shared.signals.lease_generation(),
    };
    let mut failures = 0;
    let mut wake = shared.signals.log.subscribe();
    while !shared.shutdown.is_cancelled() {
        // Serving many outboxes, a round is a batch like a claim: it holds a
        // shared batch permit from before it reads until its page is settled.
        let Ok(permit) = shared.batch_permit().await else {
            break;
        };
        let round = reader.round(&shared, &log, d, part, owner).await;
        drop(permit);
        match round {
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
                tracing::warn!(destination = %name, part, error = %sanitize_error(&e.to_string()), retry_in = ?delay, "reading the log failed");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shared.shutdown.cancelled() => {}
                }
            }
        }
    }
    // The last move first: the lease goes only once it is in.
    if let Err(e) = reader.catch_up(&shared).await {
        tracing::warn!(destination = %name, part, error = %sanitize_error(&e.to_string()), "the log cursor's last move failed; its page is delivered again");
    }
    if let Err(e) = log.release(owner, &name, part).await {
        tracing::debug!(error = %sanitize_error(&e.to_string()), "could not release the log cursor's lease; it expires by itself");
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
    /// The window's next pages being read (in id order), started while the
    /// pages before them were published.
    ahead: VecDeque<Ahead>,
    /// The router has ordered routes.
    ordered: bool,
    /// When this reader last moved the cursor.
    moved_at: Option<Instant>,
    /// The last page's cursor move, committing while the next page is read
    /// and published (see [`Behind`]).
    behind: Option<Behind>,
    /// Where the next window starts (the last window's `hi`) while the move
    /// that closed that window may not be committed yet.
    next_lo: Option<String>,
    /// Another relay is owed this partition: give it back once the moves in
    /// flight are in.
    give_back: bool,
    /// `Signals::leases` when this reader last checked its lease: a
    /// change (a reader joined, a partition was given back) brings the next
    /// check forward to the next round.
    leases_seen: u64,
}

/// Cursor moves committing in the background. A page that hands nothing
/// off moves the cursor behind the reader: its move commits (and waits for
/// its WAL flush) while the next pages are read and published, so no event
/// waits for a flush before it is read. Moves commit one after another, in
/// order: each waits for the one before it and is not made when that one
/// failed. At most [`MOVES_IN_FLIGHT`] are in flight; everything that needs
/// the cursor's row as committed (opening a window from it, renewing or
/// giving back the lease, a page with hand-offs, which moves the cursor in
/// the transaction that hands them off) waits for them first. So a crash
/// redelivers at most the pages whose moves were in flight and the one
/// published meanwhile.
struct Behind {
    /// The last move, which waits for the ones before it.
    task: tokio::task::JoinHandle<Result<bool, sqlx::Error>>,
    /// Events the moves in flight record as delivered.
    delivered: usize,
    /// Moves in flight (this one and those it waits for) when it was made.
    moves: usize,
}

/// At most this many cursor moves of one reader are in flight.
const MOVES_IN_FLIGHT: usize = 2;

/// At most this many pages of one reader are read ahead at once. A page's
/// read takes about twice as long as its publishing in a drain to Redis
/// (4 ms against 1.5–2 ms for 1,000 events): with two reads under way, one
/// page in six was not in when its turn came; with three, one in fifty,
/// and the drain ran ~5 % faster (docs/performance.md, 2026-12-07).
const PAGES_AHEAD: usize = 3;

/// A page of the open window read by a task of its own, so that its rows
/// are decoded on another worker thread while this one publishes. A page
/// after `after_id` is the same whenever it is read (the window's events
/// are fixed by its snapshots), so a read is used when the page before it
/// ended at `after_id`, and dropped (aborted) otherwise.
struct Ahead {
    window: LogWindow,
    task: AbortOnDropHandle<Result<Vec<LogEvent>, sqlx::Error>>,
}

impl Ahead {
    fn read(log: &Log, window: LogWindow, batch: i64) -> Self {
        let task = {
            let (log, window) = (log.clone(), window.clone());
            AbortOnDropHandle::new(tokio::spawn(crate::telemetry::label::inherit(async move {
                log.page(&window, batch).await
            })))
        };
        Self { window, task }
    }

    /// The page; a failed read is read again.
    async fn page(mut self, log: &Log, batch: i64) -> Result<Vec<LogEvent>, sqlx::Error> {
        match (&mut self.task).await {
            Ok(Ok(page)) => Ok(page),
            _ => log.page(&self.window, batch).await,
        }
    }
}

impl Reader {
    fn forget(&mut self) {
        self.held_until = None;
        self.window = None;
        self.ahead.clear();
        self.next_lo = None;
    }

    /// Wait for the cursor move in flight, if any: false when it found the
    /// lease lost (or the cursor moved by someone else), and the reader
    /// forgets its view.
    async fn catch_up(&mut self, shared: &Shared) -> Result<bool, sqlx::Error> {
        let Some(Behind {
            task, delivered, ..
        }) = self.behind.take()
        else {
            return Ok(true);
        };
        let moved = match task.await {
            Ok(moved) => moved,
            Err(joined) => Err(sqlx::Error::Protocol(format!(
                "the log cursor's move did not finish: {joined}"
            ))),
        };
        match moved {
            Ok(true) => {
                self.moved_at = Some(Instant::now());
                count(shared, delivered, &[], 0);
                Ok(true)
            }
            Ok(false) => {
                self.forget();
                Ok(false)
            }
            Err(e) => {
                self.forget();
                Err(e)
            }
        }
    }

    /// Read a page, publish it (reading the next page of the window
    /// meanwhile), then settle it: move the cursor and hand off what the
    /// destination did not take.
    async fn round(
        &mut self,
        shared: &Shared,
        log: &Log,
        d: usize,
        part: i32,
        owner: Uuid,
    ) -> Result<Round, sqlx::Error> {
        let config = &shared.config;
        let name = &shared.router.destinations()[d].name;
        let batch = i64::from(config.batch_size);
        let leases = shared.signals.lease_generation();
        if leases != self.leases_seen {
            self.leases_seen = leases;
            self.held_until = None;
        }
        if self.held_until.is_none_or(|t| Instant::now() >= t) {
            let renew_every = (config.lease / 3).min(RENEW_MAX);
            let moving = self.behind.as_ref().is_some_and(|b| !b.task.is_finished());
            if moving && !self.give_back {
                // Moves in flight: renew without giving the partition back
                // (and without waiting for them), and learn whether another
                // relay is owed it.
                let lease = log.renew(owner, name, part, config.lease).await?;
                if !lease.held {
                    self.forget();
                    return Ok(Round::NotHeld);
                }
                self.give_back = lease.beyond_share;
            } else {
                // Once the moves are in, nothing of this cursor is in flight:
                // a partition beyond this relay's share is given back here.
                if !self.catch_up(shared).await? {
                    return Ok(lost(name, part));
                }
                self.give_back = false;
                if !log.acquire(owner, name, part, config.lease).await? {
                    self.forget();
                    return Ok(Round::NotHeld);
                }
            }
            // A partition owed to another relay goes back at the next round.
            self.held_until = Some(if self.give_back {
                Instant::now()
            } else {
                Instant::now() + renew_every
            });
        }
        let (window, page) = match self.window.take() {
            Some(w) => {
                let page = match self.ahead.pop_front() {
                    Some(ahead) if ahead.window == w => ahead.page(log, batch).await?,
                    _ => {
                        self.ahead.clear();
                        log.page(&w, batch).await?
                    }
                };
                (w, page)
            }
            None => {
                self.ahead.clear();
                // The window and its first page in one read; a window read
                // from its start begins at its first event. It starts where
                // the last one ended, or, when this reader does not know
                // that, where the cursor's row says once its move is in.
                if self.next_lo.is_none() && !self.catch_up(shared).await? {
                    return Ok(lost(name, part));
                }
                let from = self.next_lo.as_deref();
                let Some(opened) = log.open(name, part, owner, from, batch).await? else {
                    self.forget();
                    return Ok(Round::NotHeld);
                };
                opened
            }
        };
        // A new window with nothing in it was only read (opening it wrote
        // nothing): unless the cursor has not moved for a while (retention
        // and the lag gauges go by its `lo`), leave the cursor where it is —
        // the next window, from the same `lo`, holds whatever this one would
        // have — and save the write an idle poll would cost.
        if page.is_empty()
            && window.after_id == 0
            && self.moved_at.is_some_and(|t| t.elapsed() < IDLE_MOVE)
        {
            return Ok(Round::Idle);
        }
        if !page.is_empty() {
            crate::telemetry::otel::claimed(
                &shared.store.schema(),
                page.iter().map(|e| &e.event.headers),
            );
        }
        let done = (page.len() as i64) < batch;
        let last = page.last().map_or(window.after_id, |e| e.id);
        let next = LogWindow {
            after_id: last,
            ..window.clone()
        };
        // The next page of the window does not depend on how this one is
        // published: it is read meanwhile (unless a read of it is under way
        // already). When this page was dense (as many ids as events), the
        // pages after the next one are read too, each from where the one
        // before it ends if that is dense as well, on spare connections.
        if done {
            self.ahead.clear();
        } else {
            // Guessed reads take only connections nothing else waits for:
            // not one the next page's read, started just now, is about to take.
            let mut spare = log.spare_connections();
            if self.ahead.front().is_none_or(|a| a.window != next) {
                self.ahead.clear();
                self.ahead.push_back(Ahead::read(log, next.clone(), batch));
                spare = spare.saturating_sub(1);
            }
            let dense = last - window.after_id == batch;
            while dense && self.ahead.len() < PAGES_AHEAD && spare > 0 {
                let after_id = self.ahead.back().map_or(last, |a| a.window.after_id) + batch;
                let guess = LogWindow {
                    after_id,
                    ..window.clone()
                };
                self.ahead.push_back(Ahead::read(log, guess, batch));
                spare -= 1;
            }
            // Let the reads start now. A task spawned from a worker waits in
            // that worker's own next-task slot, which the other worker does
            // not take from, so without this the read's query would leave
            // only when publishing first gives the thread up — after the
            // page's messages are built, about a millisecond a page later.
            tokio::task::yield_now().await;
        }
        let published = publish_page(shared, log, d, &page, self.ordered).await;
        let Published {
            delivered,
            handoffs,
        } = published?;
        let delivered_at: Vec<_> = delivered
            .iter()
            .map(|&i| page[i].event.created_at)
            .collect();
        let delivered = delivered.len();
        let retried = handoffs.iter().filter(|(_, h)| h.tried && !h.dead).count();
        let handoffs: Vec<Handoff<'_>> = handoffs
            .into_iter()
            .map(|(i, h)| into_handoff(h, &page[i]))
            .collect();
        m::record_commit_to_delivery(delivered_at.into_iter());
        // This page's move: in line when it hands events off, behind the
        // reader otherwise; either way after the moves in flight, which it
        // waits for first when it hands events off or too many are in flight.
        let wait = !handoffs.is_empty()
            || self
                .behind
                .as_ref()
                .is_some_and(|b| b.moves >= MOVES_IN_FLIGHT && !b.task.is_finished());
        if wait && !self.catch_up(shared).await? {
            return Ok(lost(name, part));
        }
        let settled = crate::telemetry::otel::settle_span(
            &shared.store.schema(),
            page.iter().map(|e| &e.event.headers),
        );
        if handoffs.is_empty() {
            let before = self.behind.take();
            let (moves, delivered_before) = match &before {
                Some(b) if !b.task.is_finished() => (b.moves + 1, b.delivered),
                Some(b) => (1, b.delivered),
                None => (1, 0),
            };
            let (log, window) = (log.clone(), window.clone());
            let moving = async move {
                if let Some(before) = before {
                    match before.task.await {
                        Ok(Ok(true)) => {}
                        Ok(other) => return other,
                        Err(joined) => {
                            return Err(sqlx::Error::Protocol(format!(
                                "the log cursor's move did not finish: {joined}"
                            )))
                        }
                    }
                }
                log.advance(&window, owner, last, delivered as i64, done)
                    .await
            };
            self.behind = Some(Behind {
                task: tokio::spawn(crate::telemetry::label::inherit(moving.instrument(settled))),
                delivered: delivered_before + delivered,
                moves,
            });
        } else {
            let kept = log
                .settle_page(&window, owner, last, delivered as i64, done, &handoffs)
                .instrument(settled)
                .await?;
            if !kept {
                self.forget();
                return Ok(lost(name, part));
            }
            self.moved_at = Some(Instant::now());
            count(shared, delivered, &handoffs, retried);
        }
        self.next_lo = done.then(|| window.hi.clone());
        if !done {
            self.window = Some(next);
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

/// The round's answer when the cursor's lease was lost (or the cursor was
/// moved by another relay).
fn lost(name: &str, part: i32) -> Round {
    tracing::warn!(destination = %name, part, "lost the log cursor's lease; another relay reads it now");
    Round::NotHeld
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

/// The hand-off log mode writes for `pending`, an event of `page`.
fn into_handoff(pending: Pending, event: &LogEvent) -> Handoff<'_> {
    Handoff {
        event,
        dead: pending.dead,
        delay: pending.delay,
        attempts: pending.attempts,
        error: pending.error,
        others: pending.others,
    }
}

/// Publish the page's events that route to `d`, in layers per aggregate on
/// ordered routes (see `crate::engine::page`); `Log::held` says which aggregates
/// the outbox holds. `ordered`: the router has ordered routes.
async fn publish_page(
    shared: &Shared,
    log: &Log,
    d: usize,
    page: &[LogEvent],
    ordered: bool,
) -> Result<Published, sqlx::Error> {
    let items: Vec<Item<'_>> = page
        .iter()
        .map(|e| Item {
            event: &e.event,
            scheduled: e.scheduled,
        })
        .collect();
    crate::engine::page_publisher::publish(shared, log, d, &items, ordered).await
}

/// Count a settled page; `retried` of the hand-offs were tried and are not
/// dead letters (the others are scheduled or held behind an earlier event of
/// their aggregate, untried).
fn count(shared: &Shared, delivered: usize, handoffs: &[Handoff<'_>], retried: usize) {
    let dead = handoffs.iter().filter(|h| h.dead).count();
    let stats = &shared.stats;
    stats
        .delivered
        .fetch_add(delivered as u64, Ordering::Relaxed);
    stats.retried.fetch_add(retried as u64, Ordering::Relaxed);
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
    let mut strays_checked: Option<Instant> = None;
    while !shared.shutdown.is_cancelled() {
        if strays_checked.is_none_or(|t| t.elapsed() >= STRAY_CHECK) {
            strays_checked = Some(Instant::now());
            warn_of_stray_cursors(&shared, &log).await;
        }
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

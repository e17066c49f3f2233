//! `postbox status`: counts by status, the oldest pending event, attempts and
//! dead letters, how far back a replay reaches and the replay jobs still
//! open; once, or refreshed until interrupted.

use crate::context::{cancel_on_signal, AnyError, Settings};
use crate::output::{out, outln};
use chrono::{DateTime, Utc};
use clap::Args;
use postbox::Schema;
use postbox_relay::health::{findings, Finding, Problem};
use postbox_relay::Store;
use postbox_store::{
    AttemptsCount, CursorLag, DestinationCounts, GroupStatus, ProducerTarget, ReplayJob,
    ReplaySource, SlotStatus, StatusCounts,
};
use std::process::ExitCode;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Print JSON: pending, scheduled, processing, sent, failed, oldest_pending_age_seconds,
    /// next_scheduled_in_seconds, oldest_pending_event_id, dead_letters, pending_attempts,
    /// producers_write_into, numbered_emits, oldest_replayable_at, replay_source,
    /// replay_jobs, …
    #[arg(long)]
    pub json: bool,
    /// Refresh every INTERVAL [default: 2s] until interrupted (JSON: one line per refresh)
    #[arg(long, value_name = "INTERVAL", num_args = 0..=1, default_missing_value = "2s",
          value_parser = humantime::parse_duration)]
    pub watch: Option<Duration>,
    /// Say loudly when no relay has read the logical slot or a log cursor
    /// for longer than this [default: relay.logical_inactive_warn, 5m];
    /// given, status exits 1 when one has not
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub inactive_warn: Option<Duration>,

    /// Show many outboxes, one line each (one outbox: an exact name)
    #[command(flatten)]
    pub select: crate::tenants::SelectArgs,
}

pub async fn run(settings: &Settings, args: StatusArgs) -> Result<ExitCode, AnyError> {
    if crate::tenants::many(settings, &args.select) {
        return status_many(settings, &args).await;
    }
    let pool = settings.pool("postbox-status").await?;
    let store = Store::new(pool, settings.schema.clone());
    let slot = settings.file.relay.slot_name(&settings.schema);
    let bound = args
        .inactive_warn
        .unwrap_or(settings.file.relay.logical_inactive_warn);
    let Some(every) = args.watch else {
        let report = status_report(&store, &slot, bound).await?;
        if args.json {
            outln!("{}", serde_json::to_string(&report)?);
        } else {
            out!("{}", render_status(&settings.schema, &report));
        }
        // Asked to watch for readers (--inactive-warn): exit 1 when the
        // slot or a log cursor has gone unread longer, as `slot status` does.
        let unread = report.logical_slot_unread_too_long
            || !report.log_cursors_unread.is_empty()
            || !report.consumer_groups_unread.is_empty()
            || report
                .logical_slot
                .as_ref()
                .is_some_and(|s| s.failing().is_some());
        return Ok(if args.inactive_warn.is_some() && unread {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        });
    };
    if every.is_zero() {
        return Err("--watch: the interval must be greater than zero".into());
    }
    let stop = CancellationToken::new();
    tokio::spawn(cancel_on_signal(stop.clone()));
    while !stop.is_cancelled() {
        let shown = match status_report(&store, &slot, bound).await {
            Ok(r) if args.json => serde_json::to_string(&r)?,
            Ok(r) => render_status(&settings.schema, &r),
            Err(e) => format!(
                "error: {}",
                postbox_relay::redact::sanitize_error(&e.to_string())
            ),
        };
        let shown_ok = if args.json {
            outln!("{shown}")
        } else if crate::output::stdout_is_terminal() {
            // Home the cursor and clear the screen, then redraw.
            out!(
                "\x1b[H\x1b[2J{}\n{shown}",
                chrono::Local::now().format("%Y-%m-%d %H:%M:%S")
            )
        } else {
            // A file or a pipe: one report after the other, each under its time.
            outln!(
                "--- {}\n{shown}",
                chrono::Local::now().format("%Y-%m-%d %H:%M:%S")
            )
        };
        if !shown_ok {
            // The reader went away (`status --watch | head`): done.
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.cancelled() => {}
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `postbox status --json`: the original keys first, then the additions.
#[derive(serde::Serialize)]
struct StatusReport {
    #[serde(flatten)]
    counts: StatusCounts,
    oldest_pending_event_id: Option<uuid::Uuid>,
    dead_letters: i64,
    pending_attempts: Vec<AttemptsCount>,
    /// Fan-out events' retries and dead letters per destination.
    destinations: Vec<DestinationCounts>,
    /// Per destination and reading mode, over the last hour: what the
    /// relays delivered and what the destination's filters kept from it.
    delivered_last_hour: Vec<postbox_store::RecentDeliveries>,
    /// Where producers write: `outbox` (claim mode) or `log`.
    producers_write_into: &'static str,
    /// Logical mode: whether emit numbers each event within its aggregate
    /// (`migrate --emit-sequence on`; ordered routes need it).
    numbered_emits: bool,
    /// Log mode: each cursor's lag.
    log_cursors: Vec<CursorLag>,
    /// Log mode: the cursors no relay has held for longer than
    /// `--inactive-warn`: each keeps the log from being truncated.
    log_cursors_unread: Vec<String>,
    /// Log mode: the log's size on disk.
    log_bytes: i64,
    /// Log mode: consumer groups (unread, in flight, waiting, dead letters,
    /// readers in the last minute, oldest unacknowledged).
    consumer_groups: Vec<GroupStatus>,
    /// Log mode: the groups with events that no reader has called
    /// `receive` on for longer than `--inactive-warn`: each keeps the log
    /// from being truncated.
    consumer_groups_unread: Vec<String>,
    /// Logical mode: the replication slot this schema's relay reads
    /// (`relay.logical_slot`, or `postbox_<schema>`), when it exists.
    logical_slot: Option<SlotStatus>,
    /// Logical mode: no relay has held the slot for longer than
    /// `--inactive-warn` (`relay.logical_inactive_warn`).
    logical_slot_unread_too_long: bool,
    /// Where a replay reads by default (where producers write): `outbox`
    /// (the outbox table and its archive) or `log` (the log and the archive).
    replay_source: &'static str,
    /// The oldest event that source still holds: how far back a replay
    /// reaches (`null`: it holds none).
    oldest_replayable_at: Option<DateTime<Utc>>,
    /// The replay jobs not done or cancelled (running, paused, failed),
    /// oldest first: each holds retention back until it ends.
    replay_jobs: Vec<OpenReplay>,
    #[serde(skip)]
    inactive_warn: Duration,
}

/// A replay job still open, as status shows it.
#[derive(serde::Serialize)]
struct OpenReplay {
    id: i64,
    state: String,
    destination: String,
    source: String,
    /// Events it has delivered, filtered out or had refused so far.
    handled: i64,
    /// Events of its range.
    total: i64,
    delivered: i64,
    filtered: i64,
    rejected: i64,
    from_at: DateTime<Utc>,
    to_at: DateTime<Utc>,
    created_by: String,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

impl From<ReplayJob> for OpenReplay {
    fn from(j: ReplayJob) -> Self {
        Self {
            handled: j.delivered + j.filtered + j.rejected,
            id: j.id,
            state: j.state,
            destination: j.destination,
            source: j.source,
            total: j.total,
            delivered: j.delivered,
            filtered: j.filtered,
            rejected: j.rejected,
            from_at: j.from_at,
            to_at: j.to_at,
            created_by: j.created_by,
            created_at: j.created_at,
            updated_at: j.updated_at,
        }
    }
}

/// How far back a replay reaches and the replay jobs still open: `status`'s
/// and `status --schemas`'s.
struct Replayable {
    source: ReplaySource,
    oldest: Option<DateTime<Utc>>,
    jobs: Vec<OpenReplay>,
}

/// The source a replay reads by default (where producers write: the log in
/// log mode, the outbox otherwise), its oldest event and the open jobs.
async fn replayable(store: &Store, target: ProducerTarget) -> Result<Replayable, sqlx::Error> {
    let source = match target {
        ProducerTarget::Log => ReplaySource::Log,
        ProducerTarget::Outbox => ReplaySource::Outbox,
    };
    let oldest = store.replays().oldest(source).await?;
    let jobs = store
        .open_replays()
        .await?
        .into_iter()
        .map(OpenReplay::from)
        .collect();
    Ok(Replayable {
        source,
        oldest,
        jobs,
    })
}

/// What a replay source (`outbox` or `log`) holds, for people.
fn source_text(source: &str) -> &'static str {
    if source == ReplaySource::Log.as_str() {
        "the log and the archive"
    } else {
        "the outbox and its archive"
    }
}

/// How long ago `at` was, for people (`-` when never).
fn ago(at: Option<DateTime<Utc>>) -> String {
    format_age(at.map(|t| (Utc::now() - t).num_milliseconds() as f64 / 1000.0))
}

async fn status_report(
    store: &Store,
    slot: &str,
    inactive_warn: Duration,
) -> Result<StatusReport, sqlx::Error> {
    let counts = store.status_counts().await?;
    let gauges = store.gauges().await?;
    let pending_attempts = store.pending_attempts().await?;
    let destinations = store.destination_counts().await?;
    let delivered_last_hour = store.tally().recent(60).await?;
    let log = store.log();
    let target = log.producer_target().await?;
    let producers_write_into = target.as_str();
    let replay = replayable(store, target).await?;
    let numbered_emits = store.logical().numbered_emits().await?;
    let log_cursors = log.cursor_lag().await?;
    let log_cursors_unread = log_cursors
        .iter()
        .filter(|c| c.unread_seconds > inactive_warn.as_secs_f64())
        .map(|c| c.destination.clone())
        .collect();
    let consumer_groups = store.groups().status().await?;
    let consumer_groups_unread = consumer_groups
        .iter()
        .filter(|g| g.unread_longer_than(inactive_warn))
        .map(|g| g.name.clone())
        .collect();
    let log_bytes = if log_cursors.is_empty() && consumer_groups.is_empty() {
        0
    } else {
        log.log_bytes().await?
    };
    let logical_slot = store.logical().status(Some(slot)).await?.into_iter().next();
    let logical_slot_unread_too_long = logical_slot
        .as_ref()
        .is_some_and(|s| s.unread_longer_than(inactive_warn));
    Ok(StatusReport {
        logical_slot_unread_too_long,
        inactive_warn,
        producers_write_into,
        numbered_emits,
        log_cursors,
        log_cursors_unread,
        log_bytes,
        consumer_groups,
        consumer_groups_unread,
        logical_slot,
        replay_source: replay.source.as_str(),
        oldest_replayable_at: replay.oldest,
        replay_jobs: replay.jobs,
        dead_letters: counts.failed,
        counts,
        oldest_pending_event_id: gauges.oldest_pending_event_id,
        pending_attempts,
        destinations,
        delivered_last_hour,
    })
}

fn format_age(secs: Option<f64>) -> String {
    secs.map(|s| {
        humantime::format_duration(Duration::from_secs(s.max(0.0).round() as u64)).to_string()
    })
    .unwrap_or_else(|| "-".to_owned())
}

fn render_status(schema: &Schema, r: &StatusReport) -> String {
    use std::fmt::Write;
    let c = &r.counts;
    let mut out = String::new();
    let _ = writeln!(out, "schema      {schema}");
    let _ = writeln!(out, "producers   write into the {}", r.producers_write_into);
    let _ = writeln!(
        out,
        "emits       {}",
        if r.numbered_emits {
            "numbered (each updates its aggregate's counter row; ordered routes work)"
        } else {
            "not numbered (no table row written; delivered unordered)"
        }
    );
    let _ = writeln!(out, "pending     {}", c.pending);
    if c.scheduled > 0 {
        let _ = writeln!(
            out,
            "scheduled   {}  (the first due in {})",
            c.scheduled,
            format_age(c.next_scheduled_in_seconds)
        );
    } else {
        let _ = writeln!(out, "scheduled   0");
    }
    let _ = writeln!(out, "processing  {}", c.processing);
    let _ = writeln!(out, "sent        {}", c.sent);
    let _ = writeln!(out, "failed      {}  (dead letters)", c.failed);
    let _ = writeln!(
        out,
        "oldest pending age  {}",
        format_age(c.oldest_pending_age_seconds)
    );
    if let Some(id) = r.oldest_pending_event_id {
        let _ = writeln!(out, "oldest pending event  {id}");
    }
    if !r.pending_attempts.is_empty() {
        let parts: Vec<String> = r
            .pending_attempts
            .iter()
            .map(|a| format!("{}: {}", a.attempts, a.count))
            .collect();
        let _ = writeln!(out, "pending by attempts  {}", parts.join(", "));
    }
    let _ = match r.oldest_replayable_at {
        Some(at) => writeln!(
            out,
            "oldest replayable event  {}  ({} ago; in {})",
            at.format("%Y-%m-%d %H:%M:%S UTC"),
            ago(Some(at)),
            source_text(r.replay_source)
        ),
        None => writeln!(
            out,
            "oldest replayable event  -  ({} hold no event)",
            source_text(r.replay_source)
        ),
    };
    if !r.replay_jobs.is_empty() {
        let _ = writeln!(
            out,
            "replay jobs  {} open; an open job holds retention back until done or cancelled  (id / destination / state / handled of its events)",
            r.replay_jobs.len()
        );
        for j in &r.replay_jobs {
            let _ = writeln!(
                out,
                "  {:<7} {:<20} {:<8} {}/{}",
                j.id, j.destination, j.state, j.handled, j.total
            );
        }
        let _ = writeln!(
            out,
            "  resume one with postbox replay resume ID, or end it with postbox replay cancel ID"
        );
    }
    if !r.log_cursors.is_empty() {
        let _ = writeln!(
            out,
            "log cursors  (unread events / oldest unread / delivered / held by a relay)"
        );
        for c in &r.log_cursors {
            let _ = writeln!(
                out,
                "  {:<20} {} / {} / {} / {}",
                c.destination,
                c.lag_events,
                format_age(c.lag_seconds),
                c.delivered,
                if c.held { "yes" } else { "no" }
            );
            if r.log_cursors_unread.contains(&c.destination) {
                let _ = writeln!(
                    out,
                    "    NOT READ for {}: no relay reads this cursor, and it keeps the log ({:.1} MB) from being truncated; start a relay that delivers to {}, or if the destination was removed: postbox log drop-cursor {}",
                    format_age(Some(c.unread_seconds)),
                    r.log_bytes as f64 / 1048576.0,
                    c.destination,
                    c.destination
                );
            }
        }
    }
    if !r.consumer_groups.is_empty() {
        let _ = writeln!(out, "consumer groups");
        for g in &r.consumer_groups {
            let _ = writeln!(out, "  {}", super::group::summary(g));
            if r.consumer_groups_unread.contains(&g.name) {
                let _ = writeln!(
                    out,
                    "    NOT READ for longer than {}: no reader calls receive on {}, and it keeps the log ({:.1} MB) from being truncated; start its readers, or if it is gone: postbox group drop {}",
                    humantime::format_duration(r.inactive_warn),
                    g.name,
                    r.log_bytes as f64 / 1048576.0,
                    g.name
                );
            }
        }
    }
    if let Some(slot) = &r.logical_slot {
        let _ = writeln!(out, "logical slot  {}", slot.summary());
        if slot.is_lost() {
            let _ = writeln!(
                out,
                "  INVALIDATED: {} (see postbox slot status)",
                slot.lost_range()
            );
        }
        if r.logical_slot_unread_too_long {
            let _ = writeln!(
                out,
                "  NOT READ for longer than {}: no relay reads the slot; events wait and WAL is retained (start a relay with --mode logical)",
                humantime::format_duration(r.inactive_warn)
            );
        }
        if let Some(failing) = slot.failing() {
            let _ = writeln!(out, "  READER FAILING: {failing}");
        }
    }
    if !r.delivered_last_hour.is_empty() {
        let _ = writeln!(
            out,
            "last hour by destination  (delivered / filtered out, by where it was read)"
        );
        for d in &r.delivered_last_hour {
            let _ = writeln!(
                out,
                "  {:<20} {:<8} {} / {}",
                d.destination, d.mode, d.delivered, d.filtered
            );
        }
    }
    if !r.destinations.is_empty() {
        let _ = writeln!(out, "fan-out by destination  (retrying / dead letters / delivered after a retry / most attempts)");
        for d in &r.destinations {
            let _ = writeln!(
                out,
                "  {:<20} {} / {} / {} / {}",
                d.destination, d.retrying, d.dead_letters, d.delivered_after_retry, d.max_attempts
            );
        }
    }
    out
}

/// `status --schemas GLOB`: one line per outbox (JSON: one object per outbox,
/// with its `outbox` name).
async fn status_many(settings: &Settings, args: &StatusArgs) -> Result<ExitCode, AnyError> {
    if args.watch.is_some() {
        return Err(
            "--watch shows one outbox: pass --schema instead of --schemas / --databases".into(),
        );
    }
    let found = crate::tenants::list(settings, &args.select, true).await?;
    #[derive(serde::Serialize)]
    struct Line<'a> {
        outbox: &'a str,
        #[serde(flatten)]
        counts: StatusCounts,
        /// Where its producers write: `outbox` (claim mode, and logical
        /// mode's emits leave it empty) or `log`.
        producers_write_into: &'static str,
        /// Log mode: the most events any destination's cursor has not read
        /// (`None`: no cursor), and the oldest of them's age.
        log_unread_events: Option<i64>,
        log_oldest_unread_seconds: Option<f64>,
        /// Log mode: its consumer groups' unread events and dead letters
        /// (`None`: no group).
        group_unread_events: Option<i64>,
        group_dead_letters: Option<i64>,
        /// Where a replay reads by default, the oldest event it still
        /// holds, and the replay jobs still open (each holds retention back).
        replay_source: &'static str,
        oldest_replayable_at: Option<DateTime<Utc>>,
        replay_jobs: Vec<OpenReplay>,
        /// What the relay's health watch would find, against `[health]`'s
        /// thresholds (empty when all is well or `[health]` is off).
        health: Vec<Problem>,
        #[serde(skip)]
        findings: Vec<Finding>,
    }
    let watch = &settings.file.health;
    let mut lines = Vec::with_capacity(found.len());
    for outbox in &found {
        let store = Store::new(outbox.pool.clone(), outbox.schema.clone());
        let counts = store
            .status_counts()
            .await
            .map_err(|e| format!("{}: {e}", outbox.name))?;
        let findings = if watch.enabled {
            let db = store
                .db_health()
                .await
                .map_err(|e| format!("{}: {e}", outbox.name))?;
            findings(&db, watch)
        } else {
            Vec::new()
        };
        let named = |e: sqlx::Error| format!("{}: {e}", outbox.name);
        let log = store.log();
        let target = log.producer_target().await.map_err(named)?;
        let cursors = log.cursor_lag().await.map_err(named)?;
        let groups = store.groups().status().await.map_err(named)?;
        let replay = replayable(&store, target).await.map_err(named)?;
        lines.push(Line {
            outbox: &outbox.name,
            counts,
            producers_write_into: target.as_str(),
            log_unread_events: cursors.iter().map(|c| c.lag_events).max(),
            log_oldest_unread_seconds: cursors
                .iter()
                .filter_map(|c| c.lag_seconds)
                .reduce(f64::max),
            group_unread_events: (!groups.is_empty())
                .then(|| groups.iter().map(|g| g.unread + g.waiting).sum()),
            group_dead_letters: (!groups.is_empty())
                .then(|| groups.iter().map(|g| g.dead_letters).sum()),
            replay_source: replay.source.as_str(),
            oldest_replayable_at: replay.oldest,
            replay_jobs: replay.jobs,
            health: findings.iter().map(Problem::from).collect(),
            findings,
        });
    }
    if args.json {
        outln!("{}", serde_json::to_string(&lines)?);
        return Ok(ExitCode::SUCCESS);
    }
    let width = lines
        .iter()
        .map(|l| l.outbox.len())
        .max()
        .unwrap_or(6)
        .max(6);
    // Claim mode's counts, how far back a replay reaches and the replay
    // jobs still open, then log mode's: what the cursors have not read and
    // what the consumer groups hold ("-": none in this outbox).
    let mut text = format!(
        "{:<width$}  {:<6} {:>9} {:>10} {:>10} {:>7}  {:<14} {:<17} {:>7} {:>10} {:>13}\n",
        "outbox",
        "writes",
        "pending",
        "processing",
        "sent",
        "failed",
        "oldest pending",
        "oldest replayable",
        "replays",
        "log unread",
        "groups u/dead"
    );
    for l in &lines {
        let c = &l.counts;
        let groups = match (l.group_unread_events, l.group_dead_letters) {
            (Some(u), Some(d)) => format!("{u}/{d}"),
            _ => "-".to_owned(),
        };
        text.push_str(&format!(
            "{:<width$}  {:<6} {:>9} {:>10} {:>10} {:>7}  {:<14} {:<17} {:>7} {:>10} {:>13}\n",
            l.outbox,
            l.producers_write_into,
            c.pending,
            c.processing,
            c.sent,
            c.failed,
            format_age(c.oldest_pending_age_seconds),
            ago(l.oldest_replayable_at),
            l.replay_jobs.len(),
            l.log_unread_events
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
            groups
        ));
    }
    // The replay jobs still open, each under its outbox's name.
    for l in &lines {
        for j in &l.replay_jobs {
            text.push_str(&format!(
                "replay job: {}: {} to {}, {} ({}/{} handled); it holds retention back until done or cancelled\n",
                l.outbox, j.id, j.destination, j.state, j.handled, j.total
            ));
        }
    }
    // What the health watch would warn about: a database's conditions once,
    // an outbox table's under the outbox's name.
    let mut databases_said = std::collections::HashSet::new();
    for (l, outbox) in lines.iter().zip(&found) {
        let database = outbox.name.rsplit_once('/').map_or("", |(d, _)| d);
        for f in &l.findings {
            if !f.database_wide() {
                text.push_str(&format!("unhealthy: {}: {}\n", l.outbox, f.summary()));
            } else if databases_said.insert((database, f.key())) {
                text.push_str(&format!(
                    "unhealthy: database {database} (all its outboxes): {}\n",
                    f.summary()
                ));
            }
        }
    }
    out!("{text}");
    Ok(ExitCode::SUCCESS)
}

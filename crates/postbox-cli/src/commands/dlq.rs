//! `postbox dlq`: list, show, replay and discard dead letters, with an audit log.
//!
//! Only glue: the operations, their batching and their audit entries live in
//! `postbox_store::DeadLetters`.

use crate::context::{AnyError, Settings};
use crate::output::{errln, outln, Progress as ProgressLine};
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use postbox_relay::redact::PayloadRedactor;
use postbox_store::Store;
use postbox_store::{
    Action, AuditEntry, DeadLetter, DeadLetters, EventRecord, Filter, Progress, Selection,
};
use std::process::ExitCode;
use uuid::Uuid;

#[derive(Args, Debug)]
pub struct DlqArgs {
    #[command(subcommand)]
    pub command: DlqCommand,
}

#[derive(Subcommand, Debug)]
pub enum DlqCommand {
    /// List unresolved dead letters, oldest first
    List(ListArgs),
    /// Show one event in full (payload, headers, last error, resolution, audit entries)
    Show(ShowArgs),
    /// Deliver dead letters again: under their own id (default) or as new events (--new-id)
    Replay(ReplayArgs),
    /// Give up on dead letters; they stay in the table, marked discarded with the reason
    Discard(DiscardArgs),
    /// Show the newest audit log entries
    Audit(AuditArgs),
}

#[derive(Args, Debug, Clone)]
pub struct FilterArgs {
    /// Only events of this type
    #[arg(long = "type", value_name = "TYPE")]
    pub event_type: Option<String>,
    /// Only events created since this time: an RFC 3339 timestamp or a duration ago (e.g. 2h, 3days)
    #[arg(long, value_name = "WHEN", value_parser = parse_since)]
    pub since: Option<DateTime<Utc>>,
}

impl FilterArgs {
    fn filter(&self) -> Filter {
        Filter {
            event_type: self.event_type.clone(),
            since: self.since,
        }
    }
}

#[derive(Args, Debug)]
pub struct ListArgs {
    #[command(flatten)]
    pub filter: FilterArgs,
    /// At most this many
    #[arg(long, default_value_t = 100)]
    pub limit: i64,
    /// Print a JSON array
    #[arg(long)]
    pub json: bool,
    /// List the dead letters of many outboxes, each row naming its outbox
    /// (--limit caps the rows in all, oldest first)
    #[command(flatten)]
    pub select: crate::tenants::SelectArgs,
}

#[derive(Args, Debug)]
pub struct ShowArgs {
    /// The event id
    pub event_id: Uuid,
    /// Print JSON
    #[arg(long)]
    pub json: bool,
}

/// Which dead letters a bulk action touches, and who asks.
#[derive(Args, Debug)]
pub struct TargetArgs {
    /// Event ids to act on
    #[arg(
        value_name = "EVENT_ID",
        required_unless_present = "all",
        conflicts_with = "all"
    )]
    pub ids: Vec<Uuid>,
    /// Act on every unresolved dead letter (narrowed by --type and --since)
    #[arg(long)]
    pub all: bool,
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Who is acting, for the audit log [default: the OS user]
    #[arg(long, value_name = "NAME")]
    pub actor: Option<String>,
    /// Events per transaction (and per audit entry)
    #[arg(long, default_value_t = 1000)]
    pub batch_size: i64,
    /// Act on the dead letters of many outboxes, one after the other
    #[command(flatten)]
    pub select: crate::tenants::SelectArgs,
}

impl TargetArgs {
    fn selection(&self) -> Result<Selection, AnyError> {
        if self.all {
            Ok(Selection::All(self.filter.filter()))
        } else if self.filter.event_type.is_some() || self.filter.since.is_some() {
            Err("--type and --since narrow --all; with explicit event ids, leave them out".into())
        } else {
            Ok(Selection::Ids(self.ids.clone()))
        }
    }

    fn actor(&self) -> Result<String, AnyError> {
        match &self.actor {
            Some(a) => Ok(a.clone()),
            None => crate::context::os_user().ok_or_else(|| {
                "cannot tell who you are ($USER is unset and `whoami` failed): pass --actor NAME"
                    .into()
            }),
        }
    }
}

#[derive(Args, Debug)]
pub struct ReplayArgs {
    #[command(flatten)]
    pub target: TargetArgs,
    /// Enqueue a copy with a fresh event id (a new operation) and mark the original replaced
    #[arg(long)]
    pub new_id: bool,
}

#[derive(Args, Debug)]
pub struct DiscardArgs {
    #[command(flatten)]
    pub target: TargetArgs,
    /// Why these events are given up on (kept with each event and in the audit log)
    #[arg(long, value_name = "TEXT")]
    pub reason: String,
}

#[derive(Args, Debug)]
pub struct AuditArgs {
    /// At most this many entries, newest first
    #[arg(long, default_value_t = 50)]
    pub limit: i64,
    /// Only entries that touched this event
    #[arg(long, value_name = "EVENT_ID")]
    pub event: Option<Uuid>,
    /// Print a JSON array
    #[arg(long)]
    pub json: bool,
}

pub async fn run(settings: &Settings, args: DlqArgs) -> Result<ExitCode, AnyError> {
    let many = |select| crate::tenants::many(settings, select);
    match args.command {
        DlqCommand::List(a) if many(&a.select) => return list_many(settings, a).await,
        DlqCommand::Replay(a) if many(&a.target.select) => {
            let action = if a.new_id {
                Action::ReplayAsNew
            } else {
                Action::Replay
            };
            return act_many(settings, &a.target, action).await;
        }
        DlqCommand::Discard(a) if many(&a.target.select) => {
            let action = Action::Discard { reason: a.reason };
            return act_many(settings, &a.target, action).await;
        }
        command => run_one(settings, command).await,
    }
}

async fn run_one(settings: &Settings, command: DlqCommand) -> Result<ExitCode, AnyError> {
    let pool = settings.pool("postbox-dlq").await?;
    let dlq = Store::new(pool, settings.schema.clone()).dead_letters();
    match command {
        DlqCommand::List(a) => list(&dlq, a).await,
        DlqCommand::Show(a) => {
            let redactor = settings.file.redact.redactor()?;
            settings.warn_if_unredacted("`postbox dlq show`");
            show(&dlq, a, &redactor).await
        }
        DlqCommand::Replay(a) => {
            let action = if a.new_id {
                Action::ReplayAsNew
            } else {
                Action::Replay
            };
            act(&dlq, &a.target, action).await
        }
        DlqCommand::Discard(a) => {
            let action = Action::Discard { reason: a.reason };
            act(&dlq, &a.target, action).await
        }
        DlqCommand::Audit(a) => audit(&dlq, a).await,
    }
}

async fn list(dlq: &DeadLetters, args: ListArgs) -> Result<ExitCode, AnyError> {
    let rows = dlq.list(&args.filter.filter(), args.limit).await?;
    if args.json {
        outln!("{}", serde_json::to_string(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    if rows.is_empty() {
        outln!("no dead letters");
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "{:<36}  {:<24}  {:<24}  {:>8}  {:<20}  last error",
        "event id",
        "type",
        "aggregate",
        "attempts",
        "created"
    );
    for r in &rows {
        print_row(r);
    }
    Ok(ExitCode::SUCCESS)
}

/// `dlq list --schemas GLOB`: the oldest dead letters of every matching
/// outbox, `--limit` in all, each naming its outbox.
async fn list_many(settings: &Settings, args: ListArgs) -> Result<ExitCode, AnyError> {
    #[derive(serde::Serialize)]
    struct Row {
        outbox: String,
        #[serde(flatten)]
        letter: DeadLetter,
    }
    let found = crate::tenants::list(settings, &args.select, true).await?;
    let filter = args.filter.filter();
    let mut rows = Vec::new();
    for outbox in &found {
        let dlq = Store::new(outbox.pool.clone(), outbox.schema.clone()).dead_letters();
        let letters = dlq
            .list(&filter, args.limit)
            .await
            .map_err(|e| format!("{}: {e}", outbox.name))?;
        rows.extend(letters.into_iter().map(|letter| Row {
            outbox: outbox.name.clone(),
            letter,
        }));
    }
    rows.sort_by_key(|r| r.letter.created_at);
    rows.truncate(usize::try_from(args.limit).unwrap_or(0));
    if args.json {
        outln!("{}", serde_json::to_string(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    if rows.is_empty() {
        outln!("no dead letters in {} outbox(es)", found.len());
        return Ok(ExitCode::SUCCESS);
    }
    let width = rows
        .iter()
        .map(|r| r.outbox.len())
        .max()
        .unwrap_or(6)
        .max(6);
    outln!(
        "{:<width$}  {:<36}  {:<24}  {:<24}  {:>8}  {:<20}  last error",
        "outbox",
        "event id",
        "type",
        "aggregate",
        "attempts",
        "created"
    );
    for r in &rows {
        let l = &r.letter;
        let aggregate = format!("{}/{}", l.aggregate_type, l.aggregate_id);
        outln!(
            "{:<width$}  {:<36}  {:<24}  {:<24}  {:>8}  {:<20}  {}",
            r.outbox,
            l.event_id,
            clip(&l.event_type, 24),
            clip(&aggregate, 24),
            l.attempts,
            l.created_at.format("%Y-%m-%d %H:%M:%S"),
            clip(l.last_error.as_deref().unwrap_or("-"), 80)
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn print_row(r: &DeadLetter) {
    let aggregate = format!("{}/{}", r.aggregate_type, r.aggregate_id);
    outln!(
        "{:<36}  {:<24}  {:<24}  {:>8}  {:<20}  {}",
        r.event_id,
        clip(&r.event_type, 24),
        clip(&aggregate, 24),
        r.attempts,
        r.created_at.format("%Y-%m-%d %H:%M:%S"),
        clip(r.last_error.as_deref().unwrap_or("-"), 80)
    );
}

async fn show(
    dlq: &DeadLetters,
    args: ShowArgs,
    redactor: &PayloadRedactor,
) -> Result<ExitCode, AnyError> {
    let Some(mut event) = dlq.show(args.event_id).await? else {
        return Err(format!("no event {} in this schema", args.event_id).into());
    };
    redactor.redact(&mut event.payload);
    redactor.redact_headers(&mut event.headers);
    let history = dlq.audit_log(100, Some(args.event_id)).await?;
    if args.json {
        let mut v = serde_json::to_value(&event)?;
        v["audit"] = serde_json::to_value(&history)?;
        outln!("{v}");
        return Ok(ExitCode::SUCCESS);
    }
    print_detail(&event);
    if !history.is_empty() {
        outln!("audit:");
        for h in &history {
            print_audit(h);
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn print_detail(e: &EventRecord) {
    let s = e;
    let state = match (e.resolution.as_deref(), e.is_dead_letter()) {
        (_, true) => "dead letter".to_owned(),
        (Some(r), _) => format!("{} ({r})", e.status),
        (None, _) => e.status.to_string(),
    };
    outln!("event id        {}", s.event_id);
    outln!("status          {state}");
    outln!(
        "type            {} (schema version {})",
        s.event_type,
        s.schema_version
    );
    outln!("aggregate       {}/{}", s.aggregate_type, s.aggregate_id);
    outln!("attempts        {}", s.attempts);
    outln!("created         {}", s.created_at.to_rfc3339());
    if let Some(at) = e.deliver_at {
        outln!("scheduled for   {}", at.to_rfc3339());
    }
    outln!("available       {}", e.available_at.to_rfc3339());
    outln!("last error      {}", s.last_error.as_deref().unwrap_or("-"));
    if let Some(at) = e.resolved_at {
        outln!("resolved        {}", at.to_rfc3339());
    }
    if let Some(note) = &e.resolution_note {
        outln!("reason          {note}");
    }
    if let Some(id) = e.replaced_by {
        outln!("replaced by     {id}");
    }
    if let Some(id) = e.replay_of {
        outln!("replay of       {id}");
    }
    outln!("headers         {}", e.headers);
    outln!("payload         {}", e.payload);
}

async fn act(dlq: &DeadLetters, target: &TargetArgs, action: Action) -> Result<ExitCode, AnyError> {
    let selection = target.selection()?;
    let actor = target.actor()?;
    let verb = match action {
        Action::Replay | Action::ReplayAsNew => "replayed",
        Action::Discard { .. } => "discarded",
    };
    // On a terminal only: a line redrawn after each batch (quiet in a pipe).
    let mut progress = ProgressLine::new(verb, None);
    let applied = dlq
        .apply(
            &selection,
            &action,
            &actor,
            target.batch_size,
            |p: Progress| {
                progress.set_total(Some(p.total));
                progress.update(p.done);
            },
        )
        .await?;
    progress.finish();
    for (original, copy) in &applied.new_ids {
        outln!("{original} -> {copy}");
    }
    let how = match action {
        Action::Replay => " under their own event id",
        Action::ReplayAsNew => " as new events",
        Action::Discard { .. } => "",
    };
    outln!(
        "{verb} {} dead letter(s){how} in {} batch(es), audited as {actor}",
        applied.count,
        applied.batches
    );
    if applied.skipped.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    for id in &applied.skipped {
        errln!("skipped {id}: not an unresolved dead letter");
    }
    Ok(ExitCode::FAILURE)
}

/// `dlq replay|discard --schemas GLOB`: the action on every matching outbox
/// in turn, each audited in its own schema with `"outbox": "<database>/<schema>"`
/// in the entry's selection. An event id is skipped only if no
/// outbox holds it as an unresolved dead letter.
async fn act_many(
    settings: &Settings,
    target: &TargetArgs,
    action: Action,
) -> Result<ExitCode, AnyError> {
    let selection = target.selection()?;
    let actor = target.actor()?;
    let verb = match action {
        Action::Replay | Action::ReplayAsNew => "replayed",
        Action::Discard { .. } => "discarded",
    };
    let found = crate::tenants::list(settings, &target.select, true).await?;
    let (mut count, mut batches) = (0, 0);
    let mut taken = std::collections::HashSet::new();
    for outbox in &found {
        // Each audit entry names its outbox, as the console's do.
        let dlq = Store::new(outbox.pool.clone(), outbox.schema.clone())
            .dead_letters()
            .naming(outbox.name.clone());
        let applied = dlq
            .apply(&selection, &action, &actor, target.batch_size, |_| {})
            .await
            .map_err(|e| {
                format!(
                    "{}: {e} (the outboxes listed before it are done)",
                    outbox.name
                )
            })?;
        if applied.count > 0 {
            outln!("{}: {verb} {} dead letter(s)", outbox.name, applied.count);
        }
        for (original, copy) in &applied.new_ids {
            outln!("{original} -> {copy}");
        }
        if let Selection::Ids(ids) = &selection {
            taken.extend(
                ids.iter()
                    .filter(|id| !applied.skipped.contains(id))
                    .copied(),
            );
        }
        count += applied.count;
        batches += applied.batches;
    }
    let how = match action {
        Action::Replay => " under their own event id",
        Action::ReplayAsNew => " as new events",
        Action::Discard { .. } => "",
    };
    outln!(
        "{verb} {count} dead letter(s){how} in {batches} batch(es) over {} outbox(es), audited as {actor}",
        found.len()
    );
    let skipped: Vec<&Uuid> = match &selection {
        Selection::Ids(ids) => ids.iter().filter(|id| !taken.contains(*id)).collect(),
        _ => Vec::new(),
    };
    if skipped.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    for id in skipped {
        errln!("skipped {id}: not an unresolved dead letter in any of these outboxes");
    }
    Ok(ExitCode::FAILURE)
}

async fn audit(dlq: &DeadLetters, args: AuditArgs) -> Result<ExitCode, AnyError> {
    let entries = dlq.audit_log(args.limit, args.event).await?;
    if args.json {
        outln!("{}", serde_json::to_string(&entries)?);
    } else if entries.is_empty() {
        outln!("no audit entries");
    } else {
        for e in &entries {
            print_audit(e);
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn print_audit(e: &AuditEntry) {
    outln!(
        "{}  {:<18}  {:<16}  {:>6}  {}{}",
        e.at.format("%Y-%m-%d %H:%M:%S"),
        e.action,
        clip(&e.actor, 16),
        e.count,
        e.selection,
        e.reason
            .as_deref()
            .map(|r| format!("  reason: {r}"))
            .unwrap_or_default()
    );
}

/// At most `max` characters, marking a cut with `…`.
fn clip(s: &str, max: usize) -> String {
    let one_line = s.replace(['\n', '\r'], " ");
    if one_line.chars().count() <= max {
        return one_line;
    }
    let mut out: String = one_line.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// An RFC 3339 timestamp, or a duration meaning that long ago (`dlq
/// --since`, `replay --from/--to`).
pub(crate) fn parse_since(s: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    let ago = humantime::parse_duration(s).map_err(|_| {
        format!("{s:?} is neither an RFC 3339 timestamp (2024-05-01T12:00:00Z) nor a duration (2h, 3days)")
    })?;
    let ago = chrono::Duration::from_std(ago).map_err(|_| format!("{s:?} is too long ago"))?;
    Utc::now()
        .checked_sub_signed(ago)
        .ok_or_else(|| format!("{s:?} is too long ago"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_takes_timestamps_and_durations() {
        let t = parse_since("2024-05-01T12:00:00Z").unwrap();
        assert_eq!(t.to_rfc3339(), "2024-05-01T12:00:00+00:00");
        let ago = Utc::now() - parse_since("2h").unwrap();
        assert!((ago.num_minutes() - 120).abs() <= 1, "{ago}");
        assert!(parse_since("yesterday-ish").is_err());
    }

    #[test]
    fn clips_long_text_to_one_line() {
        assert_eq!(clip("a\nb", 10), "a b");
        assert_eq!(clip("abcdef", 4), "abc…");
    }
}

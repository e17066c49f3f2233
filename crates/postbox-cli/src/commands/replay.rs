//! `postbox replay`: retained events delivered again to one destination,
//! through its own sink, filter and transform, as a job with a position of
//! its own (migration 29) — rate-limited, resumable after a crash or Ctrl-C,
//! audited, cancellable. Live delivery is not involved: the relay goes on
//! as before, and the job runs in this process.

use crate::context::{actor, shutdown_signal, AnyError, Settings};
use crate::output::outln;
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use postbox_relay::replay::{Ended, Runner, ATTEMPTS};
use postbox_relay::router::Pattern;
use postbox_relay::{sinks, Router, Sink, Store};
use postbox_store::{NewReplay, ProducerTarget, ReplayJob, ReplayRange, ReplaySource, Replays};
use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Exit codes, documented in `docs/replay.md`.
const EXIT_NO_DESTINATION: u8 = 3;
const EXIT_BAD_RANGE: u8 = 4;
const EXIT_NOTHING: u8 = 5;
const EXIT_BEYOND_RETENTION: u8 = 6;
const EXIT_FAILED: u8 = 7;
const EXIT_NOT_RUNNABLE: u8 = 8;
const EXIT_INTERRUPTED: u8 = 130;

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct ReplayArgs {
    #[command(subcommand)]
    pub command: Option<ReplayCommand>,
    #[command(flatten)]
    pub start: StartArgs,
}

#[derive(Subcommand, Debug)]
pub enum ReplayCommand {
    /// The newest replay jobs with their state and progress
    List {
        /// At most this many
        #[arg(long, default_value_t = 20)]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
    /// One job in full
    Show {
        id: i64,
        #[arg(long)]
        json: bool,
    },
    /// Run a job again from its position (after a crash, Ctrl-C or failure)
    Resume {
        id: i64,
        /// Events read and delivered at a time
        #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(i64).range(1..=10_000))]
        batch_size: i64,
        /// Print no progress line
        #[arg(long)]
        quiet: bool,
    },
    /// Cancel a job (audited); a runner stops after its current page
    Cancel {
        id: i64,
        /// Recorded in the audit log [default: $USER]
        #[arg(long)]
        actor: Option<String>,
    },
}

#[derive(Args, Debug)]
pub struct StartArgs {
    /// The destination to deliver to: a [destinations.NAME] of the
    /// configuration, or `sink` for a single [sink]
    #[arg(long, value_name = "NAME")]
    pub destination: Option<String>,
    /// Events created at or after this time: RFC 3339, or a duration ago (2h)
    #[arg(long, value_name = "TIME", value_parser = super::dlq::parse_since)]
    pub from: Option<DateTime<Utc>>,
    /// …and before this time [default: now]
    #[arg(long, value_name = "TIME", value_parser = super::dlq::parse_since)]
    pub to: Option<DateTime<Utc>>,
    /// Only event types matching these globs (comma-separated: order.*,user.created)
    #[arg(long, value_name = "GLOB,…")]
    pub types: Option<String>,
    /// Only one aggregate's events
    #[arg(long, value_name = "TYPE:ID")]
    pub aggregate: Option<String>,
    /// At most this many events a second (e.g. 500/s)
    #[arg(long, value_name = "N/s", value_parser = parse_rate)]
    pub rate: Option<i32>,
    /// Send each event under a new id instead of its own (consumers' inboxes
    /// then apply it again)
    #[arg(long)]
    pub new_ids: bool,
    /// Where to read: the outbox table and its archive, or the log's
    /// retained segments [default: where producers write]
    #[arg(long, value_parser = ["outbox", "log"])]
    pub source: Option<String>,
    /// Events read and delivered at a time
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub batch_size: i64,
    /// Say how many events would go, and make no job
    #[arg(long)]
    pub dry_run: bool,
    /// Print no progress line
    #[arg(long)]
    pub quiet: bool,
    /// Recorded in the audit log [default: $USER]
    #[arg(long)]
    pub actor: Option<String>,
}

/// `500/s` or `500`: events a second, 1 to 1,000,000.
fn parse_rate(s: &str) -> Result<i32, String> {
    let n = s.strip_suffix("/s").unwrap_or(s);
    match n.trim().parse::<i32>() {
        Ok(n) if (1..=1_000_000).contains(&n) => Ok(n),
        _ => Err(format!(
            "{s:?} is not a rate: give events a second, 1 to 1000000 (500/s)"
        )),
    }
}

pub async fn run(settings: &Settings, args: ReplayArgs) -> Result<ExitCode, AnyError> {
    let pool = settings.pool("postbox-replay").await?;
    let store = Store::new(pool, settings.schema.clone());
    let replays = store.replays();
    match args.command {
        Some(ReplayCommand::List { limit, json }) => {
            let jobs = replays.list(limit.clamp(1, 1000)).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&jobs)?);
            } else if jobs.is_empty() {
                outln!("no replay jobs");
            } else {
                for job in &jobs {
                    outln!("{}", line(job));
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Some(ReplayCommand::Show { id, json }) => {
            let Some(job) = replays.get(id).await? else {
                return Err(format!("no replay job {id}").into());
            };
            if json {
                outln!("{}", serde_json::to_string_pretty(&job)?);
            } else {
                show(&job);
            }
            Ok(ExitCode::SUCCESS)
        }
        Some(ReplayCommand::Cancel { id, actor: who }) => {
            let who = actor(who)?;
            match replays.cancel(id, &who).await? {
                Some(was) => {
                    outln!("replay {id} cancelled (it was {was}); a runner stops after its current page");
                    Ok(ExitCode::SUCCESS)
                }
                None => {
                    eprintln!("postbox replay: no replay job {id} that is still open (list them with: postbox replay list)");
                    Ok(ExitCode::from(EXIT_NOT_RUNNABLE))
                }
            }
        }
        Some(ReplayCommand::Resume {
            id,
            batch_size,
            quiet,
        }) => {
            let Some(job) = replays.get(id).await? else {
                return Err(format!("no replay job {id}").into());
            };
            if !job.is_open() {
                eprintln!(
                    "postbox replay: job {id} is {}: only a running, paused or failed job resumes",
                    job.state
                );
                return Ok(ExitCode::from(EXIT_NOT_RUNNABLE));
            }
            let router = router_for(settings, &job.destination)?;
            let Some(router) = router else {
                eprintln!(
                    "postbox replay: the configuration has no destination {:?} any more",
                    job.destination
                );
                return Ok(ExitCode::from(EXIT_NO_DESTINATION));
            };
            execute(settings, &replays, router, job, batch_size, quiet).await
        }
        None => start(settings, &store, &replays, args.start).await,
    }
}

async fn start(
    settings: &Settings,
    store: &Store,
    replays: &Replays,
    args: StartArgs,
) -> Result<ExitCode, AnyError> {
    let destination = args
        .destination
        .clone()
        .ok_or("--destination: required (or a subcommand: list, show, resume, cancel)")?;
    let from = args.from.ok_or("--from: required")?;
    let now = Utc::now();
    let to = args.to.unwrap_or(now);
    if from > now {
        eprintln!("postbox replay: --from ({from}) is in the future");
        return Ok(ExitCode::from(EXIT_BAD_RANGE));
    }
    if to <= from {
        eprintln!("postbox replay: --to ({to}) must be after --from ({from})");
        return Ok(ExitCode::from(EXIT_BAD_RANGE));
    }
    let Some(router) = router_for(settings, &destination)? else {
        let names = names(settings);
        eprintln!(
            "postbox replay: no destination {destination:?} in the configuration (it has: {names})"
        );
        return Ok(ExitCode::from(EXIT_NO_DESTINATION));
    };
    let mut type_likes = None;
    if let Some(types) = &args.types {
        let mut likes = Vec::new();
        for glob in types.split(',').map(str::trim).filter(|g| !g.is_empty()) {
            let pattern = Pattern::parse(glob).map_err(|e| format!("--types: {glob:?} {e}"))?;
            likes.push(pattern.like());
        }
        if likes.is_empty() {
            return Err("--types: give at least one glob".into());
        }
        type_likes = Some(likes);
    }
    let (aggregate_type, aggregate_id) = match &args.aggregate {
        None => (None, None),
        Some(a) => match a.split_once(':') {
            Some((t, i)) if !t.is_empty() && !i.is_empty() => {
                (Some(t.to_owned()), Some(i.to_owned()))
            }
            _ => return Err(format!("--aggregate: {a:?} is not TYPE:ID").into()),
        },
    };
    let source = match args.source.as_deref() {
        Some("log") => ReplaySource::Log,
        Some(_) => ReplaySource::Outbox,
        None => match store.log().producer_target().await? {
            ProducerTarget::Log => ReplaySource::Log,
            ProducerTarget::Outbox => ReplaySource::Outbox,
        },
    };
    let range = ReplayRange {
        from,
        to,
        types: args.types.clone(),
        type_likes,
        aggregate_type,
        aggregate_id,
    };
    let found = replays.range(source, &range).await?;
    if found.total == 0 {
        match found.oldest {
            Some(oldest) if to <= oldest => {
                eprintln!(
                    "postbox replay: the range ends before the oldest event the {} still holds ({oldest}): nothing of it is retained",
                    source.as_str()
                );
                return Ok(ExitCode::from(EXIT_BEYOND_RETENTION));
            }
            _ => {
                eprintln!(
                    "postbox replay: no events in the {} match the range; nothing to replay",
                    source.as_str()
                );
                return Ok(ExitCode::from(EXIT_NOTHING));
            }
        }
    }
    if let Some(oldest) = found.oldest.filter(|oldest| from < *oldest) {
        eprintln!(
            "postbox replay: note: the {} holds nothing before {oldest}; the range starts there",
            source.as_str()
        );
    }
    if args.dry_run {
        outln!(
            "would replay {} events from the {} to {destination} (created {from} to {to}); nothing sent",
            found.total,
            source.as_str()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let who = actor(args.actor.clone())?;
    let id = replays
        .create(&NewReplay {
            destination: destination.clone(),
            source,
            range,
            rate: args.rate,
            new_ids: args.new_ids,
            hi: found.hi,
            total: found.total,
            actor: who,
        })
        .await?;
    eprintln!(
        "postbox replay: job {id}: {} events from the {} to {destination} (resume with: postbox replay resume {id})",
        found.total,
        source.as_str()
    );
    let job = replays.get(id).await?.ok_or("the new replay job is gone")?;
    execute(settings, replays, router, job, args.batch_size, args.quiet).await
}

/// The configuration's router with real sinks for `destination` only (the
/// others are never sent to); None when it has no such destination.
fn router_for(settings: &Settings, destination: &str) -> Result<Option<Arc<Router>>, AnyError> {
    let file = &settings.file;
    let known = if file.destinations.is_empty() {
        destination == "sink" && file.sink.url.is_some()
    } else {
        file.destinations.contains_key(destination)
    };
    if !known {
        return Ok(None);
    }
    let wanted = if file.destinations.is_empty() {
        "sink".to_owned()
    } else {
        format!("destinations.{destination}")
    };
    let router = super::relay::router_of(file, None, &|owner, url, section| {
        if owner == wanted {
            sinks::from_url(url, &section.sink_options(None))
                .map_err(|e| format!("{owner}: {e}").into())
        } else {
            Ok(Arc::new(super::route::Unsent) as Arc<dyn Sink>)
        }
    })?;
    Ok(Some(Arc::new(router)))
}

fn names(settings: &Settings) -> String {
    if settings.file.destinations.is_empty() {
        return if settings.file.sink.url.is_some() {
            "sink".into()
        } else {
            "none".into()
        };
    }
    settings
        .file
        .destinations
        .keys()
        .cloned()
        .collect::<Vec<_>>()
        .join(", ")
}

/// Run `job` to its end, a cancellation, a failure or Ctrl-C.
async fn execute(
    settings: &Settings,
    replays: &Replays,
    router: Arc<Router>,
    mut job: ReplayJob,
    batch_size: i64,
    quiet: bool,
) -> Result<ExitCode, AnyError> {
    let d = router
        .destinations()
        .iter()
        .position(|x| x.name == job.destination || router.destinations().len() == 1)
        .ok_or("the destination is not in the router")?;
    let stop = CancellationToken::new();
    tokio::spawn({
        let stop = stop.clone();
        async move {
            shutdown_signal().await;
            stop.cancel();
        }
    });
    let runner = Runner {
        replays,
        router,
        d,
        steps: settings.file.relay.expression_steps,
        batch_size,
    };
    let started = Instant::now();
    let mut progress = Progress::new(!quiet && std::io::stderr().is_terminal());
    let ended = runner
        .run(&mut job, &stop, true, &mut |job, this_run| {
            progress.show(job, this_run, started)
        })
        .await;
    progress.end();
    match ended? {
        Ended::Done => {
            outln!(
                "replay {}: done — {} delivered, {} filtered out, {} refused by the destination",
                job.id,
                job.delivered,
                job.filtered,
                job.rejected
            );
            Ok(ExitCode::SUCCESS)
        }
        Ended::Stopped => {
            eprintln!(
                "postbox replay: job {} paused after {} events (resume with: postbox replay resume {})",
                job.id, job.delivered, job.id
            );
            Ok(ExitCode::from(EXIT_INTERRUPTED))
        }
        Ended::Failed(error) => {
            eprintln!(
                "postbox replay: job {} stopped: the destination did not take events after {ATTEMPTS} tries ({error}); resume with: postbox replay resume {}",
                job.id, job.id
            );
            Ok(ExitCode::from(EXIT_FAILED))
        }
        Ended::Cancelled => {
            eprintln!("postbox replay: job {} was cancelled", job.id);
            Ok(ExitCode::SUCCESS)
        }
        Ended::Busy => {
            eprintln!(
                "postbox replay: job {} is being run by another process",
                job.id
            );
            Ok(ExitCode::from(EXIT_NOT_RUNNABLE))
        }
    }
}

/// The progress line on a terminal: events, share, rate, time left.
struct Progress {
    on: bool,
    shown: Option<Instant>,
}

impl Progress {
    fn new(on: bool) -> Self {
        Self { on, shown: None }
    }

    fn show(&mut self, job: &ReplayJob, this_run: i64, started: Instant) {
        if !self.on
            || self
                .shown
                .is_some_and(|t| t.elapsed() < Duration::from_millis(500))
        {
            return;
        }
        self.shown = Some(Instant::now());
        let handled = job.delivered + job.filtered + job.rejected;
        let total = job.total.max(1);
        let rate = this_run as f64 / started.elapsed().as_secs_f64().max(0.001);
        let left = (job.total - handled).max(0) as f64 / rate.max(1.0);
        eprint!(
            "\r\x1b[2Kreplay {}: {handled}/{} ({:.0}%), {:.0} events/s, about {} left",
            job.id,
            job.total,
            100.0 * handled as f64 / total as f64,
            rate,
            humantime::format_duration(Duration::from_secs(left.ceil() as u64))
        );
    }

    fn end(&mut self) {
        if self.on && self.shown.is_some() {
            eprintln!();
        }
    }
}

fn line(job: &ReplayJob) -> String {
    let handled = job.delivered + job.filtered + job.rejected;
    format!(
        "{:>6}  {:<9}  {:<20}  {}/{}  {} → {}  by {}",
        job.id,
        job.state,
        job.destination,
        handled,
        job.total,
        job.from_at.format("%Y-%m-%d %H:%M:%S"),
        job.to_at.format("%Y-%m-%d %H:%M:%S"),
        job.created_by
    )
}

fn show(job: &ReplayJob) {
    outln!("replay {}", job.id);
    outln!("  state        {}", job.state);
    outln!("  destination  {}", job.destination);
    outln!("  source       {}", job.source);
    outln!("  range        {} → {}", job.from_at, job.to_at);
    if let Some(types) = &job.types {
        outln!("  types        {types}");
    }
    if let (Some(t), Some(i)) = (&job.aggregate_type, &job.aggregate_id) {
        outln!("  aggregate    {t}:{i}");
    }
    if let Some(rate) = job.rate {
        outln!("  rate         {rate}/s");
    }
    outln!("  new ids      {}", job.new_ids);
    outln!("  events       {}", job.total);
    outln!("  delivered    {}", job.delivered);
    outln!("  filtered     {}", job.filtered);
    outln!("  refused      {}", job.rejected);
    if let Some(e) = &job.last_error {
        outln!("  last error   {e}");
    }
    outln!("  made         {} by {}", job.created_at, job.created_by);
    if let Some(at) = job.finished_at {
        outln!("  finished     {at}");
    }
}

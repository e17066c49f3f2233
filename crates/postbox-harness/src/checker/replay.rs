//! `postbox verify --replay`: a replay beside the live traffic. A third of
//! the way into the run, the events created since the run began (taken
//! from the source in one snapshot: every one of them committed) are
//! replayed by `postbox replay` into a Redis list of their own, through
//! the run's database fault proxy, while the producers, the relays and the
//! faults go on. The runner is SIGKILLed at random and resumed (`postbox
//! replay resume ID`) until the job is done. The check: every event of that
//! snapshot reached the list at least once, and nothing outside the range
//! (created before or after it, or unknown to the database) did.

use super::tables::Tables;
use crate::process::ChildProcess;
use crate::supervisor::RelayCommand;
use crate::AnyError;
use chrono::{DateTime, Utc};
use postbox::Schema;
use postbox_relay::ReadMode;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redis::AsyncCommands;
use sqlx::PgPool;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// What the replay's runner needs from the run.
pub(super) struct ReplaySetup {
    pub proxied_url: String,
    pub schema: Schema,
    pub direct: PgPool,
    pub tables: Arc<Tables>,
    pub mode: ReadMode,
    pub redis_url: String,
    pub key: String,
    pub logs: PathBuf,
    pub failpoints: String,
    pub seed: u64,
    /// When the run began (the range's start).
    pub from: DateTime<Utc>,
    /// How long after the run began the job is made.
    pub after: Duration,
}

/// The replay beside the run, going.
pub(super) struct ReplayBeside {
    task: JoinHandle<Result<Replayed, AnyError>>,
    /// Cancelled when the faults end: the runner is killed no more and runs
    /// to the job's end.
    calm: CancellationToken,
}

/// What the replay did, for the report.
#[derive(Debug, Default, serde::Serialize)]
pub struct ReplayReport {
    pub source: String,
    pub from: String,
    pub to: String,
    /// Events of the range when the job was made.
    pub events: usize,
    /// Distinct events of the range the list received.
    pub delivered: usize,
    /// Bodies the list received, duplicates included.
    pub received: usize,
    pub runner_kills: u64,
    pub runner_starts: u64,
    /// Events of the range the list never received.
    pub missing: Vec<Uuid>,
    pub missing_count: usize,
    /// Events outside the range (or unknown) the list received.
    pub outside: Vec<Uuid>,
    pub outside_count: usize,
    pub passed: bool,
}

struct Replayed {
    to: DateTime<Utc>,
    source: &'static str,
    events: HashSet<Uuid>,
    kills: u64,
    starts: u64,
}

/// Longest a runner runs before it is killed, while the faults go on.
const KILL_WITHIN: Duration = Duration::from_millis(2500);

/// About how long the replay job takes, unkilled: longer than KILL_WITHIN.
const REPLAY_SECONDS: usize = 4;

impl ReplayBeside {
    pub(super) fn start(setup: ReplaySetup, stop: CancellationToken) -> Self {
        let calm = CancellationToken::new();
        let task = tokio::spawn(run(setup, stop, calm.clone()));
        Self { task, calm }
    }

    /// The faults are over: the runner is killed no more.
    pub(super) fn calm(self) -> Self {
        self.calm.cancel();
        self
    }

    /// Let the runner finish, within `timeout`, and check what the list
    /// received.
    pub(super) async fn finish(
        self,
        setup_key: (&str, &str),
        direct: &PgPool,
        tables: &Tables,
        timeout: Duration,
    ) -> Result<ReplayReport, AnyError> {
        self.calm.cancel();
        let replayed = tokio::time::timeout(timeout, self.task)
            .await
            .map_err(|_| "--replay: the replay job did not end within the drain timeout")???;
        check(replayed, setup_key, direct, tables).await
    }
}

async fn run(
    setup: ReplaySetup,
    stop: CancellationToken,
    calm: CancellationToken,
) -> Result<Replayed, AnyError> {
    tokio::select! {
        () = tokio::time::sleep(setup.after) => {}
        () = calm.cancelled() => {}
        () = stop.cancelled() => return Err("interrupted".into()),
    }
    let (to, events) = setup
        .tables
        .replay_range(&setup.direct, setup.from, source_of(setup.mode))
        .await?;
    if events.is_empty() {
        return Err("--replay: no event was created in the replay's range (is --rate 0?)".into());
    }
    let config = setup.logs.join("replay.toml");
    std::fs::write(
        &config,
        format!("[sink]\nurl = \"{}?key={}\"\n", setup.redis_url, setup.key),
    )?;
    let from = setup
        .from
        .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    let to_text = to.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    let log = setup.logs.join("replay.log");
    // Slow enough that the job outlasts the first kill: at 500/s a short
    // run's few hundred events were all sent before any runner was killed.
    let rate = format!("{}/s", (events.len() / REPLAY_SECONDS).clamp(10, 500));
    let mut rng = StdRng::seed_from_u64(setup.seed ^ 0x7e91a9);
    let (mut kills, mut starts) = (0, 0);
    let mut job: Option<i64> = None;
    loop {
        if stop.is_cancelled() {
            return Err("interrupted".into());
        }
        if job.is_none() {
            job = setup.tables.last_replay_job(&setup.direct).await?;
        }
        // Done, whether its last runner said so or was killed after the
        // job's last page.
        if let Some(id) = job {
            if setup.tables.replay_job_done(&setup.direct, id).await? {
                return Ok(Replayed {
                    to,
                    source: source_of(setup.mode),
                    events,
                    kills,
                    starts,
                });
            }
        }
        let args: Vec<String> = match job {
            Some(id) => vec!["resume".into(), id.to_string()],
            None => [
                "--destination",
                "sink",
                "--from",
                &from,
                "--to",
                &to_text,
                "--source",
                source_of(setup.mode),
                "--rate",
                &rate,
                "--actor",
                "verify",
            ]
            .map(String::from)
            .to_vec(),
        };
        let runner = command(&setup, &config, &args)?.spawn(Some(&log))?;
        starts += 1;
        let ended = if calm.is_cancelled() {
            Some(runner.wait().await)
        } else {
            let within = KILL_WITHIN.mul_f64(rng.random_range(0.2..1.0));
            tokio::select! {
                e = runner.wait() => Some(e),
                () = tokio::time::sleep(within) => None,
                () = calm.cancelled() => Some(runner.wait().await),
            }
        };
        match ended {
            None => {
                kill(&runner).await;
                kills += 1;
            }
            Some(exit) => {
                if exit?.status.success() && job.is_none() {
                    job = setup.tables.last_replay_job(&setup.direct).await?;
                    if job.is_none() {
                        return Err("--replay: postbox replay ended without making a job".into());
                    }
                }
                // Failed on a fault (the database crashed or stalled, the
                // lock of a killed runner not let go yet): again.
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    }
}

fn command(setup: &ReplaySetup, config: &Path, args: &[String]) -> std::io::Result<RelayCommand> {
    // The file through the environment: `--config` after `replay` would
    // be taken for one of its flags, which a subcommand (`resume`) refuses.
    Ok(RelayCommand::replay(&setup.proxied_url, &setup.schema)?
        .env("POSTBOX_CONFIG", &config.display().to_string())
        .args(args.iter().cloned())
        .args(["--batch-size", "50", "--quiet"])
        .env(postbox_relay::failpoint::ENV, &setup.failpoints)
        .env("NO_COLOR", "1"))
}

async fn kill(runner: &ChildProcess) {
    runner.signal(crate::os::Signal::Kill);
    let _ = runner.wait().await;
}

/// Where the run's producers write, which the replay reads.
fn source_of(mode: ReadMode) -> &'static str {
    match mode {
        ReadMode::Log => "log",
        ReadMode::Claim | ReadMode::Logical => "outbox",
    }
}

async fn check(
    replayed: Replayed,
    (redis_url, key): (&str, &str),
    direct: &PgPool,
    tables: &Tables,
) -> Result<ReplayReport, AnyError> {
    let client = redis::Client::open(redis_url)?;
    let mut redis = crate::redis_connection(&client).await?;
    let bodies: Vec<String> = redis.lrange(key, 0, -1).await?;
    let _: Result<(), _> = redis.del(key).await;
    // Each body's event id and creation time (its CloudEvents `time`): the
    // database may no longer hold a late event by now (log mode truncates
    // its ring), the body does.
    let mut received: HashMap<Uuid, Option<DateTime<Utc>>> = HashMap::new();
    let mut malformed = 0;
    for body in &bodies {
        let parsed = serde_json::from_str::<serde_json::Value>(body).ok();
        let id = parsed
            .as_ref()
            .and_then(|v| v["id"].as_str().and_then(|s| s.parse::<Uuid>().ok()));
        let time = parsed
            .as_ref()
            .and_then(|v| v["time"].as_str())
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
            .map(|t| t.with_timezone(&Utc));
        match id {
            Some(id) => {
                received.insert(id, time);
            }
            None => malformed += 1,
        }
    }
    let mut missing: Vec<Uuid> = replayed
        .events
        .iter()
        .filter(|id| !received.contains_key(id))
        .copied()
        .collect();
    // A received event beyond the snapshot is in the range only if a
    // producer committed it (the run's own table says) and it was created
    // in the range (a transaction that committed after the snapshot).
    let committed = tables.produced(direct).await?;
    let from = replayed_from(tables, direct).await?;
    let mut outside: Vec<Uuid> = received
        .iter()
        .filter(|(id, _)| !replayed.events.contains(id))
        .filter(|(id, time)| {
            !committed.contains(id) || time.is_none_or(|at| at < from || at >= replayed.to)
        })
        .map(|(id, _)| *id)
        .collect();
    let (missing_count, outside_count) = (missing.len(), outside.len() + malformed);
    missing.sort_unstable();
    missing.truncate(10);
    outside.sort_unstable();
    outside.truncate(10);
    Ok(ReplayReport {
        source: replayed.source.to_owned(),
        from: from.to_rfc3339(),
        to: replayed.to.to_rfc3339(),
        events: replayed.events.len(),
        delivered: replayed
            .events
            .iter()
            .filter(|id| received.contains_key(id))
            .count(),
        received: bodies.len(),
        runner_kills: replayed.kills,
        runner_starts: replayed.starts,
        missing,
        missing_count,
        outside,
        outside_count,
        passed: missing_count == 0 && outside_count == 0,
    })
}

/// The job's `from`, as the database holds it.
async fn replayed_from(tables: &Tables, direct: &PgPool) -> Result<DateTime<Utc>, AnyError> {
    tables
        .replay_from(direct)
        .await?
        .ok_or_else(|| "--replay: the replay job is gone".into())
}

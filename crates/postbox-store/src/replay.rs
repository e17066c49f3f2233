//! Replay jobs (migration 29): retained events delivered again to one
//! destination. A job is a row with a position of its own; whoever runs it
//! (`postbox replay`, or a relay for a destination added with a start in
//! the past) reads a page after that position, delivers it, then
//! moves the position — a runner killed between the two sends that page
//! again, never skips one. One runner per job: it holds the job's advisory
//! lock on a connection of its own for as long as it runs.

use crate::catalog;
use crate::events::StoredEvent;
use crate::groups::GroupStart;
use chrono::{DateTime, Utc};
use postbox::statements::trusted;
use postbox::Schema;
use sqlx::{PgConnection, PgPool};
use std::sync::Arc;
use uuid::Uuid;

/// The audit log's action when a replay job is made, and cancelled.
pub const ACTION_REPLAY_START: &str = "replay_start";
pub const ACTION_REPLAY_CANCEL: &str = "replay_cancel";

/// `created_by` of the jobs a relay makes for a destination added with a
/// start in the past (claim and logical mode).
pub const RELAY_ACTOR: &str = "relay";

/// Where a job reads its events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplaySource {
    /// The outbox table and its archive (claim mode; what logical mode and
    /// log mode handed to the outbox).
    Outbox,
    /// The log's retained segments and the archive (log mode: truncation
    /// with `retention.archive` moves events there).
    Log,
}

impl ReplaySource {
    pub fn as_str(self) -> &'static str {
        match self {
            ReplaySource::Outbox => "outbox",
            ReplaySource::Log => "log",
        }
    }
}

/// Which events a job replays.
#[derive(Clone, Debug)]
pub struct ReplayRange {
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    /// The event-type globs as given (shown), and as LIKE patterns (used).
    pub types: Option<String>,
    pub type_likes: Option<Vec<String>>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
}

/// What a source holds of a range, before a job is made.
#[derive(Clone, Debug)]
pub struct RangeFound {
    /// Events of the range.
    pub total: i64,
    /// The last id among them (0 when none).
    pub hi: i64,
    /// The oldest event the source holds at all (what a replay can reach).
    pub oldest: Option<DateTime<Utc>>,
}

/// A new job.
#[derive(Clone, Debug)]
pub struct NewReplay {
    pub destination: String,
    pub source: ReplaySource,
    pub range: ReplayRange,
    pub rate: Option<i32>,
    pub new_ids: bool,
    pub hi: i64,
    pub total: i64,
    pub actor: String,
}

/// A job as stored.
#[derive(Clone, Debug, PartialEq, sqlx::FromRow, serde::Serialize)]
pub struct ReplayJob {
    pub id: i64,
    pub destination: String,
    pub source: String,
    pub from_at: DateTime<Utc>,
    pub to_at: DateTime<Utc>,
    pub types: Option<String>,
    #[serde(skip)]
    pub type_likes: Option<Vec<String>>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub rate: Option<i32>,
    pub new_ids: bool,
    pub after_id: i64,
    pub after_event: Uuid,
    pub hi: i64,
    pub total: i64,
    pub state: String,
    pub delivered: i64,
    pub filtered: i64,
    pub rejected: i64,
    pub last_error: Option<String>,
    pub created_by: String,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
}

impl ReplayJob {
    pub fn source(&self) -> ReplaySource {
        if self.source == "log" {
            ReplaySource::Log
        } else {
            ReplaySource::Outbox
        }
    }

    pub fn range(&self) -> ReplayRange {
        ReplayRange {
            from: self.from_at,
            to: self.to_at,
            types: self.types.clone(),
            type_likes: self.type_likes.clone(),
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
        }
    }

    /// Whether retention still keeps what it reads (not cancelled or done).
    pub fn is_open(&self) -> bool {
        matches!(self.state.as_str(), "running" | "paused" | "failed")
    }
}

/// One event of a page, with the id the position moves by.
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct ReplayEvent {
    pub id: i64,
    #[sqlx(flatten)]
    pub event: StoredEvent,
}

/// What one delivered page adds to a job.
#[derive(Clone, Debug, Default)]
pub struct PageDone {
    pub after_id: i64,
    pub after_event: Uuid,
    pub delivered: i64,
    pub filtered: i64,
    pub rejected: i64,
    /// The last refusal's error, sanitized by the caller.
    pub error: Option<String>,
}

struct Queries {
    range: String,
    page: String,
    oldest: String,
    create: String,
    get: String,
    list: String,
    advance: String,
    set_state: String,
    lock: String,
    register: String,
    relay_open: String,
    audit_insert: String,
}

impl Queries {
    fn new(schema: &Schema) -> Self {
        let mut file = catalog("replay.sql", include_str!("../sql/replay.sql"));
        let events = file.render("events", schema);
        let queries = Self {
            range: file.render_with("range", schema, &[("events", &events)]),
            page: {
                let keep = file.render("keep", schema);
                file.render_with("page", schema, &[("keep", &keep)])
            },
            oldest: file.render("oldest", schema),
            create: file.render("create", schema),
            get: file.render("get", schema),
            list: file.render("list", schema),
            advance: file.render("advance", schema),
            set_state: file.render("set_state", schema),
            lock: file.render("lock", schema),
            register: file.render("register", schema),
            relay_open: file.render("relay_open", schema),
            audit_insert: crate::dead_letters::AuditQueries::new(schema).insert,
        };
        file.finish();
        queries
    }
}

/// The replay jobs of one schema.
#[derive(Clone)]
pub struct Replays {
    pool: PgPool,
    schema: String,
    sql: Arc<Queries>,
}

/// A runner's hold on a job: the connection holding its advisory lock
/// (the lock goes with the session, whether the runner ends or dies).
pub struct ReplayLock {
    _connection: PgConnection,
}

impl Replays {
    pub fn new(pool: PgPool, schema: &Schema) -> Self {
        Self {
            pool,
            schema: schema.name().to_owned(),
            sql: Arc::new(Queries::new(schema)),
        }
    }

    /// What `source` holds of `range`.
    pub async fn range(
        &self,
        source: ReplaySource,
        range: &ReplayRange,
    ) -> Result<RangeFound, sqlx::Error> {
        let (total, hi): (i64, i64) = sqlx::query_as(trusted(&self.sql.range))
            .bind(range.from)
            .bind(range.to)
            .bind(&range.type_likes)
            .bind(&range.aggregate_type)
            .bind(&range.aggregate_id)
            .bind(0_i64)
            .bind(Uuid::nil())
            .bind(i64::MAX)
            .bind(source.as_str())
            .fetch_one(&self.pool)
            .await?;
        Ok(RangeFound {
            total,
            hi,
            oldest: self.oldest(source).await?,
        })
    }

    /// The oldest event `source` still holds: how far back a replay reaches.
    pub async fn oldest(&self, source: ReplaySource) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
        sqlx::query_scalar(trusted(&self.sql.oldest))
            .bind(source.as_str())
            .fetch_one(&self.pool)
            .await
    }

    /// Make a job, running, recorded in the audit log in the same
    /// transaction. Returns its id.
    pub async fn create(&self, job: &NewReplay) -> Result<i64, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let id: i64 = sqlx::query_scalar(trusted(&self.sql.create))
            .bind(&job.destination)
            .bind(job.source.as_str())
            .bind(job.range.from)
            .bind(job.range.to)
            .bind(&job.range.types)
            .bind(&job.range.type_likes)
            .bind(&job.range.aggregate_type)
            .bind(&job.range.aggregate_id)
            .bind(job.rate)
            .bind(job.new_ids)
            .bind(job.hi)
            .bind(job.total)
            .bind(&job.actor)
            .fetch_one(&mut *tx)
            .await?;
        let selection = serde_json::json!({
            "replay": id,
            "destination": job.destination,
            "source": job.source.as_str(),
            "from": job.range.from,
            "to": job.range.to,
            "types": job.range.types,
            "aggregate_type": job.range.aggregate_type,
            "aggregate_id": job.range.aggregate_id,
            "rate": job.rate,
            "new_ids": job.new_ids,
        });
        sqlx::query(trusted(&self.sql.audit_insert))
            .bind(&job.actor)
            .bind(ACTION_REPLAY_START)
            .bind(selection.to_string())
            .bind(job.total)
            .bind(None::<String>)
            .bind("[]")
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(id)
    }

    pub async fn get(&self, id: i64) -> Result<Option<ReplayJob>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.get))
            .bind(id)
            .fetch_optional(&self.pool)
            .await
    }

    /// The newest jobs, at most `limit`.
    pub async fn list(&self, limit: i64) -> Result<Vec<ReplayJob>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.list))
            .bind(limit)
            .fetch_all(&self.pool)
            .await
    }

    /// The job's next events after its position, at most `limit`.
    pub async fn page(&self, job: &ReplayJob, limit: i64) -> Result<Vec<ReplayEvent>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.page))
            .bind(job.from_at)
            .bind(job.to_at)
            .bind(&job.type_likes)
            .bind(&job.aggregate_type)
            .bind(&job.aggregate_id)
            .bind(job.after_id)
            .bind(job.after_event)
            .bind(job.hi)
            .bind(job.source().as_str())
            .bind(limit)
            .fetch_all(&self.pool)
            .await
    }

    /// Move a running job past a delivered page. False when the job no
    /// longer runs (cancelled meanwhile).
    pub async fn advance(&self, id: i64, done: &PageDone) -> Result<bool, sqlx::Error> {
        let row: Option<i64> = sqlx::query_scalar(trusted(&self.sql.advance))
            .bind(id)
            .bind(done.after_id)
            .bind(done.after_event)
            .bind(done.delivered)
            .bind(done.filtered)
            .bind(done.rejected)
            .bind(&done.error)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.is_some())
    }

    /// Move job `id` to `state` if it is in one of `from`; the state it took,
    /// or None when it was in none of them.
    pub async fn set_state(
        &self,
        id: i64,
        state: &str,
        from: &[&str],
        error: Option<&str>,
    ) -> Result<Option<String>, sqlx::Error> {
        sqlx::query_scalar(trusted(&self.sql.set_state))
            .bind(id)
            .bind(state)
            .bind(from)
            .bind(error)
            .fetch_optional(&self.pool)
            .await
    }

    /// Cancel a job that is not done, recorded in the audit log. The state
    /// it was in, or None when there is no such job or it had ended.
    pub async fn cancel(&self, id: i64, actor: &str) -> Result<Option<String>, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let before: Option<ReplayJob> = sqlx::query_as(trusted(&self.sql.get))
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(before) = before.filter(ReplayJob::is_open) else {
            return Ok(None);
        };
        sqlx::query(trusted(&self.sql.set_state))
            .bind(id)
            .bind("cancelled")
            .bind(["running", "paused", "failed"])
            .bind(None::<String>)
            .execute(&mut *tx)
            .await?;
        let selection = serde_json::json!({ "replay": id, "destination": before.destination });
        sqlx::query(trusted(&self.sql.audit_insert))
            .bind(actor)
            .bind(ACTION_REPLAY_CANCEL)
            .bind(selection.to_string())
            .bind(before.delivered)
            .bind(None::<String>)
            .bind("[]")
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Some(before.state))
    }

    /// Record a relay's destinations as seen (migration 30) and, in one
    /// transaction, make a job (created by `relay`) for each destination new
    /// to a schema that had some already and given a start in `starts`
    /// (`None`: now, no job): the retained events of `source` from that
    /// start (the oldest retained for [`GroupStart::Beginning`]) until now,
    /// at `rate` events a second (None: unpaced). Returns the jobs made. A
    /// new destination whose range holds nothing gets no job.
    pub async fn start_new_destinations(
        &self,
        destinations: &[(String, Option<GroupStart>)],
        source: ReplaySource,
        rate: Option<i32>,
    ) -> Result<Vec<i64>, sqlx::Error> {
        let names: Vec<&str> = destinations.iter().map(|(n, _)| n.as_str()).collect();
        let mut tx = self.pool.begin().await?;
        let added: Vec<String> = sqlx::query_scalar(trusted(&self.sql.register))
            .bind(&names)
            .fetch_all(&mut *tx)
            .await?;
        let mut jobs = Vec::new();
        let now = Utc::now();
        for (name, start) in destinations {
            if !added.contains(name) {
                continue;
            }
            let from = match start {
                None | Some(GroupStart::Now) => continue,
                Some(GroupStart::At(t)) => *t,
                Some(GroupStart::Beginning) => {
                    let oldest: Option<DateTime<Utc>> =
                        sqlx::query_scalar(trusted(&self.sql.oldest))
                            .bind(source.as_str())
                            .fetch_one(&mut *tx)
                            .await?;
                    match oldest {
                        Some(t) => t,
                        None => continue,
                    }
                }
            };
            if from >= now {
                continue;
            }
            let (total, hi): (i64, i64) = sqlx::query_as(trusted(&self.sql.range))
                .bind(from)
                .bind(now)
                .bind(None::<Vec<String>>)
                .bind(None::<String>)
                .bind(None::<String>)
                .bind(0_i64)
                .bind(Uuid::nil())
                .bind(i64::MAX)
                .bind(source.as_str())
                .fetch_one(&mut *tx)
                .await?;
            if total == 0 {
                continue;
            }
            let id: i64 = sqlx::query_scalar(trusted(&self.sql.create))
                .bind(name)
                .bind(source.as_str())
                .bind(from)
                .bind(now)
                .bind(None::<String>)
                .bind(None::<Vec<String>>)
                .bind(None::<String>)
                .bind(None::<String>)
                .bind(rate)
                .bind(false)
                .bind(hi)
                .bind(total)
                .bind(RELAY_ACTOR)
                .fetch_one(&mut *tx)
                .await?;
            jobs.push(id);
        }
        tx.commit().await?;
        Ok(jobs)
    }

    /// The open jobs relays made for `destinations`, oldest first.
    pub async fn relay_open(&self, destinations: &[&str]) -> Result<Vec<ReplayJob>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.relay_open))
            .bind(destinations)
            .fetch_all(&self.pool)
            .await
    }

    /// Take job `id` for this runner; None when another runner holds it.
    pub async fn lock(&self, id: i64) -> Result<Option<ReplayLock>, sqlx::Error> {
        let mut connection = self.pool.acquire().await?;
        let held: bool = sqlx::query_scalar(trusted(&self.sql.lock))
            .bind(id)
            .bind(&self.schema)
            .fetch_one(&mut *connection)
            .await?;
        // Out of the pool: the lock is the session's, and the session ends
        // with the runner instead of going back to the pool still holding it.
        Ok(held.then(|| ReplayLock {
            _connection: connection.detach(),
        }))
    }
}

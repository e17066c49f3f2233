//! The outboxes a console serves: its home schema's alone, at `/` (the
//! default), or many — the schemas and databases an outbox selection names,
//! each under `/o/<database>/<schema>/`.
//!
//! Serving many, the [`Directory`] keeps one small pool per database (never
//! one per outbox) and the outboxes found in each, listed again when the list
//! is older than [`crate::ConsoleConfig::rediscover_every`] (checked by the
//! all-outboxes overview and the backlog sampler) and when a request names an
//! outbox the list does not hold (at most every few seconds). A database
//! that cannot be listed keeps the outboxes found in it before, so they show
//! as error rows rather than vanish.
//!
//! Two things keep a console over hundreds of outboxes frugal: the overview's
//! counts are read once for every viewer within
//! [`crate::ConsoleConfig::overview_cache_for`] ([`Directory::overview`]), and
//! the backlog sampler reads only the outboxes whose pages someone viewed
//! within [`crate::ConsoleConfig::watch_for`] ([`Directory::sample_watched`]);
//! nobody looking, the console sends no query at all.

use crate::samples::Samples;
use postbox::Schema;
use postbox_store::directory::{self, Schemas, Source};
use postbox_store::{Backlog, ConsoleStore, DeadLetters, Replays, Store};
use sqlx::postgres::PgConnectOptions;
use sqlx::PgPool;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// Where the outboxes of a console serving many are: the outbox
/// directory's sources (a listed outbox missing from its database is shown
/// as an error row).
pub type OutboxSource = Source;

/// One outbox the console shows, with its stores and its backlog history.
pub(crate) struct Outbox {
    /// `<database>/<schema>` (serving one outbox: the schema's name).
    pub name: String,
    pub schema: Schema,
    /// Every page of this outbox is under this path (no trailing slash;
    /// empty when the console serves one outbox at `/`).
    pub base: String,
    pub store: Store,
    pub console: ConsoleStore,
    pub dlq: DeadLetters,
    /// Its replay jobs (`postbox replay`): listed, and cancelled, audited.
    pub replays: Replays,
    pub samples: Samples,
    database: String,
    /// Which source found it.
    source: usize,
    /// When a page of this outbox was last asked for.
    viewed: Mutex<Option<Instant>>,
}

impl Outbox {
    /// The home schema's outbox, served at `/`.
    pub fn home(pool: PgPool, schema: Schema) -> Self {
        let store = Store::new(pool, schema.clone());
        Self {
            name: schema.name().to_owned(),
            base: String::new(),
            console: store.console(),
            dlq: store.dead_letters(),
            replays: store.replays(),
            store,
            samples: Samples::default(),
            database: String::new(),
            schema,
            source: 0,
            viewed: Mutex::new(None),
        }
    }

    fn served(database: &str, schema: Schema, pool: PgPool, source: usize) -> Self {
        let name = format!("{database}/{}", schema.name());
        let store = Store::new(pool, schema.clone());
        Self {
            base: format!("/o/{}/{}", segment(database), segment(schema.name())),
            console: store.console(),
            dlq: store.dead_letters().naming(name.clone()),
            replays: store.replays(),
            store,
            samples: Samples::default(),
            database: database.to_owned(),
            name,
            schema,
            source,
            viewed: Mutex::new(None),
        }
    }

    /// Someone asked for a page of this outbox now.
    pub fn viewed(&self) {
        *lock(&self.viewed) = Some(Instant::now());
    }

    /// Whether a page of this outbox was asked for within `window`.
    pub fn watched_within(&self, window: Duration) -> bool {
        lock(&self.viewed).is_some_and(|at| at.elapsed() < window)
    }

    /// `path` (starting with `/`) inside this outbox's pages.
    pub fn at(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// A path segment: unreserved characters as they are, every other byte `%XX`.
pub(crate) fn segment(name: &str) -> String {
    percent_encoding::utf8_percent_encode(name, SEGMENT).to_string()
}

const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// A path segment decoded; `None` when it is not UTF-8.
pub(crate) fn unsegment(s: &str) -> Option<String> {
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .ok()
        .map(|c| c.into_owned())
}

/// Something wrong above a single outbox: a server or database that cannot
/// be listed.
#[derive(Clone, Debug)]
pub(crate) struct Problem {
    pub what: String,
    pub why: &'static str,
}

/// What the last discovery found.
#[derive(Default)]
pub(crate) struct Known {
    /// By name.
    pub outboxes: Vec<Arc<Outbox>>,
    pub problems: Vec<Problem>,
    listed_at: Option<Instant>,
}

impl Known {
    fn find(&self, database: &str, schema: &str) -> Option<Arc<Outbox>> {
        self.outboxes
            .iter()
            .find(|o| o.database == database && o.schema.name() == schema)
            .cloned()
    }
}

/// How soon a request naming an unknown outbox may list the outboxes again.
const UNKNOWN_RELIST: Duration = Duration::from_secs(5);

/// The outboxes of a console serving many, and a pool per database.
pub(crate) struct Directory {
    sources: Vec<OutboxSource>,
    pool_size: u32,
    rediscover: Duration,
    pools: Mutex<HashMap<String, PgPool>>,
    known: RwLock<Arc<Known>>,
    listing: tokio::sync::Mutex<()>,
    /// The overview's last read, and how long it is shown to every viewer.
    overview: tokio::sync::Mutex<Option<Overview>>,
    cache_for: Duration,
}

/// Every outbox's backlog as one read of the overview found it.
#[derive(Clone)]
pub(crate) struct Overview {
    /// The list of outboxes read.
    pub known: Arc<Known>,
    pub lines: Arc<[Line]>,
    pub read_at: Instant,
    /// How long the read took.
    pub took: Duration,
}

impl Directory {
    pub fn new(
        sources: Vec<OutboxSource>,
        pool_size: u32,
        rediscover: Duration,
        cache_for: Duration,
    ) -> Self {
        Self {
            sources,
            pool_size: pool_size.max(1),
            rediscover,
            pools: Mutex::default(),
            known: RwLock::default(),
            listing: tokio::sync::Mutex::new(()),
            overview: tokio::sync::Mutex::new(None),
            cache_for,
        }
    }

    /// Every outbox's backlog for the overview: the last read while it is
    /// younger than the cache time and the list of outboxes has not been
    /// made again since, else a new read. Requests that arrive during a
    /// read wait for it and share it, so any number of viewers cost one
    /// read per cache time.
    pub async fn overview(&self) -> Overview {
        let known = self.current().await;
        let mut last = self.overview.lock().await;
        if let Some(o) = last.as_ref() {
            if Arc::ptr_eq(&o.known, &known) && o.read_at.elapsed() < self.cache_for {
                return o.clone();
            }
        }
        let started = Instant::now();
        let lines = backlogs(&known.outboxes).await;
        let read = Overview {
            known,
            lines: lines.into(),
            read_at: Instant::now(),
            took: started.elapsed(),
        };
        *last = Some(read.clone());
        read
    }

    /// Take a backlog sample of every outbox a page of which was asked for
    /// within `window` (per database one after the other, databases side by
    /// side); the names of those sampled. The outboxes are not listed again
    /// for this: an idle console sends no query.
    pub async fn sample_watched(&self, window: Duration) -> Vec<String> {
        let watched: Vec<Arc<Outbox>> = self
            .known()
            .outboxes
            .iter()
            .filter(|o| o.watched_within(window))
            .cloned()
            .collect();
        let mut sampled: Vec<String> = backlogs(&watched)
            .await
            .into_iter()
            .filter_map(|line| {
                let sample = crate::samples::Sample {
                    at: chrono::Utc::now(),
                    backlog: line.backlog.ok()?,
                };
                line.outbox.samples.push(sample);
                Some(line.outbox.name.clone())
            })
            .collect();
        sampled.sort();
        sampled
    }

    fn known(&self) -> Arc<Known> {
        match self.known.read() {
            Ok(k) => k.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// The outboxes, listed again first when the list is older than the
    /// rediscovery interval.
    pub async fn current(&self) -> Arc<Known> {
        self.listed_within(self.rediscover).await
    }

    /// The outbox `<database>/<schema>`, listing the outboxes again if it is
    /// not known and the list is older than a few seconds.
    pub async fn find(&self, database: &str, schema: &str) -> Option<Arc<Outbox>> {
        if let Some(o) = self.known().find(database, schema) {
            return Some(o);
        }
        self.listed_within(UNKNOWN_RELIST)
            .await
            .find(database, schema)
    }

    async fn listed_within(&self, age: Duration) -> Arc<Known> {
        let _one_at_a_time = self.listing.lock().await;
        let known = self.known();
        if known.listed_at.is_some_and(|at| at.elapsed() < age) {
            return known;
        }
        let fresh = Arc::new(self.list(&known).await);
        match self.known.write() {
            Ok(mut k) => *k = fresh.clone(),
            Err(poisoned) => *poisoned.into_inner() = fresh.clone(),
        }
        fresh
    }

    /// List every source's outboxes. What cannot be listed keeps what the
    /// previous list (`before`) found there.
    async fn list(&self, before: &Known) -> Known {
        let mut found = Listing {
            before,
            known: Known::default(),
        };
        let size = self.pool_size;
        let mut pools = match self.pools.lock() {
            Ok(p) => p.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        let mut pool = |key: &str, connect: &PgConnectOptions| {
            pools
                .entry(key.to_owned())
                .or_insert_with(|| {
                    // Made on first use; it connects lazily.
                    postbox_store::connect::pool_options(connect)
                        .max_connections(size)
                        .min_connections(0)
                        .idle_timeout(Some(Duration::from_secs(10)))
                        .acquire_timeout(Duration::from_secs(5))
                        .connect_lazy_with(connect.clone())
                })
                .clone()
        };
        let listing = directory::list(&self.sources, Schemas::Migrated, &mut pool).await;
        match self.pools.lock() {
            Ok(mut p) => *p = pools,
            Err(poisoned) => *poisoned.into_inner() = pools,
        }
        for unlisted in &listing.unlisted {
            let database = (!unlisted.server).then_some(unlisted.database.as_str());
            found.failed(
                unlisted.source,
                database,
                unlisted.what.clone(),
                &unlisted.error,
            );
        }
        // A listed outbox missing from its database is shown all the same
        // (as an error row): whoever listed it expects it there.
        for outbox in listing.found {
            found.add(&outbox.database, outbox.schema, outbox.pool, outbox.source);
        }
        let mut known = found.known;
        known.outboxes.sort_by(|a, b| a.name.cmp(&b.name));
        known.listed_at = Some(Instant::now());
        known
    }
}

/// A list being made.
struct Listing<'a> {
    before: &'a Known,
    known: Known,
}

impl Listing<'_> {
    fn add(&mut self, database: &str, schema: Schema, pool: PgPool, source: usize) {
        if self.known.find(database, schema.name()).is_some() {
            return;
        }
        // An outbox found again keeps its stores and its backlog history.
        let outbox = self
            .before
            .find(database, schema.name())
            .unwrap_or_else(|| Arc::new(Outbox::served(database, schema, pool, source)));
        self.known.outboxes.push(outbox);
    }

    /// Source `source` (its `database`, or all of it) could not be listed:
    /// say so, and keep what it held before.
    fn failed(&mut self, source: usize, database: Option<&str>, what: String, e: &sqlx::Error) {
        let why = unreadable(e).unwrap_or(CANNOT_LIST);
        tracing::warn!(
            what = %what,
            error = %postbox::redact::sanitize_error(&e.to_string()),
            "console: cannot list the outboxes"
        );
        self.known.problems.push(Problem { what, why });
        let kept: Vec<Arc<Outbox>> = self
            .before
            .outboxes
            .iter()
            .filter(|o| o.source == source && database.is_none_or(|d| o.database == d))
            .cloned()
            .collect();
        for o in kept {
            if self.known.find(&o.database, o.schema.name()).is_none() {
                self.known.outboxes.push(o);
            }
        }
    }
}

const CANNOT_LIST: &str = "Its outboxes could not be listed; the console's log says why.";

/// Why an outbox cannot be read, in a fixed phrase, when the error says it
/// is missing or out of reach (not for other failures).
pub(crate) fn unreadable(e: &sqlx::Error) -> Option<&'static str> {
    match e {
        sqlx::Error::Database(db) => {
            let code = db.code();
            let code = code.as_deref().unwrap_or("");
            match code {
                "42P01" | "3F000" => {
                    Some("Its tables are missing: the schema was dropped, or is not migrated.")
                }
                "3D000" => Some("Its database does not exist (any more)."),
                "42501" => Some("The console's database role may not read it."),
                c if c.starts_with("28") => Some("Its database refused the console's credentials."),
                c if c.starts_with("08") || c.starts_with("57P") || c.starts_with("53") => {
                    Some("Its database does not answer.")
                }
                _ => None,
            }
        }
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_) => Some("Its database does not answer."),
        _ => None,
    }
}

/// One outbox's line on the all-outboxes overview.
#[derive(Clone)]
pub(crate) struct Line {
    pub outbox: Arc<Outbox>,
    /// The backlog now, or why it cannot be read.
    pub backlog: Result<Backlog, &'static str>,
}

/// The backlog of each of `outboxes` now: per database, one outbox after
/// the other over its pool (a connection at a time, whatever the number of
/// schemas); databases side by side.
pub(crate) async fn backlogs(outboxes: &[Arc<Outbox>]) -> Vec<Line> {
    let mut by_database: HashMap<&str, Vec<Arc<Outbox>>> = HashMap::new();
    for o in outboxes {
        by_database.entry(&o.database).or_default().push(o.clone());
    }
    let reads = by_database.into_values().map(|outboxes| async move {
        let mut lines = Vec::with_capacity(outboxes.len());
        for outbox in outboxes {
            let backlog = match outbox.console.backlog().await {
                Ok(backlog) => Ok(backlog),
                Err(e) => {
                    tracing::warn!(
                        outbox = %outbox.name,
                        error = %postbox::redact::sanitize_error(&e.to_string()),
                        "console: cannot read the outbox's backlog"
                    );
                    Err(unreadable(&e).unwrap_or("Reading it failed; the console's log says why."))
                }
            };
            lines.push(Line { outbox, backlog });
        }
        lines
    });
    futures::future::join_all(reads)
        .await
        .into_iter()
        .flatten()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_survive_the_path() {
        for name in ["app", "app db", "a/b", "münchen", "x%41"] {
            let s = segment(name);
            assert!(!s.contains('/') && !s.contains(' '), "{s}");
            assert_eq!(unsegment(&s).as_deref(), Some(name));
        }
        assert_eq!(segment("tenant_a-1.x"), "tenant_a-1.x");
        assert_eq!(unsegment("%FF"), None);
    }

    #[test]
    fn missing_tables_and_silent_databases_are_told_apart_from_other_failures() {
        assert!(unreadable(&sqlx::Error::PoolTimedOut).is_some());
        assert!(unreadable(&sqlx::Error::RowNotFound).is_none());
    }
}

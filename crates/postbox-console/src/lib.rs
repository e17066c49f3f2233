//! The postbox operator console: a small web application, served by axum,
//! over one postbox schema or many outboxes.
//!
//! - **Outboxes.** By default the console shows its home schema's outbox at
//!   `/`. Given outbox sources ([`ConsoleConfig::outboxes`]) it serves every
//!   outbox they name, each under `/o/<database>/<schema>/` with the same
//!   pages, and an all-outboxes overview at `/`. Users, sessions and the
//!   audit of sign-ins stay in the home schema either way; one sign-in covers
//!   every outbox, and a role applies to all of them unless the user's
//!   outbox patterns limit it ([`OutboxPatterns`], [`set_user`]): a user sees
//!   and acts in only the outboxes its patterns name, everywhere else the
//!   console answers as if the outbox did not exist.
//!
//! - **Access.** Users have a role: `viewer` looks, `operator` also replays
//!   and discards dead letters and cancels replay jobs. Passwords are stored
//!   as argon2 hashes ([`add_user`]). A session is a random token in an
//!   `HttpOnly`, `SameSite=Strict` cookie (`Secure` when the console sits
//!   behind TLS); only the token's SHA-256 is stored. Every state-changing
//!   request carries the session's CSRF token (the sign-in form its own: an
//!   HMAC the console process issues under a key it makes at start, bound to
//!   the form's cookie and expiring).
//!   One guard checks the session, the token and the role in front of every
//!   state-changing route, from one table ([`state_changing_routes`]); a
//!   state-changing route without a row is refused. Sign-in attempts and
//!   replays/discards are rate limited in process; the sign-in limits cannot
//!   be used to lock a user out (see the README's console section). The client's
//!   address is the TCP peer's, or, from a trusted proxy only
//!   ([`ConsoleConfig::trusted_proxies`]), the rightmost untrusted address in
//!   `X-Forwarded-For`.
//! - **Pages.** Overview (counts, and charts of the backlog, the oldest
//!   pending age and deliveries over the last 30 minutes, from samples the
//!   console takes itself), event search and one event (payload redacted by
//!   the configured [`PayloadRedactor`]), dead letters with single and bulk
//!   replay/discard (bulk actions run in the background, batch by batch, and
//!   can be cancelled), dead letters and retrying events grouped by cause
//!   (a whole dead-letter group replayed or discarded at once), the replay
//!   jobs of `postbox replay` (an open one cancelled by an operator, audited),
//!   and the audit log, read-only. The overview and the lists update
//!   themselves in place.
//! - **Storage.** Everything goes through the `postbox-store` crate: the
//!   dead-letter operations and their audit entries (`store::dlq`) and the
//!   console's own queries and tables (`store::console`, migration 6).
//!
//! The HTML is rendered on the server; one embedded stylesheet and one small
//! script (live updates, progress polling, select-all, confirmations) are served by the
//! binary itself, so the console needs nothing from the internet.

mod assets;
mod auth;
mod client_addr;
mod form;
mod http;
mod jobs;
mod limit;
mod outboxes;
mod pages;
pub mod preview;
mod samples;
mod scope;
mod views;

pub use auth::{hash_password, verify_password, Role};
pub use client_addr::{Cidr, CidrError};
pub use http::guard::{Access, StateChangingRoute};
pub use limit::RateLimit;
pub use outboxes::OutboxSource;
pub use postbox::redact::PayloadRedactor;
pub use scope::OutboxPatterns;

use outboxes::{Directory, Outbox};
use postbox::Schema;
use postbox_store::ConsoleStore;
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// What can go wrong outside a request: managing users, serving.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsoleError {
    /// A user name must be 1 to 64 characters of letters, digits, `.`, `_`, `-`, `@`.
    #[error("invalid user name: {0}")]
    InvalidUserName(&'static str),
    /// A password must be 8 to 1024 bytes.
    #[error("invalid password: {0}")]
    InvalidPassword(&'static str),
    /// Roles are `viewer` and `operator`.
    #[error("unknown role {0:?}: expected viewer or operator")]
    UnknownRole(String),
    /// An outbox pattern is `SCHEMA_GLOB` or `DATABASE_GLOB/SCHEMA_GLOB`
    /// (`*` any run, `?` one character), comma-separated; `*` is every outbox.
    #[error("invalid outbox pattern {pattern:?}: {why} (patterns are SCHEMA_GLOB or DATABASE_GLOB/SCHEMA_GLOB, comma-separated; '*' is every outbox)")]
    InvalidOutboxPattern { pattern: String, why: &'static str },
    /// argon2 refused to hash (it does not in practice).
    #[error("cannot hash the password: {0}")]
    Hash(String),
    /// The database refused or failed a statement.
    #[error("database error")]
    Database(#[from] sqlx::Error),
    /// The schema lacks the console's tables, or its users' outbox column.
    #[error("schema {0} has no console tables, or not their latest version (migrations 6 and 23): run `postbox migrate` first")]
    NotMigrated(String),
    /// The listening socket failed.
    #[error("cannot serve the console")]
    Serve(#[source] std::io::Error),
}

/// How the console behaves; [`ConsoleConfig::new`] gives the defaults.
#[derive(Clone, Debug)]
pub struct ConsoleConfig {
    /// The home schema: the console's users, sessions and sign-in audit,
    /// and, without [`ConsoleConfig::outboxes`], the outbox shown.
    pub schema: Schema,
    /// The outboxes to serve, each under `/o/<database>/<schema>/`; empty
    /// (the default): the home schema's alone, at `/`.
    pub outboxes: Vec<OutboxSource>,
    /// Serving many outboxes: connections per database.
    pub pool_size: u32,
    /// Serving many outboxes: how old the list of outboxes may get before
    /// it is made again.
    pub rediscover_every: Duration,
    /// Masks configured payload paths and headers on event pages.
    pub redactor: PayloadRedactor,
    /// Mark cookies `Secure` (set this when users reach the console over
    /// HTTPS, through a TLS-terminating proxy). A request that arrives with
    /// `X-Forwarded-Proto: https` gets `Secure` cookies either way.
    pub secure_cookies: bool,
    /// How long a session lasts after sign-in.
    pub session_lifetime: Duration,
    /// How long a sign-in form (its CSRF token) can be sent after it was
    /// shown. A form shown before the console restarted is refused too.
    pub sign_in_form_lifetime: Duration,
    /// Sign-in attempts per client address; failed sign-ins per user name
    /// before the name is protected (see the crate's sign-in limits).
    pub sign_in_limit: RateLimit,
    /// How long an attempt for a protected name waits before its password
    /// is checked (from an address that has not failed for that name).
    pub sign_in_delay: Duration,
    /// Proxies whose `X-Forwarded-For` is believed: only when the TCP peer is
    /// in one of these is the rightmost address not in them the client's.
    /// Empty (the default): the peer's address, whatever the headers say.
    pub trusted_proxies: Vec<Cidr>,
    /// Replay and discard requests, per user.
    pub action_limit: RateLimit,
    /// Dead letters per transaction (and per audit entry) in bulk actions.
    pub batch_size: i64,
    /// Rows per page of lists.
    pub page_size: i64,
    /// How often the overview and the lists refresh themselves in the
    /// browser (at least half a second).
    pub refresh_every: Duration,
    /// How often the console samples the backlog for the overview's history
    /// chart (the last 30 minutes are kept, in memory).
    pub sample_every: Duration,
    /// Serving many outboxes: an outbox's backlog is sampled for its charts
    /// only while a page of it was viewed within this time (its charts show
    /// the history since it was first viewed). Serving one, it always is.
    pub watch_for: Duration,
    /// Serving many outboxes: how long one read of every outbox's counts is
    /// shown on the all-outboxes overview, to every viewer, before the next
    /// request reads them again (zero: every request reads them).
    pub overview_cache_for: Duration,
    /// What each destination would receive of an event, shown on its page
    /// (the relay's routes, filters and transforms; see [`preview`]). `None`:
    /// the page says no preview is configured. Serving many outboxes, it is
    /// not shown (each outbox may route its own way).
    pub route_preview: Option<Arc<dyn preview::RoutePreview>>,
}

impl ConsoleConfig {
    /// Defaults: 12-hour sessions, 5 sign-in attempts a minute (2 s delay for
    /// a protected name), no trusted proxy, 20 replay or discard requests a
    /// minute, batches of 500, pages of 50, pages refreshed every 5 s, the
    /// backlog sampled every 10 s; serving many outboxes, 3 connections per
    /// database, the outboxes listed again every 30 s, an outbox sampled
    /// for 10 minutes after its last page view and the overview's counts
    /// read at most every 3 s.
    pub fn new(schema: Schema) -> Self {
        Self {
            schema,
            outboxes: Vec::new(),
            pool_size: 3,
            rediscover_every: Duration::from_secs(30),
            redactor: PayloadRedactor::default(),
            secure_cookies: false,
            session_lifetime: Duration::from_secs(12 * 3600),
            sign_in_form_lifetime: Duration::from_secs(3600),
            sign_in_limit: RateLimit::per_minute(5),
            sign_in_delay: Duration::from_secs(2),
            trusted_proxies: Vec::new(),
            action_limit: RateLimit::per_minute(20),
            batch_size: 500,
            page_size: 50,
            refresh_every: Duration::from_secs(5),
            sample_every: Duration::from_secs(10),
            watch_for: Duration::from_secs(10 * 60),
            overview_cache_for: Duration::from_secs(3),
            route_preview: None,
        }
    }
}

/// Shared by every request.
pub(crate) struct Inner {
    pub config: ConsoleConfig,
    /// The home schema's users, sessions and sign-in audit.
    pub home: ConsoleStore,
    pub served: Served,
    pub sign_in: limit::SignInLimits,
    /// This process's key for the sign-in form's CSRF tokens.
    pub sign_in_tokens: auth::SignInTokens,
    pub actions: limit::Limiter,
    /// Requests refused because the user's outboxes do not include the
    /// one asked for: how many are logged (see [`http::access`]).
    pub refusals: limit::LogLimit,
    /// The home pool's database: serving one outbox, the database its
    /// users' outbox patterns are matched against.
    pub home_database: String,
    pub jobs: jobs::Jobs,
}

impl Inner {
    pub fn serves_many(&self) -> bool {
        matches!(self.served, Served::Many(_))
    }

    /// How often live pages refresh themselves, in milliseconds.
    pub fn refresh_ms(&self) -> u64 {
        u64::try_from(self.config.refresh_every.as_millis())
            .unwrap_or(u64::MAX)
            .max(500)
    }
}

/// What the console shows.
pub(crate) enum Served {
    /// The home schema's outbox, at `/`.
    One(Arc<Outbox>),
    /// Many outboxes, each under its prefix.
    Many(Box<Directory>),
}

/// The console application: its home schema over `pool`, and the outboxes
/// its configuration names.
#[derive(Clone)]
pub struct Console {
    pub(crate) inner: Arc<Inner>,
}

impl Console {
    pub fn new(pool: PgPool, config: ConsoleConfig) -> Self {
        let served = if config.outboxes.is_empty() {
            Served::One(Arc::new(Outbox::home(pool.clone(), config.schema.clone())))
        } else {
            Served::Many(Box::new(Directory::new(
                config.outboxes.clone(),
                config.pool_size,
                config.rediscover_every,
                config.overview_cache_for,
            )))
        };
        let home_database = {
            let connect = pool.connect_options();
            connect
                .get_database()
                .unwrap_or_else(|| connect.get_username())
                .to_owned()
        };
        let inner = Inner {
            home: ConsoleStore::new(pool, &config.schema),
            served,
            sign_in: limit::SignInLimits::new(config.sign_in_limit, config.sign_in_delay),
            sign_in_tokens: auth::SignInTokens::new(),
            actions: limit::Limiter::new(config.action_limit),
            refusals: limit::LogLimit::new(RateLimit::per_minute(10)),
            home_database,
            jobs: jobs::Jobs::default(),
            config,
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Check that the schema has the console's tables (and that the database answers).
    pub async fn check(&self) -> Result<(), ConsoleError> {
        check_schema(&self.inner.home, &self.inner.config.schema).await
    }

    /// The axum router (needs `ConnectInfo<SocketAddr>` for per-client
    /// sign-in limits; without it every client shares one bucket).
    pub fn router(&self) -> axum::Router {
        http::routes::router(self.clone(), pages::routes())
    }

    /// Take one backlog sample for the charts, as the sampler does every
    /// [`ConsoleConfig::sample_every`] while the console serves: serving one
    /// outbox, its backlog; serving many, the backlog of each outbox a page
    /// of which was viewed within [`ConsoleConfig::watch_for`]. Returns the
    /// names of the outboxes sampled (`<database>/<schema>`; serving one,
    /// the schema's), those that could not be read left out.
    pub async fn sample(&self) -> Vec<String> {
        match &self.inner.served {
            Served::One(outbox) => match outbox.samples.take(&outbox.console).await {
                Ok(_) => vec![outbox.name.clone()],
                Err(e) => {
                    tracing::warn!(
                        error = %postbox::redact::sanitize_error(&e.to_string()),
                        "console: cannot sample the backlog for the overview chart"
                    );
                    Vec::new()
                }
            },
            Served::Many(directory) => directory.sample_watched(self.inner.config.watch_for).await,
        }
    }

    /// Serve on `listener` until `shutdown` is cancelled; bulk actions still
    /// running are cancelled too (each stops after its current batch). The
    /// backlog is sampled for the overview's chart meanwhile (serving many
    /// outboxes: the outboxes being viewed, see [`Console::sample`]).
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: CancellationToken,
    ) -> Result<(), ConsoleError> {
        let jobs = self.inner.jobs.clone();
        let every = self.inner.config.sample_every;
        match &self.inner.served {
            Served::One(outbox) => {
                tokio::spawn(outbox.samples.clone().run(
                    outbox.console.clone(),
                    every,
                    shutdown.child_token(),
                ));
            }
            Served::Many(_) => {
                tokio::spawn(sample_watched(self.clone(), every, shutdown.child_token()));
            }
        }
        // Bounded like every port postbox serves: head and request timeouts,
        // a connection cap; each request carries its peer's address.
        let limits = postbox::serve::Limits::default();
        let stop = shutdown.clone();
        let served =
            postbox::serve::serve(listener, self.router(), limits, stop.cancelled_owned()).await;
        jobs.cancel_all();
        served.map_err(ConsoleError::Serve)
    }
}

/// Serving many outboxes: sample the backlog of the outboxes being viewed
/// every `every` until `stop`.
async fn sample_watched(console: Console, every: Duration, stop: CancellationToken) {
    let mut tick = tokio::time::interval(every.max(Duration::from_millis(100)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        console.sample().await;
    }
}

/// The method and path of every route the console's router mounts, in the
/// order mounted (paths in the router's syntax: `{id}` is a parameter).
pub fn routes() -> Vec<(axum::http::Method, &'static str)> {
    pages::routes().mounted()
}

/// Every state-changing route (any method but GET and HEAD) and who may use
/// it: the table the router's guard enforces before any handler runs.
pub fn state_changing_routes() -> &'static [StateChangingRoute] {
    http::guard::STATE_CHANGING
}

/// Create user `name` with `role`, or give an existing user this role and
/// password (an existing user keeps its outbox patterns; a new one may use
/// every outbox); the user's open sessions end either way. Returns true when
/// the user is new.
pub async fn add_user(
    pool: &PgPool,
    schema: &Schema,
    name: &str,
    role: Role,
    password: &str,
) -> Result<bool, ConsoleError> {
    Ok(set_user(pool, schema, name, role, None, password)
        .await?
        .created)
}

/// A user as [`set_user`] stored it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredUser {
    /// Whether the user is new.
    pub created: bool,
    /// The outboxes the user's role applies to now.
    pub outboxes: OutboxPatterns,
}

/// Create user `name` with `role`, or give an existing user this role and
/// password, and the outboxes the role applies to when `outboxes` is given
/// (`None`: an existing user keeps its own, a new one may use every
/// outbox); the user's open sessions end either way.
pub async fn set_user(
    pool: &PgPool,
    schema: &Schema,
    name: &str,
    role: Role,
    outboxes: Option<&OutboxPatterns>,
    password: &str,
) -> Result<StoredUser, ConsoleError> {
    auth::check_user_name(name)?;
    auth::check_password(password)?;
    let hash = {
        let password = password.to_owned();
        tokio::task::spawn_blocking(move || hash_password(&password))
            .await
            .map_err(|e| ConsoleError::Hash(e.to_string()))??
    };
    let store = ConsoleStore::new(pool.clone(), schema);
    check_schema(&store, schema).await?;
    let patterns = outboxes.map(OutboxPatterns::to_stored);
    let (created, stored) = store
        .upsert_user(name, role.as_str(), &hash, patterns.as_deref())
        .await?;
    Ok(StoredUser {
        created,
        outboxes: OutboxPatterns::from_stored(&stored)?,
    })
}

async fn check_schema(store: &ConsoleStore, schema: &Schema) -> Result<(), ConsoleError> {
    match store.user("").await {
        Ok(_) => Ok(()),
        // No table (migration 6), or no outboxes column (migration 23).
        Err(sqlx::Error::Database(db))
            if matches!(db.code().as_deref(), Some("42P01" | "42703")) =>
        {
            Err(ConsoleError::NotMigrated(schema.name().to_owned()))
        }
        Err(e) => Err(e.into()),
    }
}

/// Remove user `name` and end their sessions; false when there was none.
pub async fn remove_user(pool: &PgPool, schema: &Schema, name: &str) -> Result<bool, ConsoleError> {
    let store = ConsoleStore::new(pool.clone(), schema);
    check_schema(&store, schema).await?;
    Ok(store.delete_user(name).await?)
}

//! Connecting to PostgreSQL: options from the URL, bounded retries with
//! backoff, and errors that never repeat the URL's password. Every `postbox`
//! command connects through it, and so do the workloads.

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};
use std::str::FromStr;
use std::time::{Duration, Instant};

/// How long one-shot commands (and the workloads) keep retrying an unreachable database.
pub const CONNECT_PATIENCE: Duration = Duration::from_secs(15);

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("no database given: pass --database-url, set DATABASE_URL, or set database_url in the config file")]
    Missing,
    #[error("DATABASE_URL is not a valid PostgreSQL URL ({reason}); expected postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE")]
    Invalid { reason: String },
    #[error("cannot connect to PostgreSQL at {target} (gave up after {waited})")]
    Unreachable {
        target: String,
        waited: String,
        #[source]
        source: sqlx::Error,
    },
}

/// Parse a URL into connect options tagged with postbox's application name.
pub fn options(url: Option<&str>, application: &str) -> Result<PgConnectOptions, DbError> {
    let url = url.ok_or(DbError::Missing)?;
    let options = PgConnectOptions::from_str(url).map_err(|e| DbError::Invalid {
        reason: postbox::redact::sanitize_error(&e.to_string()),
    })?;
    // Statements over a second (a VACUUM, a claim behind a lock) are logged at
    // debug: the metrics and the health watch are where slowness is reported.
    Ok(options
        .application_name(application)
        .log_statements(tracing::log::LevelFilter::Trace)
        .log_slow_statements(tracing::log::LevelFilter::Debug, Duration::from_secs(1)))
}

/// Where a URL points, for messages: host, port and database, never credentials.
pub fn target(options: &PgConnectOptions) -> String {
    format!(
        "{}:{}/{}",
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or("(default database)")
    )
}

/// The pool options every postbox pool starts from. Its TCP connections
/// have `TCP_NODELAY` (sqlx sets it from 0.9.1; over TLS, Nagle's
/// algorithm held a small request back until the server's delayed
/// acknowledgement of the previous one, 40 ms and more).
pub fn pool_options(_options: &PgConnectOptions) -> PgPoolOptions {
    PgPoolOptions::new()
}

/// A pool that connects on first use (the relay retries forever on its own).
pub fn lazy_pool(options: PgConnectOptions, size: u32) -> PgPool {
    pool_options(&options)
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(options)
}

/// A pool whose first connection succeeded, retrying with backoff for up to `patience`.
pub async fn pool(
    options: PgConnectOptions,
    size: u32,
    patience: Duration,
) -> Result<PgPool, DbError> {
    let started = Instant::now();
    let mut attempt: u32 = 0;
    loop {
        attempt += 1;
        let pool = pool_options(&options)
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options.clone())
            .await;
        match pool {
            Ok(p) => return Ok(p),
            Err(e) if started.elapsed() < patience && retryable(&e) => {
                // 200 ms, doubling, at most 5 s.
                let delay = Duration::from_millis(200)
                    .saturating_mul(1 << attempt.saturating_sub(1).min(5))
                    .min(Duration::from_secs(5));
                tracing::warn!(
                    target = %target(&options),
                    error = %postbox::redact::sanitize_error(&e.to_string()),
                    retry_in = ?delay,
                    "cannot connect to PostgreSQL yet"
                );
                tokio::time::sleep(delay).await;
            }
            Err(source) => {
                return Err(DbError::Unreachable {
                    target: target(&options),
                    waited: humantime::format_duration(Duration::from_secs(
                        started.elapsed().as_secs(),
                    ))
                    .to_string(),
                    source,
                })
            }
        }
    }
}

/// Connection trouble is worth retrying; a refused login or a missing database is not.
fn retryable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => matches!(db.code().as_deref(), Some("57P03") | Some("53300")),
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::Tls(_) => true,
        _ => false,
    }
}

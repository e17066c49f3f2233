//! Test helpers shared by postbox's test suites (not published).
//!
//! - [`TestDb`]: a fresh, migrated schema per test in the database named by
//!   `POSTBOX_TEST_DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`),
//!   so tests run in parallel without seeing each other's rows.
//! - [`wait_for`]: poll a condition until it holds or a deadline passes; tests
//!   never sleep for a fixed time to "let things happen".
//! - [`redis_url`] / [`unique`]: a Redis to talk to and collision-free key names.
//! - [`qstash::QstashServer`]: a QStash-compatible server with signed deliveries.

pub mod proxy;
pub mod qstash;

use postbox::statements::trusted;
use postbox::Schema;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use std::future::Future;
use std::str::FromStr;
use std::time::{Duration, Instant};

/// The database tests run against.
pub fn database_url() -> String {
    std::env::var("POSTBOX_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// The Redis tests run against.
pub fn redis_url() -> String {
    std::env::var("POSTBOX_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A name no other test uses: `prefix` + 12 random hex digits.
/// An HTTP client builder for tests: reqwest needs a rustls provider even for
/// plain-HTTP clients, so ring is installed first (as the relay's sinks do).
pub fn http() -> reqwest::ClientBuilder {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
}

pub fn unique(prefix: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}{}", &id[..12])
}

/// One test's schema, migrated, with a pool on it.
///
/// A passing test ends with [`TestDb::drop_schema`]. A test that fails (or
/// forgets to) is cleaned up when its `TestDb` is dropped: the schema, and the
/// replication slots and publications named after it, go even then, unless
/// `POSTBOX_TEST_KEEP` is set to keep them for inspection.
pub struct TestDb {
    pub pool: PgPool,
    pub schema: Schema,
    pub url: String,
    cleaned: bool,
}

impl TestDb {
    /// A new schema `t_<random>` with postbox's migrations applied.
    pub async fn new() -> TestDb {
        let db = Self::empty().await;
        let mut conn = db.pool.acquire().await.expect("acquire a connection");
        postbox::sqlx::migrate(&mut conn, &db.schema)
            .await
            .expect("migrate the test schema");
        db
    }

    /// A pool and a fresh schema name, without migrating (the schema does not exist yet).
    pub async fn empty() -> TestDb {
        let url = database_url();
        let pool = pool(&url, 10).await;
        let schema = Schema::new(&unique("t_")).expect("valid schema name");
        TestDb {
            pool,
            schema,
            url,
            cleaned: false,
        }
    }

    /// Another pool on the same database (e.g. for a second relay).
    pub async fn another_pool(&self, size: u32) -> PgPool {
        pool(&self.url, size).await
    }

    /// `sql` with `{schema}` replaced by this test's schema.
    pub fn sql(&self, sql: &str) -> String {
        self.schema.render(sql)
    }

    /// Run statements (no parameters) in this test's schema.
    pub async fn exec(&self, sql: &str) {
        sqlx::raw_sql(trusted(&self.sql(sql)))
            .execute(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// A single i64 from a query (e.g. a count).
    pub async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(trusted(&self.sql(sql)))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Commit `events` in transactions of at most 1,000 (one batch insert
    /// each); returns their ids in order.
    pub async fn enqueue_events(&self, events: &[postbox::NewEvent]) -> Vec<uuid::Uuid> {
        let outbox = postbox::Outbox::new(self.schema.clone());
        let mut ids = Vec::with_capacity(events.len());
        for chunk in events.chunks(1000) {
            let mut tx = self.pool.begin().await.expect("begin");
            ids.extend(
                postbox::sqlx::enqueue_batch(&outbox, &mut tx, chunk)
                    .await
                    .expect("enqueue a batch"),
            );
            tx.commit().await.expect("commit");
        }
        ids
    }

    /// Drop the schema and the replication slots and publications named
    /// after it (`postbox_<schema>`, logical mode's default, and any name that
    /// begins with it); call at the end of a passing test.
    ///
    /// A slot still read (a relay's stream winding down) is waited for, up to
    /// [`CLOSE_PATIENCE`], then its reader is ended. Then the pool is closed.
    /// sqlx's `Pool::close` waits until every checked-out connection is back,
    /// so drop any `PoolConnection`, `Transaction` or `PgListener` taken from
    /// `db.pool` before calling this. A test that still holds one fails here
    /// (after [`CLOSE_PATIENCE`]) instead of hanging.
    pub async fn drop_schema(mut self) {
        self.cleaned = true;
        let slots = drop_slots(&self.pool, &slot_prefix(&self.schema), CLOSE_PATIENCE).await;
        let _ = sqlx::raw_sql(trusted(&self.sql("DROP SCHEMA IF EXISTS {schema} CASCADE")))
            .execute(&self.pool)
            .await;
        let roles = drop_roles(&self.pool, &self.schema).await;
        if let Err(e) = slots {
            panic!("drop_schema: could not drop the schema's replication slots: {e}");
        }
        if let Err(e) = roles {
            panic!("drop_schema: could not drop the roles named after the schema: {e}");
        }
        if tokio::time::timeout(CLOSE_PATIENCE, self.pool.close())
            .await
            .is_err()
        {
            panic!(
                "drop_schema: the pool did not close within {CLOSE_PATIENCE:?}: {} of its \
                 connections are still checked out; drop every connection, transaction and \
                 listener taken from db.pool before calling drop_schema",
                (self.pool.size() as usize).saturating_sub(self.pool.num_idle())
            );
        }
    }
}

impl Drop for TestDb {
    /// A test that failed, or never called [`TestDb::drop_schema`], still
    /// leaves nothing behind: on a connection of its own (the test's runtime
    /// may be unwinding), end the backends that hold locks in the schema or
    /// read its slots, then drop the slots, their publications and the schema.
    fn drop(&mut self) {
        if self.cleaned || std::env::var_os("POSTBOX_TEST_KEEP").is_some() {
            return;
        }
        let url = self.url.clone();
        let schema = self.schema.clone();
        let what = format!("schema {}", self.schema);
        aside(&what, async move { clean_up_after(&url, &schema).await });
    }
}

/// Drops a replication slot and the publication named like it when it goes
/// out of scope, passing or failing: for a test whose slot is not named
/// after its schema (which [`TestDb`] cleans up itself). A stream still
/// reading the slot is given a few seconds, then ended.
pub struct SlotGuard(pub String);

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let slot = self.0.clone();
        let what = format!("slot {slot}");
        aside(&what, async move {
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .connect_with(PgConnectOptions::from_str(&database_url())?)
                .await?;
            // The name is a test's own (`unique`): nothing else begins with it.
            drop_slots(&pool, &slot, Duration::from_secs(5)).await?;
            pool.close().await;
            Ok(())
        });
    }
}

/// Deletes a Redis key when it goes out of scope, passing or failing: for a
/// test that publishes into a key of its own (`unique`) and would otherwise
/// leave it behind when an assertion fails.
pub struct RedisKeyGuard(pub String);

impl Drop for RedisKeyGuard {
    fn drop(&mut self) {
        let key = self.0.clone();
        let what = format!("Redis key {key}");
        aside(&what, async move {
            let client = redis::Client::open(redis_url())
                .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
            let mut conn = client
                .get_multiplexed_async_connection()
                .await
                .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
            redis::cmd("DEL")
                .arg(&key)
                .query_async::<()>(&mut conn)
                .await
                .map_err(|e| sqlx::Error::Protocol(e.to_string()))
        });
    }
}

/// Run `cleanup` to its end on a thread and runtime of its own (a test's
/// runtime may be unwinding), within [`CLOSE_PATIENCE`]; say on stderr when
/// it could not.
fn aside<F>(what: &str, cleanup: F)
where
    F: Future<Output = Result<(), sqlx::Error>> + Send + 'static,
{
    let outcome = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        runtime.block_on(async {
            match tokio::time::timeout(CLOSE_PATIENCE, cleanup).await {
                Ok(done) => done.map_err(|e| e.to_string()),
                Err(_) => Err(format!("not done within {CLOSE_PATIENCE:?}")),
            }
        })
    })
    .join();
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => eprintln!("testkit: could not clean up {what}: {e}"),
        Err(_) => eprintln!("testkit: cleaning up {what} panicked"),
    }
}

/// The prefix of the replication slots (and publications) named after `schema`.
fn slot_prefix(schema: &Schema) -> String {
    format!("postbox_{}", schema.name())
}

/// Drop every replication slot whose name begins with `prefix`, and the
/// publications named like them (or beginning with `prefix`). A slot in use
/// is waited for up to `patience`, then its reader is terminated; a slot
/// still there 5 s after that is an error.
async fn drop_slots<'c, E>(executor: E, prefix: &str, patience: Duration) -> Result<(), sqlx::Error>
where
    E: sqlx::Executor<'c, Database = sqlx::Postgres> + Copy,
{
    let deadline = Instant::now() + patience;
    loop {
        let slots: Vec<(String, Option<i32>)> = sqlx::query_as(
            "SELECT slot_name::text, active_pid FROM pg_replication_slots \
             WHERE starts_with(slot_name::text, $1)",
        )
        .bind(prefix)
        .fetch_all(executor)
        .await?;
        if slots.is_empty() {
            break;
        }
        if Instant::now() >= deadline + Duration::from_secs(5) {
            let names: Vec<&str> = slots.iter().map(|(name, _)| name.as_str()).collect();
            return Err(sqlx::Error::Protocol(format!(
                "replication slots {names:?} could not be dropped"
            )));
        }
        for (slot, reader) in slots {
            match reader {
                None => {
                    // Taken again in between: the next round sees it.
                    let _ = sqlx::query("SELECT pg_drop_replication_slot($1)")
                        .bind(&slot)
                        .execute(executor)
                        .await;
                }
                Some(pid) if Instant::now() >= deadline => {
                    sqlx::query("SELECT pg_terminate_backend($1)")
                        .bind(pid)
                        .execute(executor)
                        .await?;
                }
                Some(_) => {}
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let publications: Vec<String> = sqlx::query_scalar(
        "SELECT pubname::text FROM pg_publication WHERE starts_with(pubname::text, $1)",
    )
    .bind(prefix)
    .fetch_all(executor)
    .await?;
    for publication in publications {
        let drop = format!(
            "DROP PUBLICATION IF EXISTS \"{}\"",
            publication.replace('"', "\"\"")
        );
        sqlx::raw_sql(trusted(&drop)).execute(executor).await?;
    }
    Ok(())
}

/// A failed test's cleanup, on a connection of its own: end the backends
/// holding locks on the schema's relations (the test's own, left mid-way), then
/// drop the schema, and its slots (their readers ended at once) and their
/// publications.
async fn clean_up_after(url: &str, schema: &Schema) -> Result<(), sqlx::Error> {
    let options = PgConnectOptions::from_str(url)?;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await?;
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM (SELECT DISTINCT l.pid FROM pg_locks l \
         JOIN pg_class c ON c.oid = l.relation JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 AND l.pid <> pg_backend_pid()) holders",
    )
    .bind(schema.name())
    .execute(&pool)
    .await?;
    // The schema first: a relay of the test still running cannot take its
    // slot again without it, and a slot that will not go keeps no schema.
    let schema_dropped = sqlx::raw_sql(trusted(
        &schema.render("DROP SCHEMA IF EXISTS {schema} CASCADE"),
    ))
    .execute(&pool)
    .await;
    let slots_dropped = drop_slots(&pool, &slot_prefix(schema), Duration::ZERO).await;
    let roles_dropped = drop_roles(&pool, schema).await;
    pool.close().await;
    schema_dropped?;
    slots_dropped?;
    roles_dropped
}

/// Drops the roles named after `schema` (`<schema>_relay` and the others
/// of `postbox migrate --create-roles`, a test's own `<schema>_…` logins):
/// roles belong to the cluster, so dropping the schema takes none of them.
/// The schema's name is a test's own (`unique`): no other role begins with it.
async fn drop_roles(pool: &PgPool, schema: &Schema) -> Result<(), sqlx::Error> {
    let roles: Vec<String> = sqlx::query_scalar(
        "SELECT rolname::text FROM pg_roles WHERE starts_with(rolname::text, $1)",
    )
    .bind(format!("{}_", schema.name()))
    .fetch_all(pool)
    .await?;
    for role in roles {
        let role = role.replace('"', "\"\"");
        sqlx::raw_sql(trusted(&format!(
            "DROP OWNED BY \"{role}\"; DROP ROLE IF EXISTS \"{role}\""
        )))
        .execute(pool)
        .await?;
    }
    Ok(())
}

/// How long [`TestDb::drop_schema`] waits for the pool to close: returning and
/// closing connections takes milliseconds, so running out of it means a
/// connection is still held.
pub const CLOSE_PATIENCE: Duration = Duration::from_secs(30);

async fn pool(url: &str, size: u32) -> PgPool {
    let options =
        PgConnectOptions::from_str(url).expect("POSTBOX_TEST_DATABASE_URL is a valid URL");
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .expect("connect to the test database (is PostgreSQL running? see DEVELOPERS.md)")
}

/// Poll `condition` every few milliseconds until it returns true; panic with
/// `what` if it still has not after `timeout`.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(5);
    loop {
        if condition().await {
            return;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// A Redis connection for assertions (replies may take seconds on a loaded
/// machine; redis' default response timeout is 500 ms).
pub async fn redis() -> redis::aio::MultiplexedConnection {
    let config = redis::AsyncConnectionConfig::new()
        .set_response_timeout(Some(std::time::Duration::from_secs(30)));
    redis::Client::open(redis_url())
        .expect("valid Redis URL")
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .expect("connect to Redis (is it running? see DEVELOPERS.md)")
}

/// Property-test settings shared by the suites: `cases` cases (or
/// `PROPTEST_CASES` to run longer), and no regression files written into the
/// source tree (a failure prints its shrunk input instead).
pub fn proptest_config(cases: u32) -> proptest::test_runner::Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(cases);
    proptest::test_runner::Config {
        cases,
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    }
}

/// Serve `app` on `listener` (with `TCP_NODELAY`) until the returned sender is
/// dropped or fired: the HTTP servers tests start (receivers, the QStash
/// stand-in) all run this way.
pub fn serve_http(
    listener: tokio::net::TcpListener,
    app: axum::Router,
) -> tokio::sync::oneshot::Sender<()> {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        use axum::serve::ListenerExt;
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .await;
    });
    stop
}

//! `postbox bench --only tenants`: one `postbox relay --databases --schemas`
//! process serving many outboxes — `tenant_schemas` schemas in one database
//! plus `tenant_databases` databases of one schema each — measured for:
//!
//! - RSS of the relay, the connections it holds and its CPU while idle;
//! - commit-to-Redis latency of single events committed in other tenants
//!   while one tenant drains a `tenant_backlog`-event backlog;
//! - the drain rate of `tenant_drain_events` spread over 100 outboxes
//!   against the same number drained from one outbox by a single relay.
//!
//! It creates its own databases (`postbox_bench_tn_…`) and drops them.
//!
//! The relay serving many outboxes publishes to one list per event type
//! (`KEY:{event_type}`), so the single events are read from a list of their
//! own as they arrive, not from behind the backlog in a shared list (which
//! would measure how fast the benchmark reads that list, not the relay).

use super::latency::Arrivals;
use super::report::{percentile, round2};
use super::store::BenchStore;
use super::{redis_target, Bench, RELAY_GRACE};
use crate::supervisor::run_together;
use crate::{catalog, AnyError};
use futures::StreamExt;
use postbox::statements::trusted;
use postbox::{NewEvent, Outbox, Schema};
use postbox_store::connect as db;
use serde::Serialize;
use sqlx::PgPool;
use std::collections::HashMap;
use std::time::{Duration, Instant};

const PREFIX: &str = "postbox_bench_tn";
/// How long the relay sits idle before and while its idle cost is measured.
const SETTLE: Duration = Duration::from_secs(15);
const IDLE_WINDOW: Duration = Duration::from_secs(10);
/// Events committed in quiet tenants while the backlog drains, one every…
const PROBE_EVERY: Duration = Duration::from_millis(20);
/// How often the probe loop checks whether the backlog is drained.
const PENDING_EVERY: Duration = Duration::from_secs(1);
/// The drain comparison spreads its events over this many outboxes.
const DRAIN_OUTBOXES: usize = 100;

/// What the many-outboxes run measured.
#[derive(Debug, Serialize)]
pub struct Tenants {
    pub schemas: usize,
    pub databases: usize,
    pub outboxes: usize,
    /// Seconds from the relay's start until every outbox had delivered an event.
    pub all_served_s: f64,
    pub idle_rss_mb: f64,
    pub peak_rss_mb: f64,
    /// Connections the relay held to the benchmark's databases while idle.
    pub idle_connections: i64,
    /// CPU of the idle relay, in % of one core.
    pub idle_cpu_percent: f64,
    pub backlog: i64,
    /// Events committed one at a time in other tenants while the backlog drained.
    pub probes: usize,
    pub probe_p50_ms: f64,
    pub probe_p99_ms: f64,
    pub probe_max_ms: f64,
    /// Whether the backlog was still draining when the last probe arrived.
    pub backlog_left_at_end: i64,
    pub drain_events: i64,
    pub one_outbox_events_per_s: f64,
    pub many_outboxes_events_per_s: f64,
    /// `many / one`: the target is ≥ 0.8.
    pub drain_ratio: f64,
}

struct Sql {
    create_database: String,
    drop_database: String,
    databases: String,
    connections: String,
}

fn sql() -> Sql {
    let mut file = catalog(
        "tenants_bench.sql",
        include_str!("../../sql/tenants_bench.sql"),
    );
    let s = Sql {
        create_database: file.take("create_database").to_owned(),
        drop_database: file.take("drop_database").to_owned(),
        databases: file.take("databases").to_owned(),
        connections: file.take("connections").to_owned(),
    };
    file.finish();
    s
}

fn tenant(i: usize) -> Schema {
    // Four digits: 'tenant_????' matches them all.
    Schema::new(&format!("tenant_{i:04}")).expect("a valid schema name")
}

impl Bench<'_> {
    pub(super) async fn tenants(&self) -> Result<Tenants, AnyError> {
        let options = self.options;
        let (schemas, databases) = (options.tenant_schemas.max(1), options.tenant_databases);
        let (redis_url, key) = redis_target(&self.sink)
            .ok_or("tenants needs a Redis list sink with a fixed key (…?key=NAME)")?;
        let sql = sql();
        let base = db::options(Some(self.url), "postbox-bench")?;
        self.drop_tenant_databases(&sql).await?;
        let main = format!("{PREFIX}_main");
        let mut names = vec![main.clone()];
        names.extend((1..=databases).map(|i| format!("{PREFIX}_{i:02}")));
        crate::errln!("tenants: {schemas} schemas in one database and {databases} more databases…");
        for name in &names {
            sqlx::raw_sql(trusted(&sql.create_database.replace("{database}", name)))
                .execute(&self.pool)
                .await?;
        }
        let mut pools: HashMap<String, PgPool> = HashMap::new();
        for name in &names {
            let size = if name == &main { 4 } else { 1 };
            pools.insert(
                name.clone(),
                db::pool(base.clone().database(name), size, db::CONNECT_PATIENCE).await?,
            );
        }
        let result = self
            .tenants_on(&sql, &names, &pools, schemas, &redis_url, &key)
            .await;
        for pool in pools.into_values() {
            pool.close().await;
        }
        self.drop_tenant_databases(&sql).await?;
        super::clear_redis(&self.sink).await;
        clear_keys(&redis_url, &key).await;
        result
    }

    async fn drop_tenant_databases(&self, sql: &Sql) -> Result<(), AnyError> {
        let left: Vec<String> = sqlx::query_scalar(trusted(&sql.databases))
            .bind(format!("{PREFIX}\\_%"))
            .fetch_all(&self.pool)
            .await?;
        for name in left {
            sqlx::raw_sql(trusted(&sql.drop_database.replace("{database}", &name)))
                .execute(&self.pool)
                .await?;
        }
        Ok(())
    }

    async fn tenants_on(
        &self,
        sql: &Sql,
        names: &[String],
        pools: &HashMap<String, PgPool>,
        schemas: usize,
        redis_url: &str,
        key: &str,
    ) -> Result<Tenants, AnyError> {
        let options = self.options;
        let main = &names[0];
        // Every outbox: (database, schema).
        let mut outboxes: Vec<(String, Schema)> =
            (1..=schemas).map(|i| (main.clone(), tenant(i))).collect();
        outboxes.extend(names[1..].iter().map(|n| (n.clone(), tenant(1))));
        let started = Instant::now();
        let mut migrations = futures::stream::iter(outboxes.iter().map(|(db, schema)| {
            let pool = pools[db].clone();
            let schema = schema.clone();
            async move {
                let mut conn = pool.acquire().await?;
                postbox::sqlx::migrate(&mut conn, &schema).await?;
                Ok::<_, AnyError>(())
            }
        }))
        .buffer_unordered(4);
        while let Some(done) = migrations.next().await {
            done?;
        }
        drop(migrations);
        crate::errln!(
            "tenants: {} outboxes migrated in {:.0}s; starting one relay for all of them…",
            outboxes.len(),
            started.elapsed().as_secs_f64()
        );

        let arrivals = Arrivals::start(redis_url, type_key(key, "bench.hello")).await?;
        let main_url = url_for(self.url, main)?;
        let by_type = sink_by_type(&self.sink)?;
        let relay = self
            .relay()?
            .env("DATABASE_URL", &main_url)
            .args([
                "--databases",
                &format!("{PREFIX}_*"),
                "--schemas",
                "tenant_*",
                "--sink",
                &by_type,
                "--batch-size",
                &options.batch_size.to_string(),
            ])
            .spawn(None)?;
        let pid = relay.id();
        let result = async {
            // One event per outbox: all of them are found and served.
            let relay_started = Instant::now();
            for (db, schema) in &outboxes {
                enqueue_one(&pools[db], schema, "bench.hello", 0).await?;
            }
            arrivals.wait_for(outboxes.len(), Duration::from_secs(300)).await;
            if arrivals.len() < outboxes.len() {
                return Err(format!(
                    "tenants: only {} of {} outboxes delivered within 300 s",
                    arrivals.len(),
                    outboxes.len()
                )
                .into());
            }
            let all_served_s = relay_started.elapsed().as_secs_f64();
            arrivals.stop();

            crate::errln!("tenants: idle for {}s…", (SETTLE + IDLE_WINDOW).as_secs());
            tokio::time::sleep(SETTLE).await;
            let cpu_before = cpu_ticks(pid)?;
            tokio::time::sleep(IDLE_WINDOW).await;
            let cpu_after = cpu_ticks(pid)?;
            let idle_cpu_percent =
                (cpu_after - cpu_before) as f64 / crate::os::ticks_per_second() / IDLE_WINDOW.as_secs_f64() * 100.0;
            let idle_rss_mb = rss_mb(pid, "VmRSS:")?;
            let idle_connections: i64 = sqlx::query_scalar(trusted(&sql.connections))
                .bind(format!("{PREFIX}\\_%"))
                .bind(postbox_store::RELAY_APPLICATION_NAME)
                .fetch_one(&self.pool)
                .await?;

            // A backlog in one tenant; single events in others meanwhile.
            let backlog = options.tenant_backlog;
            crate::errln!("tenants: {backlog} events in one tenant, single events in the others…");
            let busy = BenchStore::new(pools[main].clone(), &tenant(1));
            let arrivals = Arrivals::start(redis_url, type_key(key, "bench.probe")).await?;
            busy.seed(backlog, 0).await?;
            let mut committed: HashMap<uuid::Uuid, Instant> = HashMap::new();
            let mut probed: HashMap<uuid::Uuid, String> = HashMap::new();
            let quiet: Vec<&(String, Schema)> = outboxes.iter().skip(1).collect();
            let mut i = 0;
            // Counting the backlog is a scan of the busy outbox: once a
            // second, not once per probe (it would load the database the
            // relay is measured on).
            let mut looked = Instant::now() - PENDING_EVERY;
            loop {
                if looked.elapsed() >= PENDING_EVERY {
                    looked = Instant::now();
                    if busy.pending().await? == 0 {
                        break;
                    }
                }
                if committed.len() >= 100_000 {
                    break;
                }
                let (db, schema) = quiet[i % quiet.len()];
                let id = enqueue_one(&pools[db], schema, "bench.probe", i).await?;
                committed.insert(id, Instant::now());
                probed.insert(id, format!("{db}/{schema}"));
                i += 1;
                tokio::time::sleep(PROBE_EVERY).await;
            }
            let backlog_left_at_end = busy.pending().await?;
            let until = Instant::now() + Duration::from_secs(60);
            while arrivals.count_of(&committed) < committed.len() && Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let arrived = arrivals.stop();
            let mut ms: Vec<f64> = arrived
                .iter()
                .filter_map(|(id, at)| {
                    committed
                        .get(id)
                        .map(|c| at.saturating_duration_since(*c).as_secs_f64() * 1000.0)
                })
                .collect();
            if ms.len() < committed.len() {
                let got: std::collections::HashSet<_> = arrived.iter().map(|(id, _)| *id).collect();
                let missing: Vec<&String> = probed
                    .iter()
                    .filter(|(id, _)| !got.contains(*id))
                    .map(|(_, o)| o)
                    .take(10)
                    .collect();
                return Err(format!(
                    "tenants: only {} of {} single events arrived within 60 s (missing from {missing:?})",
                    ms.len(),
                    committed.len()
                )
                .into());
            }
            ms.sort_by(f64::total_cmp);
            let peak_rss_mb = rss_mb(pid, "VmHWM:")?;
            Ok::<_, AnyError>(Tenants {
                schemas,
                databases: names.len() - 1,
                outboxes: outboxes.len(),
                all_served_s: round2(all_served_s),
                idle_rss_mb: round2(idle_rss_mb),
                peak_rss_mb: round2(peak_rss_mb),
                idle_connections,
                idle_cpu_percent: round2(idle_cpu_percent),
                backlog,
                probes: ms.len(),
                probe_p50_ms: round2(percentile(&ms, 0.50)),
                probe_p99_ms: round2(percentile(&ms, 0.99)),
                probe_max_ms: round2(ms.last().copied().unwrap_or_default()),
                backlog_left_at_end,
                drain_events: 0,
                one_outbox_events_per_s: 0.0,
                many_outboxes_events_per_s: 0.0,
                drain_ratio: 0.0,
            })
        }
        .await;
        let _ = relay.stop(RELAY_GRACE).await;
        clear_keys(redis_url, key).await;
        let mut report = result?;

        // The drain: one outbox through one relay, then the same number of
        // events over 100 outboxes through one multi-outbox relay.
        let events = options.tenant_drain_events;
        let per = (events / DRAIN_OUTBOXES as i64).max(1);
        let events = per * DRAIN_OUTBOXES as i64;
        crate::errln!("tenants: {events} events from one outbox…");
        let one = BenchStore::new(pools[main].clone(), &tenant(1));
        one.seed(events, 0).await?;
        let single = self
            .relay()?
            .env("DATABASE_URL", &main_url)
            .env("POSTBOX_SCHEMA", tenant(1).name())
            .args([
                "--drain",
                "--sink",
                &self.sink,
                "--batch-size",
                &options.batch_size.to_string(),
            ]);
        let one_run = run_together(&single, 1).await?;
        super::clear_redis(&self.sink).await;
        let drain_outboxes = DRAIN_OUTBOXES.min(schemas);
        let per = events / drain_outboxes as i64;
        let events_many = per * drain_outboxes as i64;
        crate::errln!("tenants: {events_many} events over {drain_outboxes} outboxes…");
        for i in 1..=drain_outboxes {
            BenchStore::new(pools[main].clone(), &tenant(i))
                .seed(per, 0)
                .await?;
        }
        let many = self.relay()?.env("DATABASE_URL", &main_url).args([
            "--schemas",
            "tenant_*",
            "--drain",
            "--sink",
            &self.sink,
            "--batch-size",
            &options.batch_size.to_string(),
        ]);
        let many_run = run_together(&many, 1).await?;
        super::clear_redis(&self.sink).await;
        let one_rate = events as f64 / one_run.elapsed.as_secs_f64();
        let many_rate = events_many as f64 / many_run.elapsed.as_secs_f64();
        report.drain_events = events;
        report.one_outbox_events_per_s = one_rate.round();
        report.many_outboxes_events_per_s = many_rate.round();
        report.drain_ratio = round2(many_rate / one_rate);
        report.peak_rss_mb = report.peak_rss_mb.max(round2(many_run.peak_rss_mb));
        Ok(report)
    }
}

/// The list events of `event_type` go to when the relay publishes to `sink_by_type`.
fn type_key(key: &str, event_type: &str) -> String {
    format!("{key}:{event_type}")
}

/// `sink` (a Redis list with a fixed `key`) publishing to one list per
/// event type instead: `key=KEY:{event_type}`.
fn sink_by_type(sink: &str) -> Result<String, AnyError> {
    let mut u = url::Url::parse(sink).map_err(|e| format!("--sink: {e}"))?;
    let pairs: Vec<(String, String)> = u
        .query_pairs()
        .map(|(k, v)| {
            let v = if k == "key" {
                type_key(&v, "{event_type}")
            } else {
                v.into_owned()
            };
            (k.into_owned(), v)
        })
        .collect();
    u.query_pairs_mut().clear().extend_pairs(pairs);
    Ok(u.to_string())
}

/// Delete the per-type lists the many-outbox relay filled.
async fn clear_keys(redis_url: &str, key: &str) {
    for event_type in ["bench.hello", "bench.probe", "order.created"] {
        let sink = format!("{redis_url}?mode=list&key={}", type_key(key, event_type));
        super::clear_redis(&sink).await;
    }
}

/// `url` pointing at `database` (credentials and parameters kept).
fn url_for(url: &str, database: &str) -> Result<String, AnyError> {
    let mut u = url::Url::parse(url).map_err(|e| format!("DATABASE_URL: {e}"))?;
    u.set_path(&format!("/{database}"));
    Ok(u.to_string())
}

/// Commit one event in its own transaction; its id.
async fn enqueue_one(
    pool: &PgPool,
    schema: &Schema,
    event_type: &str,
    i: usize,
) -> Result<uuid::Uuid, AnyError> {
    let event = NewEvent::new(
        event_type,
        "bench",
        i.to_string(),
        &serde_json::json!({"i": i}),
    )?;
    let mut tx = pool.begin().await?;
    let id = postbox::sqlx::enqueue(&Outbox::new(schema.clone()), &mut tx, &event).await?;
    tx.commit().await?;
    Ok(id)
}

/// User + system CPU time of process `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> Result<u64, AnyError> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which is in parentheses).
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 here.
    let field = |i: usize| -> Result<u64, AnyError> {
        Ok(fields
            .get(i)
            .ok_or("unexpected /proc/PID/stat")?
            .parse::<u64>()?)
    };
    Ok(field(11)? + field(12)?)
}

/// A `/proc/PID/status` memory line (`VmRSS:`, `VmHWM:`), in MB.
fn rss_mb(pid: u32, line: &str) -> Result<f64, AnyError> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix(line))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .ok_or("no memory figure in /proc/PID/status")?;
    Ok(kb / 1024.0)
}

/// The run as `postbox bench` prints it.
pub(super) fn print(t: &Tenants) {
    crate::outln!();
    crate::outln!(
        "many outboxes, one relay ({} schemas in one database + {} databases = {} outboxes)",
        t.schemas,
        t.databases,
        t.outboxes
    );
    crate::outln!("  all outboxes served after  {:>8.1} s", t.all_served_s);
    crate::outln!(
        "  idle: RSS {:.1} MB, {} connections, CPU {:.2} % of a core   (peak RSS {:.1} MB)",
        t.idle_rss_mb,
        t.idle_connections,
        t.idle_cpu_percent,
        t.peak_rss_mb
    );
    crate::outln!(
        "  other tenants during a {}-event backlog: {} events, p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} left in the backlog at the end)",
        t.backlog,
        t.probes,
        t.probe_p50_ms,
        t.probe_p99_ms,
        t.probe_max_ms,
        t.backlog_left_at_end
    );
    crate::outln!(
        "  drain of {} events: one outbox {:.0} events/s, 100 outboxes {:.0} events/s = {:.2} ×",
        t.drain_events,
        t.one_outbox_events_per_s,
        t.many_outboxes_events_per_s,
        t.drain_ratio
    );
}

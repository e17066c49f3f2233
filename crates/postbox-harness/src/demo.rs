//! `postbox demo`: the whole flow on an embedded default.
//!
//! A small shop commits orders and their `order.placed` events in one
//! transaction (and rolls some back), the relay delivers them at least once to
//! an in-process queue that sometimes duplicates messages and sometimes loses
//! the acknowledgement (forcing a real redelivery), and a billing consumer
//! applies each event exactly once through the inbox. The report proves it.
//!
//! It runs in any read mode (`--mode`): claim (the outbox table), log (the
//! producers' `enqueue` appends to the log) or logical (the producers `emit`
//! into the WAL; the relay reads a replication slot the demo creates before
//! anyone produces and drops at the end).

use crate::pgcluster::TempCluster;
use crate::progress::Progress;
use crate::{catalog, error_chain, lock, AnyError, Verdict};
use async_trait::async_trait;
use postbox::statements::trusted;
use postbox::{InboxOutcome, NewEvent, Outbox, Schema};
use postbox_relay::sink::{Message, Outcome, Sink, SinkError};
use postbox_relay::{ReadMode, Relay, RelayConfig, RunMode, StatsSnapshot};
use postbox_store::connect as db;
use postbox_store::{Lsn, ProducerTarget, StatusCounts, Store};
use rand::Rng;
use sqlx::{PgPool, Row};
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// What `postbox demo` runs.
#[derive(Clone, Debug)]
pub struct Options {
    /// Orders to attempt.
    pub orders: u64,
    /// Orders attempted per second (all producers together).
    pub rate: u64,
    /// Percent of order transactions rolled back.
    pub rollback_percent: u32,
    /// Percent of deliveries the queue duplicates, or whose acknowledgement it loses.
    pub duplicate_percent: u32,
    /// How the relay reads the events.
    pub mode: ReadMode,
}

/// Logical mode's replication slot. The demo creates it (after dropping one
/// an interrupted run left behind) and drops it at the end: a slot nobody
/// reads keeps the server's WAL.
const SLOT: &str = "postbox_demo";

/// How long the flow may stand still after the producers finish before the
/// demo reports what it has.
const STALL: Duration = Duration::from_secs(60);

const CONSUMER: &str = "billing";
const PRODUCERS: u64 = 4;

#[derive(Default)]
struct Counters {
    committed: AtomicU64,
    rolled_back: AtomicU64,
    deliveries: AtomicU64,
    duplicates: AtomicU64,
    applied: AtomicU64,
    ghost_deliveries: AtomicU64,
}

/// Run the demo on `database_url`, or on a throwaway cluster without one.
pub async fn run(database_url: Option<&str>, options: &Options) -> Result<Verdict, AnyError> {
    if options.rollback_percent > 100 || options.duplicate_percent > 100 {
        return Err("--rollback-percent and --duplicate-percent must be between 0 and 100".into());
    }
    if options.rate == 0 {
        return Err("--rate must be at least 1".into());
    }
    let (cluster, url, schema, shop) = match database_url {
        Some(url) => (
            None,
            url.to_owned(),
            Schema::new("postbox_demo")?,
            "postbox_demo_shop",
        ),
        None => {
            crate::outln!("No DATABASE_URL: starting a throwaway PostgreSQL cluster…");
            let cluster = TempCluster::start().await?;
            let url = cluster.url().to_owned();
            crate::outln!("  cluster up at {url}");
            (Some(cluster), url, Schema::default(), "shop")
        }
    };
    let result = run_on(&url, schema, shop, options).await;
    if let Some(c) = cluster {
        if let Err(e) = c.stop().await {
            tracing::warn!(error = %error_chain(&e), "stopping the throwaway cluster failed");
        }
    }
    result
}

async fn run_on(
    url: &str,
    schema: Schema,
    shop_name: &str,
    options: &Options,
) -> Result<Verdict, AnyError> {
    let options_db = db::options(Some(url), "postbox-demo")?;
    let pool = db::pool(options_db, 12, db::CONNECT_PATIENCE).await?;
    let shop = Arc::new(Shop::new(pool.clone(), &schema, shop_name, options.mode));
    shop.create().await?;
    crate::outln!(
        "  schema {schema} migrated; shop tables in {shop_name}; {}",
        match options.mode {
            ReadMode::Claim => "claim mode (the outbox table)",
            ReadMode::Log => "log mode (producers append to the log)",
            ReadMode::Logical => "logical mode (producers emit into the WAL; slot postbox_demo)",
        }
    );
    let result = run_shop(&pool, &schema, &shop, options).await;
    if options.mode == ReadMode::Logical {
        let logical = shop.store.logical();
        if let Err(e) =
            crate::slots::drop_slot_when_free(&logical, SLOT, crate::slots::SLOT_PATIENCE).await
        {
            tracing::warn!(error = %error_chain(&e), slot = SLOT, "could not drop the demo's replication slot: drop it with `postbox slot drop`");
        }
    }
    result
}

async fn run_shop(
    pool: &PgPool,
    schema: &Schema,
    shop: &Arc<Shop>,
    options: &Options,
) -> Result<Verdict, AnyError> {
    let counters = Arc::new(Counters::default());
    let rolled_back_ids = Arc::new(Mutex::new(HashSet::new()));
    let (queue_tx, queue_rx) = mpsc::channel::<Message>(1024);

    let relay = DemoRelay::start(pool, schema, queue_tx, options)?;
    let consumer = tokio::spawn(consume(
        shop.clone(),
        queue_rx,
        counters.clone(),
        rolled_back_ids.clone(),
    ));
    let started = Instant::now();
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            tokio::spawn(produce(
                shop.clone(),
                p,
                options.clone(),
                counters.clone(),
                rolled_back_ids.clone(),
            ))
        })
        .collect();

    let store = &shop.store;
    let mut ticker = tokio::time::interval(Duration::from_millis(500));
    let producing = futures::future::join_all(producers);
    tokio::pin!(producing);
    let mut line = Progress::new("  orders", Some(options.orders));
    let produced = loop {
        tokio::select! {
            done = &mut producing => break done,
            _ = ticker.tick() => progress(&mut line, &counters, relay.delivered()),
        }
    };
    for p in produced {
        p??;
    }
    // Wait until every committed order is invoiced, the relay has read every
    // event and the outbox holds none still to deliver; then stop the relay
    // and the consumer. A flow that stops moving for STALL is reported as it
    // stands (the report then says what is missing).
    let end = shop.end().await?;
    let mut moved = (Instant::now(), counters.applied.load(Ordering::Relaxed));
    while !shop.settled(end).await? {
        let applied = counters.applied.load(Ordering::Relaxed);
        if applied != moved.1 {
            moved = (Instant::now(), applied);
        } else if moved.0.elapsed() > STALL {
            crate::errln!(
                "postbox demo: nothing moved for {STALL:?}; reporting what was delivered"
            );
            break;
        }
        ticker.tick().await;
        progress(&mut line, &counters, relay.delivered());
    }
    let relay_stats = relay.stop().await?;
    consumer.await??;
    line.finish();
    crate::outln!("{}", tally(&counters, relay_stats.delivered));
    let elapsed = started.elapsed();

    let totals = shop.totals().await?;
    let counts = store.status_counts().await?;
    Ok(report(
        options.mode,
        options,
        &counters,
        &totals,
        &counts,
        &relay_stats,
        elapsed,
    ))
}

/// Print the report; whether its counts add up.
fn report(
    mode: ReadMode,
    options: &Options,
    c: &Counters,
    totals: &Totals,
    counts: &StatusCounts,
    relay_stats: &StatsSnapshot,
    elapsed: Duration,
) -> Verdict {
    let Totals {
        orders,
        invoices,
        missing,
    } = *totals;
    let committed = c.committed.load(Ordering::Relaxed);
    let ghost = c.ghost_deliveries.load(Ordering::Relaxed);
    crate::outln!();
    crate::outln!("postbox demo: report ({:.1} s)", elapsed.as_secs_f64());
    crate::outln!("  orders attempted                {}", options.orders);
    crate::outln!("  committed with their event      {committed}");
    crate::outln!(
        "  rolled back                     {}",
        c.rolled_back.load(Ordering::Relaxed)
    );
    // In claim mode every event passes through the outbox; in the others
    // only those retried do, so the relay's own count says what it sent.
    let sent = match mode {
        ReadMode::Claim => counts.sent,
        ReadMode::Log | ReadMode::Logical => relay_stats.delivered as i64,
    };
    crate::outln!("  events sent by the relay        {sent}");
    crate::outln!(
        "  deliveries to the consumer      {}",
        c.deliveries.load(Ordering::Relaxed)
    );
    crate::outln!(
        "  duplicates absorbed by inbox    {}",
        c.duplicates.load(Ordering::Relaxed)
    );
    crate::outln!("  redeliveries after a lost ack   {}", relay_stats.retried);
    crate::outln!(
        "  invoices (effects applied)      {invoices} for {orders} orders, {missing} missing"
    );
    crate::outln!("  rolled-back events delivered    {ghost}");
    let ok = ghost == 0
        && missing == 0
        && invoices == orders
        && orders as u64 == committed
        && counts.failed == 0;
    if ok {
        crate::outln!("OK: every committed event delivered at least once, applied exactly once; no rolled-back event delivered.");
        Verdict::Pass
    } else {
        crate::outln!("VIOLATION: the counts above do not add up.");
        Verdict::Fail
    }
}

/// The progress line (on a terminal only): orders attempted so far, and the tally.
fn progress(line: &mut Progress, c: &Counters, sent: u64) {
    let attempted = c.committed.load(Ordering::Relaxed) + c.rolled_back.load(Ordering::Relaxed);
    line.update_with(attempted, tally(c, sent).trim());
}

/// Where the flow stands: committed, rolled back, sent, delivered, duplicates, applied.
fn tally(c: &Counters, sent: u64) -> String {
    format!(
        "  committed {:>6}  rolled back {:>5}  sent {:>6}  delivered {:>6}  duplicates {:>5}  applied {:>6}",
        c.committed.load(Ordering::Relaxed),
        c.rolled_back.load(Ordering::Relaxed),
        sent,
        c.deliveries.load(Ordering::Relaxed),
        c.duplicates.load(Ordering::Relaxed),
        c.applied.load(Ordering::Relaxed),
    )
}

/// The in-process relay, delivering into the demo's queue.
struct DemoRelay {
    stats: Arc<postbox_relay::Stats>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<StatsSnapshot>,
}

impl DemoRelay {
    fn start(
        pool: &PgPool,
        schema: &Schema,
        queue: mpsc::Sender<Message>,
        options: &Options,
    ) -> Result<Self, AnyError> {
        let sink = Arc::new(FlakyQueue {
            queue,
            duplicate_percent: options.duplicate_percent,
        });
        let config = RelayConfig {
            batch_size: 100,
            poll_interval: Duration::from_millis(200),
            lease: Duration::from_secs(10),
            publish_timeout: Duration::from_secs(4),
            backoff_base: Duration::from_millis(20),
            backoff_max: Duration::from_millis(500),
            mode: options.mode,
            logical_slot: Some(SLOT.to_owned()),
            ..RelayConfig::default()
        };
        let relay = Relay::new(Store::new(pool.clone(), schema.clone()), sink, config)?;
        let stats = relay.stats();
        let stop = CancellationToken::new();
        let task = {
            let stop = stop.clone();
            tokio::spawn(async move { relay.run(RunMode::Forever, stop).await })
        };
        Ok(Self { stats, stop, task })
    }

    fn delivered(&self) -> u64 {
        self.stats.snapshot().delivered
    }

    async fn stop(self) -> Result<StatsSnapshot, tokio::task::JoinError> {
        self.stop.cancel();
        self.task.await
    }
}

/// The shop's tables and postbox's outbox, in one database.
struct Shop {
    pool: PgPool,
    schema: Schema,
    store: Store,
    mode: ReadMode,
    outbox: Outbox,
    reset: String,
    create_shop: String,
    place_order: String,
    invoice_order: String,
    totals: String,
}

/// What the report compares.
#[derive(Clone, Copy)]
struct Totals {
    orders: i64,
    invoices: i64,
    missing: i64,
}

impl Shop {
    fn new(pool: PgPool, schema: &Schema, shop: &str, mode: ReadMode) -> Self {
        let mut sql = catalog("demo.sql", include_str!("../sql/demo.sql"));
        let mut render = |name| sql.render_with(name, schema, &[("shop", shop)]);
        let shop = Self {
            store: Store::new(pool.clone(), schema.clone()),
            mode,
            pool,
            schema: schema.clone(),
            outbox: Outbox::new(schema.clone()),
            reset: render("reset"),
            create_shop: render("create_shop"),
            place_order: render("place_order"),
            invoice_order: render("invoice_order"),
            totals: render("totals"),
        };
        sql.finish();
        shop
    }

    /// A fresh postbox schema and shop tables.
    async fn create(&self) -> Result<(), AnyError> {
        sqlx::raw_sql(trusted(&self.reset))
            .execute(&self.pool)
            .await?;
        let mut conn = self.pool.acquire().await?;
        postbox::sqlx::migrate(&mut conn, &self.schema).await?;
        sqlx::raw_sql(trusted(&self.create_shop))
            .execute(&mut *conn)
            .await?;
        match self.mode {
            ReadMode::Claim => {}
            ReadMode::Log => {
                self.store
                    .log()
                    .set_producer_target(ProducerTarget::Log)
                    .await?
            }
            ReadMode::Logical => {
                // Before anyone emits: the slot decodes only what follows it.
                let logical = self.store.logical();
                crate::slots::drop_slot_when_free(&logical, SLOT, crate::slots::SLOT_PATIENCE)
                    .await?;
                logical.ensure_slot(&mut conn, SLOT).await?;
            }
        }
        Ok(())
    }

    /// Logical mode: the WAL position every emit committed so far is before.
    async fn end(&self) -> Result<Option<Lsn>, sqlx::Error> {
        if self.mode != ReadMode::Logical {
            return Ok(None);
        }
        let mut conn = self.pool.acquire().await?;
        Ok(Some(self.store.logical().flush_lsn(&mut conn).await?))
    }

    /// Whether every order is invoiced, the relay has read every committed
    /// event (the log's cursors past them, or the slot confirmed past `end`)
    /// and the outbox holds none still to deliver.
    async fn settled(&self, end: Option<Lsn>) -> Result<bool, sqlx::Error> {
        let c = self.store.status_counts().await?;
        if c.pending != 0 || c.processing != 0 || self.totals().await?.missing != 0 {
            return Ok(false);
        }
        Ok(match (self.mode, end) {
            (ReadMode::Log, _) => self.store.log().unread().await? == 0,
            (ReadMode::Logical, Some(end)) => {
                let mut conn = self.pool.acquire().await?;
                self.store
                    .logical()
                    .confirmed(&mut conn, SLOT)
                    .await?
                    .is_some_and(|at| at >= end)
            }
            _ => true,
        })
    }

    async fn totals(&self) -> Result<Totals, sqlx::Error> {
        let row = sqlx::query(trusted(&self.totals))
            .fetch_one(&self.pool)
            .await?;
        Ok(Totals {
            orders: row.try_get("orders")?,
            invoices: row.try_get("invoices")?,
            missing: row.try_get("missing")?,
        })
    }
}

async fn produce(
    shop: Arc<Shop>,
    producer: u64,
    options: Options,
    counters: Arc<Counters>,
    rolled_back: Arc<Mutex<HashSet<Uuid>>>,
) -> Result<(), AnyError> {
    let mut pace = tokio::time::interval(Duration::from_secs_f64(
        PRODUCERS as f64 / options.rate as f64,
    ));
    let mut order_id = producer + 1;
    while order_id <= options.orders {
        pace.tick().await;
        let (customer, total, roll_back) = {
            let mut rng = rand::rng();
            (
                format!("customer-{}", rng.random_range(1..=200)),
                rng.random_range(100..100_000_i64),
                rng.random_range(0..100) < options.rollback_percent,
            )
        };
        let event = NewEvent::new(
            "order.placed",
            "order",
            order_id.to_string(),
            &serde_json::json!({"order_id": order_id, "customer": customer, "total_cents": total}),
        )?;
        let mut tx = shop.pool.begin().await?;
        sqlx::query(trusted(&shop.place_order))
            .bind(order_id as i64)
            .bind(&customer)
            .bind(total)
            .execute(&mut *tx)
            .await?;
        let event_id = if shop.mode == ReadMode::Logical {
            postbox::sqlx::emit(&shop.outbox, &mut tx, &event).await?
        } else {
            postbox::sqlx::enqueue(&shop.outbox, &mut tx, &event).await?
        };
        if roll_back {
            // Remember the id before rolling back, so a delivery of it would be caught.
            lock(&rolled_back).insert(event_id);
            tx.rollback().await?;
            counters.rolled_back.fetch_add(1, Ordering::Relaxed);
        } else {
            tx.commit().await?;
            counters.committed.fetch_add(1, Ordering::Relaxed);
        }
        order_id += PRODUCERS;
    }
    Ok(())
}

async fn consume(
    shop: Arc<Shop>,
    mut queue: mpsc::Receiver<Message>,
    counters: Arc<Counters>,
    rolled_back: Arc<Mutex<HashSet<Uuid>>>,
) -> Result<(), AnyError> {
    while let Some(m) = queue.recv().await {
        counters.deliveries.fetch_add(1, Ordering::Relaxed);
        if lock(&rolled_back).contains(&m.event_id) {
            counters.ghost_deliveries.fetch_add(1, Ordering::Relaxed);
        }
        let order_id: i64 = m.aggregate_id.parse()?;
        let mut tx = shop.pool.begin().await?;
        match postbox::sqlx::record_inbox(&shop.outbox, &mut tx, CONSUMER, m.event_id).await? {
            InboxOutcome::New => {
                sqlx::query(trusted(&shop.invoice_order))
                    .bind(order_id)
                    .bind(m.event_id)
                    .execute(&mut *tx)
                    .await?;
                counters.applied.fetch_add(1, Ordering::Relaxed);
            }
            InboxOutcome::Duplicate => {
                counters.duplicates.fetch_add(1, Ordering::Relaxed);
            }
        }
        tx.commit().await?;
    }
    Ok(())
}

/// An in-process queue with the flaws of a real one: it sometimes delivers a
/// message twice, and sometimes accepts a message but loses the acknowledgement
/// (the relay then delivers it again, with the same event id).
struct FlakyQueue {
    queue: mpsc::Sender<Message>,
    duplicate_percent: u32,
}

#[async_trait]
impl Sink for FlakyQueue {
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        let mut outcomes = Vec::with_capacity(batch.len());
        for m in batch {
            let (duplicate, lose_ack) = {
                let mut rng = rand::rng();
                (
                    rng.random_range(0..200) < self.duplicate_percent,
                    rng.random_range(0..200) < self.duplicate_percent,
                )
            };
            let copies = if duplicate { 2 } else { 1 };
            let mut sent = true;
            for _ in 0..copies {
                sent &= self.queue.send(m.clone()).await.is_ok();
            }
            outcomes.push(if !sent {
                Outcome::retry("demo queue closed")
            } else if lose_ack {
                Outcome::retry("acknowledgement lost (simulated)")
            } else {
                Outcome::Delivered
            });
        }
        outcomes
    }

    async fn check(&self) -> Result<(), SinkError> {
        Ok(())
    }

    fn describe(&self) -> String {
        "in-process demo queue".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_statement_is_in_demo_sql() {
        // Lazy: never connects. Shop::new takes every entry and finishes.
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .unwrap();
        let shop = Shop::new(pool, &Schema::default(), "shop", ReadMode::Claim);
        assert!(shop.place_order.contains("shop.orders"));
    }
}

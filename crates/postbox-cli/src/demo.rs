//! `postbox demo`: the whole flow on an embedded default.
//!
//! A small shop commits orders and their `order.placed` events in one
//! transaction (and rolls some back), the relay delivers them at least once to
//! an in-process queue that sometimes duplicates messages and sometimes loses
//! the acknowledgement (forcing a real redelivery), and a billing consumer
//! applies each event exactly once through the inbox. The report proves it.

use crate::commands::{AnyError, Settings};
use async_trait::async_trait;
use clap::Args;
use postbox::{InboxOutcome, NewEvent, Outbox, Schema};
use postbox_harness::pgcluster::TempCluster;
use postbox_relay::sink::{Message, Outcome, Sink, SinkError};
use postbox_relay::{Relay, RelayConfig, RunMode, Store};
use rand::Rng;
use sqlx::PgPool;
use std::collections::HashSet;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Orders to attempt
    #[arg(long, default_value_t = 3000)]
    pub orders: u64,
    /// Orders attempted per second (all producers together)
    #[arg(long, default_value_t = 1500)]
    pub rate: u64,
    /// Percent of order transactions rolled back
    #[arg(long, default_value_t = 10)]
    pub rollback_percent: u32,
    /// Percent of deliveries the queue duplicates, or whose acknowledgement it loses
    #[arg(long, default_value_t = 5)]
    pub duplicate_percent: u32,
}

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

pub async fn run(settings: &Settings, args: DemoArgs) -> Result<ExitCode, AnyError> {
    if args.rollback_percent > 100 || args.duplicate_percent > 100 {
        return Err("--rollback-percent and --duplicate-percent must be between 0 and 100".into());
    }
    if args.rate == 0 {
        return Err("--rate must be at least 1".into());
    }
    let (cluster, url, schema, shop) = match &settings.database_url {
        Some(url) => (
            None,
            url.clone(),
            Schema::new("postbox_demo")?,
            "postbox_demo_shop",
        ),
        None => {
            println!("No DATABASE_URL: starting a throwaway PostgreSQL cluster…");
            let cluster = TempCluster::start().await?;
            let url = cluster.url().to_owned();
            println!("  cluster up at {url}");
            (Some(cluster), url, Schema::default(), "shop")
        }
    };
    let result = run_on(&url, schema, shop, &args).await;
    if let Some(c) = cluster {
        if let Err(e) = c.stop().await {
            tracing::warn!(error = %crate::report(&e), "stopping the throwaway cluster failed");
        }
    }
    result
}

async fn run_on(
    url: &str,
    schema: Schema,
    shop: &str,
    args: &DemoArgs,
) -> Result<ExitCode, AnyError> {
    let options = crate::db::options(Some(url), "postbox-demo")?;
    let pool = crate::db::pool(options, 12, Duration::from_secs(15)).await?;
    prepare(&pool, &schema, shop).await?;
    println!("  schema {schema} migrated; shop tables in {shop}");

    let counters = Arc::new(Counters::default());
    let rolled_back_ids = Arc::new(Mutex::new(HashSet::new()));
    let (queue_tx, queue_rx) = mpsc::channel::<Message>(1024);

    // The relay, delivering into the in-process queue.
    let sink = Arc::new(FlakyQueue {
        queue: queue_tx,
        duplicate_percent: args.duplicate_percent,
    });
    let config = RelayConfig {
        batch_size: 100,
        poll_interval: Duration::from_millis(200),
        lease: Duration::from_secs(10),
        publish_timeout: Duration::from_secs(4),
        backoff_base: Duration::from_millis(20),
        backoff_max: Duration::from_millis(500),
        ..RelayConfig::default()
    };
    let relay = Relay::new(Store::new(pool.clone(), schema.clone()), sink, config)?;
    let relay_stats = relay.stats();
    let stop_relay = CancellationToken::new();
    let relay_task = {
        let stop = stop_relay.clone();
        tokio::spawn(async move { relay.run(RunMode::Forever, stop).await })
    };

    // The billing consumer.
    let consumer = tokio::spawn(consume(
        pool.clone(),
        Outbox::new(schema.clone()),
        shop.to_owned(),
        queue_rx,
        counters.clone(),
        rolled_back_ids.clone(),
    ));

    // The shop.
    let started = Instant::now();
    let mut producers = Vec::new();
    for p in 0..PRODUCERS {
        producers.push(tokio::spawn(produce(
            pool.clone(),
            Outbox::new(schema.clone()),
            shop.to_owned(),
            p,
            args.orders,
            args.rate,
            args.rollback_percent,
            counters.clone(),
            rolled_back_ids.clone(),
        )));
    }
    let producing = futures::future::join_all(producers);
    tokio::pin!(producing);
    let mut ticker = tokio::time::interval(Duration::from_millis(500));
    let produced = loop {
        tokio::select! {
            done = &mut producing => break done,
            _ = ticker.tick() => progress(&counters, relay_stats.snapshot().delivered),
        }
    };
    for p in produced {
        p??;
    }

    // Wait for the outbox to empty, then stop the relay and the consumer.
    let store = Store::new(pool.clone(), schema.clone());
    loop {
        let c = store.status_counts().await?;
        if c.pending == 0 && c.processing == 0 {
            break;
        }
        ticker.tick().await;
        progress(&counters, relay_stats.snapshot().delivered);
    }
    stop_relay.cancel();
    let relay_stats = relay_task.await?;
    consumer.await??;
    progress(&counters, relay_stats.delivered);
    let elapsed = started.elapsed();

    let (orders, invoices, missing): (i64, i64, i64) = sqlx::query_as(&format!(
        "SELECT (SELECT count(*) FROM {shop}.orders), (SELECT count(*) FROM {shop}.invoices), \
                (SELECT count(*) FROM {shop}.orders o WHERE NOT EXISTS \
                   (SELECT 1 FROM {shop}.invoices i WHERE i.order_id = o.id))"
    ))
    .fetch_one(&pool)
    .await?;
    let counts = store.status_counts().await?;
    let c = &counters;
    let committed = c.committed.load(Ordering::Relaxed);
    let ghost = c.ghost_deliveries.load(Ordering::Relaxed);
    println!();
    println!("postbox demo: report ({:.1} s)", elapsed.as_secs_f64());
    println!("  orders attempted                {}", args.orders);
    println!("  committed with their event      {committed}");
    println!(
        "  rolled back                     {}",
        c.rolled_back.load(Ordering::Relaxed)
    );
    println!("  events sent by the relay        {}", counts.sent);
    println!(
        "  deliveries to the consumer      {}",
        c.deliveries.load(Ordering::Relaxed)
    );
    println!(
        "  duplicates absorbed by inbox    {}",
        c.duplicates.load(Ordering::Relaxed)
    );
    println!("  redeliveries after a lost ack   {}", relay_stats.retried);
    println!("  invoices (effects applied)      {invoices} for {orders} orders, {missing} missing");
    println!("  rolled-back events delivered    {ghost}");
    let ok = ghost == 0
        && missing == 0
        && invoices == orders
        && orders as u64 == committed
        && counts.failed == 0;
    if ok {
        println!("OK: every committed event delivered at least once, applied exactly once; no rolled-back event delivered.");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("VIOLATION: the counts above do not add up.");
        Ok(ExitCode::FAILURE)
    }
}

fn progress(c: &Counters, sent: u64) {
    println!(
        "  committed {:>6}  rolled back {:>5}  sent {:>6}  delivered {:>6}  duplicates {:>5}  applied {:>6}",
        c.committed.load(Ordering::Relaxed),
        c.rolled_back.load(Ordering::Relaxed),
        sent,
        c.deliveries.load(Ordering::Relaxed),
        c.duplicates.load(Ordering::Relaxed),
        c.applied.load(Ordering::Relaxed),
    );
}

async fn prepare(pool: &PgPool, schema: &Schema, shop: &str) -> Result<(), AnyError> {
    // Only the demo's own schemas are reset.
    sqlx::raw_sql(&format!(
        "DROP SCHEMA IF EXISTS {shop} CASCADE; DROP SCHEMA IF EXISTS {} CASCADE",
        schema.quoted()
    ))
    .execute(pool)
    .await?;
    let mut conn = pool.acquire().await?;
    postbox::sqlx::migrate(&mut conn, schema).await?;
    sqlx::raw_sql(&format!(
        "CREATE SCHEMA {shop};
         CREATE TABLE {shop}.orders (id bigint PRIMARY KEY, customer text NOT NULL,
             total_cents bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE {shop}.invoices (order_id bigint PRIMARY KEY REFERENCES {shop}.orders,
             event_id uuid NOT NULL, created_at timestamptz NOT NULL DEFAULT now());"
    ))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn produce(
    pool: PgPool,
    outbox: Outbox,
    shop: String,
    producer: u64,
    orders: u64,
    rate: u64,
    rollback_percent: u32,
    counters: Arc<Counters>,
    rolled_back: Arc<Mutex<HashSet<Uuid>>>,
) -> Result<(), AnyError> {
    let insert =
        format!("INSERT INTO {shop}.orders (id, customer, total_cents) VALUES ($1, $2, $3)");
    let mut pace = tokio::time::interval(Duration::from_secs_f64(PRODUCERS as f64 / rate as f64));
    let mut order_id = producer + 1;
    while order_id <= orders {
        pace.tick().await;
        let (customer, total, roll_back) = {
            let mut rng = rand::rng();
            (
                format!("customer-{}", rng.random_range(1..=200)),
                rng.random_range(100..100_000_i64),
                rng.random_range(0..100) < rollback_percent,
            )
        };
        let event = NewEvent::new(
            "order.placed",
            "order",
            order_id.to_string(),
            &serde_json::json!({"order_id": order_id, "customer": customer, "total_cents": total}),
        )?;
        let mut tx = pool.begin().await?;
        sqlx::query(&insert)
            .bind(order_id as i64)
            .bind(&customer)
            .bind(total)
            .execute(&mut *tx)
            .await?;
        let event_id = postbox::sqlx::enqueue(&outbox, &mut tx, &event).await?;
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

async fn consume(
    pool: PgPool,
    outbox: Outbox,
    shop: String,
    mut queue: mpsc::Receiver<Message>,
    counters: Arc<Counters>,
    rolled_back: Arc<Mutex<HashSet<Uuid>>>,
) -> Result<(), AnyError> {
    let insert = format!("INSERT INTO {shop}.invoices (order_id, event_id) VALUES ($1, $2)");
    while let Some(m) = queue.recv().await {
        counters.deliveries.fetch_add(1, Ordering::Relaxed);
        if lock(&rolled_back).contains(&m.event_id) {
            counters.ghost_deliveries.fetch_add(1, Ordering::Relaxed);
        }
        let order_id: i64 = m.aggregate_id.parse()?;
        let mut tx = pool.begin().await?;
        match postbox::sqlx::record_inbox(&outbox, &mut tx, CONSUMER, m.event_id).await? {
            InboxOutcome::New => {
                sqlx::query(&insert)
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

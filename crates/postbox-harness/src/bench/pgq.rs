//! The PgQ peer (`postbox bench --peers pgq`): PgQ, the queue whose design
//! log mode follows (events appended to rotating tables, read in batches
//! bounded by transaction snapshots), fed the drain's events and drained by
//! its canonical consumer loop — `next_batch`, `get_batch_events`, publish,
//! `finish_batch`, one transaction per batch — through the same sink the
//! relay uses, in this process. Its statements are `sql/pgq.sql`.
//!
//! It runs when the server can create the `pgq` extension (Debian:
//! `postgresql-15-pgq3`); the extension is dropped afterwards when the bench
//! created it.

use crate::AnyError;
use postbox::statements::trusted;
use postbox_relay::{Message, Outcome, Sink};
use serde_json::value::RawValue;
use sqlx::PgPool;
use std::time::{Duration, Instant};

/// The consumer's name in the queue.
const CONSUMER: &str = "postbox_bench";

/// PgQ on the benchmark's database: one queue and its consumer.
pub struct PgqPeer {
    pool: PgPool,
    queue: String,
    created_extension: bool,
    /// The extension's roles that did not exist before the bench created it.
    created_roles: Vec<&'static str>,
    sql: Statements,
}

/// The roles creating the `pgq` extension makes when they do not exist.
const PGQ_ROLES: [&str; 3] = ["pgq_reader", "pgq_writer", "pgq_admin"];

struct Statements {
    create_extension: String,
    drop_extension: String,
    /// `DROP ROLE` of each of [`PGQ_ROLES`], in that order.
    drop_roles: [String; 3],
    drop_queue: String,
    create_queue: String,
    register_consumer: String,
    tick_every_event: String,
    insert_events: String,
    ticker: String,
    next_batch: String,
    batch_events: String,
    finish_batch: String,
}

impl Statements {
    /// `sql/pgq.sql`: the availability check and the rest.
    fn from_file() -> (String, Self) {
        let mut sql = crate::catalog("pgq.sql", include_str!("../../sql/pgq.sql"));
        let available = sql.take("available").to_owned();
        let statements = Statements {
            create_extension: sql.take("create_extension").to_owned(),
            drop_extension: sql.take("drop_extension").to_owned(),
            drop_roles: PGQ_ROLES.map(|role| sql.take(&format!("drop_role_{role}")).to_owned()),
            drop_queue: sql.take("drop_queue").to_owned(),
            create_queue: sql.take("create_queue").to_owned(),
            register_consumer: sql.take("register_consumer").to_owned(),
            tick_every_event: sql.take("tick_every_event").to_owned(),
            insert_events: sql.take("insert_events").to_owned(),
            ticker: sql.take("ticker").to_owned(),
            next_batch: sql.take("next_batch").to_owned(),
            batch_events: sql.take("batch_events").to_owned(),
            finish_batch: sql.take("finish_batch").to_owned(),
        };
        sql.finish();
        (available, statements)
    }
}

/// One drain by PgQ's consumer.
#[derive(Debug)]
pub struct PgqRun {
    pub elapsed: Duration,
    /// CPU of this process over the drain (the consumer and the sink).
    pub consumer_cpu_s: f64,
    /// CPU of the server's processes, when it runs on this machine.
    pub postgres_cpu_s: Option<f64>,
}

impl PgqPeer {
    /// PgQ on the bench's database, or why it is skipped: the server has no
    /// `pgq` extension, or the bench's role may not create it (creating an
    /// extension takes a superuser, or a trusted extension).
    pub async fn open(pool: PgPool, queue: &str) -> Result<Result<Self, String>, AnyError> {
        let (available, statements) = Statements::from_file();
        let (available, installed, roles): (bool, bool, Vec<String>) =
            sqlx::query_as(trusted(&available)).fetch_one(&pool).await?;
        if !available {
            return Ok(Err(
                "the server has no pgq extension (Debian: apt-get install postgresql-15-pgq3)"
                    .to_owned(),
            ));
        }
        if !installed {
            let created = sqlx::raw_sql(trusted(&statements.create_extension))
                .execute(&pool)
                .await;
            if let Err(e) = created {
                return Ok(Err(format!(
                    "cannot create the pgq extension ({}); create it as a superuser first",
                    postbox::redact::sanitize_error(&e.to_string())
                )));
            }
        }
        Ok(Ok(Self {
            pool,
            queue: queue.to_owned(),
            created_extension: !installed,
            created_roles: if installed {
                Vec::new()
            } else {
                PGQ_ROLES
                    .into_iter()
                    .filter(|role| !roles.iter().any(|r| r == role))
                    .collect()
            },
            sql: statements,
        }))
    }

    /// A fresh queue holding events 1 to `n`, committed `per_tx` to a
    /// transaction with a tick after each, as producers and the ticker
    /// daemon would leave it: each batch is one transaction's events.
    pub async fn seed(&self, n: i64, per_tx: i64) -> Result<(), AnyError> {
        self.drop_queue().await?;
        self.run(&self.sql.create_queue, &[]).await?;
        // A tick whenever the queue holds a new event (default: 500), so
        // the last transaction's events are a batch however few they are.
        self.run(&self.sql.tick_every_event, &[]).await?;
        self.run(&self.sql.register_consumer, &[CONSUMER]).await?;
        let per_tx = per_tx.max(1);
        let mut first = 1;
        while first <= n {
            let last = (first + per_tx - 1).min(n);
            sqlx::query(trusted(&self.sql.insert_events))
                .bind(&self.queue)
                .bind(first)
                .bind(last)
                .execute(&self.pool)
                .await?;
            self.run(&self.sql.ticker, &[]).await?;
            first = last + 1;
        }
        Ok(())
    }

    /// Drain the queue's `n` events through `sink` with PgQ's consumer loop
    /// (without one: read and finish each batch, as a consumer of PgQ's
    /// API alone does).
    pub async fn drain(&self, sink: Option<&dyn Sink>, n: i64) -> Result<PgqRun, AnyError> {
        let cpu_before = crate::os::own_cpu_seconds();
        let postgres_before = super::cpu::postgres_seconds();
        let started = Instant::now();
        let mut done = 0_i64;
        while done < n {
            let mut tx = self.pool.begin().await?;
            let batch: Option<i64> = sqlx::query_scalar(trusted(&self.sql.next_batch))
                .bind(&self.queue)
                .bind(CONSUMER)
                .fetch_one(&mut *tx)
                .await?;
            let Some(batch) = batch else {
                return Err(format!("pgq: no batch left after {done} of {n} events").into());
            };
            let rows: Vec<EventRow> = sqlx::query_as(trusted(&self.sql.batch_events))
                .bind(batch)
                .fetch_all(&mut *tx)
                .await?;
            let messages = rows
                .into_iter()
                .map(EventRow::into_message)
                .collect::<Result<Vec<_>, _>>()?;
            if let Some(sink) = sink {
                for outcome in sink.publish(&messages).await {
                    if outcome != Outcome::Delivered {
                        return Err(
                            format!("pgq: the sink did not take an event: {outcome:?}").into()
                        );
                    }
                }
            }
            sqlx::query(trusted(&self.sql.finish_batch))
                .bind(batch)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            done += i64::try_from(messages.len())?;
        }
        let elapsed = started.elapsed();
        Ok(PgqRun {
            elapsed,
            consumer_cpu_s: crate::os::own_cpu_seconds() - cpu_before,
            postgres_cpu_s: super::cpu::postgres_seconds()
                .zip(postgres_before)
                .map(|(after, before)| after - before),
        })
    }

    /// Drop the queue, and the extension when the bench created it, with
    /// the roles it made.
    pub async fn close(self) -> Result<(), AnyError> {
        self.drop_queue().await?;
        if self.created_extension {
            sqlx::raw_sql(trusted(&self.sql.drop_extension))
                .execute(&self.pool)
                .await?;
            for (role, drop) in PGQ_ROLES.iter().zip(&self.sql.drop_roles) {
                if self.created_roles.contains(role) {
                    sqlx::raw_sql(trusted(drop)).execute(&self.pool).await?;
                }
            }
        }
        Ok(())
    }

    async fn drop_queue(&self) -> Result<(), AnyError> {
        self.run(&self.sql.drop_queue, &[]).await
    }

    /// A statement taking the queue's name as `$1` and `more` after it.
    async fn run(&self, statement: &str, more: &[&str]) -> Result<(), AnyError> {
        let mut query = sqlx::query(trusted(statement)).bind(&self.queue);
        for value in more {
            query = query.bind(*value);
        }
        query.execute(&self.pool).await?;
        Ok(())
    }
}

/// One event of a batch, as `get_batch_events` returns it.
#[derive(sqlx::FromRow)]
struct EventRow {
    ev_id: i64,
    ev_time: chrono::DateTime<chrono::Utc>,
    ev_type: String,
    ev_data: String,
    ev_extra1: Option<String>,
    ev_extra2: Option<String>,
}

impl EventRow {
    /// The message the relay would publish for the same event: the same
    /// CloudEvents body through the same sink.
    fn into_message(self) -> Result<Message, AnyError> {
        let id = u64::try_from(self.ev_id)?;
        Ok(Message {
            event_id: uuid::Uuid::from_u64_pair(0, id),
            event_type: self.ev_type,
            aggregate_type: self.ev_extra1.unwrap_or_default(),
            aggregate_id: self.ev_extra2.unwrap_or_default(),
            schema_version: 1,
            payload: RawValue::from_string(self.ev_data)?,
            headers: Default::default(),
            created_at: self.ev_time,
            attempt: 1,
            sequence: Some(1),
            source: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_statement_is_in_pgq_sql() {
        let (available, sql) = Statements::from_file();
        assert!(available.contains("pg_available_extensions"));
        assert!(sql.next_batch.contains("pgq.next_batch"));
        for (role, drop) in PGQ_ROLES.iter().zip(&sql.drop_roles) {
            assert!(drop.contains(role), "{drop}");
        }
    }
}

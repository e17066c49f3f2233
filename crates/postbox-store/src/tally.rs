//! Deliveries counted by minute, destination and reading mode (migration
//! 20): what the relays flush every few seconds, and what status and the
//! console read back. Log and logical mode leave no `sent` outbox row, so
//! this is where their deliveries are counted.

use crate::catalog;
use postbox::statements::trusted;
use postbox::Schema;
use sqlx::PgPool;
use std::sync::Arc;

struct Queries {
    add: String,
    forget: String,
    recent: String,
}

/// The deliveries-by-minute operations of one schema; get one with
/// [`crate::Store::tally`].
#[derive(Clone)]
pub struct Tally {
    pool: PgPool,
    sql: Arc<Queries>,
}

/// Deliveries to one destination in one reading mode over a recent window.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct RecentDeliveries {
    pub destination: String,
    pub mode: String,
    pub delivered: i64,
    /// Events the destination's filters kept from it.
    pub filtered: i64,
}

impl Tally {
    pub fn new(pool: PgPool, schema: &Schema) -> Self {
        let mut file = catalog("tally.sql", include_str!("../sql/tally.sql"));
        let sql = Queries {
            add: file.render("add", schema),
            forget: file.render("forget", schema),
            recent: file.render("recent", schema),
        };
        file.finish();
        Self {
            pool,
            sql: Arc::new(sql),
        }
    }

    /// Add `counts` (destination, deliveries, events its filters kept from
    /// it) to this minute's rows of `mode` (`claim`, `log` or `logical`).
    pub async fn add(&self, mode: &str, counts: &[(String, i64, i64)]) -> Result<(), sqlx::Error> {
        if counts.iter().all(|(_, n, f)| *n == 0 && *f == 0) {
            return Ok(());
        }
        let names: Vec<&str> = counts.iter().map(|(d, _, _)| d.as_str()).collect();
        let numbers: Vec<i64> = counts.iter().map(|(_, n, _)| *n).collect();
        let filtered: Vec<i64> = counts.iter().map(|(_, _, f)| *f).collect();
        sqlx::query(trusted(&self.sql.add))
            .bind(&names)
            .bind(&numbers)
            .bind(mode)
            .bind(&filtered)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Delete rows older than two days.
    pub async fn forget_old(&self) -> Result<u64, sqlx::Error> {
        Ok(sqlx::query(trusted(&self.sql.forget))
            .execute(&self.pool)
            .await?
            .rows_affected())
    }

    /// Deliveries per destination and mode over the last `minutes` minutes.
    pub async fn recent(&self, minutes: i32) -> Result<Vec<RecentDeliveries>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.recent))
            .bind(minutes)
            .fetch_all(&self.pool)
            .await
    }
}

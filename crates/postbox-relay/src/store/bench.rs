//! The statements behind `postbox bench`: seeding, the pure-SQL ceiling on
//! postbox's own schema, and the naive row-at-a-time relay it is compared to.

use postbox::Schema;
use sqlx::{PgPool, Row};

/// Benchmark-only operations on one schema.
pub struct BenchStore {
    pool: PgPool,
    seed: String,
    ceiling: String,
    naive_select: String,
    naive_mark: String,
    table_size: String,
    pending: String,
}

/// Sizes of the outbox table.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct TableSize {
    pub table_bytes: i64,
    pub index_bytes: i64,
    pub dead_tuples: i64,
}

impl BenchStore {
    pub fn new(pool: PgPool, schema: &Schema) -> Self {
        Self {
            pool,
            seed: schema.render(include_str!("sql/bench_seed.sql")),
            ceiling: schema.render(include_str!("sql/bench_ceiling.sql")),
            naive_select: schema.render(include_str!("sql/bench_naive_select.sql")),
            naive_mark: schema.render(include_str!("sql/bench_naive_mark.sql")),
            table_size: schema.render(include_str!("sql/bench_table_size.sql")),
            pending: schema.render(include_str!("sql/bench_pending.sql")),
        }
    }

    /// Insert `n` committed events, then VACUUM ANALYZE the table.
    pub async fn seed(&self, n: i64, aggregates: i64, table: &str) -> Result<(), sqlx::Error> {
        sqlx::query(&self.seed)
            .bind(n)
            .bind(aggregates)
            .execute(&self.pool)
            .await?;
        sqlx::raw_sql(&format!("VACUUM ANALYZE {table}"))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Drain everything pending with the SQL-only claim/ack loop.
    pub async fn ceiling(&self, batch: u32) -> Result<(), sqlx::Error> {
        let sql = self.ceiling.replace("{batch}", &batch.to_string());
        sqlx::raw_sql(&sql).execute(&self.pool).await?;
        Ok(())
    }

    /// Up to 100 pending rows, oldest first: (id, payload).
    pub async fn naive_select(&self) -> Result<Vec<(i64, String)>, sqlx::Error> {
        let rows = sqlx::query(&self.naive_select)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect()
    }

    /// Mark one row sent in its own transaction.
    pub async fn naive_mark(&self, id: i64) -> Result<(), sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(&self.naive_mark)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    }

    /// Events not yet delivered (pending or in flight).
    pub async fn pending(&self) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(&self.pending)
            .fetch_one(&self.pool)
            .await
    }

    pub async fn table_size(&self) -> Result<TableSize, sqlx::Error> {
        let r = sqlx::query(&self.table_size).fetch_one(&self.pool).await?;
        Ok(TableSize {
            table_bytes: r.try_get(0)?,
            index_bytes: r.try_get(1)?,
            dead_tuples: r.try_get(2)?,
        })
    }
}

//! The statements behind `postbox bench` (`sql/bench.sql`): the benchmark's
//! schema, seeding, the pure-SQL ceiling on postbox's own schema, the naive
//! row-at-a-time relay it is compared to, and the outbox's size.

use crate::catalog;
use postbox::statements::trusted;
use postbox::Schema;
use sqlx::{PgPool, Row};

/// Benchmark-only operations on one schema.
pub struct BenchStore {
    pool: PgPool,
    schema: Schema,
    server_version: String,
    drop_schema: String,
    seed: String,
    seed_log: String,
    seed_sent: String,
    replayed: String,
    seed_emit: String,
    table_rows: String,
    log_analyze: String,
    autovacuum_off: String,
    wal_lsn: String,
    wal_since: String,
    log_size: String,
    vacuum_analyze: String,
    ceiling: String,
    log_ceiling_cursor: String,
    log_ceiling: String,
    log_read_snapshot: String,
    log_read: String,
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
        let mut sql = catalog("bench.sql", include_str!("../../sql/bench.sql"));
        let store = Self {
            pool,
            schema: schema.clone(),
            server_version: sql.take("server_version").to_owned(),
            drop_schema: sql.render("drop_schema", schema),
            seed: sql.render("seed", schema),
            seed_log: sql.render("seed_log", schema),
            seed_sent: sql.render("seed_sent", schema),
            replayed: sql.render("replayed", schema),
            seed_emit: sql.render("seed_emit", schema),
            table_rows: sql.render("table_rows", schema),
            log_analyze: sql.render("log_analyze", schema),
            autovacuum_off: sql.render("autovacuum_off", schema),
            wal_lsn: sql.render("wal_lsn", schema),
            wal_since: sql.render("wal_since", schema),
            log_size: sql.render("log_size", schema),
            vacuum_analyze: sql.render("vacuum_analyze", schema),
            ceiling: sql.render("ceiling", schema),
            log_ceiling_cursor: sql.render("log_ceiling_cursor", schema),
            log_ceiling: sql.render("log_ceiling", schema),
            log_read_snapshot: sql.render("log_read_snapshot", schema),
            log_read: sql.render("log_read", schema),
            naive_select: sql.render("naive_select", schema),
            naive_mark: sql.render("naive_mark", schema),
            table_size: sql.render("table_size", schema),
            pending: sql.render("pending", schema),
        };
        sql.finish();
        store
    }

    /// The server's version, as `SHOW server_version` has it.
    pub async fn server_version(&self) -> Result<String, sqlx::Error> {
        sqlx::query(trusted(&self.server_version))
            .fetch_one(&self.pool)
            .await?
            .try_get("server_version")
    }

    /// A freshly migrated, empty schema.
    pub async fn reset(&self) -> Result<(), postbox::Error> {
        self.drop_schema().await?;
        let mut conn = self.pool.acquire().await?;
        postbox::sqlx::migrate(&mut conn, &self.schema).await?;
        Ok(())
    }

    /// Drop the benchmark's schema.
    pub async fn drop_schema(&self) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(trusted(&self.drop_schema))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Insert `n` committed events, then VACUUM ANALYZE the table.
    pub async fn seed(&self, n: i64, aggregates: i64) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.seed))
            .bind(n)
            .bind(aggregates)
            .execute(&self.pool)
            .await?;
        sqlx::raw_sql(trusted(&self.vacuum_analyze))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Insert `n` events already delivered, created at `at`, for a replay
    /// to read again, then VACUUM ANALYZE the table.
    pub async fn seed_sent(
        &self,
        n: i64,
        at: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.seed_sent))
            .bind(n)
            .bind(at)
            .execute(&self.pool)
            .await?;
        sqlx::raw_sql(trusted(&self.vacuum_analyze))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Events the schema's replay jobs have delivered so far, and the
    /// seconds they ran for.
    pub async fn replayed(&self) -> Result<(i64, f64), sqlx::Error> {
        sqlx::query_as(trusted(&self.replayed))
            .fetch_one(&self.pool)
            .await
    }

    /// Append `n` committed events to the log (log mode), then ANALYZE it.
    pub async fn seed_log(&self, n: i64, aggregates: i64) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.seed_log))
            .bind(n)
            .bind(aggregates)
            .execute(&self.pool)
            .await?;
        sqlx::raw_sql(trusted(&self.log_analyze))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Emit `n` events into the WAL (logical mode), `per_tx` per
    /// transaction; no table row is written.
    pub async fn seed_emit(&self, n: i64, per_tx: i64) -> Result<(), sqlx::Error> {
        let per_tx = per_tx.max(1);
        let mut first = 1;
        while first <= n {
            let last = (first + per_tx - 1).min(n);
            sqlx::query(trusted(&self.seed_emit))
                .bind(first)
                .bind(last)
                .execute(&self.pool)
                .await?;
            first = last + 1;
        }
        Ok(())
    }

    /// Rows in the outbox and the log together.
    pub async fn table_rows(&self) -> Result<i64, sqlx::Error> {
        sqlx::query(trusted(&self.table_rows))
            .fetch_one(&self.pool)
            .await?
            .try_get("table_rows")
    }

    /// Autovacuum off on the log's segments and the outbox.
    pub async fn autovacuum_off(&self) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(trusted(&self.autovacuum_off))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The current WAL position.
    pub async fn wal_lsn(&self) -> Result<String, sqlx::Error> {
        sqlx::query_scalar(trusted(&self.wal_lsn))
            .fetch_one(&self.pool)
            .await
    }

    /// WAL bytes written since `lsn`.
    pub async fn wal_since(&self, lsn: &str) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(trusted(&self.wal_since))
            .bind(lsn)
            .fetch_one(&self.pool)
            .await
    }

    /// Sizes of the log's partitions.
    pub async fn log_size(&self) -> Result<TableSize, sqlx::Error> {
        let r = sqlx::query(trusted(&self.log_size))
            .fetch_one(&self.pool)
            .await?;
        Ok(TableSize {
            table_bytes: r.try_get("table_bytes")?,
            index_bytes: r.try_get("index_bytes")?,
            dead_tuples: r.try_get("dead_tuples")?,
        })
    }

    /// Drain everything pending with the SQL-only claim/ack loop.
    pub async fn ceiling(&self, batch: u32) -> Result<(), sqlx::Error> {
        let sql = self.ceiling.replace("{batch}", &batch.to_string());
        self.committing_block(&sql).await
    }

    /// Run a `DO` block that commits as it goes (the ceilings), again when
    /// PostgreSQL 15 fails it with "snapshot reference … is not owned by
    /// resource owner TopTransaction": an intermittent server error in
    /// PL/pgSQL's transaction control, seen here now and then. The blocks
    /// resume where they stopped (they work until nothing is left), so a
    /// second run finishes the same drain.
    async fn committing_block(&self, sql: &str) -> Result<(), sqlx::Error> {
        const ATTEMPTS: u32 = 3;
        let mut attempt = 1;
        loop {
            match sqlx::raw_sql(trusted(sql)).execute(&self.pool).await {
                Ok(_) => return Ok(()),
                Err(sqlx::Error::Database(e))
                    if attempt < ATTEMPTS
                        && e.message().contains("is not owned by resource owner") =>
                {
                    tracing::warn!(error = %e.message(), attempt, "the server failed a committing DO block; running it again");
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Read everything in the log with log mode's page query, moving a
    /// cursor row per page, in SQL alone.
    pub async fn log_ceiling(&self, batch: u32) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(trusted(&self.log_ceiling_cursor))
            .execute(&self.pool)
            .await?;
        let sql = self.log_ceiling.replace("{batch}", &batch.to_string());
        self.committing_block(&sql).await
    }

    /// Read every event committed in the log with log mode's page
    /// statement, page after page of `batch` over one connection, as a relay
    /// receives them, without decoding a row or sending it anywhere: the
    /// bound of one log reader's connection. How many events it read.
    pub async fn log_read(&self, batch: u32) -> Result<u64, sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        let hi: String = sqlx::query_scalar(trusted(&self.log_read_snapshot))
            .fetch_one(&mut *conn)
            .await?;
        let (mut after, mut read) = (0_i64, 0_u64);
        loop {
            let rows = sqlx::query(trusted(&self.log_read))
                .bind(&hi)
                .bind(after)
                .bind(i64::from(batch))
                .fetch_all(&mut *conn)
                .await?;
            let Some(last) = rows.last() else {
                return Ok(read);
            };
            after = last.try_get("id")?;
            read += rows.len() as u64;
        }
    }

    /// Up to 100 pending rows, oldest first: (id, payload).
    pub async fn naive_select(&self) -> Result<Vec<(i64, String)>, sqlx::Error> {
        let rows = sqlx::query(trusted(&self.naive_select))
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| Ok((r.try_get("id")?, r.try_get("payload")?)))
            .collect()
    }

    /// Mark one row sent in its own transaction.
    pub async fn naive_mark(&self, id: i64) -> Result<(), sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(trusted(&self.naive_mark))
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    }

    /// Events not yet delivered (pending or in flight).
    pub async fn pending(&self) -> Result<i64, sqlx::Error> {
        sqlx::query(trusted(&self.pending))
            .fetch_one(&self.pool)
            .await?
            .try_get("pending")
    }

    pub async fn table_size(&self) -> Result<TableSize, sqlx::Error> {
        let r = sqlx::query(trusted(&self.table_size))
            .fetch_one(&self.pool)
            .await?;
        Ok(TableSize {
            table_bytes: r.try_get("table_bytes")?,
            index_bytes: r.try_get("index_bytes")?,
            dead_tuples: r.try_get("dead_tuples")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_statement_is_in_bench_sql() {
        // Lazy: never connects. new() takes every entry and finishes.
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .unwrap();
        let store = BenchStore::new(pool, &Schema::new("x_bench").unwrap());
        assert!(store.ceiling.contains("{batch}"));
        assert!(store.log_ceiling.contains("{batch}"));
        assert!(store.seed_emit.contains("\"x_bench\".emit_one"));
        assert!(store.seed.contains("\"x_bench\".outbox"));
    }
}

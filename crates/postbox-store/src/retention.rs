//! Retention: bounded purges of sent events (deleted or archived) and old
//! inbox records, and the VACUUM after them.

use crate::store::Store;
use postbox::statements::trusted;
use std::time::Duration;

impl Store {
    /// Remove up to `limit` sent events acknowledged before `older_than` ago,
    /// deleting them or moving them to `outbox_archive`. Returns how many.
    pub async fn purge_sent(
        &self,
        older_than: Duration,
        limit: i64,
        archive: bool,
    ) -> Result<u64, sqlx::Error> {
        let sql = if archive {
            &self.sql.archive_sent
        } else {
            &self.sql.purge_sent
        };
        let done: i64 = sqlx::query_scalar(trusted(sql))
            .bind(older_than.as_secs_f64())
            .bind(limit)
            .fetch_one(&self.pool)
            .await?;
        Ok(done.max(0) as u64)
    }

    /// Delete up to `limit` inbox records processed before `older_than` ago.
    pub async fn purge_inbox(&self, older_than: Duration, limit: i64) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(trusted(&self.sql.purge_inbox))
            .bind(older_than.as_secs_f64())
            .bind(limit)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    /// `VACUUM (ANALYZE)` the outbox table (needs its owner).
    pub async fn vacuum_outbox(&self) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(trusted(&self.sql.vacuum_outbox))
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

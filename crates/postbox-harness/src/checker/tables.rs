//! The delivery checker's own tables (`sql/checker.sql`), in the run's schema
//! next to postbox's: what the producers committed, and how often the
//! consumer applied each event.

use crate::catalog;
use chrono::{DateTime, Utc};
use postbox::statements::trusted;
use postbox::Schema;
use sqlx::{PgConnection, PgPool, Row};
use std::collections::HashSet;
use uuid::Uuid;

pub struct Tables {
    create_tables: String,
    record_produced: String,
    apply_effect: String,
    commit_without_flush: String,
    produced_count: String,
    produced: String,
    effects: String,
    now: String,
    replay_range: String,
    last_replay_job: String,
    replay_job_done: String,
    replay_from: String,
    drop_schema: String,
}

impl Tables {
    pub fn new(schema: &Schema) -> Self {
        let mut sql = catalog("checker.sql", include_str!("../../sql/checker.sql"));
        let tables = Self {
            create_tables: sql.render("create_tables", schema),
            record_produced: sql.render("record_produced", schema),
            apply_effect: sql.render("apply_effect", schema),
            commit_without_flush: sql.render("commit_without_flush", schema),
            produced_count: sql.render("produced_count", schema),
            produced: sql.render("produced", schema),
            effects: sql.render("effects", schema),
            now: sql.render("now", schema),
            replay_range: sql.render("replay_range", schema),
            last_replay_job: sql.render("last_replay_job", schema),
            replay_job_done: sql.render("replay_job_done", schema),
            replay_from: sql.render("replay_from", schema),
            drop_schema: sql.render("drop_schema", schema),
        };
        sql.finish();
        tables
    }

    /// Create the tables (in a schema postbox's migrations created).
    pub async fn create(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(trusted(&self.create_tables))
            .execute(conn)
            .await?;
        Ok(())
    }

    /// The business row of a producer transaction: its events' ids.
    pub async fn record_produced(
        &self,
        tx: &mut PgConnection,
        ids: &[Uuid],
    ) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.record_produced))
            .bind(ids)
            .execute(tx)
            .await?;
        Ok(())
    }

    /// The consumer's effect of one event.
    pub async fn apply_effect(
        &self,
        tx: &mut PgConnection,
        event_id: Uuid,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.apply_effect))
            .bind(event_id)
            .execute(tx)
            .await?;
        Ok(())
    }

    /// Let the transaction `tx` commit without waiting for its WAL to be
    /// written (the planted bug `consumer-async-commit`).
    pub async fn commit_without_flush(&self, tx: &mut PgConnection) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.commit_without_flush))
            .execute(tx)
            .await?;
        Ok(())
    }

    /// How many events were committed.
    pub async fn produced_count(&self, pool: &PgPool) -> Result<i64, sqlx::Error> {
        sqlx::query(trusted(&self.produced_count))
            .fetch_one(pool)
            .await?
            .try_get("produced")
    }

    /// The events that were committed.
    pub async fn produced(&self, pool: &PgPool) -> Result<HashSet<Uuid>, sqlx::Error> {
        sqlx::query(trusted(&self.produced))
            .fetch_all(pool)
            .await?
            .iter()
            .map(|row| row.try_get("event_id"))
            .collect()
    }

    /// Each applied event and how often it was applied.
    pub async fn effects(&self, pool: &PgPool) -> Result<Vec<(Uuid, i32)>, sqlx::Error> {
        sqlx::query(trusted(&self.effects))
            .fetch_all(pool)
            .await?
            .iter()
            .map(|row| Ok((row.try_get("event_id")?, row.try_get("applied")?)))
            .collect()
    }

    /// The server's time.
    pub async fn now(&self, pool: &PgPool) -> Result<DateTime<Utc>, sqlx::Error> {
        sqlx::query(trusted(&self.now))
            .fetch_one(pool)
            .await?
            .try_get("now")
    }

    /// `--replay`: the events of `source` created from `from` until now, in
    /// one snapshot, and that now.
    pub async fn replay_range(
        &self,
        pool: &PgPool,
        from: DateTime<Utc>,
        source: &str,
    ) -> Result<(DateTime<Utc>, HashSet<Uuid>), sqlx::Error> {
        let rows = sqlx::query(trusted(&self.replay_range))
            .bind(from)
            .bind(source)
            .fetch_all(pool)
            .await?;
        let mut to = from;
        let mut events = HashSet::new();
        for row in rows {
            to = row.try_get("to_at")?;
            if let Some(id) = row.try_get::<Option<Uuid>, _>("event_id")? {
                events.insert(id);
            }
        }
        Ok((to, events))
    }

    /// The newest replay job, if any.
    pub async fn last_replay_job(&self, pool: &PgPool) -> Result<Option<i64>, sqlx::Error> {
        sqlx::query(trusted(&self.last_replay_job))
            .fetch_one(pool)
            .await?
            .try_get("id")
    }

    /// Whether replay job `id` is done.
    pub async fn replay_job_done(&self, pool: &PgPool, id: i64) -> Result<bool, sqlx::Error> {
        sqlx::query(trusted(&self.replay_job_done))
            .bind(id)
            .fetch_one(pool)
            .await?
            .try_get("done")
    }

    /// The newest replay job's `from`.
    pub async fn replay_from(&self, pool: &PgPool) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
        sqlx::query(trusted(&self.replay_from))
            .fetch_one(pool)
            .await?
            .try_get("from_at")
    }

    /// Drop the run's schema, postbox's tables with it.
    pub async fn drop_schema(&self, pool: &PgPool) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.drop_schema))
            .execute(pool)
            .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_statement_is_in_checker_sql() {
        let tables = Tables::new(&Schema::new("postbox_verify_x").unwrap());
        assert!(tables
            .apply_effect
            .contains("\"postbox_verify_x\".verify_effects"));
    }
}

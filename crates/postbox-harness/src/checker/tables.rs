//! The delivery checker's own tables (`sql/checker.sql`), in the run's schema
//! next to postbox's: what the producers committed, and how often the
//! consumer applied each event.

use crate::catalog;
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

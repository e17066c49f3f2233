//! Finding outboxes: the schemas of a database that hold one, the databases
//! of a server (for a relay serving many outboxes, and `migrate --schemas`).
//! Matching names against a pattern is the caller's business. Also the
//! outbox tables' tuple counts of many schemas at once, for the health watch
//! of such a relay.

use crate::catalog;
use postbox::statements::trusted;
use sqlx::PgPool;
use std::sync::OnceLock;

struct Queries {
    outbox_schemas: String,
    all_schemas: String,
    databases: String,
    outbox_tuples: String,
}

fn queries() -> &'static Queries {
    static QUERIES: OnceLock<Queries> = OnceLock::new();
    QUERIES.get_or_init(|| {
        let mut file = catalog("discovery.sql", include_str!("../sql/discovery.sql"));
        let q = Queries {
            outbox_schemas: file.take("outbox_schemas").to_owned(),
            all_schemas: file.take("all_schemas").to_owned(),
            databases: file.take("databases").to_owned(),
            outbox_tuples: file.take("outbox_tuples").to_owned(),
        };
        file.finish();
        q
    })
}

/// The schemas of the pool's database holding a migrated postbox outbox.
pub async fn outbox_schemas(pool: &PgPool) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(trusted(&queries().outbox_schemas))
        .fetch_all(pool)
        .await
}

/// Every schema of the pool's database but the system's.
pub async fn all_schemas(pool: &PgPool) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(trusted(&queries().all_schemas))
        .fetch_all(pool)
        .await
}

/// The databases of the pool's server that accept connections (no templates).
pub async fn databases(pool: &PgPool) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(trusted(&queries().databases))
        .fetch_all(pool)
        .await
}

/// The live and dead tuples of one schema's outbox table.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct OutboxTuples {
    pub schema: String,
    pub live_tuples: i64,
    pub dead_tuples: i64,
}

/// The tuple counts of the outbox tables of `schemas` in the pool's
/// database (a schema whose table has no statistics yet is left out).
pub async fn outbox_tuples(
    pool: &PgPool,
    schemas: &[String],
) -> Result<Vec<OutboxTuples>, sqlx::Error> {
    sqlx::query_as(trusted(&queries().outbox_tuples))
        .bind(schemas)
        .fetch_all(pool)
        .await
}

//! Every statement the library runs, rendered once per schema from the
//! `.sql` files in `crates/postbox/sql` (see [`crate::statements`]).
//! The library does not depend on the data-layer crate (`postbox-store`):
//! applications link the library alone, so its few statements stay here.

use crate::statements::Catalog;
use crate::Schema;

#[derive(Debug)]
pub(crate) struct Queries {
    pub insert_one: String,
    pub insert_many: String,
    pub emit_one: String,
    pub inbox_record: String,
    pub inbox_purge: String,
    pub inbox_sequence: String,
    #[cfg_attr(not(feature = "sqlx"), allow(dead_code))]
    pub received: ReceivedQueries,
    #[cfg_attr(not(feature = "sqlx"), allow(dead_code))]
    pub idempotency: IdempotencyQueries,
}

/// The statements behind [`crate::idempotency`] (request idempotency keys).
#[derive(Debug)]
#[cfg_attr(not(feature = "sqlx"), allow(dead_code))]
pub(crate) struct IdempotencyQueries {
    pub lock: String,
    pub insert: String,
    pub select: String,
    pub restart: String,
    pub complete: String,
    pub purge: String,
}

impl IdempotencyQueries {
    fn new(schema: &Schema) -> Self {
        let mut file = Catalog::parse("idempotency.sql", include_str!("../sql/idempotency.sql"))
            .expect("idempotency.sql parses");
        let queries = Self {
            lock: file.render("lock", schema),
            insert: file.render("insert", schema),
            select: file.render("select", schema),
            restart: file.render("restart", schema),
            complete: file.render("complete", schema),
            purge: file.render("purge", schema),
        };
        file.finish();
        queries
    }
}

/// The statements behind [`crate::received`] (the store of `postbox receive`).
#[derive(Debug)]
#[cfg_attr(not(feature = "sqlx"), allow(dead_code))]
pub(crate) struct ReceivedQueries {
    pub store: String,
    pub take: String,
    pub mark_processed: String,
    pub purge: String,
}

impl Queries {
    pub fn new(schema: &Schema) -> Self {
        let mut outbox = Catalog::parse("outbox.sql", include_str!("../sql/outbox.sql"))
            .expect("outbox.sql parses");
        let mut inbox = Catalog::parse("inbox.sql", include_str!("../sql/inbox.sql"))
            .expect("inbox.sql parses");
        let queries = Self {
            insert_one: outbox.render("insert_one", schema),
            insert_many: outbox.render("insert_many", schema),
            emit_one: outbox.render("emit_one", schema),
            inbox_record: inbox.render("record", schema),
            inbox_purge: inbox.render("purge", schema),
            inbox_sequence: inbox.render("sequence", schema),
            received: ReceivedQueries::new(schema),
            idempotency: IdempotencyQueries::new(schema),
        };
        outbox.finish();
        inbox.finish();
        queries
    }
}

impl ReceivedQueries {
    fn new(schema: &Schema) -> Self {
        let mut file = Catalog::parse("received.sql", include_str!("../sql/received.sql"))
            .expect("received.sql parses");
        let queries = Self {
            store: file.render("store", schema),
            take: file.render("take", schema),
            mark_processed: file.render("mark_processed", schema),
            purge: file.render("purge", schema),
        };
        file.finish();
        queries
    }
}

/// The migration runner's statements.
#[derive(Debug)]
#[cfg_attr(not(feature = "sqlx"), allow(dead_code))]
pub(crate) struct MigrateQueries {
    pub create_schema: String,
    pub create_history: String,
    pub select_applied: String,
    pub select_latest: String,
    pub history_exists: String,
    pub insert_applied: String,
    pub lock: String,
    pub unlock: String,
}

#[cfg_attr(not(feature = "sqlx"), allow(dead_code))]
impl MigrateQueries {
    pub fn new(schema: &Schema) -> Self {
        let mut file = Catalog::parse("migrate.sql", include_str!("../sql/migrate.sql"))
            .expect("migrate.sql parses");
        let queries = Self {
            create_schema: file.render("create_schema", schema),
            create_history: file.render("create_history", schema),
            select_applied: file.render("select_applied", schema),
            select_latest: file.render("select_latest", schema),
            history_exists: file.render("history_exists", schema),
            insert_applied: file.render("insert_applied", schema),
            lock: file.render("lock", schema),
            unlock: file.render("unlock", schema),
        };
        file.finish();
        queries
    }
}

/// Column-wise arrays for the batch insert.
pub(crate) struct Columns {
    pub event_ids: Vec<uuid::Uuid>,
    pub event_types: Vec<String>,
    pub aggregate_types: Vec<String>,
    pub aggregate_ids: Vec<String>,
    pub schema_versions: Vec<i32>,
    pub payloads: Vec<String>,
    pub headers: Vec<String>,
    /// `None` when no event of the batch is scheduled.
    pub deliver_ats: Option<Vec<Option<chrono::DateTime<chrono::Utc>>>>,
    pub deliver_after_secs: Option<Vec<Option<f64>>>,
}

impl Columns {
    pub fn new(events: &[crate::NewEvent]) -> Self {
        Self {
            event_ids: events.iter().map(|e| e.event_id).collect(),
            event_types: events.iter().map(|e| e.event_type.clone()).collect(),
            aggregate_types: events.iter().map(|e| e.aggregate_type.clone()).collect(),
            aggregate_ids: events.iter().map(|e| e.aggregate_id.clone()).collect(),
            schema_versions: events.iter().map(|e| e.schema_version).collect(),
            payloads: events.iter().map(|e| e.payload.clone()).collect(),
            headers: events.iter().map(|e| e.headers.clone()).collect(),
            deliver_ats: events
                .iter()
                .any(|e| e.deliver.is_some())
                .then(|| events.iter().map(|e| e.scheduled_at()).collect()),
            deliver_after_secs: events
                .iter()
                .any(|e| e.deliver.is_some())
                .then(|| events.iter().map(|e| e.deliver_after_secs()).collect()),
        }
    }
}

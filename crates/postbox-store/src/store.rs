//! `Store`: one schema's outbox as the relay, the CLI and the console see
//! it — its statements rendered once (`Queries`), the pool, the schema, and
//! the accessors of the other areas (dead letters, events, the log, logical
//! mode, the tally, the console). The operations live by what they do:
//! `claim.rs` (the hot path), `status.rs` (counts and health), `retention.rs`.

use crate::catalog;
use crate::commit::RelayCommit;
use crate::console::ConsoleStore;
use crate::dead_letters::DeadLetters;
use crate::events::Events;
use crate::log::Log;
use postbox::Schema;
use sqlx::PgPool;

pub(crate) struct Queries {
    pub(crate) claim: String,
    pub(crate) claim_ordered: String,
    pub(crate) delivery_states: String,
    pub(crate) record_deliveries: String,
    pub(crate) destination_counts: String,
    pub(crate) db_health: String,
    pub(crate) notify_probe: String,
    pub(crate) vacuum_outbox: String,
    pub(crate) ack_delivered: String,
    pub(crate) settle_failed: String,
    pub(crate) release: String,
    pub(crate) rescue_expired: String,
    pub(crate) next_due: String,
    pub(crate) scheduled_later: String,
    pub(crate) status_counts: String,
    pub(crate) gauges: String,
    pub(crate) pending_attempts: String,
    pub(crate) open_replays: String,
    pub(crate) ping: String,
    pub(crate) purge_sent: String,
    pub(crate) archive_sent: String,
    pub(crate) purge_inbox: String,
}

impl Queries {
    fn new(schema: &Schema, commit: RelayCommit) -> Self {
        let mut relay = catalog("relay.sql", include_str!("../sql/relay.sql"));
        let mut status = catalog("status.sql", include_str!("../sql/status.sql"));
        let mut retention = catalog("retention.sql", include_str!("../sql/retention.sql"));
        let condition = commit.condition(&mut relay);
        let commit = [("relay_commit", condition.as_str())];
        let queries = Self {
            claim: relay.render_with("claim", schema, &commit),
            claim_ordered: relay.render_with("claim_ordered", schema, &commit),
            ack_delivered: relay.render_with("ack_delivered", schema, &commit),
            settle_failed: relay.render_with("settle_failed", schema, &commit),
            release: relay.render_with("release", schema, &commit),
            rescue_expired: relay.render_with("rescue_expired", schema, &commit),
            next_due: relay.render("next_due", schema),
            scheduled_later: relay.render("scheduled_later", schema),
            delivery_states: relay.render("delivery_states", schema),
            record_deliveries: relay.render_with("record_deliveries", schema, &commit),
            notify_probe: relay.render("notify_probe", schema),
            status_counts: status.render("status_counts", schema),
            gauges: status.render("gauges", schema),
            pending_attempts: status.render("pending_attempts", schema),
            destination_counts: status.render("destination_counts", schema),
            db_health: status.render("db_health", schema),
            open_replays: status.render("open_replays", schema),
            ping: status.render("ping", schema),
            purge_sent: retention.render("purge_sent", schema),
            archive_sent: retention.render("archive_sent", schema),
            purge_inbox: retention.render("purge_inbox", schema),
            vacuum_outbox: retention.render("vacuum_outbox", schema),
        };
        relay.finish();
        status.finish();
        retention.finish();
        queries
    }
}

/// The relay's view of the outbox tables.
#[derive(Clone)]
pub struct Store {
    pub(crate) pool: PgPool,
    pub(crate) schema: Schema,
    pub(crate) sql: std::sync::Arc<Queries>,
    commit: RelayCommit,
}

impl Store {
    pub fn new(pool: PgPool, schema: Schema) -> Self {
        let commit = RelayCommit::default();
        let sql = std::sync::Arc::new(Queries::new(&schema, commit));
        Self {
            pool,
            schema,
            sql,
            commit,
        }
    }

    /// The same store, committing the relay's writes as `commit` says.
    pub fn with_relay_commit(self, commit: RelayCommit) -> Self {
        let sql = std::sync::Arc::new(Queries::new(&self.schema, commit));
        Self {
            sql,
            commit,
            ..self
        }
    }

    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The dead-letter operations for this store's schema.
    pub fn dead_letters(&self) -> DeadLetters {
        DeadLetters::new(self.pool.clone(), &self.schema)
    }

    /// Event look-ups for this store's schema.
    pub fn events(&self) -> Events {
        Events::new(self.pool.clone(), &self.schema)
    }

    pub fn replays(&self) -> crate::Replays {
        crate::Replays::new(self.pool.clone(), &self.schema)
    }

    /// The log and its cursors (log mode) for this store's schema.
    pub fn log(&self) -> Log {
        Log::committing(self.pool.clone(), &self.schema, self.commit)
    }

    /// Logical mode's slot operations for this store's schema.
    pub fn logical(&self) -> crate::Logical {
        crate::Logical::new(self.pool.clone(), &self.schema)
    }

    /// Deliveries counted by minute for this store's schema.
    pub fn tally(&self) -> crate::Tally {
        crate::Tally::new(self.pool.clone(), &self.schema)
    }

    /// The console's operations for this store's schema.
    pub fn console(&self) -> ConsoleStore {
        ConsoleStore::new(self.pool.clone(), &self.schema)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::roles::Roles;

    #[test]
    fn every_statement_renders_for_both_commit_modes() {
        let schema = Schema::new("shop").unwrap();
        let sync = Queries::new(&schema, RelayCommit::Synchronous);
        assert!(!sync.claim.contains("{relay_commit}"));
        assert!(!sync.claim.contains("set_config"));
        assert!(sync.claim.contains("\"shop\".outbox"));
        let not_flushed = Queries::new(&schema, RelayCommit::Asynchronous);
        for sql in [
            &not_flushed.claim,
            &not_flushed.ack_delivered,
            &not_flushed.settle_failed,
            &not_flushed.release,
            &not_flushed.rescue_expired,
            &not_flushed.record_deliveries,
        ] {
            assert!(
                sql.contains("set_config('synchronous_commit', 'off', true)"),
                "{sql}"
            );
        }
        let roles = Roles::for_schema(&schema).unwrap().sql(&schema);
        assert!(roles.contains("CREATE ROLE shop_relay NOLOGIN"), "{roles}");
    }
}

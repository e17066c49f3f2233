//! The health watch of a relay serving many outboxes: the single relay's
//! watch ([`crate::health`]) over every served outbox, at the cost of two
//! reads per database and round rather than one per outbox.
//!
//! Every `health.interval`, for each database with outboxes being served:
//!
//! - one read of the database's health (the oldest transaction and the
//!   replication slot holding back xmin, whether autovacuum is on): a
//!   finding there is **database-wide**, warned once for the database
//!   (`database=<name>`) and reported on each of its outboxes, since it
//!   holds back vacuum for all of them;
//! - one read of the tuple counts of all its outbox tables: an outbox whose
//!   table is mostly dead tuples is warned about with its name
//!   (`outbox=<database>/<schema>`).
//!
//! What each outbox was last found with is its [`super::OutboxStatus::health`]
//! (empty: healthy). The dead-tuple gauges carry the `outbox` label (and,
//! like the backlog gauges, are not exported when metrics are aggregated),
//! the database-wide ones a `database` label. A database that cannot be read is
//! warned about once until it can again; its outboxes keep their last findings.

use super::{lock, OutboxState};
use crate::health::{self, Finding, HealthConfig, Problem, Warnings};
use crate::redact::sanitize_error;
use postbox_store::{DbHealth, Store};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

/// The outboxes of one database, as one round sees them.
struct Served {
    database: String,
    /// One of its outboxes' stores, for the database-wide read.
    store: Store,
    outboxes: Vec<(String, Arc<OutboxState>)>,
}

/// Watch every served outbox until `stop`; `gauges`: export each outbox's
/// dead-tuple gauges (off when metrics are not labelled by outbox, where
/// they would overwrite each other).
pub(super) async fn watch(
    outboxes: &Mutex<BTreeMap<String, Arc<OutboxState>>>,
    config: &HealthConfig,
    gauges: bool,
    stop: &CancellationToken,
) {
    // Warned conditions by database key, and by outbox name.
    let mut databases: HashMap<String, Warnings> = HashMap::new();
    let mut tables: HashMap<String, Warnings> = HashMap::new();
    let mut failing: HashSet<String> = HashSet::new();
    loop {
        let mut served: BTreeMap<String, Served> = BTreeMap::new();
        for (name, state) in lock(outboxes).iter() {
            if let Some((key, store)) = lock(&state.served_on).clone() {
                served
                    .entry(key)
                    .or_insert_with(|| Served {
                        database: state.database.clone(),
                        store,
                        outboxes: Vec::new(),
                    })
                    .outboxes
                    .push((name.clone(), state.clone()));
            }
        }
        databases.retain(|key, _| served.contains_key(key));
        failing.retain(|key| served.contains_key(key));
        tables.retain(|name, _| {
            served
                .values()
                .any(|s| s.outboxes.iter().any(|(n, _)| n == name))
        });
        for (key, db) in &served {
            let read = read(db).await;
            let (health, tuples) = match read {
                Ok(read) => {
                    failing.remove(key);
                    read
                }
                Err(e) => {
                    if failing.insert(key.clone()) {
                        tracing::warn!(database = %db.database, error = %sanitize_error(&e.to_string()), "reading the database's health failed; trying again every health.interval");
                    }
                    continue;
                }
            };
            // Database-wide: warned once for the database.
            let wide = health::findings(
                &DbHealth {
                    live_tuples: None,
                    dead_tuples: None,
                    ..health.clone()
                },
                config,
            );
            let warned = databases.entry(key.clone()).or_default();
            for f in warned.due(&wide, config.repeat_warning) {
                f.warn(Some(&db.database), None);
            }
            metrics::gauge!(health::OLDEST_TRANSACTION_AGE, "database" => db.database.clone())
                .set(health.oldest_xact_age_seconds.unwrap_or(0.0));
            metrics::gauge!(health::SLOT_XMIN_AGE, "database" => db.database.clone())
                .set(health.slot_xmin_age.unwrap_or(0) as f64);
            // Each outbox's table.
            for (name, state) in &db.outboxes {
                let own = tuples.iter().find(|t| t.schema == state.schema);
                let mine = DbHealth {
                    live_tuples: own.map(|t| t.live_tuples),
                    dead_tuples: own.map(|t| t.dead_tuples),
                    ..health.clone()
                };
                let found = health::findings(&mine, config);
                let table: Vec<Finding> = found
                    .iter()
                    .filter(|f| !f.database_wide())
                    .cloned()
                    .collect();
                let warned = tables.entry(name.clone()).or_default();
                let due: Vec<&Finding> = warned.due(&table, config.repeat_warning);
                let outbox: Arc<str> = name.as_str().into();
                for f in due {
                    f.warn(None, Some(name));
                }
                if gauges {
                    crate::label::scope(outbox, async {
                        metrics::gauge!(health::DEAD_TUPLES)
                            .set(mine.dead_tuples.unwrap_or(0) as f64);
                        metrics::gauge!(health::DEAD_TUPLE_RATIO)
                            .set(mine.dead_tuple_ratio().unwrap_or(0.0));
                    })
                    .await;
                }
                *lock(&state.health) = found.iter().map(Problem::from).collect();
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(config.interval) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// The database's health and its outbox tables' tuple counts.
async fn read(
    db: &Served,
) -> Result<(DbHealth, Vec<postbox_store::discovery::OutboxTuples>), sqlx::Error> {
    let schemas: Vec<String> = db.outboxes.iter().map(|(_, s)| s.schema.clone()).collect();
    let health = db.store.db_health().await?;
    let tuples = postbox_store::discovery::outbox_tuples(db.store.pool(), &schemas).await?;
    Ok((health, tuples))
}

//! The schema's versioned migrations, embedded in every binary that links postbox.

use sha2::{Digest, Sha256};

/// One versioned migration. `sql` is a template: `{schema}` stands for the schema.
#[derive(Clone, Copy, Debug)]
pub struct Migration {
    pub version: i32,
    pub name: &'static str,
    pub sql: &'static str,
}

impl Migration {
    /// SHA-256 of the template, hex: detects a released migration that was edited.
    pub fn checksum(&self) -> String {
        Sha256::digest(self.sql.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// All migrations, in order. Never edit a released one: add a new one.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "outbox",
        sql: include_str!("../migrations/0001_outbox.sql"),
    },
    Migration {
        version: 2,
        name: "received",
        sql: include_str!("../migrations/0002_received.sql"),
    },
    Migration {
        version: 3,
        name: "retention",
        sql: include_str!("../migrations/0003_retention.sql"),
    },
    Migration {
        version: 4,
        name: "operator",
        sql: include_str!("../migrations/0004_operator.sql"),
    },
    Migration {
        version: 5,
        name: "sequences_destinations",
        sql: include_str!("../migrations/0005_sequences_destinations.sql"),
    },
    Migration {
        version: 6,
        name: "console",
        sql: include_str!("../migrations/0006_console.sql"),
    },
    Migration {
        version: 7,
        name: "log",
        sql: include_str!("../migrations/0007_log.sql"),
    },
    Migration {
        version: 8,
        name: "least_privilege",
        sql: include_str!("../migrations/0008_least_privilege.sql"),
    },
    Migration {
        version: 9,
        name: "log_producers",
        sql: include_str!("../migrations/0009_log_producers.sql"),
    },
    Migration {
        version: 10,
        name: "log_privileges",
        sql: include_str!("../migrations/0010_log_privileges.sql"),
    },
    Migration {
        version: 11,
        name: "logical",
        sql: include_str!("../migrations/0011_logical.sql"),
    },
    Migration {
        version: 12,
        name: "scheduled",
        sql: include_str!("../migrations/0012_scheduled.sql"),
    },
    Migration {
        version: 13,
        name: "scheduled_emit",
        sql: include_str!("../migrations/0013_scheduled_emit.sql"),
    },
    Migration {
        version: 14,
        name: "log_partitions",
        sql: include_str!("../migrations/0014_log_partitions.sql"),
    },
    Migration {
        version: 15,
        name: "logical_readers",
        sql: include_str!("../migrations/0015_logical_readers.sql"),
    },
    Migration {
        version: 16,
        name: "emit_sequence",
        sql: include_str!("../migrations/0016_emit_sequence.sql"),
    },
    Migration {
        version: 17,
        name: "emit_numbering",
        sql: include_str!("../migrations/0017_emit_numbering.sql"),
    },
    Migration {
        version: 18,
        name: "log_reading",
        sql: include_str!("../migrations/0018_log_reading.sql"),
    },
    Migration {
        version: 19,
        name: "logical_trust",
        sql: include_str!("../migrations/0019_logical_trust.sql"),
    },
    Migration {
        version: 20,
        name: "deliveries_by_minute",
        sql: include_str!("../migrations/0020_deliveries_by_minute.sql"),
    },
    Migration {
        version: 21,
        name: "payload_limit",
        sql: include_str!("../migrations/0021_payload_limit.sql"),
    },
    Migration {
        version: 22,
        name: "reader_failures",
        sql: include_str!("../migrations/0022_reader_failures.sql"),
    },
    Migration {
        version: 23,
        name: "console_outboxes",
        sql: include_str!("../migrations/0023_console_outboxes.sql"),
    },
    Migration {
        version: 24,
        name: "inbox_apply",
        sql: include_str!("../migrations/0024_inbox_apply.sql"),
    },
    Migration {
        version: 25,
        name: "log_page_snapshots",
        sql: include_str!("../migrations/0025_log_page_snapshots.sql"),
    },
    Migration {
        version: 26,
        name: "consumer_groups",
        sql: include_str!("../migrations/0026_consumer_groups.sql"),
    },
    Migration {
        version: 27,
        name: "filtered_by_minute",
        sql: include_str!("../migrations/0027_filtered_by_minute.sql"),
    },
    Migration {
        version: 28,
        name: "group_tokens",
        sql: include_str!("../migrations/0028_group_tokens.sql"),
    },
    Migration {
        version: 29,
        name: "replay_jobs",
        sql: include_str!("../migrations/0029_replay_jobs.sql"),
    },
    Migration {
        version: 30,
        name: "destinations_seen",
        sql: include_str!("../migrations/0030_destinations_seen.sql"),
    },
    Migration {
        version: 31,
        name: "log_floor",
        sql: include_str!("../migrations/0031_log_floor.sql"),
    },
    Migration {
        version: 32,
        name: "reader_position",
        sql: include_str!("../migrations/0032_reader_position.sql"),
    },
];

/// Which migrations still need to run, given the (version, checksum) pairs applied.
pub(crate) fn pending(
    schema: &crate::Schema,
    applied: &[(i32, String)],
) -> Result<Vec<&'static Migration>, crate::Error> {
    let latest = MIGRATIONS.last().map_or(0, |m| m.version);
    if let Some((found, _)) = applied.iter().find(|(v, _)| *v > latest) {
        return Err(crate::Error::SchemaTooNew {
            schema: schema.name().to_owned(),
            found: *found,
            latest,
        });
    }
    let mut todo = Vec::new();
    for m in MIGRATIONS {
        match applied.iter().find(|(v, _)| *v == m.version) {
            Some((_, sum)) if *sum != m.checksum() => {
                return Err(crate::Error::MigrationChanged {
                    version: m.version,
                    name: m.name,
                    applied: sum.clone(),
                    expected: m.checksum(),
                })
            }
            Some(_) => {}
            None => todo.push(m),
        }
    }
    Ok(todo)
}

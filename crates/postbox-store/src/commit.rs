//! How the relay's own writes commit (`{relay_commit}` in the hot-path
//! statements of `relay.sql` and `log.sql`).

use crate::catalog;
use postbox::statements::Catalog;

/// How the relay's own writes commit (the `{relay_commit}` condition in the
/// hot-path statements: claim, acknowledge, settle, release, rescue, record
/// deliveries, and log mode's window and cursor moves).
///
/// By default they commit like any other transaction. Asynchronously
/// (`relay.synchronous_commit = false`), each statement sets
/// `synchronous_commit = off` for its own implicit transaction, so it does not
/// wait for the WAL flush. That is safe for the delivery contract: a crash of
/// PostgreSQL can only lose a suffix of the WAL, so it rolls the relay's marks
/// back to an earlier consistent state — a claim or an acknowledgement is
/// forgotten and the event is delivered again (at least once, never lost).
/// The producers' commits, which hold the events themselves, keep the
/// application's own setting, and flushing them flushes every earlier relay
/// commit too. It takes the relay's flushes off a busy disk; measured on the
/// project's machine it did not lower the relay's own latency (README,
/// Performance), so it is not the default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RelayCommit {
    #[default]
    Synchronous,
    /// Do not wait for the WAL flush (`relay.synchronous_commit = false`).
    Asynchronous,
}

impl RelayCommit {
    /// The `{relay_commit}` condition, from `relay.sql` (`relay`).
    pub(crate) fn condition(self, relay: &mut Catalog) -> String {
        let without_flush = relay.take("commit_without_flush");
        match self {
            RelayCommit::Synchronous => "true".to_owned(),
            RelayCommit::Asynchronous => without_flush.to_owned(),
        }
    }

    /// The condition alone, for statements of other files.
    pub(crate) fn condition_alone(self) -> String {
        self.condition(&mut catalog("relay.sql", include_str!("../sql/relay.sql")))
    }
}

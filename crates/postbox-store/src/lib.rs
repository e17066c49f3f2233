//! postbox's data layer: every statement the relay, the console and the CLI
//! run against postbox's tables, and the typed rows they return.
//!
//! The statements are the `.sql` files in `crates/postbox-store/sql`, one file
//! per area, one named entry per statement (see [`postbox::statements`]),
//! rendered once per schema. Rows are read by column name into the structs
//! below (`sqlx::FromRow`), so a statement's column order can change freely;
//! a renamed column fails the crate's tests, not a user's relay.
//!
//! What stays elsewhere: the library's own statements (enqueue, inbox,
//! idempotency keys, migrations) live in `crates/postbox/sql`, because
//! applications link the library alone; the benchmark's statements live with
//! the benchmark.
//!
//! Areas:
//! - [`Store`] — the relay's hot path (claim, settle, release, rescue,
//!   per-destination state), status and health reads, retention, roles;
//! - [`DeadLetters`] — operator actions on dead letters, each audited;
//! - [`Events`] — events as operators look them up ([`EventRecord`], the one
//!   read model of an outbox row);
//! - [`ConsoleStore`] — the console's users, sessions and overview;
//! - [`Log`] — log mode's snapshot cursors over the append-only log;
//! - [`Groups`] — consumer groups that pull from the log (receive, ack,
//!   nack), their status and dead letters;
//! - [`Logical`] — logical mode's replication slot: peek, decode, confirm,
//!   status, and the hand-off of what a destination did not take.
//! - [`Replays`] — replay jobs: retained events read again, by id, for one
//!   destination, with a position of their own;
//! - [`Tally`] — deliveries counted by minute, destination and reading mode;
//! - [`connect`] — connecting: options from a URL, a pool after bounded retries,
//!   errors that never repeat a password;
//! - [`directory`] — the outboxes a process serves many of: sources (a listed
//!   outbox, or schema and database name patterns) and one listing of them,
//!   shared by the relay, the console and the commands;
//! - [`discovery`] — the schemas holding an outbox, the databases of a server.

mod claim;
mod commit;
pub mod connect;
mod console;
mod dead_letters;
pub mod directory;
pub mod discovery;
mod events;
mod groups;
mod log;
mod logical;
mod replay;
mod retention;
mod roles;
mod rows;
mod status;
mod store;
mod tally;

pub use claim::{
    Claim, ClaimOrder, DeliveryState, DeliveryUpdate, Failure, NextDue, Rescued, ScheduledLater,
    Settled,
};
pub use commit::RelayCommit;
pub use console::{
    Backlog, ConsoleStore, ErrorGroup, GroupOf, RelaySeen, StoredSession, StoredUser,
    RELAY_APPLICATION_NAME,
};
pub use dead_letters::{
    Action, Applied, AuditEntry, DeadLetter, DeadLetters, DlqError, Filter, Progress, Selection,
    ACTION_DISCARD, ACTION_REPLAY, ACTION_REPLAY_NEW_ID, MAX_ACTOR_BYTES, MAX_BATCH,
    MAX_REASON_BYTES,
};
pub use events::{
    DeliveryRecord, EventQuery, EventRecord, EventRow, Events, Status, StatusFilter, StoredEvent,
};
pub use groups::{
    is_token_shaped, token_hash, GroupDeadLetter, GroupStart, GroupStatus, GroupToken, Groups,
    NewGroup, Received, ACTION_CREATE_GROUP_TOKEN, ACTION_DROP_GROUP, ACTION_REPLAY_GROUP_DEAD,
    ACTION_REVOKE_GROUP_TOKEN, TOKEN_PREFIX,
};
pub use log::{
    CursorDropped, CursorLag, CursorStart, Handoff, HeldEvents, Lease, Log, LogEvent, LogWindow,
    ProducerTarget, ACTION_DROP_CURSOR,
};
pub use logical::{
    decode_change, decode_event, decode_or_refuse, default_slot_name, rough_duration, Change,
    Logical, LogicalEvent, LogicalHandoff, Lsn, Refusal, RefusedMessage, SlotStatus, Unread,
};
pub use replay::{
    NewReplay, PageDone, RangeFound, ReplayEvent, ReplayJob, ReplayLock, ReplayRange, ReplaySource,
    Replays, ACTION_REPLAY_CANCEL, ACTION_REPLAY_START, RELAY_ACTOR,
};
pub use roles::{CreateRolesError, RoleNameError, Roles};
pub use rows::ClaimedEvent;
pub use status::{AttemptsCount, DbHealth, DestinationCounts, Gauges, StatusCounts};
pub use store::Store;
pub use tally::{RecentDeliveries, Tally};

use postbox::statements::Catalog;

/// Parse one of this crate's `.sql` files (embedded at build time).
fn catalog(file: &'static str, text: &'static str) -> Catalog {
    Catalog::parse(file, text).unwrap_or_else(|e| panic!("{e}"))
}

//! What `postbox verify`, `postbox bench` and `postbox demo` run, shipped
//! with the `postbox` binary (these are user-facing commands, not tests).
//!
//! - [`checker`] (`postbox verify`: the delivery checker under faults),
//!   [`bench`] (`postbox bench`) and [`demo`] (`postbox demo`): the
//!   workloads. Each takes plain options and prints what the command prints;
//!   the CLI only parses flags. The TCP fault proxy they put in front of
//!   servers is its own crate, `postbox-proxy` (test suites take it through
//!   `postbox_testkit::proxy` without compiling any of this).
//! - [`pgcluster`]: a throwaway PostgreSQL cluster when no database is given;
//!   [`slots`]: dropping a workload's replication slot once it is let go
//!   (connecting is `postbox_store::connect`).
//! - [`output`] and [`progress`]: printing that survives closed pipes, and
//!   progress shown on a terminal only.
//! - [`process`]: child processes (waited for, signalled, their peak memory
//!   read); [`supervisor`]: `postbox relay` children run to their end or kept
//!   running; [`os`]: the one place that calls libc.
//!
//! Statements live in `sql/*.sql` (named entries, read with
//! [`postbox::statements::Catalog`]); rows are read by column name.

pub mod bench;
pub mod checker;
pub mod demo;
mod group_reader;
pub mod os;
pub mod output;
pub mod pgcluster;
pub mod process;
pub mod progress;
pub mod slots;
pub mod supervisor;

/// Any error, with its chain of sources.
pub type AnyError = Box<dyn std::error::Error + Send + Sync>;

/// Whether a workload's checks held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Fail,
}

/// An error and its chain of causes on one line (see
/// [`postbox::redact::error_chain`]).
pub use postbox::redact::error_chain;

/// A Redis connection whose replies may take as long as a loaded machine
/// needs: redis' default of 500 ms is shorter than a blocking read's wait, and
/// a read abandoned by the client still takes its entries on the server
/// (XREADGROUP moves them to the pending list, BLMPOP removes them).
pub(crate) async fn redis_connection(
    client: &redis::Client,
) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    let config = redis::AsyncConnectionConfig::new()
        .set_response_timeout(Some(std::time::Duration::from_secs(30)));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

/// Lock `m`, taking the data of a poisoned lock as it is.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The named statements of one of the `sql/*.sql` files embedded in this
/// crate. They are part of the binary, so a file that does not parse is a
/// programming error (the crate's tests parse every one).
pub(crate) fn catalog(file: &'static str, text: &'static str) -> postbox::statements::Catalog {
    postbox::statements::Catalog::parse(file, text).unwrap_or_else(|e| panic!("{e}"))
}

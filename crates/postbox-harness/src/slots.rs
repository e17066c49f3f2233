//! Waiting for a replication slot to be let go (the workloads drop theirs).

use std::time::{Duration, Instant};

/// How long the workloads wait for a replication slot to be let go.
pub const SLOT_PATIENCE: Duration = Duration::from_secs(30);

/// Drop logical mode's `slot` (true when it existed) once no session reads
/// it: a relay that has just stopped leaves its server process behind for a
/// moment, and PostgreSQL refuses to drop a slot in use (SQLSTATE 55006).
/// A server that cannot be reached, or is still starting after a crash
/// (verify's `crash` fault), is tried again too. Waits at most `patience`;
/// any other error returns at once.
pub async fn drop_slot_when_free(
    logical: &postbox_store::Logical,
    slot: &str,
    patience: Duration,
) -> Result<bool, sqlx::Error> {
    let until = Instant::now() + patience;
    loop {
        match logical.drop_slot(slot).await {
            Err(e) if passing(&e) && Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other,
        }
    }
}

/// An error that goes away by itself: the slot still in use, the server
/// unreachable, shutting down or starting up (SQLSTATE class 57P).
fn passing(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(e) => e
            .code()
            .is_some_and(|c| c == "55006" || c.starts_with("57P")),
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut => true,
        _ => false,
    }
}

//! The rescuer: returns events whose lease expired (their relay died or
//! stalled) to `pending`, or dead-letters those out of attempts.

use crate::engine::Shared;
use crate::redact::sanitize_error;
use crate::telemetry::metrics as m;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Events rescued per statement.
const RESCUE_LIMIT: i64 = 1000;

pub(crate) async fn rescue_loop(shared: Arc<Shared>, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(shared.config.rescue_interval) => {}
            _ = stop.cancelled() => return,
        }
        loop {
            match shared
                .store
                .rescue_expired(shared.config.max_attempts, RESCUE_LIMIT)
                .await
            {
                Ok(r) => {
                    let n = r.requeued.len() + r.dead_lettered.len();
                    if n == 0 {
                        break;
                    }
                    shared
                        .stats
                        .rescued
                        .fetch_add(r.requeued.len() as u64, Ordering::Relaxed);
                    shared
                        .stats
                        .dead_lettered
                        .fetch_add(r.dead_lettered.len() as u64, Ordering::Relaxed);
                    metrics::counter!(m::LEASES_RECLAIMED).increment(n as u64);
                    metrics::counter!(m::DEAD_LETTERED).increment(r.dead_lettered.len() as u64);
                    tracing::warn!(
                        requeued = r.requeued.len(),
                        dead_lettered = r.dead_lettered.len(),
                        "reclaimed events whose lease expired"
                    );
                    shared.signals.outbox.notify_one();
                    if (n as i64) < RESCUE_LIMIT {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %sanitize_error(&e.to_string()), "looking for expired leases failed");
                    break;
                }
            }
        }
    }
}

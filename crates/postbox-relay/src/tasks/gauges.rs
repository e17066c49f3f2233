//! The gauges task: refreshes the backlog metrics (and, in log mode, each
//! cursor's lag) from one cheap store query, and the open replay jobs'.

use crate::config::ReadMode;
use crate::engine::Shared;
use crate::redact::sanitize_error;
use crate::telemetry::metrics as m;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Refresh the backlog gauges every `every` (the first reading at once).
pub(crate) async fn gauge_loop(shared: Arc<Shared>, every: Duration, stop: CancellationToken) {
    let mut failing = false;
    let mut replaying = std::collections::BTreeSet::new();
    loop {
        let refreshed = match m::refresh_gauges(&shared.store).await {
            Ok(_) if shared.config.mode == ReadMode::Log => m::refresh_log_lag(&shared.store).await,
            other => other.map(|_| ()),
        };
        let refreshed = match refreshed {
            Ok(()) => m::refresh_replays(&shared.store, &replaying)
                .await
                .map(|now| replaying = now),
            e => e,
        };
        match refreshed {
            Ok(()) => failing = false,
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(error = %sanitize_error(&e.to_string()), "reading the backlog gauges failed; they keep their last value");
            }
            Err(_) => {}
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.cancelled() => return,
        }
    }
}

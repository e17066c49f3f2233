//! LISTEN: one connection listening on the schema's channel, waking the
//! readers a notification concerns ([`crate::engine::Signals`]); or, serving
//! many outboxes, forwarding the tenants layer's wake signal. Polling always
//! catches what a lost notification would miss.

use crate::backoff;
use crate::engine::Shared;
use crate::redact::sanitize_error;
use crate::tasks::health;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// How long the LISTEN probe waits for its own notification.
const LISTEN_PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Send a notification on the relays' channel and wait for it to come back.
/// It does not when the connection goes through a pooler in transaction mode
/// (PgBouncer), which accepts LISTEN but never delivers notifications.
async fn probe_listen(
    shared: &Shared,
    listener: &mut sqlx::postgres::PgListener,
    stop: &CancellationToken,
) -> Result<(), String> {
    let payload = format!("postbox-probe:{}", uuid::Uuid::new_v4());
    if let Err(e) = shared.store.notify_probe(&payload).await {
        // Not a verdict on LISTEN: try again on the next connection.
        return Err(format!(
            "could not send the LISTEN probe ({})",
            sanitize_error(&e.to_string())
        ));
    }
    let deadline = tokio::time::Instant::now() + LISTEN_PROBE_TIMEOUT;
    loop {
        tokio::select! {
            n = listener.try_recv() => match n {
                Ok(Some(n)) if n.payload() == payload => {
                    metrics::gauge!(health::LISTEN_WORKING).set(1.0);
                    tracing::debug!("LISTEN probe came back: notifications work");
                    return Ok(());
                }
                // Another relay's probe or a new event: wake who reads it, keep waiting.
                Ok(Some(n)) => shared.signals.notified(n.payload()),
                Ok(None) | Err(_) => return Err("the LISTEN connection dropped during the probe".into()),
            },
            _ = tokio::time::sleep_until(deadline) => {
                metrics::gauge!(health::LISTEN_WORKING).set(0.0);
                return Err(format!(
                    "LISTEN is connected but its probe notification did not come back within {}s: \
                     the connection probably goes through a pooler in transaction mode (e.g. PgBouncer), \
                     which drops notifications; point the relay at Postgres directly or a session-mode pool",
                    LISTEN_PROBE_TIMEOUT.as_secs()
                ));
            }
            _ = stop.cancelled() => return Ok(()),
        }
    }
}

/// Wake the claimer (and log readers) whenever `signal` is notified.
pub(crate) async fn forward_wake(
    shared: Arc<Shared>,
    signal: Arc<Notify>,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = signal.notified() => shared.signals.wake_all(),
            _ = stop.cancelled() => return,
        }
    }
}

pub(crate) async fn listen_loop(shared: Arc<Shared>, stop: CancellationToken) {
    let channel = shared.store.schema().notify_channel();
    let mut failures = 0;
    // The probe runs once per process: its verdict does not change on reconnects.
    let mut probed = false;
    while !stop.is_cancelled() {
        let listener = async {
            let mut l = sqlx::postgres::PgListener::connect_with(shared.store.pool()).await?;
            l.listen(&channel).await?;
            Ok::<_, sqlx::Error>(l)
        };
        let mut listener = match listener.await {
            Ok(l) => l,
            Err(e) => {
                failures += 1;
                let delay = backoff::full_jitter(
                    failures,
                    Duration::from_millis(500),
                    Duration::from_secs(30),
                );
                tracing::warn!(error = %sanitize_error(&e.to_string()), retry_in = ?delay, "LISTEN failed; polling meanwhile");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => continue,
                    _ = stop.cancelled() => return,
                }
            }
        };
        failures = 0;
        tracing::debug!(%channel, "listening for new events");
        // What was committed, and any lease given back, before LISTEN began
        // notified nobody here: look once now.
        shared.signals.missed_notifications();
        if !probed {
            probed = true;
            if let Err(e) = probe_listen(&shared, &mut listener, &stop).await {
                tracing::warn!(
                    poll_interval = %humantime::format_duration(shared.config.poll_interval),
                    "{e}; relying on polling"
                );
            }
        }
        loop {
            tokio::select! {
                n = listener.try_recv() => match n {
                    Ok(Some(n)) => shared.signals.notified(n.payload()),
                    Ok(None) => {
                        // Connection lost: notifications may have been missed.
                        shared.signals.missed_notifications();
                        tracing::warn!("LISTEN connection lost; reconnecting");
                        break;
                    }
                    Err(e) => {
                        shared.signals.missed_notifications();
                        tracing::warn!(error = %sanitize_error(&e.to_string()), "LISTEN failed; reconnecting");
                        break;
                    }
                },
                _ = stop.cancelled() => return,
            }
        }
    }
}

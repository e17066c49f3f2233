//! One LISTEN connection per database, dispatching each notification to the
//! outbox whose channel (`postbox_<schema>`) it came on.

use crate::backoff;
use crate::metrics as m;
use crate::redact::sanitize_error;
use sqlx::postgres::PgListener;
use sqlx::PgPool;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The channels one database's listener serves, each with the signal that
/// wakes its outbox's engine.
#[derive(Default)]
pub(crate) struct Channels {
    map: Mutex<HashMap<String, Arc<Notify>>>,
    /// Notified when a channel is added or removed.
    changed: Notify,
}

impl Channels {
    pub(crate) fn add(&self, channel: String, wake: Arc<Notify>) {
        self.lock().insert(channel, wake);
        self.changed.notify_one();
    }

    pub(crate) fn remove(&self, channel: &str) {
        self.lock().remove(channel);
        self.changed.notify_one();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Notify>>> {
        // A panic while holding this lock cannot leave the map half-changed.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn names(&self) -> HashSet<String> {
        self.lock().keys().cloned().collect()
    }

    fn wake(&self, channel: &str) {
        if let Some(wake) = self.lock().get(channel) {
            wake.notify_one();
        }
    }

    /// Notifications may have been missed: wake every outbox.
    fn wake_all(&self) {
        for wake in self.lock().values() {
            wake.notify_one();
        }
    }
}

/// Listen on every channel of `channels` over one connection of `pool`
/// until `stop`; reconnect with backoff, waking every outbox after a gap.
pub(crate) async fn listen_loop(
    database: String,
    pool: PgPool,
    channels: Arc<Channels>,
    stop: CancellationToken,
) {
    let mut failures = 0;
    while !stop.is_cancelled() {
        let wanted = channels.names();
        if wanted.is_empty() {
            tokio::select! {
                _ = channels.changed.notified() => continue,
                _ = stop.cancelled() => return,
            }
        }
        let connected = async {
            let mut l = PgListener::connect_with(&pool).await?;
            l.listen_all(wanted.iter().map(String::as_str)).await?;
            Ok::<_, sqlx::Error>(l)
        };
        let mut listener = match connected.await {
            Ok(l) => l,
            Err(e) => {
                failures += 1;
                metrics::counter!(m::OUTBOX_ERRORS, "database" => database.clone(), "kind" => "listen")
                    .increment(1);
                let delay = backoff::full_jitter(
                    failures,
                    Duration::from_millis(500),
                    Duration::from_secs(30),
                );
                tracing::warn!(%database, error = %sanitize_error(&e.to_string()), retry_in = ?delay, "LISTEN failed; its outboxes poll meanwhile");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => continue,
                    _ = stop.cancelled() => return,
                }
            }
        };
        failures = 0;
        let mut listening = wanted;
        tracing::debug!(%database, channels = listening.len(), "listening for new events");
        // Events committed while (re)connecting sent no notification we saw.
        channels.wake_all();
        loop {
            tokio::select! {
                n = listener.try_recv() => match n {
                    Ok(Some(n)) => channels.wake(n.channel()),
                    Ok(None) => {
                        channels.wake_all();
                        tracing::warn!(%database, "LISTEN connection lost; reconnecting");
                        break;
                    }
                    Err(e) => {
                        channels.wake_all();
                        tracing::warn!(%database, error = %sanitize_error(&e.to_string()), "LISTEN failed; reconnecting");
                        break;
                    }
                },
                _ = channels.changed.notified() => {
                    let wanted = channels.names();
                    let added: Vec<&str> = wanted.difference(&listening).map(String::as_str).collect();
                    let removed: Vec<&str> = listening.difference(&wanted).map(String::as_str).collect();
                    let mut result = if added.is_empty() {
                        Ok(())
                    } else {
                        listener.listen_all(added.iter().copied()).await
                    };
                    for channel in removed {
                        if result.is_ok() {
                            result = listener.unlisten(channel).await;
                        }
                    }
                    if let Err(e) = result {
                        tracing::warn!(%database, error = %sanitize_error(&e.to_string()), "changing LISTEN channels failed; reconnecting");
                        break;
                    }
                    if wanted.is_empty() {
                        // Nothing to listen for: give the connection back.
                        break;
                    }
                    listening = wanted;
                }
                _ = stop.cancelled() => return,
            }
        }
    }
}

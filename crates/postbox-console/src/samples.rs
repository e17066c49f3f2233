//! The backlog's recent history, for the overview's chart: the console
//! process samples the backlog every `sample_every` and keeps the last
//! [`HISTORY`] of samples in memory (the database keeps no history of
//! counts, and past pending/retrying counts cannot be rebuilt from the
//! table's timestamps). A console that just started shows a short history.

use chrono::{DateTime, Utc};
use postbox_store::{Backlog, ConsoleStore};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How far back the chart goes.
pub(crate) const HISTORY: Duration = Duration::from_secs(30 * 60);

#[derive(Clone, Copy, Debug)]
pub(crate) struct Sample {
    pub at: DateTime<Utc>,
    pub backlog: Backlog,
}

#[derive(Clone, Default)]
pub(crate) struct Samples {
    ring: Arc<Mutex<VecDeque<Sample>>>,
}

impl Samples {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Sample>> {
        match self.ring.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Keep `sample`, dropping those older than [`HISTORY`].
    pub fn push(&self, sample: Sample) {
        let mut ring = self.lock();
        let horizon = sample.at - chrono::Duration::from_std(HISTORY).unwrap_or_default();
        while ring.front().is_some_and(|s| s.at < horizon) {
            ring.pop_front();
        }
        ring.push_back(sample);
    }

    /// The samples kept, oldest first.
    pub fn all(&self) -> Vec<Sample> {
        self.lock().iter().copied().collect()
    }

    /// Take one sample now.
    pub async fn take(&self, store: &ConsoleStore) -> Result<Sample, sqlx::Error> {
        let backlog = store.backlog().await?;
        let sample = Sample {
            at: Utc::now(),
            backlog,
        };
        self.push(sample);
        Ok(sample)
    }

    /// Sample every `every` until `stop`; a failed sample is logged and skipped.
    pub async fn run(self, store: ConsoleStore, every: Duration, stop: CancellationToken) {
        let mut tick = tokio::time::interval(every.max(Duration::from_millis(100)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            if let Err(e) = self.take(&store).await {
                tracing::warn!(
                    error = %postbox::redact::sanitize_error(&e.to_string()),
                    "console: cannot sample the backlog for the overview chart"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_older_than_the_history_are_dropped() {
        let s = Samples::default();
        let now = Utc::now();
        for back in [40_i64, 31, 29, 1, 0] {
            s.push(Sample {
                at: now - chrono::Duration::minutes(back),
                backlog: Backlog::default(),
            });
        }
        let kept: Vec<i64> = s.all().iter().map(|x| (now - x.at).num_minutes()).collect();
        assert_eq!(kept, [29, 1, 0]);
    }
}

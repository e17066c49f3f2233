//! The tally: every few seconds, the deliveries each destination took since
//! the last flush go to `<schema>.deliveries_by_minute` (migration 20), one
//! statement per source (the outbox's, counted as `claim`, and the stream
//! reader's, counted under the reading mode), nothing while idle; hourly,
//! rows older than two days go. Log
//! and logical mode leave no `sent` outbox row, so this is how status and
//! the console count their deliveries.

use crate::config::ReadMode;
use crate::engine::{Read, Shared};
use crate::redact::sanitize_error;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How often counts are flushed.
const FLUSH_EVERY: Duration = Duration::from_secs(5);
/// How often old rows are deleted.
const FORGET_EVERY: Duration = Duration::from_secs(3600);

fn mode_name(mode: ReadMode) -> &'static str {
    match mode {
        ReadMode::Claim => "claim",
        ReadMode::Log => "log",
        ReadMode::Logical => "logical",
    }
}

pub(crate) async fn tally_loop(shared: Arc<Shared>, stop: CancellationToken) {
    let tally = shared.store.tally();
    // What the stream readers delivered counts under the reading mode; what
    // the claim pipeline delivered (in every mode) under `claim`.
    let modes = [
        (Read::Outbox, "claim"),
        (Read::Stream, mode_name(shared.config.mode)),
    ];
    let mut forgot: Option<Instant> = None;
    let mut failing = false;
    loop {
        let stopping = tokio::select! {
            _ = tokio::time::sleep(FLUSH_EVERY) => false,
            _ = stop.cancelled() => true,
        };
        let mut flushed = false;
        for (read, mode) in modes {
            let counts: Vec<(String, i64, i64)> = shared
                .router
                .destinations()
                .iter()
                .zip(&shared.delivered)
                .zip(&shared.filtered)
                .map(|((d, n), f)| {
                    let n = n[read as usize].swap(0, Ordering::Relaxed);
                    let f = f[read as usize].swap(0, Ordering::Relaxed);
                    (
                        d.name.clone(),
                        i64::try_from(n).unwrap_or(i64::MAX),
                        i64::try_from(f).unwrap_or(i64::MAX),
                    )
                })
                .collect();
            if counts.iter().all(|(_, n, f)| *n == 0 && *f == 0) {
                continue;
            }
            match tally.add(mode, &counts).await {
                Ok(()) => {
                    flushed = true;
                    failing = false;
                }
                Err(e) => {
                    // Put them back: the next flush tries again.
                    for (((_, n, f), slot), filtered) in
                        counts.iter().zip(&shared.delivered).zip(&shared.filtered)
                    {
                        slot[read as usize].fetch_add(*n as u64, Ordering::Relaxed);
                        filtered[read as usize].fetch_add(*f as u64, Ordering::Relaxed);
                    }
                    if !failing {
                        failing = true;
                        tracing::warn!(error = %sanitize_error(&e.to_string()), "counting deliveries by minute failed (is the schema migrated, and the relay role granted deliveries_by_minute?); status and the console undercount until it works; trying again");
                    }
                }
            }
        }
        // Old rows go hourly, and only where this relay counts anything: an
        // idle outbox (of hundreds served) sends no statement at all.
        if flushed && forgot.is_none_or(|t| t.elapsed() >= FORGET_EVERY) {
            forgot = Some(Instant::now());
            if let Err(e) = tally.forget_old().await {
                tracing::debug!(error = %sanitize_error(&e.to_string()), "deleting old delivery counts failed");
            }
        }
        if stopping {
            return;
        }
    }
}

//! Bulk actions on dead letters, run in the background batch by batch, with
//! progress and cancellation. Each batch is its own transaction with its own
//! audit entry (`store::dlq`), so a cancelled action leaves exactly what its
//! audit entries say.

use chrono::{DateTime, Utc};
use postbox_store::{Action, DeadLetters, Progress, Selection};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Bulk actions running at once, across users.
pub(crate) const MAX_RUNNING: usize = 4;
/// Finished actions kept to be looked at.
const KEEP_FINISHED: usize = 100;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum JobState {
    Running,
    Finished,
    Cancelled,
    Failed,
}

impl JobState {
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Running => "running",
            JobState::Finished => "finished",
            JobState::Cancelled => "cancelled",
            JobState::Failed => "failed",
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Job {
    pub id: Uuid,
    /// The outbox whose dead letters it acts on (its name).
    pub outbox: String,
    pub owner: String,
    /// `replay` or `discard`.
    pub verb: &'static str,
    /// What was selected, for people.
    pub what: String,
    pub total: u64,
    pub done: u64,
    pub batches: u64,
    pub skipped: usize,
    pub state: JobState,
    pub started_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    cancel: CancellationToken,
}

#[derive(Clone, Default)]
pub(crate) struct Jobs {
    all: Arc<Mutex<HashMap<Uuid, Job>>>,
}

/// Too many bulk actions are running.
pub(crate) struct Busy;

impl Jobs {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Job>> {
        match self.all.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    pub fn get(&self, id: Uuid) -> Option<Job> {
        self.lock().get(&id).cloned()
    }

    /// The newest actions on `outbox` first.
    pub fn recent(&self, outbox: &str, n: usize) -> Vec<Job> {
        let mut jobs: Vec<Job> = self
            .lock()
            .values()
            .filter(|j| j.outbox == outbox)
            .cloned()
            .collect();
        jobs.sort_by_key(|j| std::cmp::Reverse(j.started_at));
        jobs.truncate(n);
        jobs
    }

    /// Ask a running action to stop after its current batch.
    pub fn cancel(&self, id: Uuid) -> bool {
        match self.lock().get(&id) {
            Some(job) if job.state == JobState::Running => {
                job.cancel.cancel();
                true
            }
            _ => false,
        }
    }

    pub fn cancel_all(&self) {
        for job in self.lock().values() {
            job.cancel.cancel();
        }
    }

    /// Start `action` on `selection` in the background.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        &self,
        outbox: String,
        dlq: DeadLetters,
        selection: Selection,
        action: Action,
        actor: String,
        owner: String,
        what: String,
        total: u64,
        batch: i64,
    ) -> Result<Uuid, Busy> {
        let id = Uuid::now_v7();
        let cancel = CancellationToken::new();
        {
            let mut all = self.lock();
            if all
                .values()
                .filter(|j| j.state == JobState::Running)
                .count()
                >= MAX_RUNNING
            {
                return Err(Busy);
            }
            if all.len() >= KEEP_FINISHED {
                let mut finished: Vec<(DateTime<Utc>, Uuid)> = all
                    .values()
                    .filter(|j| j.state != JobState::Running)
                    .map(|j| (j.started_at, j.id))
                    .collect();
                finished.sort();
                for (_, old) in finished.iter().take(all.len() + 1 - KEEP_FINISHED) {
                    all.remove(old);
                }
            }
            all.insert(
                id,
                Job {
                    id,
                    outbox,
                    owner,
                    verb: match action {
                        Action::Discard { .. } => "discard",
                        _ => "replay",
                    },
                    what,
                    total,
                    done: 0,
                    batches: 0,
                    skipped: 0,
                    state: JobState::Running,
                    started_at: Utc::now(),
                    finished_at: None,
                    cancel: cancel.clone(),
                },
            );
        }
        let jobs = self.clone();
        tokio::spawn(async move {
            let progress_jobs = jobs.clone();
            let stop = cancel.clone();
            let result = dlq
                .apply_until(
                    &selection,
                    &action,
                    &actor,
                    batch,
                    |p: Progress| {
                        if let Some(job) = progress_jobs.lock().get_mut(&id) {
                            job.done = p.done;
                            job.total = p.total.max(p.done);
                            job.batches += 1;
                        }
                    },
                    move || stop.is_cancelled(),
                )
                .await;
            let mut all = jobs.lock();
            let Some(job) = all.get_mut(&id) else {
                return;
            };
            job.finished_at = Some(Utc::now());
            match result {
                Ok(applied) => {
                    job.done = applied.count;
                    job.batches = applied.batches;
                    if cancel.is_cancelled() {
                        job.state = JobState::Cancelled;
                    } else {
                        job.state = JobState::Finished;
                        job.skipped = applied.skipped.len();
                    }
                }
                Err(e) => {
                    tracing::error!(
                        job = %id,
                        error = %postbox::redact::sanitize_error(&e.to_string()),
                        "bulk dead-letter action failed"
                    );
                    job.state = JobState::Failed;
                }
            }
        });
        Ok(id)
    }
}

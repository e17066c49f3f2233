//! Speaking up while a destination is down: retries are routine (debug
//! level), but a destination that keeps failing gets a WARN when it starts,
//! then at least once every [`WARN_EVERY`] while it lasts (what fails, since
//! when, how many attempts failed, what is waiting), and an INFO when it
//! delivers again.

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

/// How often a destination that keeps failing is reported again.
pub const WARN_EVERY: Duration = Duration::from_secs(60);

/// One destination's run of failures.
#[derive(Debug, Default)]
pub struct Trouble {
    state: Mutex<Option<Run>>,
}

#[derive(Debug)]
struct Run {
    started: Instant,
    since: SystemTime,
    failed: u64,
    last_warned: Instant,
}

/// What to say after a publish round.
#[derive(Debug, PartialEq, Eq)]
pub enum Report {
    Nothing,
    /// It keeps failing: `failed` attempts over `lasting`, since `since`.
    Failing {
        since: SystemTime,
        lasting: Duration,
        failed: u64,
    },
    /// It delivered again after `lasted` and `failed` failed attempts.
    Recovered {
        lasted: Duration,
        failed: u64,
    },
}

impl Trouble {
    /// Record a round: `delivered` events took, `failed` must be retried.
    /// A round that delivered anything ends the run of failures; one that
    /// only failed extends it (a round of rejections or deferrals says
    /// nothing about the destination being reachable).
    pub fn observe(&self, now: Instant, delivered: usize, failed: usize) -> Report {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if delivered > 0 {
            return match state.take() {
                Some(run) => Report::Recovered {
                    lasted: now.saturating_duration_since(run.started),
                    failed: run.failed,
                },
                None => Report::Nothing,
            };
        }
        if failed == 0 {
            return Report::Nothing;
        }
        match state.as_mut() {
            None => {
                let since = SystemTime::now();
                *state = Some(Run {
                    started: now,
                    since,
                    failed: failed as u64,
                    last_warned: now,
                });
                Report::Failing {
                    since,
                    lasting: Duration::ZERO,
                    failed: failed as u64,
                }
            }
            Some(run) => {
                run.failed += failed as u64;
                if now.saturating_duration_since(run.last_warned) < WARN_EVERY {
                    return Report::Nothing;
                }
                run.last_warned = now;
                Report::Failing {
                    since: run.since,
                    lasting: now.saturating_duration_since(run.started),
                    failed: run.failed,
                }
            }
        }
    }
}

/// A duration for people: whole seconds.
pub fn whole_seconds(d: Duration) -> String {
    humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warns_at_once_then_once_a_minute_then_reports_the_recovery() {
        let t = Trouble::default();
        let start = Instant::now();
        assert!(matches!(
            t.observe(start, 0, 10),
            Report::Failing { failed: 10, .. }
        ));
        for s in 1..60 {
            assert_eq!(
                t.observe(start + Duration::from_secs(s), 0, 1),
                Report::Nothing,
                "quiet within the minute ({s} s)"
            );
        }
        match t.observe(start + Duration::from_secs(61), 0, 1) {
            Report::Failing {
                lasting, failed, ..
            } => {
                assert_eq!(lasting, Duration::from_secs(61));
                assert_eq!(failed, 10 + 59 + 1);
            }
            other => panic!("expected a second warning, got {other:?}"),
        }
        assert_eq!(
            t.observe(start + Duration::from_secs(62), 0, 1),
            Report::Nothing
        );
        assert_eq!(
            t.observe(start + Duration::from_secs(90), 5, 0),
            Report::Recovered {
                lasted: Duration::from_secs(90),
                failed: 71
            }
        );
        assert_eq!(
            t.observe(start + Duration::from_secs(91), 5, 0),
            Report::Nothing,
            "said once"
        );
    }

    #[test]
    fn rejections_alone_are_not_trouble() {
        let t = Trouble::default();
        assert_eq!(t.observe(Instant::now(), 0, 0), Report::Nothing);
    }
}

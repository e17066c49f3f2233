//! The end of a checker run: the checks (what the database, the producers'
//! ledger and the consumer saw must agree on) and the report, as text or JSON
//! (`--json`; the field names are the JSON keys).

use super::consumer::Seen;
use super::faults::FaultCounters;
use super::tables::Tables;
use super::workload::Ledger;
use crate::{lock, AnyError};
use sqlx::PgPool;
use std::collections::HashSet;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use uuid::Uuid;

/// Violating event ids kept per check.
const SHOW: usize = 20;

/// The figures and findings of one run.
#[derive(Debug, Default, serde::Serialize)]
pub struct ContractReport {
    pub passed: bool,
    pub sink: String,
    /// A pull run: a consumer group's readers instead of relays and a
    /// broker (the "relays" are `postbox group serve` children over HTTP).
    pub pull: bool,
    /// The relays' reading mode: claim or log.
    pub mode: String,
    /// The relays' `relay.synchronous_commit`.
    pub relay_synchronous_commit: bool,
    /// The bug planted on purpose (`--plant`), if any.
    pub planted: Option<String>,
    pub relays: usize,
    pub ordered: bool,
    pub seed: u64,
    pub duration_seconds: f64,
    pub drain_seconds: f64,
    pub failpoints: String,
    pub transactions_committed: u64,
    pub transactions_rolled_back: u64,
    pub transactions_aborted_by_faults: u64,
    pub commit_outcomes_lost: u64,
    pub events_committed: u64,
    pub events_not_committed: u64,
    pub deliveries: u64,
    pub duplicates: u64,
    pub redeliveries: u64,
    pub effects_applied: u64,
    pub consumer_batches_retried: u64,
    pub consumer_acks_dropped: u64,
    pub relay_starts: u64,
    pub relay_kills: u64,
    pub relay_failpoint_exits: u64,
    pub relay_unexpected_exits: u64,
    pub faults: FaultCounters,
    pub dead_letters: i64,
    /// Committed events never delivered.
    pub lost: Vec<Uuid>,
    pub lost_count: usize,
    /// Events whose transaction did not commit, delivered anyway.
    pub rolled_back_delivered: Vec<Uuid>,
    /// Effects applied other than once: (event id, times).
    pub effects_not_once: Vec<(Uuid, i32)>,
    /// Events the producers saw committed whose business row is missing.
    pub commits_missing: Vec<Uuid>,
    /// Deliveries of ids no producer made, or bodies that were not events.
    pub unknown_deliveries: u64,
    pub order_violations: Vec<String>,
    pub order_violation_count: usize,
    pub schema: String,
    pub logs: String,
    /// The replay beside the run (`--replay`).
    pub replay: Option<super::replay::ReplayReport>,
}

impl ContractReport {
    /// Check what the run's tables hold against what the producers and the
    /// consumer saw: the findings and the figures; whether the run passed.
    pub async fn check(
        tables: &Tables,
        pool: &PgPool,
        ledger: &Ledger,
        seen: &Seen,
    ) -> Result<ContractReport, AnyError> {
        let committed = tables.produced(pool).await?;
        let effects = tables.effects(pool).await?;
        let mut r = ContractReport::default();
        r.find_violations(&committed, &effects, ledger, seen);
        r.count(&committed, &effects, ledger, seen);
        r.passed = r.lost_count == 0
            && r.rolled_back_delivered.is_empty()
            && r.effects_not_once.is_empty()
            && r.commits_missing.is_empty()
            && r.unknown_deliveries == 0
            && r.order_violation_count == 0
            && seen.malformed.load(Ordering::Relaxed) == 0;
        Ok(r)
    }

    fn find_violations(
        &mut self,
        committed: &HashSet<Uuid>,
        effects: &[(Uuid, i32)],
        ledger: &Ledger,
        seen: &Seen,
    ) {
        let applied: HashSet<Uuid> = effects.iter().map(|(id, _)| *id).collect();
        let known_committed = lock(&ledger.committed);
        let rolled_back = lock(&ledger.rolled_back);
        let uncertain = lock(&ledger.uncertain);
        let by_event = lock(&seen.by_event);

        let lost: Vec<Uuid> = committed.difference(&applied).copied().collect();
        self.lost_count = lost.len();
        self.lost = first(lost);

        let mut not_committed: HashSet<Uuid> = rolled_back.iter().copied().collect();
        not_committed.extend(uncertain.iter().filter(|id| !committed.contains(id)));
        self.rolled_back_delivered = first(
            not_committed
                .iter()
                .filter(|id| by_event.contains_key(id) || applied.contains(id))
                .copied()
                .collect(),
        );
        self.effects_not_once = first(effects.iter().filter(|(_, n)| *n != 1).copied().collect());
        self.commits_missing = first(known_committed.difference(committed).copied().collect());
        self.unknown_deliveries = by_event
            .keys()
            .filter(|id| !committed.contains(id) && !not_committed.contains(id))
            .count() as u64;
        self.events_not_committed = not_committed.len() as u64;

        let violations = lock(&seen.order_violations);
        self.order_violation_count = violations.len();
        self.order_violations = violations.iter().take(SHOW).cloned().collect();
    }

    fn count(
        &mut self,
        committed: &HashSet<Uuid>,
        effects: &[(Uuid, i32)],
        ledger: &Ledger,
        seen: &Seen,
    ) {
        self.transactions_committed = count(&ledger.tx_committed);
        self.transactions_rolled_back = count(&ledger.tx_rolled_back);
        self.transactions_aborted_by_faults = count(&ledger.tx_aborted);
        self.commit_outcomes_lost = count(&ledger.tx_uncertain);
        self.events_committed = committed.len() as u64;
        self.deliveries = count(&seen.deliveries);
        self.duplicates = count(&seen.duplicates);
        self.redeliveries = count(&seen.redeliveries);
        self.effects_applied = effects.len() as u64;
        self.consumer_batches_retried = count(&seen.retried_batches);
        self.consumer_acks_dropped = count(&seen.acks_dropped);
    }

    /// The report as text.
    pub fn text(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "ran {:.0} s, drained in {:.1} s ({} mode, relay.synchronous_commit = {})",
            self.duration_seconds, self.drain_seconds, self.mode, self.relay_synchronous_commit
        );
        self.write_figures(&mut o);
        self.write_checks(&mut o);
        self.write_replay(&mut o);
        self.write_violations(&mut o);
        let _ = writeln!(
            o,
            "{}",
            if self.passed {
                "PASS: every committed event delivered at least once and applied exactly once; no rolled-back event delivered."
            } else {
                "FAIL"
            }
        );
        o
    }

    fn write_figures(&self, o: &mut String) {
        let (r, f) = (self, &self.faults);
        line(
            o,
            "transactions committed",
            r.transactions_committed.to_string(),
        );
        line(
            o,
            "transactions rolled back",
            r.transactions_rolled_back.to_string(),
        );
        line(
            o,
            "transactions failed by faults",
            format!(
                "{} before the commit, {} with the commit's outcome lost",
                r.transactions_aborted_by_faults, r.commit_outcomes_lost
            ),
        );
        line(o, "events committed", r.events_committed.to_string());
        line(
            o,
            "events not committed",
            r.events_not_committed.to_string(),
        );
        line(o, "deliveries to the consumer", r.deliveries.to_string());
        line(
            o,
            "duplicates absorbed by the inbox",
            r.duplicates.to_string(),
        );
        line(o, "redeliveries by the broker", r.redeliveries.to_string());
        line(o, "effects applied", r.effects_applied.to_string());
        if r.pull {
            line(
                o,
                "group servers started / killed",
                format!("{} / {}", r.relay_starts, r.relay_kills),
            );
            line(o, "readers killed", count(&f.reader_kills).to_string());
        } else {
            line(
                o,
                "relays started / killed / failpoint exits",
                format!(
                    "{} / {} / {}",
                    r.relay_starts, r.relay_kills, r.relay_failpoint_exits
                ),
            );
        }
        if r.relay_unexpected_exits > 0 {
            line(
                o,
                "relay exits not caused by verify",
                r.relay_unexpected_exits.to_string(),
            );
        }
        line(
            o,
            "relays stalled past their lease",
            count(&f.relay_stalls).to_string(),
        );
        line(
            o,
            "sink resets / outages / hangs / stalls",
            format!(
                "{} / {} / {} / {}",
                count(&f.sink_resets),
                count(&f.sink_outages),
                count(&f.sink_hangs),
                count(&f.sink_stalls)
            ),
        );
        line(
            o,
            "database resets / outages / stalls",
            format!(
                "{} / {} / {}",
                count(&f.db_resets),
                count(&f.db_outages),
                count(&f.db_stalls)
            ),
        );
        line(
            o,
            "PostgreSQL crashes survived",
            format!(
                "{} (longest recovery {} ms)",
                count(&f.db_crashes),
                count(&f.db_crash_longest_downtime_ms)
            ),
        );
        line(
            o,
            "consumer batches retried / acks dropped",
            format!(
                "{} / {}",
                r.consumer_batches_retried, r.consumer_acks_dropped
            ),
        );
        line(o, "dead letters", r.dead_letters.to_string());
    }

    fn write_checks(&self, o: &mut String) {
        let r = self;
        let verdict = |ok: bool| if ok { "ok" } else { "FAILED" };
        let _ = writeln!(o, "checks");
        line(
            o,
            "every committed event delivered",
            verdict(r.lost_count == 0).into(),
        );
        line(
            o,
            "no rolled-back event delivered",
            verdict(r.rolled_back_delivered.is_empty() && r.unknown_deliveries == 0).into(),
        );
        line(
            o,
            "every effect applied exactly once",
            verdict(r.effects_not_once.is_empty()).into(),
        );
        line(
            o,
            "per-aggregate order held",
            if r.ordered {
                verdict(r.order_violation_count == 0).into()
            } else {
                "not checked (run with --ordered)".into()
            },
        );
    }

    fn write_replay(&self, o: &mut String) {
        let Some(r) = &self.replay else { return };
        let _ = writeln!(
            o,
            "replay beside the run ({} created {} to {})",
            r.source, r.from, r.to
        );
        line(o, "events in its range", r.events.to_string());
        line(
            o,
            "delivered to its list / bodies received",
            format!("{} / {}", r.delivered, r.received),
        );
        line(
            o,
            "runner started / killed",
            format!("{} / {}", r.runner_starts, r.runner_kills),
        );
        line(
            o,
            "every event of the range delivered",
            if r.missing_count == 0 { "ok" } else { "FAILED" }.into(),
        );
        line(
            o,
            "nothing outside the range delivered",
            if r.outside_count == 0 { "ok" } else { "FAILED" }.into(),
        );
        if r.missing_count > 0 {
            let _ = writeln!(
                o,
                "REPLAY MISSED: {} events of its range never reached its list:\n    {}",
                r.missing_count,
                ids(&r.missing, r.missing_count)
            );
        }
        if r.outside_count > 0 {
            let _ = writeln!(
                o,
                "REPLAY OUTSIDE ITS RANGE: {} bodies:\n    {}",
                r.outside_count,
                ids(&r.outside, r.outside_count)
            );
        }
    }

    fn write_violations(&self, o: &mut String) {
        let r = self;
        if r.lost_count > 0 {
            let _ = writeln!(
                o,
                "LOST: {} committed events were never delivered:\n    {}",
                r.lost_count,
                ids(&r.lost, r.lost_count)
            );
        }
        if !r.rolled_back_delivered.is_empty() {
            let _ = writeln!(
                o,
                "DELIVERED AFTER ROLLBACK:\n    {}",
                ids(&r.rolled_back_delivered, r.rolled_back_delivered.len())
            );
        }
        if r.unknown_deliveries > 0 {
            let _ = writeln!(
                o,
                "UNKNOWN: {} delivered ids no producer made",
                r.unknown_deliveries
            );
        }
        if !r.effects_not_once.is_empty() {
            let list: Vec<String> = r
                .effects_not_once
                .iter()
                .map(|(id, n)| format!("{id} applied {n} times"))
                .collect();
            let _ = writeln!(o, "EFFECTS NOT ONCE:\n    {}", list.join("\n    "));
        }
        if !r.commits_missing.is_empty() {
            let _ = writeln!(
                o,
                "COMMITTED BUT MISSING from the database:\n    {}",
                ids(&r.commits_missing, r.commits_missing.len())
            );
        }
        if r.order_violation_count > 0 {
            let _ = writeln!(
                o,
                "ORDER: {} events applied out of sequence:\n    {}",
                r.order_violation_count,
                r.order_violations.join("\n    ")
            );
        }
    }
}

/// The first [`SHOW`] of `items`, in order.
fn first<T: Ord>(mut items: Vec<T>) -> Vec<T> {
    items.sort_unstable();
    items.truncate(SHOW);
    items
}

fn count(n: &AtomicU64) -> u64 {
    n.load(Ordering::Relaxed)
}

/// One figure of the report.
fn line(o: &mut String, label: &str, value: String) {
    let _ = writeln!(o, "  {label:<42} {value}");
}

/// Event ids, one per line, with how many more there were.
fn ids(v: &[Uuid], total: usize) -> String {
    let mut s: Vec<String> = v.iter().map(Uuid::to_string).collect();
    if total > v.len() {
        s.push(format!("… ({} more)", total - v.len()));
    }
    s.join("\n    ")
}

//! What `postbox bench` measured, and how it is printed: a table, or JSON
//! (`--json`; the field names are the JSON keys).

use super::store::TableSize;
use serde::Serialize;

#[derive(Debug, Default, Serialize)]
pub struct BenchReport {
    pub machine: Machine,
    pub drain: Option<Drain>,
    pub latency: Vec<Latency>,
    pub scale: Vec<Scale>,
    /// The scale-out run in log mode: relays sharing one log's partitions.
    pub log_scale: Vec<LogScale>,
    pub ordered: Option<Ordered>,
    pub producer: Option<Producer>,
    pub sustained: Option<Sustained>,
    /// The sustained run in log mode, autovacuum off and no vacuum step.
    pub log_sustained: Option<LogSustained>,
    pub tenants: Option<super::tenants::Tenants>,
    /// Consumer groups read over SQL, against PgQ's consumer API.
    pub groups: Option<Groups>,
}

/// Consumer groups: `events` received and acknowledged `batch_size` at a
/// time, per reader setup, each run twice (the order reversed).
#[derive(Debug, Serialize)]
pub struct Groups {
    pub events: i64,
    pub batch_size: i32,
    pub rows: Vec<GroupsRow>,
    /// Why PgQ's row is missing, when `--peers pgq` asked for it.
    pub pgq_skipped: Option<String>,
    /// Commit to a long-polling reader (SQL, HTTP) at the latency rate.
    pub latency: Vec<Latency>,
}

#[derive(Debug, Serialize)]
pub struct GroupsRow {
    pub reader: String,
    pub readers: usize,
    pub rounds_events_per_s: Vec<f64>,
    /// The rounds' mean.
    pub events_per_s: f64,
    /// Against PgQ's consumer API in the same run.
    pub vs_pgq: Option<f64>,
}

#[derive(Debug, Serialize)]
pub struct Sustained {
    pub rate: u64,
    pub duration_s: f64,
    pub events: u64,
    /// Samples of the outbox table: seconds since the start, sizes, pending.
    pub samples: Vec<Sample>,
    pub relay_peak_rss_mb: f64,
}

/// The sustained run in log mode: producers append to the log, one relay
/// reads it; the log's segments (table and indexes) and the outbox sampled.
#[derive(Debug, Serialize)]
pub struct LogSustained {
    pub rate: u64,
    pub duration_s: f64,
    pub events: u64,
    /// Events the relay delivered (what the sink received).
    pub delivered: u64,
    pub samples: Vec<LogSample>,
    pub relay_peak_rss_mb: f64,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct LogSample {
    pub at_s: f64,
    /// The log's segments: table and index bytes, dead tuples.
    pub log_table_bytes: i64,
    pub log_index_bytes: i64,
    pub log_dead_tuples: i64,
    /// The outbox (only what a destination did not take goes there).
    pub outbox_table_bytes: i64,
    pub outbox_dead_tuples: i64,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Sample {
    pub at_s: f64,
    pub table_bytes: i64,
    pub index_bytes: i64,
    pub dead_tuples: i64,
    pub pending: i64,
}

#[derive(Debug, Serialize)]
pub struct Ordered {
    pub events: i64,
    pub aggregates: i64,
    pub unordered_events_per_s: f64,
    pub ordered_events_per_s: f64,
    pub ordered_vs_unordered: f64,
}

#[derive(Debug, Default, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub postgres: String,
    pub sink: String,
}

/// What one reader's drain cost in CPU, per million events delivered.
#[derive(Debug, Serialize)]
pub struct Cost {
    /// `claim`, `log`, `logical` (the relay in that mode) or `pgq` (PgQ's consumer).
    pub reader: &'static str,
    /// The reader's process: the relay, or the bench's PgQ consumer.
    pub reader_cpu_s_per_million: f64,
    /// The PostgreSQL server's processes meanwhile, when it runs on this
    /// machine.
    pub postgres_cpu_s_per_million: Option<f64>,
}

/// The drain's events through PgQ's canonical consumer into the same sink.
#[derive(Debug, Serialize)]
pub struct PgqDrain {
    pub events_per_s: f64,
    /// Log mode's rate over PgQ's.
    pub log_vs_pgq: f64,
}

#[derive(Debug, Serialize)]
pub struct Drain {
    pub events: i64,
    pub batch_size: u32,
    pub relay_events_per_s: f64,
    pub relay_peak_rss_mb: f64,
    pub ceiling_events_per_s: f64,
    pub naive_events: i64,
    pub naive_events_per_s: f64,
    pub relay_vs_ceiling: f64,
    pub relay_vs_naive: f64,
    pub table_after: TableSize,
    /// WAL the claim-mode drain wrote, per event (relay side).
    pub wal_bytes_per_event: f64,
    /// The same events through a relay in log mode.
    pub log_relay_events_per_s: f64,
    pub log_relay_peak_rss_mb: f64,
    pub log_wal_bytes_per_event: f64,
    pub log_vs_claim: f64,
    pub log_vs_naive: f64,
    /// The same events through log mode's page query and cursor moves in
    /// SQL alone.
    pub log_ceiling_events_per_s: f64,
    pub log_vs_log_ceiling: f64,
    /// The same events read with log mode's page statement over one
    /// connection, received and not decoded, nothing sent on: what one log
    /// reader's connection can carry (the ceiling above never leaves the
    /// server).
    pub log_read_events_per_s: f64,
    pub log_vs_log_read: f64,
    /// The log's partitions after the log-mode drain.
    pub log_after: TableSize,
    /// The same number of events emitted into the WAL (`emit`, in
    /// transactions of `logical_events_per_transaction`) through a relay in
    /// logical mode reading a replication slot.
    pub logical_events_per_transaction: i64,
    pub logical_relay_events_per_s: f64,
    pub logical_relay_peak_rss_mb: f64,
    pub logical_vs_log: f64,
    pub logical_vs_claim: f64,
    pub logical_vs_naive: f64,
    /// One transaction of this many emitted events, drained by a relay in
    /// logical mode: its rate and the relay's peak RSS (a transaction is
    /// never held in memory).
    pub logical_big_transaction_events: i64,
    pub logical_big_transaction_events_per_s: f64,
    pub logical_big_transaction_peak_rss_mb: f64,
    /// PgQ's consumer on the same events (`--peers pgq`).
    pub pgq: Option<PgqDrain>,
    /// Log mode with a filter and a transform, against the same drain without.
    pub shaped: ShapedDrain,
    /// CPU per million events, per reader.
    pub cost: Vec<Cost>,
}

/// Log-mode drains with a filter and a transform on the sink and without
/// them, two rounds each, alternating.
#[derive(Debug, Serialize)]
pub struct ShapedDrain {
    pub filter: &'static str,
    pub transform: &'static str,
    pub events_per_s: f64,
    pub without_events_per_s: f64,
    pub vs_without: f64,
}

/// Producers committing one event per transaction as fast as they can,
/// with `enqueue` (a row in the outbox and a sequence counter row), with
/// `emit` (the WAL only: the default) and with `emit` numbering its events
/// (`migrate --emit-sequence on`: a sequence counter row per aggregate).
#[derive(Debug, Serialize)]
pub struct Producer {
    pub producers: usize,
    pub duration_s: f64,
    pub enqueue_commits_per_s: f64,
    pub emit_commits_per_s: f64,
    pub emit_vs_enqueue: f64,
    pub emit_numbered_commits_per_s: f64,
    pub emit_numbered_vs_enqueue: f64,
    /// Rows in the outbox, the log and the sequence counters after each
    /// run (every event has an aggregate of its own).
    pub enqueue_table_rows: i64,
    pub emit_table_rows: i64,
    pub emit_numbered_table_rows: i64,
}

#[derive(Debug, Serialize)]
pub struct Latency {
    pub mode: String,
    pub rate: u64,
    /// Events per second the producers committed (each commit waits for a flush).
    pub achieved_rate: f64,
    pub events: usize,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

#[derive(Debug, Serialize)]
pub struct Scale {
    pub relays: usize,
    pub events: i64,
    pub events_per_s: f64,
    pub peak_rss_mb: f64,
}

/// Relays draining one log together, its destination's cursor split into
/// `partitions`.
#[derive(Debug, Serialize)]
pub struct LogScale {
    pub relays: usize,
    pub partitions: u16,
    pub events: i64,
    pub events_per_s: f64,
    /// Against one relay on the same log in the same run.
    pub vs_one_relay: f64,
    /// Messages the sink received beyond one per event.
    pub duplicates: i64,
    pub peak_rss_mb: f64,
}

pub(super) fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

pub(super) fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

pub(super) fn print_table(r: &BenchReport) {
    crate::outln!(
        "postbox bench: {} CPUs, PostgreSQL {}, sink {}",
        r.machine.cpus,
        r.machine.postgres,
        r.machine.sink
    );
    if let Some(d) = &r.drain {
        crate::outln!();
        crate::outln!("drain ({} events, batch {})", d.events, d.batch_size);
        crate::outln!(
            "  relay → sink               {:>9.0} events/s   peak RSS {:.1} MB",
            d.relay_events_per_s,
            d.relay_peak_rss_mb
        );
        crate::outln!(
            "  pure-SQL ceiling           {:>9.0} events/s   relay = {:.2} × ceiling",
            d.ceiling_events_per_s,
            d.relay_vs_ceiling
        );
        crate::outln!(
            "  naive relay ({:>6} ev.)   {:>9.0} events/s   relay = {:.1} × naive",
            d.naive_events,
            d.naive_events_per_s,
            d.relay_vs_naive
        );
        crate::outln!(
            "  outbox after the drain: table {:.1} MB, indexes {:.1} MB, {} dead tuples; WAL {:.0} bytes/event",
            d.table_after.table_bytes as f64 / 1e6,
            d.table_after.index_bytes as f64 / 1e6,
            d.table_after.dead_tuples,
            d.wal_bytes_per_event
        );
        crate::outln!(
            "  relay in log mode          {:>9.0} events/s   peak RSS {:.1} MB   = {:.2} × claim mode, {:.1} × naive",
            d.log_relay_events_per_s, d.log_relay_peak_rss_mb, d.log_vs_claim, d.log_vs_naive
        );
        crate::outln!(
            "  pure-SQL log ceiling       {:>9.0} events/s   log relay = {:.2} × log ceiling",
            d.log_ceiling_events_per_s,
            d.log_vs_log_ceiling
        );
        crate::outln!(
            "  log pages over the wire    {:>9.0} events/s   log relay = {:.2} × (one connection reading the pages; rows neither decoded nor sent)",
            d.log_read_events_per_s,
            d.log_vs_log_read
        );
        crate::outln!(
            "  log mode, filter+transform {:>9.0} events/s   = {:.2} × the same drain without them ({:.0} events/s; two rounds each, alternating)",
            d.shaped.events_per_s, d.shaped.vs_without, d.shaped.without_events_per_s
        );
        crate::outln!(
            "  log after the drain: table {:.1} MB, indexes {:.1} MB, {} dead tuples; WAL {:.0} bytes/event",
            d.log_after.table_bytes as f64 / 1e6,
            d.log_after.index_bytes as f64 / 1e6,
            d.log_after.dead_tuples,
            d.log_wal_bytes_per_event
        );
        crate::outln!(
            "  relay in logical mode      {:>9.0} events/s   peak RSS {:.1} MB   = {:.2} × log mode, {:.2} × claim mode, {:.1} × naive ({} events per emitting transaction)",
            d.logical_relay_events_per_s,
            d.logical_relay_peak_rss_mb,
            d.logical_vs_log,
            d.logical_vs_claim,
            d.logical_vs_naive,
            d.logical_events_per_transaction
        );
        crate::outln!(
            "  logical, one transaction of {} events: {:.0} events/s, relay peak RSS {:.1} MB",
            d.logical_big_transaction_events,
            d.logical_big_transaction_events_per_s,
            d.logical_big_transaction_peak_rss_mb
        );
        if let Some(p) = &d.pgq {
            crate::outln!(
                "  PgQ's consumer → sink      {:>9.0} events/s   log relay = {:.2} × PgQ",
                p.events_per_s,
                p.log_vs_pgq
            );
        }
        crate::outln!("  CPU per million events delivered (reader + PostgreSQL server):");
        for c in &d.cost {
            let server = c
                .postgres_cpu_s_per_million
                .map_or_else(|| "not on this machine".to_owned(), |s| format!("{s:.1} s"));
            let reader = if c.reader == "pgq" {
                "PgQ consumer"
            } else {
                c.reader
            };
            crate::outln!(
                "    {reader:<12} reader {:>6.1} s + server {server}",
                c.reader_cpu_s_per_million
            );
        }
    }
    if let Some(p) = &r.producer {
        crate::outln!();
        crate::outln!(
            "producer cost ({} producers, one event per transaction, {:.0} s each)",
            p.producers,
            p.duration_s
        );
        crate::outln!(
            "  enqueue (row + counter)    {:>9.0} commits/s   table rows written {}",
            p.enqueue_commits_per_s,
            p.enqueue_table_rows
        );
        crate::outln!(
            "  emit (WAL only)            {:>9.0} commits/s   table rows written {}   = {:.2} × enqueue",
            p.emit_commits_per_s,
            p.emit_table_rows,
            p.emit_vs_enqueue
        );
        crate::outln!(
            "  emit, numbered (counters)  {:>9.0} commits/s   table rows written {}   = {:.2} × enqueue",
            p.emit_numbered_commits_per_s,
            p.emit_numbered_table_rows,
            p.emit_numbered_vs_enqueue
        );
    }
    if !r.latency.is_empty() {
        crate::outln!();
        let label = |l: &Latency| format!("{} ({}/s)", l.mode, l.rate);
        let heading = "commit-to-Redis latency (target rate)";
        // The label column is as wide as the longest label, so the figures
        // line up under their headings.
        let width = r
            .latency
            .iter()
            .map(|l| label(l).len())
            .fold(heading.len() - 2, usize::max);
        crate::outln!(
            "{heading:<w$}   committed/s   events   p50 ms   p95 ms   p99 ms   max ms",
            w = width + 2
        );
        for l in &r.latency {
            crate::outln!(
                "  {:<width$} {:>13.0} {:>8} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
                label(l),
                l.achieved_rate,
                l.events,
                l.p50_ms,
                l.p95_ms,
                l.p99_ms,
                l.max_ms
            );
        }
    }
    if let Some(g) = &r.groups {
        crate::outln!();
        crate::outln!(
            "consumer groups ({} events, {} per receive, no sink; mean of 2 rounds, order reversed in the second)",
            g.events,
            g.batch_size
        );
        for row in &g.rows {
            crate::outln!(
                "  {:<30} {:>9.0} events/s{}",
                row.reader,
                row.events_per_s,
                row.vs_pgq
                    .filter(|_| !row.reader.starts_with("PgQ"))
                    .map(|v| format!("   = {v:.2} × PgQ"))
                    .unwrap_or_default()
            );
        }
        if let Some(why) = &g.pgq_skipped {
            crate::outln!("  PgQ skipped: {why}");
        }
        for l in &g.latency {
            crate::outln!(
                "  commit → {:<26} {:>5.0}/s   p50 {:>6.2} ms   p95 {:>6.2} ms   p99 {:>6.2} ms   max {:>7.2} ms",
                l.mode,
                l.achieved_rate,
                l.p50_ms,
                l.p95_ms,
                l.p99_ms,
                l.max_ms
            );
        }
    }
    if let Some(o) = &r.ordered {
        crate::outln!();
        crate::outln!(
            "ordered ({} events over {} aggregates)",
            o.events,
            o.aggregates
        );
        crate::outln!(
            "  unordered                  {:>9.0} events/s",
            o.unordered_events_per_s
        );
        crate::outln!(
            "  --ordered                  {:>9.0} events/s   = {:.2} × unordered",
            o.ordered_events_per_s,
            o.ordered_vs_unordered
        );
    }
    if let Some(s) = &r.sustained {
        crate::outln!();
        crate::outln!(
            "sustained ({} events/s for {:.0} s, {} events, retention on; relay peak RSS {:.1} MB)",
            s.rate,
            s.duration_s,
            s.events,
            s.relay_peak_rss_mb
        );
        crate::outln!("  at s     table MB  indexes MB  dead tuples   pending");
        for x in &s.samples {
            crate::outln!(
                "  {:>6.0} {:>10.1} {:>11.1} {:>12} {:>9}",
                x.at_s,
                x.table_bytes as f64 / 1e6,
                x.index_bytes as f64 / 1e6,
                x.dead_tuples,
                x.pending
            );
        }
    }
    if let Some(s) = &r.log_sustained {
        crate::outln!();
        crate::outln!(
            "sustained, log mode ({} events/s asked for {:.0} s, {} events produced ({:.0}/s reached), {} delivered; autovacuum off, no vacuum; relay peak RSS {:.1} MB)",
            s.rate,
            s.duration_s,
            s.events,
            s.events as f64 / s.duration_s.max(1.0),
            s.delivered,
            s.relay_peak_rss_mb
        );
        crate::outln!(
            "  at s   log table MB  log indexes MB  log dead tuples  outbox MB  outbox dead tuples"
        );
        for x in &s.samples {
            crate::outln!(
                "  {:>6.0} {:>12.1} {:>15.1} {:>16} {:>10.2} {:>19}",
                x.at_s,
                x.log_table_bytes as f64 / 1e6,
                x.log_index_bytes as f64 / 1e6,
                x.log_dead_tuples,
                x.outbox_table_bytes as f64 / 1e6,
                x.outbox_dead_tuples
            );
        }
    }
    if let Some(t) = &r.tenants {
        super::tenants::print(t);
    }
    if !r.scale.is_empty() {
        crate::outln!();
        crate::outln!("scale-out ({} events)", r.scale[0].events);
        for s in &r.scale {
            crate::outln!(
                "  {} relay process(es)       {:>9.0} events/s   peak RSS {:.1} MB each",
                s.relays,
                s.events_per_s,
                s.peak_rss_mb
            );
        }
    }
    if !r.log_scale.is_empty() {
        crate::outln!();
        crate::outln!(
            "scale-out, log mode ({} events, one log split into {} partitions)",
            r.log_scale[0].events,
            r.log_scale[0].partitions
        );
        for s in &r.log_scale {
            crate::outln!(
                "  {} relay process(es)       {:>9.0} events/s   = {:.2} × one relay   {} duplicates   peak RSS {:.1} MB each",
                s.relays,
                s.events_per_s,
                s.vs_one_relay,
                s.duplicates,
                s.peak_rss_mb
            );
        }
    }
}

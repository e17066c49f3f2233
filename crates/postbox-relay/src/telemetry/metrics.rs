//! Every metric postbox exports: names, labels, units and histogram buckets.
//!
//! The relay records through the `metrics` facade; nothing is exported until
//! the binary installs a recorder (the CLI's `--metrics-listen` installs a
//! Prometheus one), so a library user pays nothing. All names start with
//! `postbox_`; counters end in `_total`, durations are in seconds.

use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit,
};
use postbox_store::{Gauges, Store};

/// Gauge: events waiting to be claimed (`status = 'pending'`, due or scheduled).
pub const PENDING_EVENTS: &str = "postbox_pending_events";
/// Gauge: age in seconds of the oldest pending event (0 when none is pending).
pub const OLDEST_PENDING_AGE: &str = "postbox_oldest_pending_age_seconds";
/// Gauge: events claimed by some relay and not yet settled.
pub const PROCESSING_EVENTS: &str = "postbox_processing_events";
/// Gauge: dead letters (`status = 'failed'`).
pub const DEAD_LETTERS: &str = "postbox_dead_letters";
/// Counter: what each destination's sink answered per event; labels `outcome`
/// (one of [`OUTCOME_LABELS`]) and `destination` (`default` for `--sink`).
pub const PUBLISH_OUTCOMES: &str = "postbox_publish_outcomes_total";
/// Counter: events a destination's filter (or its routes' filters) kept
/// from it; label `destination`.
pub const FILTERED: &str = "postbox_filtered_events_total";
/// Counter: events on which a destination's filter, transform or headers
/// expression failed (each a dead letter of that destination); labels
/// `destination` and `expression` (`filter`, `transform`, `headers`).
pub const EXPRESSION_FAILURES: &str = "postbox_expression_failures_total";
/// Histogram: the attempt number of each event handed to the sink (1 = first try).
pub const ATTEMPTS: &str = "postbox_publish_attempts";
/// Histogram: seconds one batch spent in the sink.
pub const PUBLISH_LATENCY: &str = "postbox_publish_duration_seconds";
/// Histogram: seconds from the producing transaction's insert to the acknowledgement.
pub const DELIVERY_LATENCY: &str = "postbox_commit_to_delivery_seconds";
/// Counter: events whose lease expired and that were returned to `pending`.
pub const LEASES_RECLAIMED: &str = "postbox_leases_reclaimed_total";
/// Counter: events this relay could not settle because a newer lease held them.
pub const ACKS_LOST: &str = "postbox_acks_lost_total";
/// Counter: events that became dead letters (rejected, or out of attempts).
pub const DEAD_LETTERED: &str = "postbox_dead_lettered_total";
/// Counter: rows removed by retention; label `table` is `outbox`, `inbox` or `idempotency_keys`.
pub const RETENTION_PURGED: &str = "postbox_retention_purged_total";
/// Counters of the HTTP receiver (`postbox receive`): duplicate deliveries
/// absorbed (label `consumer`) and deliveries refused (label `reason`).
pub use postbox::received::{INBOX_DUPLICATES, RECEIVE_REJECTED};
/// Log mode: committed events a destination's cursor has not read (label `destination`).
pub const LOG_LAG_EVENTS: &str = "postbox_log_lag_events";
/// Log mode: age of the oldest event a destination's cursor has not read (0 when caught up).
pub const LOG_LAG_SECONDS: &str = "postbox_log_lag_seconds";
/// Log mode, consumer groups (label `group`): committed events of the
/// group's types it has not read yet.
pub const GROUP_UNREAD: &str = "postbox_group_unread_events";
/// …events handed out and not acknowledged, visibility not over.
pub const GROUP_IN_FLIGHT: &str = "postbox_group_in_flight_events";
/// …events waiting to be handed out (again): nacked, timed out, scheduled,
/// or behind their aggregate in an ordered group.
pub const GROUP_WAITING: &str = "postbox_group_waiting_events";
/// …the group's dead letters.
pub const GROUP_DEAD_LETTERS: &str = "postbox_group_dead_letters";
/// …readers that called `receive` in the last minute.
pub const GROUP_READERS: &str = "postbox_group_readers";
/// …age of the group's oldest event not acknowledged (0 when none).
pub const GROUP_LAG_SECONDS: &str = "postbox_group_lag_seconds";
/// Logical mode: WAL written since the replication slot's confirmed position (label `slot`).
pub const SLOT_LAG_BYTES: &str = "postbox_slot_lag_bytes";
/// Logical mode: seconds since the relay last read the slot up to the WAL's
/// flush position (label `slot`; 0 while it keeps up).
pub const SLOT_LAG_SECONDS: &str = "postbox_slot_lag_seconds";
/// Logical mode: WAL the replication slot keeps from being removed (label `slot`).
pub const SLOT_RETAINED_BYTES: &str = "postbox_slot_retained_bytes";
/// Logical mode: 1 when the replication slot was invalidated (`wal_status =
/// lost`: events since its confirmed position can no longer be read), 0
/// while the relay reads it (label `slot`).
pub const SLOT_INVALIDATED: &str = "postbox_slot_invalidated";
/// Logical mode: seconds since a relay last held the replication slot (0
/// while one does), as the health watch sees it (label `slot`).
pub const SLOT_UNREAD_SECONDS: &str = "postbox_slot_unread_seconds";

/// Counter: database operations of the relay that failed (and are retried); label `operation`.
pub const DB_ERRORS: &str = "postbox_database_errors_total";
/// Counter: a multi-outbox relay's troubles with one outbox (label `outbox`) or
/// one database (label `database`); label `kind` (`discovery`, `missing`, `start`).
pub const OUTBOX_ERRORS: &str = "postbox_outbox_errors_total";
/// Gauge: outboxes a multi-outbox relay serves.
pub const OUTBOXES: &str = "postbox_outboxes";

/// The values of the `outcome` label of [`PUBLISH_OUTCOMES`].
pub const OUTCOME_LABELS: [&str; 4] = ["delivered", "retry", "reject", "deferred"];

/// Buckets for [`ATTEMPTS`].
pub const ATTEMPT_BUCKETS: &[f64] = &[1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 20.0, 50.0];
/// Buckets for [`PUBLISH_LATENCY`] (seconds).
pub const PUBLISH_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Buckets for [`DELIVERY_LATENCY`] (seconds): a healthy relay is sub-second,
/// retries and outages stretch into minutes and hours.
pub const DELIVERY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
    3600.0, 21600.0,
];

/// Every histogram with its buckets, for the exporter's configuration.
pub const HISTOGRAMS: &[(&str, &[f64])] = &[
    (ATTEMPTS, ATTEMPT_BUCKETS),
    (PUBLISH_LATENCY, PUBLISH_BUCKETS),
    (DELIVERY_LATENCY, DELIVERY_BUCKETS),
];

/// Gauge: age in seconds of the oldest transaction holding back xmin (0 when none is visible).
pub const OLDEST_TRANSACTION_AGE: &str = "postbox_db_oldest_transaction_age_seconds";
/// Gauge: transactions by which the worst replication slot holds back xmin (0: none).
pub const SLOT_XMIN_AGE: &str = "postbox_db_replication_slot_xmin_age";
/// Gauge: dead tuples of the outbox table.
pub const DEAD_TUPLES: &str = "postbox_outbox_dead_tuples";
/// Gauge: dead / (live + dead) tuples of the outbox table.
pub const DEAD_TUPLE_RATIO: &str = "postbox_outbox_dead_tuple_ratio";
/// Gauge: replay jobs (`postbox replay`) not done or cancelled: running,
/// paused or failed, each holding retention back.
pub const REPLAY_JOBS_OPEN: &str = "postbox_replay_jobs_open";
/// Gauge: events an open replay job still has to go through (its range's
/// total less those delivered, filtered and refused), by destination.
pub const REPLAY_EVENTS_LEFT: &str = "postbox_replay_events_left";
/// Gauge: 1 when the LISTEN probe came back, 0 when it did not (polling only).
pub const LISTEN_WORKING: &str = "postbox_listen_working";

/// Gauge: how many times in a row logical mode's reader failed to read its
/// slot (0 while it reads), by slot; `/readyz` is unready from three on.
pub const READER_FAILURES: &str = "postbox_reader_consecutive_failures";

/// Gauge: 1 for a log cursor of a destination this relay does not deliver
/// to that no relay reads (it keeps the log from being truncated), by
/// destination.
pub const LOG_CURSOR_UNREAD: &str = "postbox_log_cursor_unread";

/// Counter: messages under a schema's logical prefix set aside instead of
/// delivered — not events postbox can decode, or not signed by the schema's
/// emit (by slot).
pub const LOGICAL_REFUSED: &str = "postbox_logical_refused_total";

/// Counter: times a reading session found its replication slot behind the
/// position the relay had noted confirming (a server crash, or up to
/// PostgreSQL 16 a restart, brought it back) and moved it up (by slot).
pub const SLOT_MOVED_UP: &str = "postbox_slot_moved_up_total";

/// Register help texts and units with the installed recorder, and create the
/// counters at zero so that dashboards and `rate()` see them before the first event.
pub fn describe() {
    describe_gauge!(PENDING_EVENTS, "Events waiting to be claimed");
    describe_gauge!(
        OLDEST_PENDING_AGE,
        Unit::Seconds,
        "Age of the oldest pending event"
    );
    describe_gauge!(PROCESSING_EVENTS, "Events claimed and not yet settled");
    describe_gauge!(
        LOG_LAG_EVENTS,
        "Log mode: committed events a destination's cursor has not read"
    );
    describe_gauge!(
        GROUP_UNREAD,
        "Consumer groups: committed events of the group's types it has not read"
    );
    describe_gauge!(
        GROUP_IN_FLIGHT,
        "Consumer groups: events handed out and not acknowledged"
    );
    describe_gauge!(
        GROUP_WAITING,
        "Consumer groups: events waiting to be handed out (again)"
    );
    describe_gauge!(GROUP_DEAD_LETTERS, "Consumer groups: dead letters");
    describe_gauge!(
        GROUP_READERS,
        "Consumer groups: readers that called receive in the last minute"
    );
    describe_gauge!(
        GROUP_LAG_SECONDS,
        Unit::Seconds,
        "Consumer groups: age of the oldest event not acknowledged"
    );
    describe_gauge!(
        LOG_LAG_SECONDS,
        Unit::Seconds,
        "Log mode: age of the oldest event a destination's cursor has not read"
    );
    describe_gauge!(DEAD_LETTERS, "Dead letters (status failed)");
    describe_counter!(
        PUBLISH_OUTCOMES,
        "Sink answers per event, by destination and outcome"
    );
    describe_counter!(
        FILTERED,
        "Events a destination's filters kept from it, by destination"
    );
    describe_counter!(
        EXPRESSION_FAILURES,
        "Events on which a destination's expression failed (dead letters of that destination)"
    );
    describe_histogram!(ATTEMPTS, "Attempt number of each event handed to the sink");
    describe_histogram!(
        PUBLISH_LATENCY,
        Unit::Seconds,
        "Time one batch spent in the sink"
    );
    describe_histogram!(
        DELIVERY_LATENCY,
        Unit::Seconds,
        "Time from the event's insert to its acknowledgement"
    );
    describe_counter!(
        LEASES_RECLAIMED,
        "Events reclaimed after their lease expired"
    );
    describe_counter!(
        ACKS_LOST,
        "Settlements refused because a newer lease held the event"
    );
    describe_counter!(DEAD_LETTERED, "Events that became dead letters");
    describe_counter!(RETENTION_PURGED, "Rows removed by retention, by table");
    describe_counter!(
        INBOX_DUPLICATES,
        "Duplicate deliveries absorbed by an inbox"
    );
    describe_counter!(
        RECEIVE_REJECTED,
        "Deliveries postbox receive refused, by reason"
    );
    describe_counter!(
        DB_ERRORS,
        "Failed database operations of the relay (retried), by operation"
    );
    describe_counter!(
        OUTBOX_ERRORS,
        "Troubles of a multi-outbox relay with one outbox or database, by kind"
    );
    describe_gauge!(OUTBOXES, "Outboxes this relay serves");
    describe_gauge!(
        READER_FAILURES,
        "Times in a row logical mode's reader failed to read its slot (0 while it reads), by slot"
    );
    describe_gauge!(
        LOG_CURSOR_UNREAD,
        "1 for a log cursor no configured destination of this relay and no relay reads (it keeps the log from being truncated), by destination"
    );
    describe_counter!(
        LOGICAL_REFUSED,
        "Messages under the schema's logical prefix set aside instead of delivered (not events postbox can decode), by slot"
    );
    describe_counter!(
        SLOT_MOVED_UP,
        "Times logical mode's reader found its slot behind the position it had noted confirming (a server crash or restart brought it back) and moved it up, by slot"
    );
    describe_health();
    for name in [LEASES_RECLAIMED, ACKS_LOST, DEAD_LETTERED] {
        counter!(name).absolute(0);
    }
}

/// The health watch's gauges (`crate::tasks::health`).
fn describe_health() {
    use metrics::describe_gauge;
    describe_gauge!(
        OLDEST_TRANSACTION_AGE,
        metrics::Unit::Seconds,
        "Age of the oldest transaction holding back the xmin horizon"
    );
    describe_gauge!(
        SLOT_XMIN_AGE,
        "Transactions by which a replication slot holds back the xmin horizon"
    );
    describe_gauge!(DEAD_TUPLES, "Dead tuples of the outbox table");
    describe_gauge!(
        DEAD_TUPLE_RATIO,
        "Dead / (live + dead) tuples of the outbox table"
    );
    describe_gauge!(
        REPLAY_JOBS_OPEN,
        "Replay jobs not done or cancelled (each holds retention back)"
    );
    describe_gauge!(
        REPLAY_EVENTS_LEFT,
        "Events open replay jobs still have to go through, by destination"
    );
    describe_gauge!(
        LISTEN_WORKING,
        "1 when LISTEN/NOTIFY reaches the relay, 0 when it relies on polling"
    );
}

/// Set the backlog gauges from one reading of the store.
pub fn set_gauges(g: &Gauges) {
    gauge!(PENDING_EVENTS).set(g.pending as f64);
    gauge!(PROCESSING_EVENTS).set(g.processing as f64);
    gauge!(DEAD_LETTERS).set(g.dead_letters as f64);
    gauge!(OLDEST_PENDING_AGE).set(g.oldest_pending_age_seconds.unwrap_or(0.0));
}

/// Read the backlog gauges once (a cheap query on the partial indexes) and set them.
pub async fn refresh_gauges(store: &Store) -> Result<Gauges, sqlx::Error> {
    let g = store.gauges().await?;
    set_gauges(&g);
    Ok(g)
}

/// Set the replay gauges from the open jobs: how many, and the events left
/// per destination. A destination of `known` (those reported before) with
/// no open job left is set to 0; returns the destinations reported now.
pub async fn refresh_replays(
    store: &Store,
    known: &std::collections::BTreeSet<String>,
) -> Result<std::collections::BTreeSet<String>, sqlx::Error> {
    let jobs = store.open_replays().await?;
    gauge!(REPLAY_JOBS_OPEN).set(jobs.len() as f64);
    let mut left: std::collections::BTreeMap<String, i64> =
        known.iter().map(|d| (d.clone(), 0)).collect();
    for j in &jobs {
        *left.entry(j.destination.clone()).or_default() +=
            (j.total - j.delivered - j.filtered - j.rejected).max(0);
    }
    for (d, n) in &left {
        gauge!(REPLAY_EVENTS_LEFT, "destination" => d.clone()).set(*n as f64);
    }
    Ok(jobs.into_iter().map(|j| j.destination).collect())
}

/// Record commit-to-delivery latency for events created at `created` and
/// delivered now.
pub fn record_commit_to_delivery(created: impl Iterator<Item = chrono::DateTime<chrono::Utc>>) {
    let now = chrono::Utc::now();
    let latency = histogram!(DELIVERY_LATENCY);
    for at in created {
        let secs = (now - at).num_microseconds().unwrap_or(i64::MAX) as f64 / 1e6;
        latency.record(secs.max(0.0));
    }
}

/// Refresh log mode's lag gauges, one pair per cursor, and each consumer
/// group's gauges.
pub async fn refresh_log_lag(store: &Store) -> Result<(), sqlx::Error> {
    for c in store.log().cursor_lag().await? {
        gauge!(LOG_LAG_EVENTS, "destination" => c.destination.clone()).set(c.lag_events as f64);
        gauge!(LOG_LAG_SECONDS, "destination" => c.destination).set(c.lag_seconds.unwrap_or(0.0));
    }
    for g in store.groups().status().await? {
        let group = || g.name.clone();
        gauge!(GROUP_UNREAD, "group" => group()).set(g.unread as f64);
        gauge!(GROUP_IN_FLIGHT, "group" => group()).set(g.in_flight as f64);
        gauge!(GROUP_WAITING, "group" => group()).set(g.waiting as f64);
        gauge!(GROUP_DEAD_LETTERS, "group" => group()).set(g.dead_letters as f64);
        gauge!(GROUP_READERS, "group" => group()).set(g.readers as f64);
        gauge!(GROUP_LAG_SECONDS, "group" => group()).set(g.lag_seconds.unwrap_or(0.0));
    }
    Ok(())
}

/// Start the per-destination outcome counters at zero, so rates exist before
/// the first failure.
pub fn init_destination(destination: &str) {
    for outcome in OUTCOME_LABELS {
        counter!(PUBLISH_OUTCOMES, "outcome" => outcome, "destination" => destination.to_owned())
            .absolute(0);
    }
    counter!(FILTERED, "destination" => destination.to_owned()).absolute(0);
}

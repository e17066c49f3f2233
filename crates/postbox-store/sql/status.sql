-- What `postbox status`, the metrics task, the health watch and the
-- console's overview read.

-- name: status_counts
-- Counts by status and the age of the oldest pending event. Events scheduled
-- for later (pending, their `deliver_at` still ahead: migration 12) are
-- counted apart and left out of `pending` and its age: they are not late,
-- they are not due yet. `next_scheduled_in_seconds`: until the first is due.
SELECT count(*) FILTER (WHERE status = 'pending' AND NOT COALESCE(deliver_at > now(), false))
         AS pending,
       count(*) FILTER (WHERE status = 'pending' AND deliver_at > now()) AS scheduled,
       count(*) FILTER (WHERE status = 'processing') AS processing,
       count(*) FILTER (WHERE status = 'sent') AS sent,
       count(*) FILTER (WHERE status = 'failed' AND resolved_at IS NULL) AS failed,
       extract(epoch FROM now() - min(created_at)
                 FILTER (WHERE status = 'pending' AND NOT COALESCE(deliver_at > now(), false)))::float8
         AS oldest_pending_age_seconds,
       extract(epoch FROM min(deliver_at) FILTER (WHERE status = 'pending' AND deliver_at > now())
                 - now())::float8
         AS next_scheduled_in_seconds
FROM {schema}.outbox;

-- name: gauges
-- The backlog gauges, read every few seconds by the metrics task. Each count
-- reads one small partial index; the oldest pending event is the lowest
-- pending id (ids grow with inserts), looked up by primary key. An event
-- scheduled for later (migration 12) is pending but not late: it is not the
-- oldest pending event before it is due.
WITH p AS (
    SELECT count(*) AS n,
           min(id) FILTER (WHERE available_at <= now() OR NOT COALESCE(deliver_at > now(), false))
             AS oldest
    FROM {schema}.outbox WHERE status = 'pending'
)
SELECT p.n AS pending,
       (SELECT count(*) FROM {schema}.outbox WHERE status = 'processing') AS processing,
       (SELECT count(*) FROM {schema}.outbox WHERE status = 'failed' AND resolved_at IS NULL)
         AS dead_letters,
       o.event_id AS oldest_pending_event_id,
       extract(epoch FROM now() - o.created_at)::float8 AS oldest_pending_age_seconds
FROM p LEFT JOIN {schema}.outbox o ON o.id = p.oldest;

-- name: pending_attempts
-- How many pending events have been attempted how often (0 = never claimed).
SELECT attempts, count(*) AS count
FROM {schema}.outbox
WHERE status = 'pending'
GROUP BY attempts
ORDER BY attempts;

-- name: destination_counts
-- Per-destination state of fan-out events: how many wait for a retry, how many
-- are dead letters (not yet resolved by an operator), how many were delivered
-- after a retry, and the most attempts any open one has taken.
SELECT d.destination,
       count(*) FILTER (WHERE d.status = 'pending') AS retrying,
       count(*) FILTER (WHERE d.status = 'failed' AND o.resolved_at IS NULL) AS dead_letters,
       count(*) FILTER (WHERE d.status = 'sent') AS delivered_after_retry,
       COALESCE(max(d.attempts) FILTER (WHERE d.status <> 'sent'), 0) AS max_attempts
FROM {schema}.deliveries d
JOIN {schema}.outbox o ON o.id = d.outbox_id
GROUP BY d.destination
ORDER BY d.destination;

-- name: db_health
-- What degrades a queue table in production, in one read of the statistics
-- views: the oldest transaction holding back the xmin horizon (vacuum cannot
-- remove dead rows newer than it), the replication slot holding it back the
-- most, the outbox table's live and dead tuples, and whether autovacuum is
-- on at all. $1 is the schema name.
-- Without pg_monitor (or pg_read_all_stats) other roles' sessions are hidden
-- from pg_stat_activity, and the first columns are NULL.
WITH oldest AS (
    SELECT pid, application_name, state,
           extract(epoch FROM now() - xact_start)::float8 AS age
    FROM pg_stat_activity
    WHERE backend_xmin IS NOT NULL AND xact_start IS NOT NULL AND pid <> pg_backend_pid()
    ORDER BY xact_start
    LIMIT 1),
slot AS (
    SELECT slot_name::text AS slot_name, active,
           GREATEST(age(xmin), age(catalog_xmin))::bigint AS xmin_age
    FROM pg_replication_slots
    WHERE xmin IS NOT NULL OR catalog_xmin IS NOT NULL
    ORDER BY 3 DESC NULLS LAST
    LIMIT 1),
tup AS (
    SELECT n_live_tup, n_dead_tup
    FROM pg_stat_user_tables
    WHERE schemaname = $1 AND relname = 'outbox')
SELECT oldest.pid AS oldest_xact_pid,
       oldest.application_name AS oldest_xact_application,
       oldest.state AS oldest_xact_state,
       oldest.age AS oldest_xact_age_seconds,
       slot.slot_name, slot.active AS slot_active, slot.xmin_age AS slot_xmin_age,
       tup.n_live_tup AS live_tuples, tup.n_dead_tup AS dead_tuples,
       current_setting('autovacuum')::bool AS autovacuum
FROM (SELECT 1) AS one
LEFT JOIN oldest ON true
LEFT JOIN slot ON true
LEFT JOIN tup ON true;

-- name: open_replays
-- The replay jobs not yet done or cancelled (running, paused, failed: each
-- keeps retention from removing what it still reads, migration 29), oldest
-- first, through the table's partial index of open jobs.
SELECT id, destination, source, from_at, to_at, types, type_likes, aggregate_type,
       aggregate_id, rate, new_ids, after_id, after_event, hi, total, state, delivered,
       filtered, rejected, last_error, created_by, created_at, updated_at, finished_at
FROM {schema}.replay_jobs
WHERE state IN ('running', 'paused', 'failed')
ORDER BY id;

-- name: ping
-- Readiness: the database answers and postbox's table is readable.
SELECT 1 FROM {schema}.outbox LIMIT 0;

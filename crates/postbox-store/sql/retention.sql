-- Retention: sent events purged or archived, old inbox records purged, and
-- the outbox vacuumed, each in bounded batches.

-- name: purge_sent
-- Retention: delete up to $2 sent events acknowledged more than $1 seconds
-- ago, oldest first, with their per-destination rows. Only 'sent' rows:
-- pending, processing and failed rows are never touched, nor those an
-- unfinished replay job still reads (migration 29; archiving keeps them
-- where a job finds them). SKIP LOCKED lets several relays purge side by
-- side. Returns how many events went.
WITH gone AS (
    DELETE FROM {schema}.outbox
    WHERE id IN (
        SELECT o.id FROM {schema}.outbox o
        WHERE o.status = 'sent' AND o.sent_at < now() - make_interval(secs => $1)
          AND NOT EXISTS (SELECT 1 FROM {schema}.replay_jobs j
                          WHERE j.source = 'outbox'
                            AND j.state IN ('running', 'paused', 'failed')
                            AND o.id >= j.after_id AND o.id <= j.hi)
        ORDER BY o.id
        LIMIT $2
        FOR UPDATE SKIP LOCKED)
      AND status = 'sent'
    RETURNING id),
destinations AS (
    DELETE FROM {schema}.deliveries WHERE outbox_id IN (SELECT id FROM gone))
SELECT count(*) FROM gone;

-- name: archive_sent
-- Retention with archiving: move up to $2 sent events acknowledged more than
-- $1 seconds ago into outbox_archive, in one statement (both or neither),
-- dropping their per-destination rows. Only 'sent' rows are moved. Returns how
-- many events moved.
WITH moved AS (
    DELETE FROM {schema}.outbox
    WHERE id IN (
        SELECT id FROM {schema}.outbox
        WHERE status = 'sent' AND sent_at < now() - make_interval(secs => $1)
        ORDER BY id
        LIMIT $2
        FOR UPDATE SKIP LOCKED)
      AND status = 'sent'
    RETURNING id, event_id, aggregate_type, aggregate_id, event_type, schema_version,
              payload, headers, attempts, created_at, sent_at, sequence),
destinations AS (
    DELETE FROM {schema}.deliveries WHERE outbox_id IN (SELECT id FROM moved)),
kept AS (
    INSERT INTO {schema}.outbox_archive
        (id, event_id, aggregate_type, aggregate_id, event_type, schema_version,
         payload, headers, attempts, created_at, sent_at, sequence)
    SELECT id, event_id, aggregate_type, aggregate_id, event_type, schema_version,
           payload, headers, attempts, created_at, sent_at, sequence
    FROM moved
    RETURNING 1)
SELECT count(*) FROM kept;

-- name: purge_inbox
-- Retention: delete up to $2 inbox records processed more than $1 seconds ago
-- (reads the processed_at index). No row lock in the subquery: locking needs
-- UPDATE, which the relay role has no use for on the inbox, and nothing but a
-- purge ever locks an inbox row (consumers only insert them), so SKIP LOCKED
-- would only keep two purges apart. Two purges side by side take the same
-- oldest rows: the second waits for the first to commit, then finds them gone
-- (a short batch ends its pass).
DELETE FROM {schema}.inbox
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {schema}.inbox
    WHERE processed_at < now() - make_interval(secs => $1)
    ORDER BY processed_at
    LIMIT $2));

-- name: vacuum_outbox
-- Make the space of removed and updated outbox rows reusable, and refresh the
-- planner's statistics. Cannot run inside a transaction block.
VACUUM (ANALYZE) {schema}.outbox;

-- Events as operators look them up: one event in full (the one read model,
-- EventRecord), a search page, and a fan-out event's destinations.

-- name: show
-- One event by id for the console, with what the timeline needs.
SELECT id, event_id, event_type, aggregate_type, aggregate_id, schema_version,
       sequence, status::text AS status, attempts, created_at, available_at, sent_at,
       lease_expires_at, last_error, payload, headers,
       resolved_at, resolution, resolution_note, replaced_by, replay_of, deliver_at
FROM {schema}.outbox
WHERE event_id = $1;

-- name: search
-- Events matching the console's search, newest first, at most $9: event id
-- $1, aggregate type $2 and id $3, event type $4, status $5 (an event status,
-- or 'dead' for unresolved dead letters, 'discarded' or 'replaced'), created
-- in [$6, $7), and with row id below $8 (the next page). NULL matches anything.
SELECT id, event_id, event_type, aggregate_type, aggregate_id, status::text AS status,
       attempts, created_at, available_at, lease_expires_at, sent_at, last_error, resolution
FROM {schema}.outbox
WHERE ($1::uuid IS NULL OR event_id = $1)
  AND ($2::text IS NULL OR aggregate_type = $2)
  AND ($3::text IS NULL OR aggregate_id = $3)
  AND ($4::text IS NULL OR event_type = $4)
  AND ($5::text IS NULL
       OR ($5 = 'dead' AND status = 'failed' AND resolved_at IS NULL)
       OR ($5 IN ('discarded', 'replaced') AND resolution = $5)
       OR status::text = $5)
  AND ($6::timestamptz IS NULL OR created_at >= $6)
  AND ($7::timestamptz IS NULL OR created_at < $7)
  AND ($8::bigint IS NULL OR id < $8)
ORDER BY id DESC
LIMIT $9;

-- name: deliveries
-- Per-destination state of one fan-out event (outbox row id $1).
SELECT destination, status::text AS status, attempts, available_at, last_error, updated_at, sent_at
FROM {schema}.deliveries
WHERE outbox_id = $1
ORDER BY destination;

-- name: find
-- One event by id ($1) wherever this outbox still keeps it: the outbox
-- table (claim mode), the log's retained segments (log mode; it has no
-- index on event_id, so this reads the log whole) or the archive; the
-- first of them that has it. For `postbox route test --event-id`.
SELECT event_id, event_type, aggregate_type, aggregate_id, schema_version, sequence,
       created_at, payload::text AS payload, headers, place
FROM (
    SELECT event_id, event_type, aggregate_type, aggregate_id, schema_version, sequence,
           created_at, payload, headers, 'outbox' AS place, 1 AS rank
    FROM {schema}.outbox WHERE event_id = $1
    UNION ALL
    SELECT event_id, event_type, aggregate_type, aggregate_id, schema_version, sequence,
           created_at, payload, headers, 'log', 2
    FROM {schema}.log WHERE event_id = $1
    UNION ALL
    SELECT event_id, event_type, aggregate_type, aggregate_id, schema_version, sequence,
           created_at, payload, headers, 'archive', 3
    FROM {schema}.outbox_archive WHERE event_id = $1
) found
ORDER BY rank
LIMIT 1;

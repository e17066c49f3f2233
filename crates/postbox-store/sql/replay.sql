-- Replay jobs (migration 29): retained events delivered again to one
-- destination, read by id from one source — `outbox` (the outbox table) or
-- `log` (the log's retained segments), each with the archive, where both
-- the purge and log truncation move what they keep — and the job's row.

-- name: events
-- Not run alone: the selection `range` and `page` read. Events of source $9
-- ('outbox' or 'log', each with the archive) created in [$1, $2), of an event type LIKE ANY $3
-- (NULL: any), aggregate type $4 and id $5 (NULL: any), after ($6, $7) in
-- (id, event_id) order (an archived log event may share an id with an
-- outbox row) up to id $8. The branch of the other source is cut by its
-- one-time filter on $9 and reads nothing.
SELECT id, event_id, event_type, aggregate_type, aggregate_id, schema_version, sequence,
       created_at, payload, headers, place
FROM (
    SELECT id, event_id, event_type, aggregate_type, aggregate_id, schema_version, sequence,
           created_at, payload, headers, 'outbox' AS place
    FROM {schema}.outbox
    WHERE $9 = 'outbox' AND id >= $6 AND id <= $8
    UNION ALL
    SELECT id, event_id, event_type, aggregate_type, aggregate_id, schema_version, sequence,
           created_at, payload, headers, 'archive'
    FROM {schema}.outbox_archive
    WHERE id >= $6 AND id <= $8
    UNION ALL
    SELECT id, event_id, event_type, aggregate_type, aggregate_id, schema_version, sequence,
           created_at, payload, headers, 'log'
    FROM {schema}.log
    WHERE $9 = 'log' AND id >= $6 AND id <= $8
) e
WHERE (id, event_id) > ($6, $7)
  AND created_at >= $1 AND created_at < $2
  AND ($3::text[] IS NULL OR event_type LIKE ANY ($3))
  AND ($4::text IS NULL OR aggregate_type = $4)
  AND ($5::text IS NULL OR aggregate_id = $5);

-- name: range
-- What a new job would replay: how many events, and the last id (the job's
-- `hi`); `events` with ($6, $7) before every event and $8 after.
SELECT count(*) AS total, coalesce(max(id), 0) AS hi
FROM ({events}) e;

-- name: keep
-- Not run alone: which rows of a source `page` keeps — after ($6, $7) in
-- (id, event_id) order up to id $8, created in [$1, $2), of an event type
-- LIKE ANY $3 (NULL: any), aggregate type $4 and id $5 (NULL: any).
id >= $6 AND id <= $8 AND (id, event_id) > ($6, $7)
  AND created_at >= $1 AND created_at < $2
  AND ($3::text[] IS NULL OR event_type LIKE ANY ($3))
  AND ($4::text IS NULL OR aggregate_type = $4)
  AND ($5::text IS NULL OR aggregate_id = $5)

-- name: page
-- The job's next events after its position, at most $10: each source's
-- first $10 in id order (its id index read from the position, stopping at
-- $10 — a page costs the same at the start of a long range as at its
-- end), then the union's first $10. Within one table ids are unique, so
-- id order there is (id, event_id) order.
SELECT id, event_id, event_type, aggregate_type, aggregate_id, schema_version, sequence,
       created_at, payload::text AS payload, headers, place
FROM (
    (SELECT id, event_id, event_type, aggregate_type, aggregate_id, schema_version, sequence,
            created_at, payload, headers, 'outbox' AS place
     FROM {schema}.outbox
     WHERE $9 = 'outbox' AND {keep}
     ORDER BY id
     LIMIT $10)
    UNION ALL
    (SELECT id, event_id, event_type, aggregate_type, aggregate_id, schema_version, sequence,
            created_at, payload, headers, 'archive'
     FROM {schema}.outbox_archive
     WHERE {keep}
     ORDER BY id
     LIMIT $10)
    UNION ALL
    (SELECT id, event_id, event_type, aggregate_type, aggregate_id, schema_version, sequence,
            created_at, payload, headers, 'log'
     FROM {schema}.log
     WHERE $9 = 'log' AND {keep}
     ORDER BY id
     LIMIT $10)
) e
ORDER BY id, event_id
LIMIT $10;

-- name: oldest
-- The oldest event source $1 still holds: how far back a replay reaches (the
-- creation time of its lowest id; ids grow with time).
SELECT min(created_at)
FROM (
    (SELECT created_at FROM {schema}.outbox WHERE $1 = 'outbox' ORDER BY id LIMIT 1)
    UNION ALL
    (SELECT created_at FROM {schema}.outbox_archive ORDER BY id LIMIT 1)
    UNION ALL
    (SELECT created_at FROM {schema}.log WHERE $1 = 'log' ORDER BY id LIMIT 1)
) o;

-- name: create
-- A new job, running; returns its id.
INSERT INTO {schema}.replay_jobs
    (destination, source, from_at, to_at, types, type_likes, aggregate_type, aggregate_id,
     rate, new_ids, after_id, hi, total, created_by)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 0, $11, $12, $13)
RETURNING id;

-- name: get
SELECT id, destination, source, from_at, to_at, types, type_likes, aggregate_type,
       aggregate_id, rate, new_ids, after_id, after_event, hi, total, state, delivered,
       filtered, rejected, last_error, created_by, created_at, updated_at, finished_at
FROM {schema}.replay_jobs
WHERE id = $1;

-- name: list
-- The newest jobs, at most $1.
SELECT id, destination, source, from_at, to_at, types, type_likes, aggregate_type,
       aggregate_id, rate, new_ids, after_id, after_event, hi, total, state, delivered,
       filtered, rejected, last_error, created_by, created_at, updated_at, finished_at
FROM {schema}.replay_jobs
ORDER BY id DESC
LIMIT $1;

-- name: advance
-- A page went out: the job's position moves to ($2, $3) and its counts grow
-- by $4 delivered, $5 filtered out, $6 refused ($7 the last refusal's error,
-- sanitized). Only while it runs: no row back means it was cancelled.
UPDATE {schema}.replay_jobs
SET after_id = $2, after_event = $3, delivered = delivered + $4,
    filtered = filtered + $5, rejected = rejected + $6,
    last_error = coalesce($7, last_error), updated_at = now()
WHERE id = $1 AND state = 'running'
RETURNING id;

-- name: set_state
-- Job $1 goes to state $2 from one of the states $3 ($4: an error to keep).
-- Returns the new state, or no row when it was in none of them.
UPDATE {schema}.replay_jobs
SET state = $2, last_error = coalesce($4, last_error), updated_at = now(),
    finished_at = CASE WHEN $2 IN ('done', 'cancelled') THEN now() END
WHERE id = $1 AND state = ANY ($3)
RETURNING state;

-- name: lock
-- The runner's hold on job $1, for its session: one runner per job.
SELECT pg_try_advisory_lock(hashtext('postbox replay ' || $2), $1::integer) AS held;

-- name: register
-- A relay's destinations $1 recorded as seen (migration 30); returns the
-- names new to a table that already held some (destinations added to a
-- running outbox). All CTEs read one snapshot: `known` is the table before
-- this insert. Two relays registering at once: the second waits on the
-- first's rows and inserts nothing of them, so a name comes back once.
WITH known AS (SELECT EXISTS (SELECT 1 FROM {schema}.destinations_seen) AS some),
added AS (
    INSERT INTO {schema}.destinations_seen (name)
    SELECT DISTINCT unnest($1::text[])
    ON CONFLICT (name) DO NOTHING
    RETURNING name
)
SELECT added.name FROM added, known WHERE known.some;

-- name: relay_open
-- The open jobs relays made (created_by 'relay') for destinations $1, oldest first.
SELECT id, destination, source, from_at, to_at, types, type_likes, aggregate_type,
       aggregate_id, rate, new_ids, after_id, after_event, hi, total, state, delivered,
       filtered, rejected, last_error, created_by, created_at, updated_at, finished_at
FROM {schema}.replay_jobs
WHERE state IN ('running', 'failed') AND created_by = 'relay' AND destination = ANY ($1)
ORDER BY id;

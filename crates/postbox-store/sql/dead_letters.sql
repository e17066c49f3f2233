-- Dead letters for operators: list, count, pick a batch, replay, replay
-- under a new id, discard, and wake the relays after a replay.

-- name: list
-- Unresolved dead letters after row id $4, oldest first, at most $5: of event
-- type $1 (any when NULL), created at or after $2 (any when NULL), among event
-- ids $3 (any when NULL). Reads the partial index on failed rows.
SELECT id, event_id, event_type, aggregate_type, aggregate_id, schema_version,
       attempts, created_at, last_error
FROM {schema}.outbox
WHERE status = 'failed' AND resolved_at IS NULL
  AND ($1::text IS NULL OR event_type = $1)
  AND ($2::timestamptz IS NULL OR created_at >= $2)
  AND ($3::uuid[] IS NULL OR event_id = ANY($3))
  AND id > $4
ORDER BY id
LIMIT $5;

-- name: count
-- How many unresolved dead letters match the filter (same parameters $1–$3 as dlq_list.sql).
SELECT count(*)
FROM {schema}.outbox
WHERE status = 'failed' AND resolved_at IS NULL
  AND ($1::text IS NULL OR event_type = $1)
  AND ($2::timestamptz IS NULL OR created_at >= $2)
  AND ($3::uuid[] IS NULL OR event_id = ANY($3));

-- name: pick
-- Lock the next batch of unresolved dead letters for an operator action, in
-- the action's transaction (parameters as in dlq_list.sql). Relays never hold
-- failed rows, so the lock only waits for another operator.
SELECT id, event_id, last_error
FROM {schema}.outbox
WHERE status = 'failed' AND resolved_at IS NULL
  AND ($1::text IS NULL OR event_type = $1)
  AND ($2::timestamptz IS NULL OR created_at >= $2)
  AND ($3::uuid[] IS NULL OR event_id = ANY($3))
  AND id > $4
ORDER BY id
LIMIT $5
FOR UPDATE;

-- name: replay
-- Replay dead letters under their own event id (the same logical effect):
-- due at once with a fresh retry budget. Rows locked by dlq_pick.sql. Of a
-- fan-out event, only the destinations that failed are published to again.
WITH replayed AS (
    UPDATE {schema}.outbox
    SET status = 'pending', attempts = 0, available_at = now(),
        lease_token = NULL, lease_expires_at = NULL
    WHERE id = ANY($1) AND status = 'failed' AND resolved_at IS NULL
    RETURNING event_id, id),
destinations AS (
    UPDATE {schema}.deliveries
    SET status = 'pending', attempts = 0, available_at = now(), updated_at = now()
    WHERE outbox_id IN (SELECT id FROM replayed) AND status = 'failed')
SELECT event_id FROM replayed;

-- name: replay_new_id
-- Replay dead letters as a new operation: insert a pending copy with a fresh
-- UUIDv7 that names its original (replay_of), and resolve each original as
-- 'replaced' by its copy. The original keeps status 'failed' and its payload.
WITH copies AS (
    INSERT INTO {schema}.outbox
        (event_id, aggregate_type, aggregate_id, event_type, schema_version, payload, headers, replay_of)
    SELECT {schema}.uuid_v7(), aggregate_type, aggregate_id, event_type, schema_version, payload, headers, event_id
    FROM {schema}.outbox
    WHERE id = ANY($1) AND status = 'failed' AND resolved_at IS NULL
    ORDER BY id
    RETURNING event_id, replay_of
)
UPDATE {schema}.outbox o
SET resolved_at = now(), resolution = 'replaced', replaced_by = c.event_id
FROM copies c
WHERE o.event_id = c.replay_of
RETURNING o.event_id AS original, c.event_id AS copy;

-- name: discard
-- Discard dead letters: they stay 'failed' (nothing is deleted) and are
-- resolved as 'discarded' with the operator's reason $2.
UPDATE {schema}.outbox
SET resolved_at = now(), resolution = 'discarded', resolution_note = $2
WHERE id = ANY($1) AND status = 'failed' AND resolved_at IS NULL
RETURNING event_id;

-- name: notify
-- Wake the relays after a replay committed (polling would find the rows anyway).
SELECT pg_notify({channel}, '');

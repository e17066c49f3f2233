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
RETURNING o.event_id, c.event_id

-- One event by id, whatever its status, with its dead-letter resolution.
SELECT id, event_id, event_type, aggregate_type, aggregate_id, schema_version,
       attempts, created_at, last_error, status::text, available_at,
       payload::text, headers::text,
       resolved_at, resolution, resolution_note, replaced_by, replay_of
FROM {schema}.outbox
WHERE event_id = $1

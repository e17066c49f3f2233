-- One event by id for the console, with what the timeline needs.
SELECT id, event_id, event_type, aggregate_type, aggregate_id, schema_version,
       sequence, status::text, attempts, created_at, available_at, sent_at,
       lease_expires_at, last_error, payload::text, headers::text,
       resolved_at, resolution, resolution_note, replaced_by, replay_of
FROM {schema}.outbox
WHERE event_id = $1

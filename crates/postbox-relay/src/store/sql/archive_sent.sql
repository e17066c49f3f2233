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
SELECT count(*) FROM kept

-- Record what one round of publishing did at each destination of fan-out
-- events: delivered ('sent', never published to again), dead ('failed'), or
-- waiting for a retry ('pending', due after the delay). A 'sent' row is never
-- overwritten: a stale relay cannot undo another's delivery.
INSERT INTO {schema}.deliveries AS d
    (outbox_id, destination, status, attempts, available_at, last_error, sent_at, updated_at)
SELECT u.id, u.destination,
       CASE WHEN u.delivered THEN 'sent'::{schema}.event_status
            WHEN u.dead THEN 'failed'::{schema}.event_status
            ELSE 'pending'::{schema}.event_status END,
       u.attempts,
       now() + make_interval(secs => u.delay_secs),
       u.error,
       CASE WHEN u.delivered THEN now() END,
       now()
FROM unnest($1::bigint[], $2::text[], $3::bool[], $4::bool[], $5::int4[], $6::float8[], $7::text[])
     AS u(id, destination, delivered, dead, attempts, delay_secs, error)
WHERE {relay_commit}
ON CONFLICT (outbox_id, destination) DO UPDATE
SET status = EXCLUDED.status,
    attempts = EXCLUDED.attempts,
    available_at = EXCLUDED.available_at,
    last_error = EXCLUDED.last_error,
    sent_at = EXCLUDED.sent_at,
    updated_at = now()
WHERE d.status <> 'sent'

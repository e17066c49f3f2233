-- Per-destination state of one fan-out event (outbox row id $1).
SELECT destination, status::text, attempts, available_at, last_error, updated_at, sent_at
FROM {schema}.deliveries
WHERE outbox_id = $1
ORDER BY destination

-- Per-destination state of the events $1 (fan-out events only have rows):
-- status, attempts so far, and seconds until the destination is due again.
SELECT outbox_id, destination, status::text, attempts,
       GREATEST(extract(epoch FROM available_at - now()), 0)::float8
FROM {schema}.deliveries
WHERE outbox_id = ANY($1)

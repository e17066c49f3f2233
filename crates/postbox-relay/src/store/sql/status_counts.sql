-- Counts by status and the age of the oldest pending event.
SELECT count(*) FILTER (WHERE status = 'pending'),
       count(*) FILTER (WHERE status = 'processing'),
       count(*) FILTER (WHERE status = 'sent'),
       count(*) FILTER (WHERE status = 'failed' AND resolved_at IS NULL),
       extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending'))::float8
FROM {schema}.outbox

-- The backlog gauges, read every few seconds by the metrics task. Each count
-- reads one small partial index; the oldest pending event is the lowest
-- pending id (ids grow with inserts), looked up by primary key.
WITH p AS (
    SELECT count(*) AS n, min(id) AS oldest FROM {schema}.outbox WHERE status = 'pending'
)
SELECT p.n,
       (SELECT count(*) FROM {schema}.outbox WHERE status = 'processing'),
       (SELECT count(*) FROM {schema}.outbox WHERE status = 'failed' AND resolved_at IS NULL),
       o.event_id,
       extract(epoch FROM now() - o.created_at)::float8
FROM p LEFT JOIN {schema}.outbox o ON o.id = p.oldest

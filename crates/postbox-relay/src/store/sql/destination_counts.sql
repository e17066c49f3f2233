-- Per-destination state of fan-out events: how many wait for a retry, how many
-- are dead letters (not yet resolved by an operator), how many were delivered
-- after a retry, and the most attempts any open one has taken.
SELECT d.destination,
       count(*) FILTER (WHERE d.status = 'pending'),
       count(*) FILTER (WHERE d.status = 'failed' AND o.resolved_at IS NULL),
       count(*) FILTER (WHERE d.status = 'sent'),
       COALESCE(max(d.attempts) FILTER (WHERE d.status <> 'sent'), 0)
FROM {schema}.deliveries d
JOIN {schema}.outbox o ON o.id = d.outbox_id
GROUP BY d.destination
ORDER BY d.destination

-- Settle events that were not delivered, only where lease $2 still holds them:
-- a rejection, or a retry past the budget of $3 attempts, becomes a dead letter
-- ('failed'); any other retry waits until now() + its delay.
UPDATE {schema}.outbox o
SET status = CASE WHEN f.reject OR o.attempts >= $3
                  THEN 'failed'::{schema}.event_status ELSE 'pending'::{schema}.event_status END,
    available_at = CASE WHEN f.reject OR o.attempts >= $3
                        THEN o.available_at ELSE now() + make_interval(secs => f.delay_secs) END,
    last_error = f.error,
    lease_token = NULL,
    lease_expires_at = NULL
FROM unnest($1::bigint[], $4::bool[], $5::float8[], $6::text[]) AS f(id, reject, delay_secs, error)
WHERE o.id = f.id AND o.lease_token = $2 AND o.status = 'processing'
RETURNING o.id, o.status = 'failed'

-- Settle events that were not delivered, only where lease $2 still holds them:
-- a rejection, or a retry past its budget of attempts ($3), becomes a dead
-- letter ('failed'); any other retry waits until now() + its delay. An event
-- the sink deferred without trying ($7 false) gets its attempt back.
UPDATE {schema}.outbox o
SET status = CASE WHEN f.reject OR (f.counted AND o.attempts >= f.budget)
                  THEN 'failed'::{schema}.event_status ELSE 'pending'::{schema}.event_status END,
    available_at = CASE WHEN f.reject OR (f.counted AND o.attempts >= f.budget)
                        THEN o.available_at ELSE now() + make_interval(secs => f.delay_secs) END,
    attempts = CASE WHEN f.counted THEN o.attempts ELSE GREATEST(o.attempts - 1, 0) END,
    last_error = f.error,
    lease_token = NULL,
    lease_expires_at = NULL
FROM unnest($1::bigint[], $4::bool[], $5::float8[], $6::text[], $3::int4[], $7::bool[])
     AS f(id, reject, delay_secs, error, budget, counted)
WHERE o.id = f.id AND o.lease_token = $2 AND o.status = 'processing' AND {relay_commit}
RETURNING o.id, o.status = 'failed'

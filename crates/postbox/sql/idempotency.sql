-- Request idempotency keys (postbox::idempotency).

-- name: lock
-- Transaction-level: held until the caller's transaction ends.
SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0));

-- name: insert
INSERT INTO {schema}.idempotency_keys (scope, key, fingerprint, expires_at)
VALUES ($1, $2, $3, now() + make_interval(secs => $4))
ON CONFLICT (scope, key) DO NOTHING
RETURNING true;

-- name: select
SELECT fingerprint, status, response_status, response_type, response_body,
       expires_at <= now() AS expired
FROM {schema}.idempotency_keys WHERE scope = $1 AND key = $2
FOR UPDATE;

-- name: restart
UPDATE {schema}.idempotency_keys
SET fingerprint = $3, status = 'in_flight', response_status = NULL,
    response_type = NULL, response_body = NULL, created_at = now(),
    completed_at = NULL, expires_at = now() + make_interval(secs => $4)
WHERE scope = $1 AND key = $2;

-- name: complete
UPDATE {schema}.idempotency_keys
SET status = 'completed', response_status = $3, response_type = $4,
    response_body = $5, completed_at = now()
WHERE scope = $1 AND key = $2 AND status = 'in_flight';

-- name: purge
DELETE FROM {schema}.idempotency_keys WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM {schema}.idempotency_keys
  WHERE expires_at < now() LIMIT $1 FOR UPDATE SKIP LOCKED));

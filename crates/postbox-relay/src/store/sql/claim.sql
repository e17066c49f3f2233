-- Claim up to $3 due events for one lease: token $1, lease length $2 seconds.
-- One statement; SKIP LOCKED lets any number of relays claim side by side.
UPDATE {schema}.outbox o
SET status = 'processing',
    lease_token = $1,
    lease_expires_at = now() + make_interval(secs => $2),
    attempts = o.attempts + 1
WHERE o.id IN (
    SELECT id FROM {schema}.outbox
    WHERE status = 'pending' AND available_at <= now()
    ORDER BY available_at, id
    LIMIT $3
    FOR UPDATE SKIP LOCKED)
  AND {relay_commit}
RETURNING o.id, o.event_id, o.event_type, o.aggregate_type, o.aggregate_id, o.schema_version,
          o.payload::text, o.headers::text, o.created_at, o.attempts, o.sequence

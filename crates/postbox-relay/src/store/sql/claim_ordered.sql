-- Claim up to $3 due events for one lease (token $1, lease length $2 seconds),
-- keeping per-aggregate order for the event types matching the LIKE patterns
-- in $4: such an event is claimed only when no earlier event of its aggregate
-- (among those types) is still undelivered — pending (due or waiting for a
-- retry), in flight, or a dead letter whose type matches a blocking pattern in
-- $5 and that no operator has resolved. So one aggregate never has two events
-- in flight, N+1 never overtakes N, and a retry holds back only its own
-- aggregate. Other events are claimed as by claim.sql.
UPDATE {schema}.outbox o
SET status = 'processing',
    lease_token = $1,
    lease_expires_at = now() + make_interval(secs => $2),
    attempts = o.attempts + 1
WHERE o.id IN (
    SELECT c.id FROM {schema}.outbox c
    WHERE c.status = 'pending' AND c.available_at <= now()
      AND (c.sequence IS NULL
           OR NOT (c.event_type LIKE ANY ($4::text[]))
           OR NOT EXISTS (
               SELECT 1 FROM {schema}.outbox p
               WHERE p.aggregate_type = c.aggregate_type
                 AND p.aggregate_id = c.aggregate_id
                 AND p.sequence < c.sequence
                 AND p.status <> 'sent'
                 AND p.event_type LIKE ANY ($4::text[])
                 AND (p.status <> 'failed'
                      OR (p.resolved_at IS NULL AND p.event_type LIKE ANY ($5::text[])))))
    ORDER BY c.available_at, c.id
    LIMIT $3
    FOR UPDATE SKIP LOCKED)
  AND {relay_commit}
RETURNING o.id, o.event_id, o.event_type, o.aggregate_type, o.aggregate_id, o.schema_version,
          o.payload::text, o.headers::text, o.created_at, o.attempts, o.sequence

-- Reclaim up to $2 events whose lease expired (their relay died or stalled).
-- Cheap: reads only the small set of in-flight rows. An event whose lease
-- expired on its last allowed attempt ($1) becomes a dead letter.
UPDATE {schema}.outbox o
SET status = CASE WHEN o.attempts >= $1
                  THEN 'failed'::{schema}.event_status ELSE 'pending'::{schema}.event_status END,
    last_error = CASE WHEN o.attempts >= $1
                      THEN 'lease expired on attempt ' || o.attempts || ' (relay stopped, or publishing outlived the lease)'
                      ELSE o.last_error END,
    available_at = now(),
    lease_token = NULL,
    lease_expires_at = NULL
WHERE o.id IN (
    SELECT id FROM {schema}.outbox
    WHERE status = 'processing' AND lease_expires_at < now()
    ORDER BY id
    LIMIT $2
    FOR UPDATE SKIP LOCKED)
  AND {relay_commit}
RETURNING o.event_id, o.status = 'failed'

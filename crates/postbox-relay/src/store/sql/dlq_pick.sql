-- Lock the next batch of unresolved dead letters for an operator action, in
-- the action's transaction (parameters as in dlq_list.sql). Relays never hold
-- failed rows, so the lock only waits for another operator.
SELECT id, event_id, last_error
FROM {schema}.outbox
WHERE status = 'failed' AND resolved_at IS NULL
  AND ($1::text IS NULL OR event_type = $1)
  AND ($2::timestamptz IS NULL OR created_at >= $2)
  AND ($3::uuid[] IS NULL OR event_id = ANY($3))
  AND id > $4
ORDER BY id
LIMIT $5
FOR UPDATE

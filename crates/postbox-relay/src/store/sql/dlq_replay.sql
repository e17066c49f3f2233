-- Replay dead letters under their own event id (the same logical effect):
-- due at once with a fresh retry budget. Rows locked by dlq_pick.sql.
UPDATE {schema}.outbox
SET status = 'pending', attempts = 0, available_at = now(),
    lease_token = NULL, lease_expires_at = NULL
WHERE id = ANY($1) AND status = 'failed' AND resolved_at IS NULL
RETURNING event_id

-- Replay dead letters under their own event id (the same logical effect):
-- due at once with a fresh retry budget. Rows locked by dlq_pick.sql. Of a
-- fan-out event, only the destinations that failed are published to again.
WITH replayed AS (
    UPDATE {schema}.outbox
    SET status = 'pending', attempts = 0, available_at = now(),
        lease_token = NULL, lease_expires_at = NULL
    WHERE id = ANY($1) AND status = 'failed' AND resolved_at IS NULL
    RETURNING event_id, id),
destinations AS (
    UPDATE {schema}.deliveries
    SET status = 'pending', attempts = 0, available_at = now(), updated_at = now()
    WHERE outbox_id IN (SELECT id FROM replayed) AND status = 'failed')
SELECT event_id FROM replayed

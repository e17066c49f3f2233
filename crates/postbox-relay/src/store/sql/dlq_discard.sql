-- Discard dead letters: they stay 'failed' (nothing is deleted) and are
-- resolved as 'discarded' with the operator's reason $2.
UPDATE {schema}.outbox
SET resolved_at = now(), resolution = 'discarded', resolution_note = $2
WHERE id = ANY($1) AND status = 'failed' AND resolved_at IS NULL
RETURNING event_id

-- Give back claimed events that were never published (graceful shutdown):
-- they are due again at once and the attempt does not count.
UPDATE {schema}.outbox
SET status = 'pending', lease_token = NULL, lease_expires_at = NULL,
    attempts = greatest(attempts - 1, 0)
WHERE id = ANY($1) AND lease_token = $2 AND status = 'processing' AND {relay_commit}

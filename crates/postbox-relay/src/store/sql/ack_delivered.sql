-- Mark delivered events sent, only where lease $2 still holds them.
UPDATE {schema}.outbox
SET status = 'sent', sent_at = now(), lease_token = NULL, lease_expires_at = NULL, last_error = NULL
WHERE id = ANY($1) AND lease_token = $2 AND status = 'processing' AND {relay_commit}
RETURNING id

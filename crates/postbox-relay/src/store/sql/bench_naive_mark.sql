-- ...then one UPDATE and one COMMIT per row.
UPDATE {schema}.outbox SET status = 'sent', sent_at = now() WHERE id = $1

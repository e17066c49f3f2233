-- Retention: delete up to $2 sent events acknowledged more than $1 seconds
-- ago, oldest first. Only 'sent' rows: pending, processing and failed rows are
-- never touched. SKIP LOCKED lets several relays purge side by side.
DELETE FROM {schema}.outbox
WHERE id IN (
    SELECT id FROM {schema}.outbox
    WHERE status = 'sent' AND sent_at < now() - make_interval(secs => $1)
    ORDER BY id
    LIMIT $2
    FOR UPDATE SKIP LOCKED)
  AND status = 'sent'

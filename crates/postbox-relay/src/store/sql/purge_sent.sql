-- Retention: delete up to $2 sent events acknowledged more than $1 seconds
-- ago, oldest first, with their per-destination rows. Only 'sent' rows:
-- pending, processing and failed rows are never touched. SKIP LOCKED lets
-- several relays purge side by side. Returns how many events went.
WITH gone AS (
    DELETE FROM {schema}.outbox
    WHERE id IN (
        SELECT id FROM {schema}.outbox
        WHERE status = 'sent' AND sent_at < now() - make_interval(secs => $1)
        ORDER BY id
        LIMIT $2
        FOR UPDATE SKIP LOCKED)
      AND status = 'sent'
    RETURNING id),
destinations AS (
    DELETE FROM {schema}.deliveries WHERE outbox_id IN (SELECT id FROM gone))
SELECT count(*) FROM gone

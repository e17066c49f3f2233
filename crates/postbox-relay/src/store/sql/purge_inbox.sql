-- Retention: delete up to $2 inbox records processed more than $1 seconds ago
-- (reads the processed_at index).
DELETE FROM {schema}.inbox
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {schema}.inbox
    WHERE processed_at < now() - make_interval(secs => $1)
    ORDER BY processed_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED))

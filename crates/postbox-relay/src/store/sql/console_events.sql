-- Events matching the console's search, newest first, at most $9: event id
-- $1, aggregate type $2 and id $3, event type $4, status $5 (an event status,
-- or 'dead' for unresolved dead letters, 'discarded' or 'replaced'), created
-- in [$6, $7), and with row id below $8 (the next page). NULL matches anything.
SELECT id, event_id, event_type, aggregate_type, aggregate_id, status::text,
       attempts, created_at, sent_at, last_error, resolution
FROM {schema}.outbox
WHERE ($1::uuid IS NULL OR event_id = $1)
  AND ($2::text IS NULL OR aggregate_type = $2)
  AND ($3::text IS NULL OR aggregate_id = $3)
  AND ($4::text IS NULL OR event_type = $4)
  AND ($5::text IS NULL
       OR ($5 = 'dead' AND status = 'failed' AND resolved_at IS NULL)
       OR ($5 IN ('discarded', 'replaced') AND resolution = $5)
       OR status::text = $5)
  AND ($6::timestamptz IS NULL OR created_at >= $6)
  AND ($7::timestamptz IS NULL OR created_at < $7)
  AND ($8::bigint IS NULL OR id < $8)
ORDER BY id DESC
LIMIT $9

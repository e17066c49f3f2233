-- Unresolved dead letters after row id $4, oldest first, at most $5: of event
-- type $1 (any when NULL), created at or after $2 (any when NULL), among event
-- ids $3 (any when NULL). Reads the partial index on failed rows.
SELECT id, event_id, event_type, aggregate_type, aggregate_id, schema_version,
       attempts, created_at, last_error
FROM {schema}.outbox
WHERE status = 'failed' AND resolved_at IS NULL
  AND ($1::text IS NULL OR event_type = $1)
  AND ($2::timestamptz IS NULL OR created_at >= $2)
  AND ($3::uuid[] IS NULL OR event_id = ANY($3))
  AND id > $4
ORDER BY id
LIMIT $5

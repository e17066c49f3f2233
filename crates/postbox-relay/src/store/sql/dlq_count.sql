-- How many unresolved dead letters match the filter (same parameters $1–$3 as dlq_list.sql).
SELECT count(*)
FROM {schema}.outbox
WHERE status = 'failed' AND resolved_at IS NULL
  AND ($1::text IS NULL OR event_type = $1)
  AND ($2::timestamptz IS NULL OR created_at >= $2)
  AND ($3::uuid[] IS NULL OR event_id = ANY($3))

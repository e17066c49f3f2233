-- The newest audit entries, at most $1; only those that touched event $2 when it is not NULL.
SELECT id, at, actor, action, selection::text, count, reason, details::text
FROM {schema}.audit_log
WHERE $2::uuid IS NULL OR details @> jsonb_build_array(jsonb_build_object('event_id', $2::text))
ORDER BY id DESC
LIMIT $1

-- Audit entries, newest first, at most $4: with id below $1 (the next page),
-- of action $2 and actor $3 (any when NULL).
SELECT id, at, actor, action, selection::text, count, reason, details::text
FROM {schema}.audit_log
WHERE ($1::bigint IS NULL OR id < $1)
  AND ($2::text IS NULL OR action = $2)
  AND ($3::text IS NULL OR actor = $3)
ORDER BY id DESC
LIMIT $4

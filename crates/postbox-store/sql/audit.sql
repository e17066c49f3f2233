-- The audit log of operator actions.

-- name: insert
-- One audit entry: actor $1, action $2, selection $3 (JSON), count $4, reason $5, details $6 (JSON array).
INSERT INTO {schema}.audit_log (actor, action, selection, count, reason, details)
VALUES ($1, $2, $3::text::jsonb, $4, $5, $6::text::jsonb)
RETURNING id;

-- name: list
-- The newest audit entries, at most $1; only those that touched event $2 when it is not NULL.
SELECT id, at, actor, action, selection, count, reason, details
FROM {schema}.audit_log
WHERE $2::uuid IS NULL OR details @> jsonb_build_array(jsonb_build_object('event_id', $2::text))
ORDER BY id DESC
LIMIT $1;

-- name: page
-- Audit entries, newest first, at most $4: with id below $1 (the next page),
-- of action $2 and actor $3 (any when NULL), and only actions starting with
-- $6 when it is not NULL. Entries of action $5 (when not NULL) never match an
-- actor filter: their actor is hidden from the reader.
SELECT id, at, actor, action, selection, count, reason, details
FROM {schema}.audit_log
WHERE ($1::bigint IS NULL OR id < $1)
  AND ($2::text IS NULL OR action = $2)
  AND ($3::text IS NULL OR (actor = $3 AND action IS DISTINCT FROM $5::text))
  AND ($6::text IS NULL OR starts_with(action, $6::text))
ORDER BY id DESC
LIMIT $4;

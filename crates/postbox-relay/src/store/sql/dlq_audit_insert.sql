-- One audit entry: actor $1, action $2, selection $3 (JSON), count $4, reason $5, details $6 (JSON array).
INSERT INTO {schema}.audit_log (actor, action, selection, count, reason, details)
VALUES ($1, $2, $3::text::jsonb, $4, $5, $6::text::jsonb)
RETURNING id

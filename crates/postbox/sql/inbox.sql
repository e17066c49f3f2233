-- The consumers' inbox: which events a consumer has applied.

-- name: record
INSERT INTO {schema}.inbox (consumer, event_id) VALUES ($1, $2)
ON CONFLICT DO NOTHING;

-- name: purge
-- Up to $2 records processed more than $1 seconds ago.
DELETE FROM {schema}.inbox WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM {schema}.inbox
  WHERE processed_at < now() - make_interval(secs => $1) LIMIT $2));

-- name: sequence
SELECT {schema}.inbox_sequence($1, $2, $3, $4, $5) AS last_sequence;

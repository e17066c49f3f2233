-- The store of `postbox receive`: deliveries kept until a consumer processes them.

-- name: store
INSERT INTO {schema}.received (consumer, event_id, headers, body)
VALUES ($1, $2, $3::text::jsonb, $4)
ON CONFLICT (consumer, event_id) DO NOTHING;

-- name: take
SELECT id, consumer, event_id, headers, body, received_at
FROM {schema}.received
WHERE consumer = $1 AND processed_at IS NULL
ORDER BY id LIMIT $2
FOR UPDATE SKIP LOCKED;

-- name: mark_processed
UPDATE {schema}.received SET processed_at = now()
WHERE consumer = $1 AND id = ANY($2) AND processed_at IS NULL;

-- name: purge
DELETE FROM {schema}.received WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM {schema}.received
  WHERE processed_at < now() - make_interval(secs => $1) LIMIT $2));

-- Log mode: cursors reading the append-only log by snapshots (see migration 7).
-- Snapshots travel as text ($n::text::pg_snapshot).

-- name: cursors_ensure
-- A cursor for each destination $1 that has none; a new cursor starts before
-- the first event still in the log.
INSERT INTO {schema}.log_cursors (destination)
SELECT unnest($1::text[])
ON CONFLICT (destination) DO NOTHING;

-- name: cursors_acquire
-- Take (or renew) the lease on the cursors of destinations $2 for owner $1,
-- for $3 seconds, where nobody else holds a live lease. Returns those held.
UPDATE {schema}.log_cursors
SET owner = $1, lease_expires_at = now() + make_interval(secs => $3)
WHERE destination = ANY($2::text[])
  AND (owner IS NULL OR owner = $1 OR lease_expires_at < now())
RETURNING destination;

-- name: cursors_release
-- Give up owner $1's leases (on shutdown), so another relay takes over at once.
UPDATE {schema}.log_cursors
SET owner = NULL, lease_expires_at = NULL
WHERE owner = $1;

-- name: window
-- The window cursor $1 reads now, opening one when none is open: the events
-- visible in `hi` (a snapshot taken here) and not in `lo`. Only while owner
-- $2 holds the cursor.
UPDATE {schema}.log_cursors
SET hi = COALESCE(hi, pg_current_snapshot()),
    after_id = CASE WHEN hi IS NULL THEN 0 ELSE after_id END
WHERE destination = $1 AND owner = $2 AND lease_expires_at > now()
RETURNING destination, lo::text AS lo, hi::text AS hi, after_id;

-- name: page
-- Up to $4 events of the window (lo $1, hi $2) after id $3, in id order.
-- An event of the window either belongs to a transaction that was in
-- progress at `lo` (its xip list) or to one that started after `lo`
-- (txid >= xmax of lo); either way it must be visible in `hi`.
SELECT id, event_id, event_type, aggregate_type, aggregate_id, schema_version,
       payload::text AS payload, headers::text AS headers, created_at, sequence
FROM (
    SELECT * FROM {schema}.log
    WHERE txid IN (SELECT pg_snapshot_xip($1::text::pg_snapshot))
      AND pg_visible_in_snapshot(txid, $2::text::pg_snapshot)
      AND id > $3
    UNION ALL
    SELECT * FROM {schema}.log
    WHERE txid >= pg_snapshot_xmax($1::text::pg_snapshot)
      AND txid < pg_snapshot_xmax($2::text::pg_snapshot)
      AND pg_visible_in_snapshot(txid, $2::text::pg_snapshot)
      AND id > $3
) AS w
ORDER BY id
LIMIT $4;

-- name: advance
-- Record that cursor $1 (owner $2) published its window up to id $3 ($4
-- events); with $5 the window is done: `hi` becomes `lo`. False (no row)
-- when the lease was lost: the caller stops reading this cursor.
UPDATE {schema}.log_cursors
SET lo = CASE WHEN $5 THEN hi ELSE lo END,
    hi = CASE WHEN $5 THEN NULL ELSE hi END,
    after_id = CASE WHEN $5 THEN 0 ELSE $3 END,
    delivered = delivered + $4,
    updated_at = now()
WHERE destination = $1 AND owner = $2 AND lease_expires_at > now()
RETURNING true AS advanced;

-- name: producer_target
SELECT producer_target FROM {schema}.log_settings;

-- name: set_producer_target
UPDATE {schema}.log_settings SET producer_target = $1;

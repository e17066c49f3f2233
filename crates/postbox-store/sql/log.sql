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
-- Give up owner $1's leases on the cursors of destinations $2 (on shutdown),
-- so another relay takes over at once.
UPDATE {schema}.log_cursors
SET owner = NULL, lease_expires_at = NULL
WHERE owner = $1 AND destination = ANY($2::text[]);

-- name: window
-- The window cursor $1 reads now, opening one when none is open: the events
-- visible in `hi` (a snapshot taken here) and not in `lo`. Only while owner
-- $2 holds the cursor.
UPDATE {schema}.log_cursors
SET hi = COALESCE(hi, pg_current_snapshot()),
    after_id = CASE WHEN hi IS NULL THEN 0 ELSE after_id END
WHERE destination = $1 AND owner = $2 AND lease_expires_at > now()
RETURNING destination, lo::text AS lo, hi::text AS hi, after_id;

-- name: window_floor
-- The lowest id among the events of the window (lo $1, hi $2); NULL when it
-- has none. Found along the (txid, id) index — the window's transactions
-- are the ones in progress at `lo` and those from `lo`'s xmax up to `hi`'s —
-- so its cost is the window's size, not the log's: `id + 0` keeps the
-- planner from answering min(id) by walking the id index from the log's
-- start. A window read from its floor skips every older event unread.
SELECT LEAST(
    (SELECT min(id + 0) FROM {schema}.log
     WHERE txid >= pg_snapshot_xmax($1::text::pg_snapshot)
       AND txid < pg_snapshot_xmax($2::text::pg_snapshot)
       AND pg_visible_in_snapshot(txid, $2::text::pg_snapshot)),
    (SELECT min(id + 0) FROM {schema}.log
     WHERE txid = ANY (ARRAY(SELECT pg_snapshot_xip($1::text::pg_snapshot)))
       AND pg_visible_in_snapshot(txid, $2::text::pg_snapshot))) AS floor;

-- name: page
-- Up to $4 events of the window (lo $1, hi $2) after id $3, in id order.
-- An event of the window either belongs to a transaction that was in
-- progress at `lo` (its xip list) or to one that started after `lo`
-- (txid >= xmax of lo); either way it must be visible in `hi`. Read along
-- the id index from $3: a page of a large window costs about a page of rows,
-- not the whole window.
-- A log event is on its first attempt (`attempts` 1): retries happen in the outbox.
-- `scheduled`: its delivery time (migration 12) is still ahead; the reader
-- hands it to the outbox rather than publish it.
SELECT id, event_id, event_type, aggregate_type, aggregate_id, schema_version,
       payload::text AS payload, headers::text AS headers, created_at, sequence,
       1 AS attempts, COALESCE(deliver_at > now(), false) AS scheduled
FROM {schema}.log
WHERE id > $3
  AND pg_visible_in_snapshot(txid, $2::text::pg_snapshot)
  AND (txid >= pg_snapshot_xmax($1::text::pg_snapshot)
       OR txid = ANY (ARRAY(SELECT pg_snapshot_xip($1::text::pg_snapshot))))
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

-- name: handoff
-- Events destination $1 did not take leave the log for the claim/retry
-- machinery, in the transaction that moves the cursor past them (migration
-- 10's log_handoff: the events are copied from the log, the relay says only
-- how their delivery went). $2/$3 log ids and event ids, $4 dead, $5 delay
-- in seconds, $6 error, $7 fan-out, $8 attempts so far, $9/$10 the other
-- destinations of fan-out events. An event scheduled for later is due in the
-- outbox at its `deliver_at` at the earliest (migration 12).
-- Returns how many of the events it found in the log.
SELECT {schema}.log_handoff($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) AS found;

-- name: rotate
-- Move producers to the next segment when the current one is older than $1
-- seconds and the next one is empty.
SELECT {schema}.log_rotate(make_interval(secs => $1)) AS rotated;

-- name: truncate
-- Empty segment $1 if every cursor has read past it (archiving first with $2);
-- NULL when it is still needed.
SELECT {schema}.log_truncate($1, $2) AS removed;

-- name: cursor_lag
-- Each cursor's lag: committed events it has not read (not visible in its
-- `lo`), the age of the oldest of them, and how many it delivered so far.
SELECT c.destination,
       c.delivered,
       c.owner IS NOT NULL AND c.lease_expires_at > now() AS held,
       (SELECT count(*) FROM {schema}.log l
        WHERE l.txid >= pg_snapshot_xmin(c.lo)
          AND NOT pg_visible_in_snapshot(l.txid, c.lo)) AS lag_events,
       (SELECT extract(epoch FROM now() - min(l.created_at))::float8 FROM {schema}.log l
        WHERE l.txid >= pg_snapshot_xmin(c.lo)
          AND NOT pg_visible_in_snapshot(l.txid, c.lo)) AS lag_seconds
FROM {schema}.log_cursors c
ORDER BY c.destination;

-- name: unread
-- Events in the log some cursor has not read yet (every event, when no
-- cursor exists).
SELECT count(*) AS unread FROM {schema}.log l
WHERE NOT EXISTS (SELECT 1 FROM {schema}.log_cursors)
   OR EXISTS (SELECT 1 FROM {schema}.log_cursors c
              WHERE NOT pg_visible_in_snapshot(l.txid, c.lo));

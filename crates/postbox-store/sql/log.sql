-- Log mode: cursors reading the append-only log by snapshots (see migration 7).
-- Snapshots travel as text ($n::text::pg_snapshot).

-- name: cursors_ensure
-- Cursors for each destination $1 that has none, split into $2 partitions
-- (migration 14), starting where its entry of $3 says: 'beginning' before
-- the first event still in the log, 'now' after every event committed so
-- far; '' (no `start` configured) at the beginning when the schema has no
-- cursor yet (the outbox's first destinations), else now (a destination
-- added to a running outbox).
INSERT INTO {schema}.log_cursors (destination, part, parts, lo)
SELECT d, p, $2,
       CASE WHEN s = 'beginning'
                 OR (s = '' AND NOT EXISTS (SELECT 1 FROM {schema}.log_cursors))
            THEN '1:1:'::pg_snapshot
            ELSE pg_current_snapshot() END
FROM unnest($1::text[], $3::text[]) AS x(d, s), generate_series(0, $2 - 1) AS p
WHERE NOT EXISTS (SELECT 1 FROM {schema}.log_cursors c WHERE c.destination = d)
ON CONFLICT (destination, part) DO NOTHING;

-- name: cursors_split
-- Into how many partitions each of destinations $1 is split now.
SELECT destination, max(parts) AS parts
FROM {schema}.log_cursors
WHERE destination = ANY($1::text[])
GROUP BY destination;

-- name: cursors_lock
-- Re-splitting destination $1 (in a transaction): its cursors, locked; the
-- caller goes on only when no relay holds any of them. `start` is the
-- earliest of their `lo` snapshots (snapshots taken later see more, so
-- the order of xmax, then xmin, then more transactions in progress first,
-- is the order they were taken in).
SELECT count(*) FILTER (WHERE owner IS NOT NULL AND lease_expires_at > now()) AS held,
       (array_agg(lo::text ORDER BY pg_snapshot_xmax(lo), pg_snapshot_xmin(lo),
                  cardinality(ARRAY(SELECT pg_snapshot_xip(lo))) DESC))[1] AS start,
       sum(delivered)::bigint AS delivered
FROM (SELECT * FROM {schema}.log_cursors WHERE destination = $1 FOR UPDATE) c;

-- name: cursors_drop
-- Re-splitting: destination $1's cursors go (the caller holds their locks).
DELETE FROM {schema}.log_cursors WHERE destination = $1;

-- name: cursors_split_at
-- Re-splitting: destination $1's cursors anew, $2 partitions all starting at
-- snapshot $3, the first keeping the count $4 delivered so far.
INSERT INTO {schema}.log_cursors (destination, part, parts, lo, delivered)
SELECT $1, p, $2, $3::text::pg_snapshot, CASE WHEN p = 0 THEN $4 ELSE 0 END
FROM generate_series(0, $2 - 1) AS p;

-- name: cursors_acquire
-- Take, renew or give back owner $1's lease on partition $3 of destination
-- $2's cursor, for $4 seconds, and renew $1's heartbeat as a reader of $2.
-- A relay holds at most its share of the destination's partitions,
-- ceil(parts / live readers) (a reader is live while its heartbeat is
-- younger than the lease): it keeps a partition it holds while fewer than
-- its share of its others come before it, gives it back otherwise (called
-- between pages, so nothing is in flight), and takes a free or expired one
-- while it holds fewer than its share. With $5 (`keep`, a renewal while
-- moves are in flight) it never gives one back: it keeps and renews a
-- partition it holds beyond its share, and says so (`beyond`), so that the
-- reader gives it back once its moves are in. Returns whether $1 holds it
-- now, and whether beyond its share. A reader new to the destination (its
-- first heartbeat) and a partition given back announce themselves on the
-- schema's channel (payload `log-lease`), so that the other relays check
-- their share at once rather than at their next renewal, and a relay
-- waiting for a partition takes it at once. It commits without waiting for the WAL flush (synchronous_commit off for
-- its own transaction, whatever relay.synchronous_commit says): a lease
-- and a heartbeat carry no delivery state, and the reader renews them
-- between pages, where a flush would hold up the next page; a PostgreSQL
-- crash that loses a renewal can only let another relay take the
-- partition early, which is a crash's redelivery, never a skip (the cursor
-- moves only under a lease the move itself checks).
WITH beat AS (
    INSERT INTO {schema}.log_readers AS r (destination, owner, seen_at)
    VALUES ($2, $1, now())
    ON CONFLICT (destination, owner) DO UPDATE SET seen_at = now()
    -- xmax is 0 on a row this statement inserted, not on one it updated.
    RETURNING (r.xmax = 0) AS joined),
share AS (
    SELECT ceil(c.parts::numeric / (1 + (
               SELECT count(*) FROM {schema}.log_readers r
               WHERE r.destination = $2 AND r.owner <> $1
                 AND r.seen_at > now() - make_interval(secs => $4))))::bigint AS share,
           count(*) FILTER (WHERE m.part < c.part) AS before,
           count(m.part) AS mine,
           COALESCE(c.owner = $1 AND c.lease_expires_at > now(), false) AS was_mine
    FROM {schema}.log_cursors c
    LEFT JOIN {schema}.log_cursors m
      ON m.destination = c.destination AND m.part <> c.part
     AND m.owner = $1 AND m.lease_expires_at > now()
    WHERE c.destination = $2 AND c.part = $3
    GROUP BY c.parts, c.part, c.owner, c.lease_expires_at),
taken AS (
    UPDATE {schema}.log_cursors c
    SET owner = CASE WHEN (c.owner = $1 AND ($5 OR s.before < s.share)) OR s.mine < s.share
                     THEN $1 END,
        lease_expires_at = CASE WHEN (c.owner = $1 AND ($5 OR s.before < s.share))
                                     OR s.mine < s.share
                                THEN now() + make_interval(secs => $4) END
    FROM share s
    WHERE c.destination = $2 AND c.part = $3
      AND (c.owner = $1 OR c.owner IS NULL OR c.lease_expires_at < now())
    RETURNING c.owner, s.before >= s.share AS beyond),
announced AS (
    SELECT pg_notify({channel}, 'log-lease')
    WHERE (SELECT joined FROM beat)
       OR ((SELECT was_mine FROM share) AND NOT EXISTS (SELECT 1 FROM taken WHERE owner = $1)))
SELECT EXISTS (SELECT 1 FROM taken WHERE owner = $1) AS held,
       COALESCE((SELECT beyond FROM taken WHERE owner = $1), false) AS beyond
FROM (SELECT set_config('synchronous_commit', 'off', true)) AS without_flush,
     (SELECT count(*) FROM announced) AS announcing;

-- name: cursors_release
-- Give up owner $1's lease on partition $3 of destination $2's cursor (on
-- shutdown, or a drain's end), so another relay takes over at once; and,
-- unless $1 holds another of $2's partitions, its heartbeat as a reader.
WITH freed AS (
    UPDATE {schema}.log_cursors
    SET owner = NULL, lease_expires_at = NULL
    WHERE owner = $1 AND destination = $2 AND part = $3)
DELETE FROM {schema}.log_readers r
WHERE r.owner = $1 AND r.destination = $2
  AND NOT EXISTS (SELECT 1 FROM {schema}.log_cursors c
                  WHERE c.destination = $2 AND c.part <> $3 AND c.owner = $1
                    AND c.lease_expires_at > now());

-- name: open
-- The window partition $3 of cursor $1 reads now while owner $2 holds it
-- (with $5, a new window from that snapshot), and its first page of up to
-- $4 events, from its floor when it is new or after its stored `after_id`
-- (migration 18's `log_open`). A read: opening a window writes nothing;
-- `advance` stores its `hi` when it moves past a page of it, or moves `lo`
-- to it. The first row is the window (event columns NULL; `after_id` where
-- its first page starts, 0 when it holds no event); the events follow
-- (window columns NULL). No row at all when $2 does not hold the cursor.
SELECT * FROM {schema}.log_open($1, $2, $3, $4, $5) ORDER BY id NULLS FIRST;

-- name: page
-- Up to $4 events of the window (lo $1, hi $2) after id $3, in id order,
-- of partition $6 of a cursor split into $5 (migration 18's `log_page`,
-- which reads along the id index from $3 with one plan for any
-- parameters: a page of a large window costs about a page of rows). The
-- columns are named in the order the relay decodes them, by position.
SELECT id, event_id, event_type, aggregate_type, aggregate_id, schema_version,
       payload, headers, created_at, sequence, attempts, scheduled
FROM {schema}.log_page($1, $2, $3, $4, $5, $6) ORDER BY id;

-- name: advance
-- Record that partition $6 of cursor $1 (owner $2) published its window
-- (lo $7, hi $8) up to id $3 ($4 events): with $5 the window is done and
-- `lo` becomes its `hi`; otherwise the window stays open, stored at `hi`
-- (the first page of a window stores it). Only while the cursor is where the
-- window was read from (`lo` $7, and `hi` $8 when it stores one), so a
-- reader whose view is stale (it lost the lease and took it back meanwhile)
-- moves nothing. False (no row) then, or when the lease was lost: the
-- caller stops reading this cursor. {relay_commit}: relay.synchronous_commit
-- (see relay.sql); in a transaction that hands events off too, it applies
-- to the whole transaction.
UPDATE {schema}.log_cursors
SET lo = CASE WHEN $5 THEN $8::text::pg_snapshot ELSE lo END,
    hi = CASE WHEN $5 THEN NULL ELSE $8::text::pg_snapshot END,
    after_id = CASE WHEN $5 THEN 0 ELSE $3 END,
    delivered = delivered + $4,
    updated_at = now()
WHERE destination = $1 AND part = $6 AND owner = $2 AND lease_expires_at > now()
  AND lo::text = $7 AND (hi IS NULL OR hi::text = $8)
  AND {relay_commit}
RETURNING true AS advanced;

-- name: held
-- Ordered routes: what the outbox still holds, for destination $1, of the
-- aggregates $2/$3 (types and ids, parallel): per aggregate, event type and
-- whether it is a dead letter, the lowest sequence among its events that are
-- pending, in flight, or dead letters no operator has resolved, and that
-- have not reached $1 (no delivery row for $1 marked sent — a fan-out event
-- another destination handed off is delivered to $1 from the log). Read
-- along the partial index (aggregate_type, aggregate_id, sequence) WHERE
-- status <> 'sent'. The reader decides, by its routes, which of these hold
-- back the aggregate's later events at $1.
SELECT o.aggregate_type, o.aggregate_id, o.event_type,
       COALESCE(d.status, o.status) = 'failed' AS dead,
       min(o.sequence) AS sequence
FROM {schema}.outbox o
JOIN unnest($2::text[], $3::text[]) AS a(aggregate_type, aggregate_id)
  ON o.aggregate_type = a.aggregate_type AND o.aggregate_id = a.aggregate_id
LEFT JOIN {schema}.deliveries d ON d.outbox_id = o.id AND d.destination = $1
WHERE o.status <> 'sent'
  AND o.sequence IS NOT NULL
  AND (o.status <> 'failed' OR o.resolved_at IS NULL)
  AND d.status IS DISTINCT FROM 'sent'
GROUP BY 1, 2, 3, 4;

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
-- Each destination's lag: committed events its cursor has not read (not
-- visible in the `lo` of the partition they belong to), the age of the
-- oldest of them, and how many it delivered so far; held when a relay holds
-- every partition; unread_seconds: how long no relay has held any of its
-- partitions (0 while one does).
SELECT c.destination,
       sum(c.delivered)::bigint AS delivered,
       bool_and(c.owner IS NOT NULL AND c.lease_expires_at > now()) AS held,
       CASE WHEN bool_or(c.owner IS NOT NULL AND c.lease_expires_at > now()) THEN 0::float8
            ELSE greatest(extract(epoch FROM now() - max(coalesce(c.lease_expires_at, c.updated_at))), 0)::float8
       END AS unread_seconds,
       sum((SELECT count(*) FROM {schema}.log l
            WHERE l.txid >= pg_snapshot_xmin(c.lo)
              AND NOT pg_visible_in_snapshot(l.txid, c.lo)
              AND (c.parts = 1 OR {schema}.log_part(l.aggregate_type, l.aggregate_id, c.parts) = c.part)))::bigint
         AS lag_events,
       max((SELECT extract(epoch FROM now() - min(l.created_at))::float8 FROM {schema}.log l
            WHERE l.txid >= pg_snapshot_xmin(c.lo)
              AND NOT pg_visible_in_snapshot(l.txid, c.lo)
              AND (c.parts = 1 OR {schema}.log_part(l.aggregate_type, l.aggregate_id, c.parts) = c.part)))
         AS lag_seconds
FROM {schema}.log_cursors c
GROUP BY c.destination
ORDER BY c.destination;

-- name: unread
-- Events in the log some cursor has not read yet (every event, when no
-- cursor exists): not visible in the `lo` of the partition of some
-- destination's cursor it belongs to.
SELECT count(*) AS unread FROM {schema}.log l
WHERE NOT EXISTS (SELECT 1 FROM {schema}.log_cursors)
   OR EXISTS (SELECT 1 FROM {schema}.log_cursors c
              WHERE NOT pg_visible_in_snapshot(l.txid, c.lo)
                AND (c.parts = 1
                     OR {schema}.log_part(l.aggregate_type, l.aggregate_id, c.parts) = c.part));

-- name: log_bytes
-- The log's size on disk: every segment, with its indexes and TOAST.
SELECT coalesce(sum(pg_total_relation_size(i.inhrelid)), 0)::bigint AS bytes
FROM pg_inherits i
WHERE i.inhparent = '{schema}.log'::regclass;

-- name: drop_cursor
-- Drop destination $1's cursor (every partition) and its readers' heartbeats,
-- unless a relay holds a partition ($2: drop it anyway). The partitions dropped.
WITH dropped AS (
    DELETE FROM {schema}.log_cursors
    WHERE destination = $1
      AND ($2 OR NOT EXISTS (
          SELECT FROM {schema}.log_cursors h
          WHERE h.destination = $1 AND h.owner IS NOT NULL AND h.lease_expires_at > now()))
    RETURNING part, delivered),
readers AS (
    DELETE FROM {schema}.log_readers r
    WHERE r.destination = $1 AND EXISTS (SELECT FROM dropped))
SELECT count(*)::integer AS parts, coalesce(sum(delivered), 0)::bigint AS delivered FROM dropped;

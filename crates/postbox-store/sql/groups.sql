-- Consumer groups (migration 26): readers that pull events from the log.
-- The reading calls are the schema's own functions, so any driver makes
-- the same ones.

-- name: create
SELECT {schema}.create_group($1, $2, $3, $4, $5);

-- name: drop
SELECT {schema}.drop_group($1) AS existed;

-- name: receive
SELECT receipt, id, event_id, event_type, aggregate_type, aggregate_id, sequence,
       schema_version, payload, headers, created_at, attempts
FROM {schema}.receive($1, $2, make_interval(secs => $3), make_interval(secs => $4));

-- name: ack
SELECT {schema}.ack($1, $2) AS acked;

-- name: nack
SELECT {schema}.nack($1, $2, make_interval(secs => $3), $4) AS nacked;

-- name: status
-- Each group: its settings, the events it has not read yet (committed, not
-- visible in its cursor's `lo`, not read in its open window, of its types),
-- what it holds (in flight, waiting, dead letters), who read it in the last
-- minute, and the age of its oldest event not yet acknowledged.
SELECT g.name, g.types, g.ordered, g.max_attempts, g.received, g.dead_lettered,
       g.created_at, g.read_at,
       u.unread, i.in_flight, w.waiting,
       (SELECT count(*) FROM {schema}.group_dead_letters d
        WHERE d.group_name = g.name AND d.replayed_at IS NULL) AS dead_letters,
       (SELECT count(*) FROM {schema}.group_readers r
        WHERE r.group_name = g.name AND r.seen_at > now() - interval '60 seconds') AS readers,
       extract(epoch FROM now() - least(
         u.oldest,
         (SELECT l.created_at FROM {schema}.log l
          WHERE l.id = least(i.first_id, w.first_id))))::float8 AS lag_seconds
FROM {schema}.consumer_groups g
CROSS JOIN LATERAL (
    SELECT count(*) AS unread, min(l.created_at) AS oldest
    FROM {schema}.log l
    WHERE l.txid >= pg_snapshot_xmin(g.lo)
      AND NOT pg_visible_in_snapshot(l.txid, g.lo)
      AND NOT (g.hi IS NOT NULL AND l.id <= g.after_id AND pg_visible_in_snapshot(l.txid, g.hi))
      AND (g.type_likes IS NULL OR l.event_type LIKE ANY (g.type_likes))
      AND (g.start_at IS NULL OR l.created_at >= g.start_at)) u
CROSS JOIN LATERAL (
    SELECT count(*) AS in_flight, min(x.id) AS first_id
    FROM {schema}.group_batches b, unnest(b.ids) AS x(id)
    WHERE b.group_name = g.name) i
CROSS JOIN LATERAL (
    SELECT count(*) AS waiting, min(x.id) AS first_id
    FROM {schema}.group_waiting x WHERE x.group_name = g.name) w
ORDER BY g.name;

-- name: dead_letters
-- A group's dead letters not replayed, oldest first, after id $2, at most $3.
SELECT id, event_id, event_type, aggregate_type, aggregate_id, attempts, last_error, dead_at
FROM {schema}.group_dead_letters
WHERE group_name = $1 AND id > $2 AND replayed_at IS NULL
ORDER BY id
LIMIT $3;

-- name: replay_dead
-- Dead letters of group $1 (of event ids $2; all when NULL) back to the group.
SELECT {schema}.group_replay_dead($1, $2) AS replayed;

-- name: token_create
-- A bearer token for the group's HTTP API (migration 28): only its hash.
INSERT INTO {schema}.group_tokens (group_name, token_hash, label, created_by)
VALUES ($1, $2, $3, $4)
RETURNING id;

-- name: token_list
SELECT id, group_name, label, created_by, created_at, last_used_at
FROM {schema}.group_tokens
WHERE $1::text IS NULL OR group_name = $1
ORDER BY group_name, id;

-- name: token_revoke
DELETE FROM {schema}.group_tokens WHERE group_name = $1 AND id = $2;

-- name: token_group
-- The group a token opens and the token's id (no row: none), through the
-- function the consumer role may call.
SELECT group_name, token_id FROM {schema}.group_token_group($1);

-- name: pending
-- Whether a group has anything to hand out now (read only).
SELECT {schema}.group_pending($1) AS pending;

-- The console's own tables (users, sessions) and what its overview reads.

-- name: user_upsert
-- Create console user $1 with role $2, password hash $3 and outbox patterns
-- $4 (migration 23; empty: every outbox), or replace the role and hash of an
-- existing one, and its patterns unless $4 is NULL (a new user then gets
-- none: every outbox). Returns whether the user is new, and the patterns
-- stored.
INSERT INTO {schema}.console_users AS u (name, role, password_hash, outboxes)
VALUES ($1, $2, $3, coalesce($4::text[], '{}'))
ON CONFLICT (name) DO UPDATE
SET role = excluded.role, password_hash = excluded.password_hash,
    outboxes = coalesce($4::text[], u.outboxes), updated_at = now()
RETURNING (xmax = 0) AS created, outboxes;

-- name: user_get
-- One console user by name: role, password hash and outbox patterns.
SELECT role, password_hash, outboxes FROM {schema}.console_users WHERE name = $1;

-- name: user_delete
-- Remove console user $1 (their sessions go with them). Returns the name when it existed.
DELETE FROM {schema}.console_users WHERE name = $1 RETURNING name;

-- name: sessions_end_user
-- End every session of console user $1 (after a password or role change).
DELETE FROM {schema}.console_sessions WHERE user_name = $1;

-- name: session_insert
-- A new session: token hash $1, user $2, CSRF token $3, lasting $4 seconds.
-- Expired sessions are swept in the same statement.
WITH swept AS (
    DELETE FROM {schema}.console_sessions WHERE expires_at < now())
INSERT INTO {schema}.console_sessions (token_hash, user_name, csrf_token, expires_at)
VALUES ($1, $2, $3, now() + make_interval(secs => $4));

-- name: session_get
-- The live session whose token hashes to $1: its user, the user's current
-- role and outbox patterns (migration 23), and the session's CSRF token.
SELECT s.user_name, u.role, u.outboxes, s.csrf_token
FROM {schema}.console_sessions s
JOIN {schema}.console_users u ON u.name = s.user_name
WHERE s.token_hash = $1 AND s.expires_at > now();

-- name: session_delete
-- Sign out: end the session whose token hashes to $1.
DELETE FROM {schema}.console_sessions WHERE token_hash = $1;

-- name: delivery_rate
-- Events delivered per minute over the last $1 minutes (minutes with none
-- are left out), in every reading mode: claim mode's acknowledged outbox
-- rows, counted among the newest $2 of them (a bounded scan of the primary
-- key: the outbox has no index on sent_at, and adding one would cost every
-- acknowledgement its HOT update) and in the archive (indexed); log and
-- logical mode's deliveries from the stream, which leave no outbox row,
-- from the relays' counts by minute (migration 20; counted per
-- destination, so an event fanned out counts once: the most any one
-- destination of a mode took, summed over the modes).
WITH recent AS (
    SELECT sent_at FROM {schema}.outbox
    WHERE id > (SELECT COALESCE(max(id), 0) FROM {schema}.outbox) - $2
      AND status = 'sent' AND sent_at >= date_trunc('minute', now()) - make_interval(mins => $1)
    UNION ALL
    SELECT sent_at FROM {schema}.outbox_archive
    WHERE sent_at >= date_trunc('minute', now()) - make_interval(mins => $1)),
claimed AS (
    SELECT date_trunc('minute', sent_at) AS minute, count(*) AS events
    FROM recent GROUP BY 1),
streamed AS (
    SELECT minute, max(delivered) AS events
    FROM {schema}.deliveries_by_minute
    WHERE mode <> 'claim' AND minute >= date_trunc('minute', now()) - make_interval(mins => $1)
    GROUP BY minute, mode)
SELECT minute, sum(events)::bigint AS events
FROM (SELECT * FROM claimed UNION ALL SELECT * FROM streamed) x
GROUP BY minute
ORDER BY minute;

-- name: relays
-- Relays connected to this database now, by client address: their sessions
-- carry application_name 'postbox-relay'. Without pg_monitor (or
-- pg_read_all_stats) other roles' client addresses read as NULL.
SELECT COALESCE(host(client_addr), 'local') AS client,
       count(*) AS connections,
       min(backend_start) AS connected_since,
       max(COALESCE(state_change, backend_start)) AS last_active
FROM pg_catalog.pg_stat_activity
WHERE application_name = $1 AND datname = current_database()
GROUP BY 1
ORDER BY 1;

-- name: backlog
-- The backlog now, for the console's history chart: pending events never
-- attempted, pending events waiting for a retry (attempted before), events
-- claimed by a relay, unresolved dead letters, and the oldest pending
-- event's age. Each part reads a partial index (pending, processing, failed
-- rows), not the whole table. Events scheduled for later (migration 12) are
-- neither pending nor old yet: left out until they are due.
WITH p AS (
    SELECT count(*) FILTER (WHERE attempts = 0) AS pending,
           count(*) FILTER (WHERE attempts > 0) AS retrying,
           min(created_at) AS oldest
    FROM {schema}.outbox
    WHERE status = 'pending' AND NOT COALESCE(deliver_at > now(), false))
SELECT p.pending,
       p.retrying,
       (SELECT count(*) FROM {schema}.outbox WHERE status = 'processing') AS processing,
       (SELECT count(*) FROM {schema}.outbox WHERE status = 'failed' AND resolved_at IS NULL)
         AS dead_letters,
       extract(epoch FROM now() - p.oldest)::float8 AS oldest_pending_age_seconds
FROM p;

-- name: error_groups
-- Events grouped by cause: unresolved dead letters ($1 = 'dead') or events
-- waiting for a retry ($1 = 'retrying': pending after a failed attempt), by
-- last error and the destinations not yet delivered to (fan-out), largest
-- group first, at most $2 groups. `key` names the group for error_group_ids.
WITH e AS (
    SELECT o.id, o.event_id, o.event_type, o.created_at, o.last_error,
           (SELECT string_agg(d.destination, ', ' ORDER BY d.destination)
            FROM {schema}.deliveries d
            WHERE d.outbox_id = o.id AND d.status <> 'sent') AS destinations
    FROM {schema}.outbox o
    WHERE ($1::text = 'dead' AND o.status = 'failed' AND o.resolved_at IS NULL)
       OR ($1::text = 'retrying' AND o.status = 'pending' AND o.attempts > 0))
SELECT md5(COALESCE(last_error, '') || chr(31) || COALESCE(destinations, '')) AS key,
       last_error,
       destinations,
       count(*) AS events,
       min(created_at) AS oldest,
       max(created_at) AS newest,
       (array_agg(event_id ORDER BY id))[1] AS example,
       string_agg(DISTINCT event_type, ', ') AS event_types
FROM e
GROUP BY last_error, destinations
ORDER BY count(*) DESC, min(id)
LIMIT $2;

-- name: error_group_ids
-- The unresolved dead letters of the group named $1 (its key in
-- error_groups), oldest first, at most $2: event id and last error.
SELECT o.event_id, o.last_error
FROM {schema}.outbox o
WHERE o.status = 'failed' AND o.resolved_at IS NULL
  AND md5(COALESCE(o.last_error, '') || chr(31) || COALESCE(
        (SELECT string_agg(d.destination, ', ' ORDER BY d.destination)
         FROM {schema}.deliveries d
         WHERE d.outbox_id = o.id AND d.status <> 'sent'), '')) = $1
ORDER BY o.id
LIMIT $2;

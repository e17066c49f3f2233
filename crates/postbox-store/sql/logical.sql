-- Logical mode: the relay's reads of its replication slot, the slot's
-- confirmation, its status, and the hand-off of events a destination did not
-- take (migration 11). $1 is always the slot's name; the slot's publication
-- has the same name.

-- name: lock
-- Only one relay reads a slot: the reader holds this session-level advisory
-- lock for as long as its connection lives; a standby tries again until the
-- holder's session ends.
SELECT pg_try_advisory_lock(hashtextextended('postbox.logical.' || $1, 0)) AS held;

-- name: create_slot
-- Create the slot when wal_level allows it and it does not exist yet, as a
-- statement of its own (the first thing its transaction does): one row,
-- true, when it was created; no row otherwise. Not through a PL/pgSQL
-- function: PostgreSQL 15 fails a slot created inside one ("snapshot
-- reference … is not owned by resource owner") whenever the creation had to
-- wait for a concurrent transaction, after creating it.
SELECT pg_create_logical_replication_slot($1, 'pgoutput') IS NOT NULL AS created
WHERE current_setting('wal_level') = 'logical'
  AND NOT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = $1);

-- name: ensure_slot
-- When create_slot made nothing: false for an existing slot, or the error
-- naming wal_level when it is not logical (SQLSTATE 55000).
SELECT {schema}.logical_ensure_slot($1) AS created;

-- name: ensure_publication
SELECT {schema}.logical_ensure_publication($1);

-- name: flush_lsn
-- The WAL position decoding may read up to.
SELECT pg_current_wal_flush_lsn()::text AS lsn;

-- name: peek
-- The slot's changes of transactions committed before $2, without confirming
-- them, stopping after the transaction that takes the rows past $3.
SELECT lsn::text AS lsn, data
FROM pg_logical_slot_peek_binary_changes($1, $2::text::pg_lsn, $3::int4,
       'proto_version', '1', 'publication_names', $1, 'messages', 'true');

-- name: advance
-- Confirm the slot up to $2 (the server may then recycle the WAL before it).
-- The caller asks only past the slot's confirmed position, which is an
-- error otherwise. A plain call: invoked from a query that also scans
-- pg_replication_slots, PostgreSQL 15 may fail it at commit ("snapshot
-- reference … is not owned by resource owner").
SELECT pg_replication_slot_advance($1, $2::text::pg_lsn) IS NOT NULL AS advanced;

-- name: confirmed
-- The slot's confirmed position (NULL while the slot is still being created).
SELECT confirmed_flush_lsn::text AS lsn FROM pg_replication_slots WHERE slot_name = $1;

-- name: read_now
-- The reader notes that it read the slot now (migration 15), and the
-- position it confirmed the slot up to (migration 32).
SELECT {schema}.logical_read_now($1, $2::text::pg_lsn);

-- name: noted
-- The position the reader last noted on this server (NULL when none was).
SELECT confirmed_lsn::text AS lsn FROM {schema}.logical_readers
 WHERE slot_name = $1 AND confirmed_on = (SELECT system_identifier FROM pg_control_system());

-- name: read_failed
-- The reader notes a failed reading session and its error (migration 22).
SELECT {schema}.logical_read_failed($1, $2);

-- name: status
-- Logical slots of this database ($1 NULL) or one of them: how far behind
-- the WAL they are and what they retain. wal_status `lost`: the server
-- removed WAL the slot still needed (max_slot_wal_keep_size). reader_pid:
-- the backend holding the reader's advisory lock (see `lock`: a bigint key
-- shows in pg_locks as classid = high and objid = low 32 bits), i.e. a
-- relay reads the slot now; a slot read through the SQL interface is
-- `active` only during each read. last_read_seconds_ago: since a relay last
-- noted a read of it in this schema (NULL: never); reader_failures,
-- failing_seconds, reader_error: its reading sessions that failed in a row
-- since (migration 22). noted_lsn: the position a relay last noted it
-- confirmed the slot up to on this server (migration 32; NULL: none, or the
-- note came from another server); behind_note_bytes: how far the slot
-- stands behind that note (NULL unless it does), WAL whose events were
-- delivered and which a crash or restart brought back: the next relay to
-- read the slot moves it up to the note.
SELECT s.slot_name,
       s.plugin,
       s.active,
       s.active_pid,
       s.wal_status,
       s.confirmed_flush_lsn::text AS confirmed_lsn,
       pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::float8 AS lag_bytes,
       pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::float8 AS retained_bytes,
       s.safe_wal_size::float8 AS safe_wal_bytes,
       CASE WHEN current_setting('max_slot_wal_keep_size') = '-1' THEN NULL
            ELSE pg_size_bytes(current_setting('max_slot_wal_keep_size'))::float8 END
         AS max_slot_wal_keep_bytes,
       pg_current_wal_lsn()::text AS current_lsn,
       l.pid AS reader_pid,
       extract(epoch FROM now() - r.read_at)::float8 AS last_read_seconds_ago,
       coalesce(r.failures, 0) AS reader_failures,
       extract(epoch FROM now() - r.failing_since)::float8 AS failing_seconds,
       r.last_error AS reader_error,
       n.lsn::text AS noted_lsn,
       CASE WHEN n.lsn > s.confirmed_flush_lsn
            THEN pg_wal_lsn_diff(n.lsn, s.confirmed_flush_lsn)::float8 END AS behind_note_bytes
FROM pg_replication_slots s
LEFT JOIN pg_locks l
  ON l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
 AND l.classid::int8 = ((hashtextextended('postbox.logical.' || s.slot_name, 0) >> 32) & 4294967295)
 AND l.objid::int8 = (hashtextextended('postbox.logical.' || s.slot_name, 0) & 4294967295)
LEFT JOIN {schema}.logical_readers r ON r.slot_name = s.slot_name
LEFT JOIN LATERAL (
  SELECT r.confirmed_lsn AS lsn
   WHERE r.confirmed_on = (SELECT system_identifier FROM pg_control_system())
) n ON true
WHERE s.slot_type = 'logical' AND s.database = current_database()
  AND ($1::text IS NULL OR s.slot_name = $1)
ORDER BY s.slot_name;

-- name: drop_slot
-- Drop the slot and its publication; true when the slot existed.
SELECT {schema}.logical_drop_slot($1) AS existed;

-- name: handoff
-- Events destination $1 did not take go to the outbox's retry and
-- dead-letter machinery from their emitted content ($2) and tag ($3;
-- migration 19 checks every tag and takes the event's fields from the
-- checked content), with how their delivery went ($4 dead, $5 delay in
-- seconds, $6 error, empty for an event handed off untried, $7 fan-out,
-- $8 attempts so far) and the other destinations of fan-out events
-- ($9/$10). Returns how many events it was given.
SELECT {schema}.logical_handoff_verified($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) AS found;

-- name: verify
-- Which (SHA-256 of an event's JSON, tag) pairs carry a valid tag, in order
-- (migration 19; the relay never sees the key).
SELECT {schema}.logical_verify($1, $2) AS valid;

-- name: numbered_emits
-- Whether emit numbers each event within its aggregate (migration 17).
SELECT numbered_emits FROM {schema}.logical_settings;

-- name: set_numbered_emits
UPDATE {schema}.logical_settings SET numbered_emits = $1;

-- name: refuse
-- Keep a message the reader set aside (migration 19) and trim the table to
-- its newest 1,000 rows.
WITH kept AS (
    INSERT INTO {schema}.logical_refused (lsn, reason, excerpt)
    VALUES ($1, $2, $3)
    RETURNING id)
DELETE FROM {schema}.logical_refused
WHERE id <= (SELECT id FROM kept) - 1000;

-- name: refused
-- The messages set aside, newest first.
SELECT refused_at, lsn, reason, excerpt FROM {schema}.logical_refused
ORDER BY id DESC LIMIT $1;

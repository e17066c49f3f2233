-- The least-privilege roles of `postbox migrate --create-roles`: one
-- idempotent script; {producer}, {relay}, {monitor} and {consumer} are the
-- role names.

-- name: create_roles
-- Least-privilege roles for postbox's schema {schema}. They are NOLOGIN
-- groups: a DBA grants them to login users (GRANT {relay} TO relay_login).
-- Idempotent: run it again after an upgrade to cover new tables.
DO $roles$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = '{producer}') THEN
    CREATE ROLE {producer} NOLOGIN;
  END IF;
  IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = '{relay}') THEN
    CREATE ROLE {relay} NOLOGIN;
  END IF;
  IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = '{monitor}') THEN
    CREATE ROLE {monitor} NOLOGIN;
  END IF;
  IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = '{consumer}') THEN
    CREATE ROLE {consumer} NOLOGIN;
  END IF;
END
$roles$;

GRANT USAGE ON SCHEMA {schema} TO {producer}, {relay}, {monitor}, {consumer};

-- Producer: can enqueue and nothing else. It calls the SECURITY DEFINER
-- enqueue functions (migration 7; the Rust library calls enqueue_one and
-- enqueue_many), which alone write the outbox and the sequence counters, so
-- it cannot add an event already sent or failed, with an error or a lease,
-- nor renumber an aggregate (it may schedule an event for later: migration
-- 12's `deliver_at`); and it cannot read, change or delete events. The
-- REVOKEs take back what earlier versions of this script granted.
REVOKE ALL ON {schema}.outbox, {schema}.aggregate_sequences FROM {producer};
GRANT EXECUTE ON FUNCTION
    {schema}.enqueue(text, text, text, jsonb, jsonb, timestamptz),
    {schema}.enqueue_one(uuid, text, text, text, integer, jsonb, jsonb, timestamptz),
    {schema}.enqueue_many(uuid[], text[], text[], text[], integer[], jsonb[], jsonb[],
                          timestamptz[]),
    {schema}.uuid_v7()
  TO {producer};
-- Logical mode (migrations 11 and 13): events written into the WAL only.
GRANT EXECUTE ON FUNCTION
    {schema}.emit(text, text, text, jsonb, jsonb, timestamptz),
    {schema}.emit_one(uuid, text, text, text, integer, jsonb, jsonb, timestamptz)
  TO {producer};
-- Request idempotency keys are written in the producer's own transaction.
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.idempotency_keys TO {producer};

-- Relay: claims, settles and rescues events, and runs retention. It changes
-- only an event's delivery state (status, attempts, when it is due, its lease,
-- when it was sent, its last error), never what the event says (type,
-- aggregate, sequence, payload, headers) nor an operator's resolution. The
-- REVOKE takes back the table-wide UPDATE earlier versions granted (and with
-- it the column grants, given again below).
REVOKE UPDATE ON {schema}.outbox FROM {relay};
GRANT SELECT, DELETE ON {schema}.outbox TO {relay};
GRANT UPDATE (status, attempts, available_at, lease_token, lease_expires_at, sent_at, last_error)
  ON {schema}.outbox TO {relay};
-- The relay checks at start-up that the schema is migrated.
GRANT SELECT ON {schema}.schema_migrations TO {relay};
GRANT SELECT, INSERT ON {schema}.outbox_archive TO {relay};
GRANT SELECT, DELETE ON {schema}.inbox TO {relay};
-- Per-destination state of fan-out events.
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.deliveries TO {relay};
-- Retention purges expired request idempotency keys. The purge locks them
-- (FOR UPDATE SKIP LOCKED: it skips a key whose request is restarting it
-- right now rather than wait for that request), and a row lock needs UPDATE
-- on at least one column: created_at, which no decision reads.
GRANT SELECT, DELETE ON {schema}.idempotency_keys TO {relay};
GRANT UPDATE (created_at) ON {schema}.idempotency_keys TO {relay};

-- Log mode: the relay reads the log (through its partitioned parent: the
-- segments need no grant of their own) and the producers' target, keeps its
-- own cursors (and, migration 14, re-splits them and keeps the heartbeat
-- that shares a destination's partitions), and does everything else to the log through the SECURITY
-- DEFINER functions of migration 10: rotating and truncating the ring, and
-- handing events it did not deliver to the outbox (copied from the log, so
-- it needs no INSERT on the outbox and cannot make up an event).
-- Its pages are read through log_page and log_open (migration 18), which
-- run with the caller's rights: this SELECT is what lets them read; a new
-- window's first page starts at log_floor's answer (migration 31).
GRANT SELECT ON {schema}.log, {schema}.log_settings TO {relay};
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.log_cursors, {schema}.log_readers TO {relay};
GRANT EXECUTE ON FUNCTION
    {schema}.log_floor(pg_snapshot, pg_snapshot),
    {schema}.log_rotate(interval),
    {schema}.log_truncate(integer, boolean),
    {schema}.log_handoff(text, bigint[], uuid[], boolean[], float8[], text[], boolean[],
                         integer[], uuid[], text[])
  TO {relay};
-- Logical mode: the relay checks the tags of what it read from the slot
-- (logical_verify, migration 19: it never sees the key), and hands events a
-- destination did not take to the outbox through logical_handoff_verified,
-- which takes their emitted content and tag, never an event's fields: a
-- relay role can hand off what producers emitted and nothing else. The
-- REVOKE takes back the field-taking logical_handoff earlier versions of
-- this script granted. Reading the slot needs the REPLICATION attribute on
-- the relay's login role, which a DBA grants (ALTER ROLE … REPLICATION); it
-- is not a group privilege, and it is cluster-wide (see the book's
-- security page).
REVOKE EXECUTE ON FUNCTION
    {schema}.logical_handoff(text, uuid[], text[], text[], text[], integer[], jsonb[], jsonb[],
                             timestamptz[], timestamptz[], bigint[], boolean[], float8[], text[],
                             boolean[], integer[], uuid[], text[])
  FROM {relay};
GRANT EXECUTE ON FUNCTION
    {schema}.logical_verify(bytea[], bytea[]),
    {schema}.logical_handoff_verified(text, text[], bytea[], boolean[], float8[], text[],
                                      boolean[], integer[], uuid[], text[])
  TO {relay};
-- …and notes when it read its slot (migration 15), with where it confirmed
-- the slot up to (migration 32: a position it confirms to the server anyway).
GRANT EXECUTE ON FUNCTION {schema}.logical_read_now(text),
    {schema}.logical_read_now(text, pg_lsn) TO {relay};
-- …and each reading session that failed (migration 22).
GRANT EXECUTE ON FUNCTION {schema}.logical_read_failed(text, text) TO {relay};
-- …and reads those notes with its slot's status (lag, time unread).
GRANT SELECT ON {schema}.logical_readers TO {relay};
-- …and whether emits are numbered (migration 17): with ordered routes it
-- refuses to read a schema whose emits carry no sequence. The producer
-- needs no grant: emit_one reads the setting as its owner, and only the
-- owner changes it (postbox migrate --emit-sequence).
GRANT SELECT ON {schema}.logical_settings TO {relay};
-- Log mode: the relay's gauges include each consumer group's (migration
-- 26): it reads the groups' tables, and changes none of them.
GRANT SELECT ON {schema}.consumer_groups, {schema}.group_batches, {schema}.group_waiting,
    {schema}.group_dead_letters, {schema}.group_readers TO {relay};
-- Every mode: retention keeps what an unfinished replay job still reads
-- (migration 29): the purge reads the jobs. In claim and logical mode the
-- relay records the destinations it serves (migration 30), makes a job for
-- one added with a start in the past, and runs it: it inserts jobs and
-- moves their position, counts and state, never their range or destination.
GRANT SELECT, INSERT ON {schema}.replay_jobs, {schema}.destinations_seen TO {relay};
GRANT UPDATE (after_id, after_event, delivered, filtered, rejected, last_error, state,
              updated_at, finished_at)
  ON {schema}.replay_jobs TO {relay};
-- Every mode: the relay counts deliveries by minute (migration 20).
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.deliveries_by_minute TO {relay};
-- …and keeps what it set aside (migration 19), trimming the table.
GRANT SELECT, INSERT, DELETE ON {schema}.logical_refused TO {relay};

-- Monitor: read-only, for `postbox status` and dashboards (every table of
-- the schema as of this run: run it again after an upgrade).
GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {monitor};

-- The operator console's password hashes and session tokens are not for
-- dashboards: the monitor role reads everything else.
REVOKE ALL ON {schema}.console_users, {schema}.console_sessions FROM {monitor};
-- Nor is the key that signs emitted events (migration 19): the owner's alone.
REVOKE ALL ON {schema}.logical_key FROM {monitor};
-- Nor are the hashes of consumer groups' HTTP tokens (migration 28).
REVOKE ALL ON {schema}.group_tokens FROM {monitor};

-- Consumer: reads consumer groups (migration 26) and nothing else. receive,
-- ack and nack run with their owner's rights; the role has no table of the
-- schema, cannot create or drop a group, and cannot write an event.
GRANT EXECUTE ON FUNCTION
    {schema}.receive(text, integer, interval, interval),
    {schema}.ack(text, text[]),
    {schema}.nack(text, text, interval, text)
  TO {consumer};
-- …and, serving the groups over HTTP (`postbox group serve`, migration
-- 28), finds the group a bearer token opens (it reads no token itself).
-- It also asks, read only, whether a group has anything to hand out
-- before a waiting long poll calls receive.
GRANT EXECUTE ON FUNCTION
    {schema}.group_token_group(bytea),
    {schema}.group_pending(text)
  TO {consumer};

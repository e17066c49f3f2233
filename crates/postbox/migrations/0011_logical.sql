-- postbox schema, version 11: logical-decoding mode. Producers may write an
-- event into the WAL only, as a transactional logical message
-- (`pg_logical_emit_message(true, prefix, content)`): no table row, no
-- index entry, no dead tuple. The message is decoded only if, and when, its
-- transaction commits, in commit order; a relay in logical mode reads it from
-- a replication slot. Events a destination does not take are handed to the
-- outbox's retry and dead-letter machinery by `logical_handoff`.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

-- The logical message prefix of this schema's events: `postbox.<schema>`.
CREATE FUNCTION {schema}.logical_prefix() RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp AS $fn$
  SELECT 'postbox.' || btrim('{schema}', '"')
$fn$;

-- One event with the id and schema version the caller chose (the Rust
-- library's `emit`, which validated the event already). The message's
-- content is a JSON object; `sequence` is absent (see the README: emitted
-- events are delivered in commit order and carry no per-aggregate number,
-- which would cost a counter row per event).
CREATE FUNCTION {schema}.emit_one(
    event_id       uuid,
    event_type     text,
    aggregate_type text,
    aggregate_id   text,
    schema_version integer,
    payload        jsonb,
    headers        jsonb
) RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp AS $fn$
  SELECT NULL FROM pg_logical_emit_message(true, {schema}.logical_prefix(),
    jsonb_build_object(
      'event_id', emit_one.event_id,
      'event_type', emit_one.event_type,
      'aggregate_type', emit_one.aggregate_type,
      'aggregate_id', emit_one.aggregate_id,
      'schema_version', emit_one.schema_version,
      'payload', emit_one.payload,
      'headers', emit_one.headers,
      'created_at_us', (extract(epoch FROM now()) * 1000000)::bigint)::text)
$fn$;

-- Emit from any language: the checks and SQLSTATEs of `enqueue`, a UUIDv7
-- id, schema version 1.
CREATE FUNCTION {schema}.emit(
    event_type     text,
    aggregate_type text,
    aggregate_id   text,
    payload        jsonb,
    headers        jsonb DEFAULT '{}'
) RETURNS uuid
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  new_id uuid := {schema}.uuid_v7();
BEGIN
  IF event_type IS NULL OR octet_length(event_type) NOT BETWEEN 1 AND 255 THEN
    RAISE EXCEPTION 'postbox.emit: event_type must be 1 to 255 bytes long'
      USING ERRCODE = '22023';
  END IF;
  IF aggregate_type IS NULL OR octet_length(aggregate_type) NOT BETWEEN 1 AND 255 THEN
    RAISE EXCEPTION 'postbox.emit: aggregate_type must be 1 to 255 bytes long'
      USING ERRCODE = '22023';
  END IF;
  IF aggregate_id IS NULL OR octet_length(aggregate_id) NOT BETWEEN 1 AND 255 THEN
    RAISE EXCEPTION 'postbox.emit: aggregate_id must be 1 to 255 bytes long'
      USING ERRCODE = '22023';
  END IF;
  IF payload IS NULL THEN
    RAISE EXCEPTION 'postbox.emit: payload must not be NULL (use ''null''::jsonb for an empty payload)'
      USING ERRCODE = '22023';
  END IF;
  IF headers IS NULL OR jsonb_typeof(headers) <> 'object' THEN
    RAISE EXCEPTION 'postbox.emit: headers must be a JSON object'
      USING ERRCODE = '22023';
  END IF;
  PERFORM {schema}.emit_one(new_id, event_type, aggregate_type, aggregate_id, 1, payload, headers);
  RETURN new_id;
END
$fn$;

-- Make sure replication slot `slot` exists (pgoutput). Runs with the
-- caller's rights: creating a slot needs the REPLICATION attribute, and must
-- be the first thing its transaction does. Returns whether it created the
-- slot. Fails with SQLSTATE 55000 naming the setting when the server's
-- wal_level is not logical.
CREATE FUNCTION {schema}.logical_ensure_slot(slot text) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  IF current_setting('wal_level') <> 'logical' THEN
    RAISE EXCEPTION 'postbox logical mode needs wal_level = logical (it is %): run ALTER SYSTEM SET wal_level = logical and restart PostgreSQL', current_setting('wal_level')
      USING ERRCODE = '55000';
  END IF;
  IF EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = slot) THEN
    RETURN false;
  END IF;
  PERFORM pg_create_logical_replication_slot(slot, 'pgoutput');
  RETURN true;
END
$fn$;

-- Make sure the publication pgoutput reads the slot through exists: named
-- like the slot, publishing no table (only logical messages are read).
-- Creating it needs CREATE on the database. It must exist before the slot:
-- pgoutput looks the publication up in the catalog as of each change it
-- decodes, so a slot created first fails on the first table change written
-- before the publication.
CREATE FUNCTION {schema}.logical_ensure_publication(slot text) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_publication WHERE pubname = slot) THEN
    EXECUTE format('CREATE PUBLICATION %I', slot);
  END IF;
END
$fn$;

-- Drop replication slot `slot` and its publication (both if they exist).
-- Returns whether the slot existed.
CREATE FUNCTION {schema}.logical_drop_slot(slot text) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  existed boolean := EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = slot);
BEGIN
  IF existed THEN
    PERFORM pg_drop_replication_slot(slot);
  END IF;
  EXECUTE format('DROP PUBLICATION IF EXISTS %I', slot);
  RETURN existed;
END
$fn$;

-- Hand events destination `destination` did not take to the outbox. Unlike
-- log_handoff, the event exists nowhere but in the WAL, so the relay passes
-- its content: a role allowed to call this function can add any event to
-- the outbox (a relay role in logical mode is trusted with events' content).
-- Per event as log_handoff: `dead`, `delay_secs`, `errors` (sanitized),
-- `fanout`, `attempts`, and the placeholders of the other destinations of a
-- fan-out event. An event already in the outbox (handed off before a crash,
-- or by another destination) is not inserted twice. Returns how many events
-- it was given.
CREATE FUNCTION {schema}.logical_handoff(
    destination        text,
    event_ids          uuid[],
    event_types        text[],
    aggregate_types    text[],
    aggregate_ids      text[],
    schema_versions    integer[],
    payloads           jsonb[],
    headers            jsonb[],
    created_ats        timestamptz[],
    dead               boolean[],
    delay_secs         float8[],
    errors             text[],
    fanout             boolean[],
    attempts           integer[],
    other_event_ids    uuid[],
    other_destinations text[]
) RETURNS integer
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
WITH h AS (
    SELECT *
    FROM unnest(logical_handoff.event_ids, logical_handoff.event_types,
                logical_handoff.aggregate_types, logical_handoff.aggregate_ids,
                logical_handoff.schema_versions, logical_handoff.payloads,
                logical_handoff.headers, logical_handoff.created_ats,
                logical_handoff.dead, logical_handoff.delay_secs, logical_handoff.errors,
                logical_handoff.fanout, logical_handoff.attempts)
      AS x(event_id, event_type, aggregate_type, aggregate_id, schema_version, payload,
           headers, created_at, dead, delay_secs, error, fanout, attempts)),
inserted AS (
    INSERT INTO {schema}.outbox
        (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers,
         created_at, status, attempts, available_at, last_error)
    SELECT event_id, event_type, aggregate_type, aggregate_id, schema_version,
           payload, headers, created_at,
           CASE WHEN dead THEN 'failed'::{schema}.event_status
                ELSE 'pending'::{schema}.event_status END,
           attempts, now() + make_interval(secs => delay_secs), error
    FROM h
    ON CONFLICT (event_id) DO NOTHING
    RETURNING id, event_id),
rows AS (
    SELECT o.id, h.event_id, h.dead, h.delay_secs, h.error, h.attempts, true AS existed
    FROM h JOIN {schema}.outbox o ON o.event_id = h.event_id
    WHERE h.fanout
    UNION ALL
    SELECT i.id, h.event_id, h.dead, h.delay_secs, h.error, h.attempts, false
    FROM inserted i JOIN h ON h.event_id = i.event_id
    WHERE h.fanout),
mine AS (
    INSERT INTO {schema}.deliveries AS d
        (outbox_id, destination, status, attempts, available_at, last_error, updated_at)
    SELECT r.id, logical_handoff.destination,
           CASE WHEN r.dead THEN 'failed'::{schema}.event_status
                ELSE 'pending'::{schema}.event_status END,
           r.attempts, now() + make_interval(secs => r.delay_secs), r.error, now()
    FROM rows r
    ON CONFLICT (outbox_id, destination) DO UPDATE
    SET status = EXCLUDED.status, attempts = EXCLUDED.attempts,
        available_at = EXCLUDED.available_at, last_error = EXCLUDED.last_error,
        updated_at = now()
    WHERE d.attempts = 0 AND d.status = 'sent'
    RETURNING d.outbox_id),
placeholders AS (
    INSERT INTO {schema}.deliveries
        (outbox_id, destination, status, attempts, available_at, updated_at)
    SELECT r.id, p.destination, 'sent'::{schema}.event_status, 0, now(), now()
    FROM unnest(logical_handoff.other_event_ids, logical_handoff.other_destinations)
      AS p(event_id, destination)
    JOIN rows r ON r.event_id = p.event_id
    ON CONFLICT (outbox_id, destination) DO NOTHING),
revived AS (
    UPDATE {schema}.outbox o
    SET status = 'pending', available_at = LEAST(o.available_at, now()),
        lease_token = NULL, lease_expires_at = NULL
    FROM rows r
    WHERE o.id = r.id AND r.existed AND o.status <> 'pending'
      AND o.id IN (SELECT outbox_id FROM mine))
SELECT count(*)::integer FROM h
$fn$;

REVOKE EXECUTE ON FUNCTION
    {schema}.logical_handoff(text, uuid[], text[], text[], text[], integer[], jsonb[], jsonb[],
                             timestamptz[], boolean[], float8[], text[], boolean[], integer[],
                             uuid[], text[])
  FROM PUBLIC;

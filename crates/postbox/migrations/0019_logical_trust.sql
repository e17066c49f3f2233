-- postbox schema, version 19: who may write a schema's logical stream is
-- decided by grants, not by knowing its prefix.
--
-- `pg_logical_emit_message` is executable by PUBLIC, so any login can write
-- a message under `postbox.<schema>`. From this version on, `emit_one`
-- signs each message with a key only the schema's owner can read: the
-- content is the 64 hex digits of HMAC-SHA256(key, SHA-256(event JSON))
-- followed by the event JSON. The relay asks `logical_verify` (it never
-- sees the key) and sets aside whatever does not carry a valid tag, and it
-- hands events to the outbox only through `logical_handoff_verified`, which
-- takes the emitted content and its tag, never an event's fields: a relay
-- login can hand off what producers emitted and nothing else.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

-- Only the schema's owner and the roles it grants may emit (PostgreSQL
-- makes a new function executable by PUBLIC): `postbox migrate
-- --create-roles` grants both to <schema>_producer; nobody else gets them.
REVOKE EXECUTE ON FUNCTION
    {schema}.emit(text, text, text, jsonb, jsonb, timestamptz),
    {schema}.emit_one(uuid, text, text, text, integer, jsonb, jsonb, timestamptz)
  FROM PUBLIC;

-- A bound on payloads for every way into the schema: emit_one checks it
-- here, and migration 21's trigger on the outbox and the log. It measures
-- the payload's JSON text as the database prints it, which has a space
-- after every `:` and `,` that the libraries' compact form has not: the
-- default, 1.5 MiB, lets in everything the libraries' 1 MiB limit accepts
-- and refuses what is far beyond it. `limits_payload_too_big` is the check.
-- One row; the owner changes it:
--   UPDATE myschema.limits SET max_payload_bytes = 4194304;
CREATE TABLE {schema}.limits (
    only_row          boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    max_payload_bytes integer NOT NULL DEFAULT 1572864 CHECK (max_payload_bytes > 0)
);

-- Whether `payload` is over the schema's limit: its JSON text is measured
-- (not its stored size, which a number like 1e100000 keeps small however
-- long it prints).
CREATE FUNCTION {schema}.limits_payload_too_big(payload jsonb) RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp AS $fn$
  SELECT octet_length(limits_payload_too_big.payload::text) > l.max_payload_bytes
  FROM {schema}.limits l
$fn$;
REVOKE EXECUTE ON FUNCTION {schema}.limits_payload_too_big(jsonb) FROM PUBLIC;
INSERT INTO {schema}.limits DEFAULT VALUES;

-- The key, one row, readable by the owner alone (no role script grants
-- it). The inner and outer HMAC pads are kept, so a tag is two SHA-256s.
-- The key's 244 random bits come from two gen_random_uuid() (PostgreSQL's
-- strong random source; no extension needed).
CREATE TABLE {schema}.logical_key (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    ipad     bytea NOT NULL,
    opad     bytea NOT NULL
);
REVOKE ALL ON {schema}.logical_key FROM PUBLIC;
WITH k AS (
    SELECT decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex')
           || '\x0000000000000000000000000000000000000000000000000000000000000000'::bytea AS key),
bytes AS (
    SELECT i, get_byte(k.key, i) AS b FROM k, generate_series(0, 63) AS i)
INSERT INTO {schema}.logical_key (ipad, opad)
SELECT decode(string_agg(lpad(to_hex(b # 54), 2, '0'), '' ORDER BY i), 'hex'),
       decode(string_agg(lpad(to_hex(b # 92), 2, '0'), '' ORDER BY i), 'hex')
FROM bytes;

-- The tag of an event JSON's SHA-256.
CREATE FUNCTION {schema}.logical_tag(digest bytea) RETURNS bytea
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp AS $fn$
  SELECT sha256(k.opad || sha256(k.ipad || logical_tag.digest)) FROM {schema}.logical_key k
$fn$;
REVOKE EXECUTE ON FUNCTION {schema}.logical_tag(bytea) FROM PUBLIC;

-- Migration 17's emit_one, signing its message.
CREATE OR REPLACE FUNCTION {schema}.emit_one(
    event_id       uuid,
    event_type     text,
    aggregate_type text,
    aggregate_id   text,
    schema_version integer,
    payload        jsonb,
    headers        jsonb,
    deliver_at     timestamptz DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  seq bigint;
  content text;
BEGIN
  IF NOT isfinite(emit_one.deliver_at) THEN
    RAISE EXCEPTION 'postbox.emit: deliver_at must be a finite time (NULL: at once)'
      USING ERRCODE = '22023';
  END IF;
  IF {schema}.limits_payload_too_big(emit_one.payload) THEN
    RAISE EXCEPTION 'postbox.emit: the payload is % bytes of JSON, more than the schema''s limit of % bytes (limits.max_payload_bytes)',
      octet_length(emit_one.payload::text), (SELECT l.max_payload_bytes FROM {schema}.limits l)
      USING ERRCODE = '54000';
  END IF;
  IF (SELECT s.numbered_emits FROM {schema}.logical_settings s) THEN
    INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence)
    VALUES (emit_one.aggregate_type, emit_one.aggregate_id, 1)
    ON CONFLICT ON CONSTRAINT aggregate_sequences_pkey
    DO UPDATE SET last_sequence = s.last_sequence + 1
    RETURNING s.last_sequence INTO seq;
  END IF;
  content := (jsonb_build_object(
      'event_id', emit_one.event_id,
      'event_type', emit_one.event_type,
      'aggregate_type', emit_one.aggregate_type,
      'aggregate_id', emit_one.aggregate_id,
      'schema_version', emit_one.schema_version,
      'payload', emit_one.payload,
      'headers', emit_one.headers,
      'created_at_us', (extract(epoch FROM now()) * 1000000)::bigint)
     || CASE WHEN seq IS NULL THEN '{}'::jsonb
             ELSE jsonb_build_object('sequence', seq) END
     || CASE WHEN emit_one.deliver_at IS NULL THEN '{}'::jsonb
             ELSE jsonb_build_object('deliver_at_us',
                    (extract(epoch FROM emit_one.deliver_at) * 1000000)::bigint) END)::text;
  PERFORM pg_logical_emit_message(true, {schema}.logical_prefix(),
    encode({schema}.logical_tag(sha256(convert_to(content, 'UTF8'))), 'hex') || content);
END
$fn$;

-- Which of these (event JSON SHA-256, tag) pairs carry a valid tag, in
-- order. The relay asks before it publishes what it read from the slot.
CREATE FUNCTION {schema}.logical_verify(digests bytea[], tags bytea[]) RETURNS boolean[]
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
  SELECT coalesce(array_agg(coalesce(u.t = sha256(k.opad || sha256(k.ipad || u.d)), false)
                            ORDER BY u.i), '{}')
  FROM unnest(logical_verify.digests, logical_verify.tags) WITH ORDINALITY AS u(d, t, i),
       {schema}.logical_key k
$fn$;
REVOKE EXECUTE ON FUNCTION {schema}.logical_verify(bytea[], bytea[]) FROM PUBLIC;

-- Hand events to the outbox from their emitted content and tag: every tag
-- is checked (one that fails refuses the whole call), and the event's
-- fields come from the checked content, so a caller cannot write an event
-- a producer did not emit. The rest is migration 16's logical_handoff.
CREATE FUNCTION {schema}.logical_handoff_verified(
    destination        text,
    contents           text[],
    tags               bytea[],
    dead               boolean[],
    delay_secs         float8[],
    errors             text[],
    fanout             boolean[],
    attempts           integer[],
    other_event_ids    uuid[],
    other_destinations text[]
) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  c jsonb[];
BEGIN
  IF cardinality(logical_handoff_verified.contents) IS DISTINCT FROM
       cardinality(logical_handoff_verified.tags)
     OR EXISTS (
       SELECT FROM unnest(logical_handoff_verified.contents, logical_handoff_verified.tags)
         AS u(content, tag)
       WHERE u.tag IS NULL OR u.content IS NULL
          OR u.tag IS DISTINCT FROM
             {schema}.logical_tag(sha256(convert_to(u.content, 'UTF8')))) THEN
    RAISE EXCEPTION 'postbox.logical_handoff: an event''s tag does not match its content'
      USING ERRCODE = '42501';
  END IF;
  SELECT array_agg(u.content::jsonb ORDER BY u.i) INTO c
  FROM unnest(logical_handoff_verified.contents) WITH ORDINALITY AS u(content, i);
  RETURN {schema}.logical_handoff(
    logical_handoff_verified.destination,
    ARRAY(SELECT (e->>'event_id')::uuid FROM unnest(c) WITH ORDINALITY AS x(e, i) ORDER BY i),
    ARRAY(SELECT e->>'event_type' FROM unnest(c) WITH ORDINALITY AS x(e, i) ORDER BY i),
    ARRAY(SELECT e->>'aggregate_type' FROM unnest(c) WITH ORDINALITY AS x(e, i) ORDER BY i),
    ARRAY(SELECT e->>'aggregate_id' FROM unnest(c) WITH ORDINALITY AS x(e, i) ORDER BY i),
    ARRAY(SELECT (e->>'schema_version')::integer FROM unnest(c) WITH ORDINALITY AS x(e, i) ORDER BY i),
    ARRAY(SELECT e->'payload' FROM unnest(c) WITH ORDINALITY AS x(e, i) ORDER BY i),
    ARRAY(SELECT e->'headers' FROM unnest(c) WITH ORDINALITY AS x(e, i) ORDER BY i),
    ARRAY(SELECT to_timestamp((e->>'created_at_us')::numeric / 1000000)
          FROM unnest(c) WITH ORDINALITY AS x(e, i) ORDER BY i),
    ARRAY(SELECT to_timestamp((e->>'deliver_at_us')::numeric / 1000000)
          FROM unnest(c) WITH ORDINALITY AS x(e, i) ORDER BY i),
    ARRAY(SELECT (e->>'sequence')::bigint FROM unnest(c) WITH ORDINALITY AS x(e, i) ORDER BY i),
    logical_handoff_verified.dead, logical_handoff_verified.delay_secs,
    logical_handoff_verified.errors, logical_handoff_verified.fanout,
    logical_handoff_verified.attempts, logical_handoff_verified.other_event_ids,
    logical_handoff_verified.other_destinations);
END
$fn$;
REVOKE EXECUTE ON FUNCTION {schema}.logical_handoff_verified(text, text[], bytea[], boolean[],
    float8[], text[], boolean[], integer[], uuid[], text[]) FROM PUBLIC;

-- The hand-off that takes an event's fields is the owner's alone from now
-- on: take it back from every role an earlier role script granted it to.
DO $revoke$
DECLARE
  g record;
BEGIN
  FOR g IN
    SELECT a.grantee::regrole::text AS grantee
    FROM pg_catalog.pg_proc f
    CROSS JOIN LATERAL pg_catalog.aclexplode(f.proacl) AS a
    WHERE f.oid = '{schema}.logical_handoff(text, uuid[], text[], text[], text[], integer[], jsonb[], jsonb[], timestamptz[], timestamptz[], bigint[], boolean[], float8[], text[], boolean[], integer[], uuid[], text[])'::regprocedure
      AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> f.proowner
  LOOP
    EXECUTE format('REVOKE EXECUTE ON FUNCTION {schema}.logical_handoff(text, uuid[], text[], '
                   'text[], text[], integer[], jsonb[], jsonb[], timestamptz[], timestamptz[], '
                   'bigint[], boolean[], float8[], text[], boolean[], integer[], uuid[], text[]) '
                   'FROM %s', g.grantee);
  END LOOP;
END
$revoke$;

-- What the logical reader set aside instead of delivering: messages under
-- the schema's prefix that are not an event it can decode, or that carry
-- no valid tag. The slot is confirmed past them; this table keeps the
-- newest 1,000 for an operator (`Logical::refuse` trims it), and
-- postbox_logical_refused_total counts every one.
CREATE TABLE {schema}.logical_refused (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    refused_at timestamptz NOT NULL DEFAULT now(),
    lsn        text NOT NULL,
    reason     text NOT NULL,
    -- The message's first bytes (at most 512), as text.
    excerpt    text NOT NULL
);

-- postbox schema, version 17: numbering emitted events becomes a per-schema
-- choice, off by default (`postbox migrate --emit-sequence on|off` sets it).
--
-- Off, `emit_one` writes the event into the WAL and nothing else: no table
-- row, no index entry, no dead tuple (it only reads the one-row settings
-- table); its message carries no `sequence`, as before migration 16, and
-- the relay delivers it unordered.
--
-- On, it numbers the event within its aggregate as migration 16 did: it
-- bumps the aggregate's counter row in `aggregate_sequences` (one row
-- update, so one dead tuple, per event; producers of one aggregate wait for
-- each other's commit on that row) and writes the number into the message.
-- Ordered routes in logical mode need it: a relay with ordered routes in
-- logical mode refuses to read a schema where it is off.
--
-- `emit_one` keeps its signature, SECURITY DEFINER, search_path and grants
-- (CREATE OR REPLACE keeps the owner and every privilege given on it).
-- `{schema}` is replaced by the quoted schema name when the migration runs.

-- Logical mode's settings, one row, as log mode's `log_settings`.
CREATE TABLE {schema}.logical_settings (
    only_row       boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    numbered_emits boolean NOT NULL DEFAULT false
);
INSERT INTO {schema}.logical_settings DEFAULT VALUES;

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
BEGIN
  IF NOT isfinite(emit_one.deliver_at) THEN
    RAISE EXCEPTION 'postbox.emit: deliver_at must be a finite time (NULL: at once)'
      USING ERRCODE = '22023';
  END IF;
  IF (SELECT s.numbered_emits FROM {schema}.logical_settings s) THEN
    INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence)
    VALUES (emit_one.aggregate_type, emit_one.aggregate_id, 1)
    ON CONFLICT ON CONSTRAINT aggregate_sequences_pkey
    DO UPDATE SET last_sequence = s.last_sequence + 1
    RETURNING s.last_sequence INTO seq;
  END IF;
  PERFORM pg_logical_emit_message(true, {schema}.logical_prefix(),
    (jsonb_build_object(
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
                    (extract(epoch FROM emit_one.deliver_at) * 1000000)::bigint) END)::text);
END
$fn$;

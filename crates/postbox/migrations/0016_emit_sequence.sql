-- postbox schema, version 16: emitted events carry their aggregate's
-- sequence number, so logical mode can keep ordered routes. `emit_one` bumps
-- the aggregate's counter row in `aggregate_sequences` (migration 5) in the
-- producer's transaction, as the enqueue functions do, and writes the number
-- into the logical message (`sequence`). The counter row's lock serializes
-- producers of one aggregate until they commit, so an aggregate's events
-- are decoded in sequence order; a rollback returns the number. Producers
-- of one aggregate share one counter whether they enqueue or emit.
--
-- `emit_one` becomes SECURITY DEFINER: a producer role has no privilege on
-- the counters (migration 8), and only bumps one by emitting an event, as
-- with enqueue. Its EXECUTE stays PostgreSQL's default, as before.
--
-- `logical_handoff` takes each event's sequence and keeps it on the outbox
-- row, where the ordered claim orders an aggregate's events by it.
-- As in migration 13, the old functions are replaced (not overloaded) and
-- whoever could run them may run their successors.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

ALTER FUNCTION {schema}.emit_one(uuid, text, text, text, integer, jsonb, jsonb, timestamptz)
  RENAME TO emit_one_before_16;
ALTER FUNCTION {schema}.logical_handoff(text, uuid[], text[], text[], text[], integer[], jsonb[],
                                        jsonb[], timestamptz[], timestamptz[], boolean[], float8[],
                                        text[], boolean[], integer[], uuid[], text[])
  RENAME TO logical_handoff_before_16;

-- Migration 13's emit_one, numbering the event within its aggregate.
CREATE FUNCTION {schema}.emit_one(
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
  INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence)
  VALUES (emit_one.aggregate_type, emit_one.aggregate_id, 1)
  ON CONFLICT ON CONSTRAINT aggregate_sequences_pkey
  DO UPDATE SET last_sequence = s.last_sequence + 1
  RETURNING s.last_sequence INTO seq;
  PERFORM pg_logical_emit_message(true, {schema}.logical_prefix(),
    (jsonb_build_object(
      'event_id', emit_one.event_id,
      'event_type', emit_one.event_type,
      'aggregate_type', emit_one.aggregate_type,
      'aggregate_id', emit_one.aggregate_id,
      'schema_version', emit_one.schema_version,
      'payload', emit_one.payload,
      'headers', emit_one.headers,
      'sequence', seq,
      'created_at_us', (extract(epoch FROM now()) * 1000000)::bigint)
     || CASE WHEN emit_one.deliver_at IS NULL THEN '{}'::jsonb
             ELSE jsonb_build_object('deliver_at_us',
                    (extract(epoch FROM emit_one.deliver_at) * 1000000)::bigint) END)::text);
END
$fn$;

-- Migration 13's hand-off, keeping each event's sequence (`sequences`, NULL
-- for an event emitted before this migration) on its outbox row.
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
    deliver_ats        timestamptz[],
    sequences          bigint[],
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
                logical_handoff.deliver_ats, logical_handoff.sequences, logical_handoff.dead,
                logical_handoff.delay_secs, logical_handoff.errors,
                logical_handoff.fanout, logical_handoff.attempts)
      AS x(event_id, event_type, aggregate_type, aggregate_id, schema_version, payload,
           headers, created_at, deliver_at, sequence, dead, delay_secs, error, fanout, attempts)),
due AS (
    -- Never due before its deliver_at; an empty error is no error (an event
    -- handed off untried: scheduled, or behind an earlier one).
    SELECT h.*, GREATEST(now() + make_interval(secs => h.delay_secs), h.deliver_at) AS due_at,
           NULLIF(h.error, '') AS last_error
    FROM h),
inserted AS (
    INSERT INTO {schema}.outbox
        (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers,
         created_at, status, attempts, available_at, last_error, deliver_at, sequence)
    SELECT event_id, event_type, aggregate_type, aggregate_id, schema_version,
           payload, headers, created_at,
           CASE WHEN dead THEN 'failed'::{schema}.event_status
                ELSE 'pending'::{schema}.event_status END,
           attempts, due_at, last_error, deliver_at, sequence
    FROM due
    ON CONFLICT (event_id) DO NOTHING
    RETURNING id, event_id),
rows AS (
    SELECT o.id, h.event_id, h.dead, h.due_at, h.last_error, h.attempts, true AS existed
    FROM due h JOIN {schema}.outbox o ON o.event_id = h.event_id
    WHERE h.fanout
    UNION ALL
    SELECT i.id, h.event_id, h.dead, h.due_at, h.last_error, h.attempts, false
    FROM inserted i JOIN due h ON h.event_id = i.event_id
    WHERE h.fanout),
mine AS (
    INSERT INTO {schema}.deliveries AS d
        (outbox_id, destination, status, attempts, available_at, last_error, updated_at)
    SELECT r.id, logical_handoff.destination,
           CASE WHEN r.dead THEN 'failed'::{schema}.event_status
                ELSE 'pending'::{schema}.event_status END,
           r.attempts, r.due_at, r.last_error, now()
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
                             timestamptz[], timestamptz[], bigint[], boolean[], float8[], text[],
                             boolean[], integer[], uuid[], text[])
  FROM PUBLIC;

-- Whoever could run an old function (other than its owner) may run its
-- successor; then the old ones go.
DO $grants$
DECLARE
  g record;
BEGIN
  FOR g IN
    SELECT p.new_signature, a.grantee::regrole::text AS grantee
    FROM (VALUES
      ('{schema}.emit_one_before_16(uuid, text, text, text, integer, jsonb, jsonb, timestamptz)'::regprocedure,
       '{schema}.emit_one(uuid, text, text, text, integer, jsonb, jsonb, timestamptz)'),
      ('{schema}.logical_handoff_before_16(text, uuid[], text[], text[], text[], integer[], jsonb[], jsonb[], timestamptz[], timestamptz[], boolean[], float8[], text[], boolean[], integer[], uuid[], text[])'::regprocedure,
       '{schema}.logical_handoff(text, uuid[], text[], text[], text[], integer[], jsonb[], jsonb[], timestamptz[], timestamptz[], bigint[], boolean[], float8[], text[], boolean[], integer[], uuid[], text[])'))
      AS p(old, new_signature)
    JOIN pg_catalog.pg_proc f ON f.oid = p.old
    CROSS JOIN LATERAL pg_catalog.aclexplode(f.proacl) AS a
    WHERE a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> f.proowner
  LOOP
    EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s', g.new_signature, g.grantee);
  END LOOP;
END
$grants$;

DROP FUNCTION {schema}.emit_one_before_16(uuid, text, text, text, integer, jsonb, jsonb,
                                          timestamptz);
DROP FUNCTION {schema}.logical_handoff_before_16(text, uuid[], text[], text[], text[], integer[],
                                                 jsonb[], jsonb[], timestamptz[], timestamptz[],
                                                 boolean[], float8[], text[], boolean[],
                                                 integer[], uuid[], text[]);

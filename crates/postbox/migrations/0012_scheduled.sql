-- postbox schema, version 12: scheduled delivery. A producer may say when an
-- event becomes deliverable (`deliver_at`); until then no relay sees it.
-- `{schema}` is replaced by the quoted schema name when the migration runs.
--
-- - `outbox.deliver_at` and `log.deliver_at` keep the time asked for (NULL:
--   at once). In the outbox the event is simply not due before then: it is
--   inserted `pending` with `available_at` = that time, so the claim (which
--   takes only due rows) needs no change. In the log a cursor that reads an
--   event not yet due hands it to the outbox through `log_handoff`, due at
--   that time, and moves on: the cursor never waits for it.
-- - The three enqueue functions take one more argument, `deliver_at
--   timestamptz DEFAULT NULL` (for `enqueue`, by name:
--   `enqueue(..., deliver_at => now() + interval '1 hour')`). The old
--   functions are replaced, not overloaded: a call with the old arguments
--   resolves to the new function through the default, where two overloads
--   would make it ambiguous. The EXECUTE grants of the old functions (the
--   producer role's) are carried over to the new ones, so producers keep
--   working without running `--create-roles` again.
-- - A time in the past means at once. An infinite time is refused.

ALTER TABLE {schema}.outbox ADD COLUMN deliver_at timestamptz;
ALTER TABLE {schema}.log ADD COLUMN deliver_at timestamptz;

-- The old functions step aside (keeping their grants until they are copied).
ALTER FUNCTION {schema}.enqueue(text, text, text, jsonb, jsonb)
  RENAME TO enqueue_before_12;
ALTER FUNCTION {schema}.enqueue_one(uuid, text, text, text, integer, jsonb, jsonb)
  RENAME TO enqueue_one_before_12;
ALTER FUNCTION {schema}.enqueue_many(uuid[], text[], text[], text[], integer[], jsonb[], jsonb[])
  RENAME TO enqueue_many_before_12;

-- Enqueue from any language: the interface and checks of migration 9, and
-- `deliver_at`.
CREATE FUNCTION {schema}.enqueue(
    event_type     text,
    aggregate_type text,
    aggregate_id   text,
    payload        jsonb,
    headers        jsonb DEFAULT '{}',
    deliver_at     timestamptz DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  new_id uuid := {schema}.uuid_v7();
  seq bigint;
BEGIN
  IF event_type IS NULL OR octet_length(event_type) NOT BETWEEN 1 AND 255 THEN
    RAISE EXCEPTION 'postbox.enqueue: event_type must be 1 to 255 bytes long'
      USING ERRCODE = '22023';
  END IF;
  IF aggregate_type IS NULL OR octet_length(aggregate_type) NOT BETWEEN 1 AND 255 THEN
    RAISE EXCEPTION 'postbox.enqueue: aggregate_type must be 1 to 255 bytes long'
      USING ERRCODE = '22023';
  END IF;
  IF aggregate_id IS NULL OR octet_length(aggregate_id) NOT BETWEEN 1 AND 255 THEN
    RAISE EXCEPTION 'postbox.enqueue: aggregate_id must be 1 to 255 bytes long'
      USING ERRCODE = '22023';
  END IF;
  IF payload IS NULL THEN
    RAISE EXCEPTION 'postbox.enqueue: payload must not be NULL (use ''null''::jsonb for an empty payload)'
      USING ERRCODE = '22023';
  END IF;
  IF headers IS NULL OR jsonb_typeof(headers) <> 'object' THEN
    RAISE EXCEPTION 'postbox.enqueue: headers must be a JSON object'
      USING ERRCODE = '22023';
  END IF;
  IF NOT isfinite(enqueue.deliver_at) THEN
    RAISE EXCEPTION 'postbox.enqueue: deliver_at must be a finite time (NULL: at once)'
      USING ERRCODE = '22023';
  END IF;
  INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence)
  VALUES (enqueue.aggregate_type, enqueue.aggregate_id, 1)
  ON CONFLICT ON CONSTRAINT aggregate_sequences_pkey
  DO UPDATE SET last_sequence = s.last_sequence + 1
  RETURNING s.last_sequence INTO seq;
  IF {schema}.log_producing() THEN
    INSERT INTO {schema}.log
      (event_id, event_type, aggregate_type, aggregate_id, payload, headers, sequence, deliver_at)
    VALUES (new_id, event_type, aggregate_type, aggregate_id, payload, headers, seq,
            enqueue.deliver_at);
  ELSE
    INSERT INTO {schema}.outbox
      (event_id, event_type, aggregate_type, aggregate_id, payload, headers, sequence,
       deliver_at, available_at)
    VALUES (new_id, event_type, aggregate_type, aggregate_id, payload, headers, seq,
            enqueue.deliver_at, GREATEST(now(), enqueue.deliver_at));
  END IF;
  RETURN new_id;
END
$fn$;

-- One event with the id and schema version the caller chose (the Rust
-- library's `enqueue`, which validated the event already; the table's
-- constraints check it again). The aggregate's counter row is bumped first:
-- concurrent producers of one aggregate wait on its row lock.
CREATE FUNCTION {schema}.enqueue_one(
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
  IF NOT isfinite(enqueue_one.deliver_at) THEN
    RAISE EXCEPTION 'postbox.enqueue: deliver_at must be a finite time (NULL: at once)'
      USING ERRCODE = '22023';
  END IF;
  INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence)
  VALUES (enqueue_one.aggregate_type, enqueue_one.aggregate_id, 1)
  ON CONFLICT ON CONSTRAINT aggregate_sequences_pkey
  DO UPDATE SET last_sequence = s.last_sequence + 1
  RETURNING s.last_sequence INTO seq;
  IF {schema}.log_producing() THEN
    INSERT INTO {schema}.log
      (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers,
       sequence, deliver_at)
    VALUES (enqueue_one.event_id, enqueue_one.event_type, enqueue_one.aggregate_type,
            enqueue_one.aggregate_id, enqueue_one.schema_version, enqueue_one.payload,
            enqueue_one.headers, seq, enqueue_one.deliver_at);
  ELSE
    INSERT INTO {schema}.outbox
      (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers,
       sequence, deliver_at, available_at)
    VALUES (enqueue_one.event_id, enqueue_one.event_type, enqueue_one.aggregate_type,
            enqueue_one.aggregate_id, enqueue_one.schema_version, enqueue_one.payload,
            enqueue_one.headers, seq, enqueue_one.deliver_at,
            GREATEST(now(), enqueue_one.deliver_at));
  END IF;
END
$fn$;

-- A batch, column-wise (the Rust library's `enqueue_batch`). One counter bump
-- per aggregate of the batch, taken in a fixed order so two batches sharing
-- aggregates cannot deadlock; the batch's events of one aggregate are
-- numbered in input order. `deliver_ats` is NULL when nothing is scheduled
-- (a missing time is NULL: at once).
CREATE FUNCTION {schema}.enqueue_many(
    event_ids       uuid[],
    event_types     text[],
    aggregate_types text[],
    aggregate_ids   text[],
    schema_versions integer[],
    payloads        jsonb[],
    headers         jsonb[],
    deliver_ats     timestamptz[] DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_column
BEGIN
  IF enqueue_many.deliver_ats IS NOT NULL
     AND EXISTS (SELECT 1 FROM unnest(enqueue_many.deliver_ats) AS t(at) WHERE NOT isfinite(t.at)) THEN
    RAISE EXCEPTION 'postbox.enqueue: deliver_at must be a finite time (NULL: at once)'
      USING ERRCODE = '22023';
  END IF;
  IF {schema}.log_producing() THEN
    WITH e AS (
      SELECT * FROM unnest(enqueue_many.event_ids, enqueue_many.event_types,
                           enqueue_many.aggregate_types, enqueue_many.aggregate_ids,
                           enqueue_many.schema_versions, enqueue_many.payloads,
                           enqueue_many.headers, enqueue_many.deliver_ats)
        WITH ORDINALITY
        AS e(event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers,
             deliver_at, ord)),
    counts AS (
      SELECT e.aggregate_type, e.aggregate_id, count(*) AS n FROM e GROUP BY 1, 2),
    seq AS (
      INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence)
      SELECT c.aggregate_type, c.aggregate_id, c.n FROM counts c ORDER BY 1, 2
      ON CONFLICT ON CONSTRAINT aggregate_sequences_pkey
      DO UPDATE SET last_sequence = s.last_sequence + EXCLUDED.last_sequence
      RETURNING s.aggregate_type, s.aggregate_id, s.last_sequence)
    INSERT INTO {schema}.log
      (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers,
       sequence, deliver_at)
    SELECT e.event_id, e.event_type, e.aggregate_type, e.aggregate_id, e.schema_version,
           e.payload, e.headers,
           seq.last_sequence - c.n
             + row_number() OVER (PARTITION BY e.aggregate_type, e.aggregate_id ORDER BY e.ord),
           e.deliver_at
    FROM e
    JOIN counts c ON c.aggregate_type = e.aggregate_type AND c.aggregate_id = e.aggregate_id
    JOIN seq ON seq.aggregate_type = e.aggregate_type AND seq.aggregate_id = e.aggregate_id
    ORDER BY e.ord;
  ELSE
    WITH e AS (
      SELECT * FROM unnest(enqueue_many.event_ids, enqueue_many.event_types,
                           enqueue_many.aggregate_types, enqueue_many.aggregate_ids,
                           enqueue_many.schema_versions, enqueue_many.payloads,
                           enqueue_many.headers, enqueue_many.deliver_ats)
        WITH ORDINALITY
        AS e(event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers,
             deliver_at, ord)),
    counts AS (
      SELECT e.aggregate_type, e.aggregate_id, count(*) AS n FROM e GROUP BY 1, 2),
    seq AS (
      INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence)
      SELECT c.aggregate_type, c.aggregate_id, c.n FROM counts c ORDER BY 1, 2
      ON CONFLICT ON CONSTRAINT aggregate_sequences_pkey
      DO UPDATE SET last_sequence = s.last_sequence + EXCLUDED.last_sequence
      RETURNING s.aggregate_type, s.aggregate_id, s.last_sequence)
    INSERT INTO {schema}.outbox
      (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers,
       sequence, deliver_at, available_at)
    SELECT e.event_id, e.event_type, e.aggregate_type, e.aggregate_id, e.schema_version,
           e.payload, e.headers,
           seq.last_sequence - c.n
             + row_number() OVER (PARTITION BY e.aggregate_type, e.aggregate_id ORDER BY e.ord),
           e.deliver_at, GREATEST(now(), e.deliver_at)
    FROM e
    JOIN counts c ON c.aggregate_type = e.aggregate_type AND c.aggregate_id = e.aggregate_id
    JOIN seq ON seq.aggregate_type = e.aggregate_type AND seq.aggregate_id = e.aggregate_id
    ORDER BY e.ord;
  END IF;
END
$fn$;

REVOKE EXECUTE ON FUNCTION
    {schema}.enqueue(text, text, text, jsonb, jsonb, timestamptz),
    {schema}.enqueue_one(uuid, text, text, text, integer, jsonb, jsonb, timestamptz),
    {schema}.enqueue_many(uuid[], text[], text[], text[], integer[], jsonb[], jsonb[], timestamptz[])
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
      ('{schema}.enqueue_before_12(text, text, text, jsonb, jsonb)'::regprocedure,
       '{schema}.enqueue(text, text, text, jsonb, jsonb, timestamptz)'),
      ('{schema}.enqueue_one_before_12(uuid, text, text, text, integer, jsonb, jsonb)'::regprocedure,
       '{schema}.enqueue_one(uuid, text, text, text, integer, jsonb, jsonb, timestamptz)'),
      ('{schema}.enqueue_many_before_12(uuid[], text[], text[], text[], integer[], jsonb[], jsonb[])'::regprocedure,
       '{schema}.enqueue_many(uuid[], text[], text[], text[], integer[], jsonb[], jsonb[], timestamptz[])'))
      AS p(old, new_signature)
    JOIN pg_catalog.pg_proc f ON f.oid = p.old
    CROSS JOIN LATERAL pg_catalog.aclexplode(f.proacl) AS a
    WHERE a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> f.proowner
  LOOP
    EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s', g.new_signature, g.grantee);
  END LOOP;
END
$grants$;

DROP FUNCTION {schema}.enqueue_before_12(text, text, text, jsonb, jsonb);
DROP FUNCTION {schema}.enqueue_one_before_12(uuid, text, text, text, integer, jsonb, jsonb);
DROP FUNCTION {schema}.enqueue_many_before_12(uuid[], text[], text[], text[], integer[], jsonb[], jsonb[]);

-- Migration 10's hand-off, unchanged but for scheduling: an event handed to
-- the outbox is never due before its `deliver_at` (kept on the outbox row),
-- and an empty error is no error (a scheduled event is handed off untried).
CREATE OR REPLACE FUNCTION {schema}.log_handoff(
    destination        text,
    ids                bigint[],
    event_ids          uuid[],
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
    SELECT l.event_id, l.event_type, l.aggregate_type, l.aggregate_id, l.schema_version,
           l.payload, l.headers, l.sequence, l.created_at, l.deliver_at,
           x.dead, GREATEST(now() + make_interval(secs => x.delay_secs), l.deliver_at) AS due,
           NULLIF(x.error, '') AS error, x.fanout, x.attempts
    FROM unnest(log_handoff.ids, log_handoff.event_ids, log_handoff.dead,
                log_handoff.delay_secs, log_handoff.errors, log_handoff.fanout,
                log_handoff.attempts)
      AS x(id, event_id, dead, delay_secs, error, fanout, attempts)
    JOIN {schema}.log l ON l.id = x.id AND l.event_id = x.event_id),
inserted AS (
    INSERT INTO {schema}.outbox
        (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers,
         sequence, created_at, status, attempts, available_at, last_error, deliver_at)
    SELECT event_id, event_type, aggregate_type, aggregate_id, schema_version,
           payload, headers, sequence, created_at,
           CASE WHEN dead THEN 'failed'::{schema}.event_status
                ELSE 'pending'::{schema}.event_status END,
           attempts, due, error, deliver_at
    FROM h
    ON CONFLICT (event_id) DO NOTHING
    RETURNING id, event_id),
rows AS (
    -- Fan-out events only: those whose outbox row existed before this
    -- statement, and those it inserted (not visible to a scan of the table).
    SELECT o.id, h.event_id, h.dead, h.due, h.error, h.attempts, true AS existed
    FROM h JOIN {schema}.outbox o ON o.event_id = h.event_id
    WHERE h.fanout
    UNION ALL
    SELECT i.id, h.event_id, h.dead, h.due, h.error, h.attempts, false
    FROM inserted i JOIN h ON h.event_id = i.event_id
    WHERE h.fanout),
mine AS (
    INSERT INTO {schema}.deliveries AS d
        (outbox_id, destination, status, attempts, available_at, last_error, updated_at)
    SELECT r.id, log_handoff.destination,
           CASE WHEN r.dead THEN 'failed'::{schema}.event_status
                ELSE 'pending'::{schema}.event_status END,
           r.attempts, r.due, r.error, now()
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
    FROM unnest(log_handoff.other_event_ids, log_handoff.other_destinations) AS p(event_id, destination)
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

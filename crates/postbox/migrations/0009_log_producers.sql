-- postbox schema, version 9: producers write into the log when the schema
-- is in log mode (`postbox migrate --mode log` sets
-- log_settings.producer_target), into the outbox otherwise. The enqueue
-- functions keep their interface, their checks and their rights (migration
-- 8); only the table they insert into depends on the setting, read in the
-- producer's own transaction.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

-- Whether producers write into the log now.
CREATE FUNCTION {schema}.log_producing() RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp AS $fn$
  SELECT producer_target = 'log' FROM {schema}.log_settings
$fn$;

-- Enqueue from any language (unchanged interface, checks and rights).
CREATE OR REPLACE FUNCTION {schema}.enqueue(
    event_type     text,
    aggregate_type text,
    aggregate_id   text,
    payload        jsonb,
    headers        jsonb DEFAULT '{}'
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
  INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence)
  VALUES (enqueue.aggregate_type, enqueue.aggregate_id, 1)
  ON CONFLICT ON CONSTRAINT aggregate_sequences_pkey
  DO UPDATE SET last_sequence = s.last_sequence + 1
  RETURNING s.last_sequence INTO seq;
  IF {schema}.log_producing() THEN
    INSERT INTO {schema}.log
      (event_id, event_type, aggregate_type, aggregate_id, payload, headers, sequence)
    VALUES (new_id, event_type, aggregate_type, aggregate_id, payload, headers, seq);
  ELSE
    INSERT INTO {schema}.outbox
      (event_id, event_type, aggregate_type, aggregate_id, payload, headers, sequence)
    VALUES (new_id, event_type, aggregate_type, aggregate_id, payload, headers, seq);
  END IF;
  RETURN new_id;
END
$fn$;

-- One event with the id and schema version the caller chose (the Rust
-- library's `enqueue`, which validated the event already; the table's
-- constraints check it again). The aggregate's counter row is bumped first:
-- concurrent producers of one aggregate wait on its row lock.
CREATE OR REPLACE FUNCTION {schema}.enqueue_one(
    event_id       uuid,
    event_type     text,
    aggregate_type text,
    aggregate_id   text,
    schema_version integer,
    payload        jsonb,
    headers        jsonb
) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  seq bigint;
BEGIN
  INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence)
  VALUES (enqueue_one.aggregate_type, enqueue_one.aggregate_id, 1)
  ON CONFLICT ON CONSTRAINT aggregate_sequences_pkey
  DO UPDATE SET last_sequence = s.last_sequence + 1
  RETURNING s.last_sequence INTO seq;
  IF {schema}.log_producing() THEN
    INSERT INTO {schema}.log
      (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers, sequence)
    VALUES (enqueue_one.event_id, enqueue_one.event_type, enqueue_one.aggregate_type,
            enqueue_one.aggregate_id, enqueue_one.schema_version, enqueue_one.payload,
            enqueue_one.headers, seq);
  ELSE
    INSERT INTO {schema}.outbox
      (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers, sequence)
    VALUES (enqueue_one.event_id, enqueue_one.event_type, enqueue_one.aggregate_type,
            enqueue_one.aggregate_id, enqueue_one.schema_version, enqueue_one.payload,
            enqueue_one.headers, seq);
  END IF;
END
$fn$;

-- A batch, column-wise (the Rust library's `enqueue_batch`). One counter bump
-- per aggregate of the batch, taken in a fixed order so two batches sharing
-- aggregates cannot deadlock; the batch's events of one aggregate are
-- numbered in input order.
CREATE OR REPLACE FUNCTION {schema}.enqueue_many(
    event_ids       uuid[],
    event_types     text[],
    aggregate_types text[],
    aggregate_ids   text[],
    schema_versions integer[],
    payloads        jsonb[],
    headers         jsonb[]
) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
#variable_conflict use_column
BEGIN
  IF {schema}.log_producing() THEN
    WITH e AS (
      SELECT * FROM unnest(enqueue_many.event_ids, enqueue_many.event_types,
                           enqueue_many.aggregate_types, enqueue_many.aggregate_ids,
                           enqueue_many.schema_versions, enqueue_many.payloads,
                           enqueue_many.headers)
        WITH ORDINALITY
        AS e(event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers, ord)),
    counts AS (
      SELECT e.aggregate_type, e.aggregate_id, count(*) AS n FROM e GROUP BY 1, 2),
    seq AS (
      INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence)
      SELECT c.aggregate_type, c.aggregate_id, c.n FROM counts c ORDER BY 1, 2
      ON CONFLICT ON CONSTRAINT aggregate_sequences_pkey
      DO UPDATE SET last_sequence = s.last_sequence + EXCLUDED.last_sequence
      RETURNING s.aggregate_type, s.aggregate_id, s.last_sequence)
    INSERT INTO {schema}.log
      (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers, sequence)
    SELECT e.event_id, e.event_type, e.aggregate_type, e.aggregate_id, e.schema_version,
           e.payload, e.headers,
           seq.last_sequence - c.n
             + row_number() OVER (PARTITION BY e.aggregate_type, e.aggregate_id ORDER BY e.ord)
    FROM e
    JOIN counts c ON c.aggregate_type = e.aggregate_type AND c.aggregate_id = e.aggregate_id
    JOIN seq ON seq.aggregate_type = e.aggregate_type AND seq.aggregate_id = e.aggregate_id
    ORDER BY e.ord;
  ELSE
    WITH e AS (
      SELECT * FROM unnest(enqueue_many.event_ids, enqueue_many.event_types,
                           enqueue_many.aggregate_types, enqueue_many.aggregate_ids,
                           enqueue_many.schema_versions, enqueue_many.payloads,
                           enqueue_many.headers)
        WITH ORDINALITY
        AS e(event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers, ord)),
    counts AS (
      SELECT e.aggregate_type, e.aggregate_id, count(*) AS n FROM e GROUP BY 1, 2),
    seq AS (
      INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence)
      SELECT c.aggregate_type, c.aggregate_id, c.n FROM counts c ORDER BY 1, 2
      ON CONFLICT ON CONSTRAINT aggregate_sequences_pkey
      DO UPDATE SET last_sequence = s.last_sequence + EXCLUDED.last_sequence
      RETURNING s.aggregate_type, s.aggregate_id, s.last_sequence)
    INSERT INTO {schema}.outbox
      (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers, sequence)
    SELECT e.event_id, e.event_type, e.aggregate_type, e.aggregate_id, e.schema_version,
           e.payload, e.headers,
           seq.last_sequence - c.n
             + row_number() OVER (PARTITION BY e.aggregate_type, e.aggregate_id ORDER BY e.ord)
    FROM e
    JOIN counts c ON c.aggregate_type = e.aggregate_type AND c.aggregate_id = e.aggregate_id
    JOIN seq ON seq.aggregate_type = e.aggregate_type AND seq.aggregate_id = e.aggregate_id
    ORDER BY e.ord;
  END IF;
END
$fn$;


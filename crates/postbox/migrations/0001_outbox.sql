-- postbox schema, version 1: the outbox, the inbox and the enqueue function.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

CREATE TYPE {schema}.event_status AS ENUM ('pending', 'processing', 'sent', 'failed');

-- UUIDv7 (RFC 9562): 48-bit Unix milliseconds, version 7, random rest.
CREATE FUNCTION {schema}.uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $fn$
  SELECT encode(
           set_bit(set_bit(
             overlay(uuid_send(gen_random_uuid())
                     PLACING substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                     FROM 1 FOR 6),
             52, 1), 53, 1),
           'hex')::uuid
$fn$;

-- The outbox. `id` is a monotonically increasing key that breaks ties in the
-- claim order; `event_id` is the stable identity consumers deduplicate on.
-- Lease columns are in no index.
CREATE TABLE {schema}.outbox (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id         uuid NOT NULL,
    aggregate_type   text NOT NULL,
    aggregate_id     text NOT NULL,
    event_type       text NOT NULL,
    schema_version   integer NOT NULL DEFAULT 1,
    payload          jsonb NOT NULL,
    headers          jsonb NOT NULL DEFAULT '{}',
    status           {schema}.event_status NOT NULL DEFAULT 'pending',
    attempts         integer NOT NULL DEFAULT 0,
    available_at     timestamptz NOT NULL DEFAULT now(),
    lease_token      uuid,
    lease_expires_at timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    sent_at          timestamptz,
    last_error       text,
    CONSTRAINT outbox_event_id_key UNIQUE (event_id),
    CONSTRAINT outbox_event_type_length CHECK (octet_length(event_type) BETWEEN 1 AND 255),
    CONSTRAINT outbox_aggregate_type_length CHECK (octet_length(aggregate_type) BETWEEN 1 AND 255),
    CONSTRAINT outbox_aggregate_id_length CHECK (octet_length(aggregate_id) BETWEEN 1 AND 255),
    CONSTRAINT outbox_schema_version_positive CHECK (schema_version >= 1),
    CONSTRAINT outbox_headers_object CHECK (jsonb_typeof(headers) = 'object')
) WITH (fillfactor = 80);

-- The hot claim reads this index in order and stops after one batch: due rows
-- come first, so a backlog of rows waiting for a retry costs the claim nothing.
CREATE INDEX outbox_pending_idx ON {schema}.outbox (available_at, id) WHERE status = 'pending';
-- In-flight rows only: the lease rescuer scans this small set.
CREATE INDEX outbox_processing_idx ON {schema}.outbox (id) WHERE status = 'processing';
-- Dead letters, for operators.
CREATE INDEX outbox_failed_idx ON {schema}.outbox (id) WHERE status = 'failed';

-- Wake-up hint for relays: one notification per inserting statement (Postgres
-- folds identical notifications of one transaction into one). Operators with
-- very high commit rates can turn it off:
--   ALTER TABLE <schema>.outbox DISABLE TRIGGER outbox_notify;
CREATE FUNCTION {schema}.notify_relays() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
  PERFORM pg_notify(TG_ARGV[0], '');
  RETURN NULL;
END
$fn$;

CREATE TRIGGER outbox_notify AFTER INSERT ON {schema}.outbox
  FOR EACH STATEMENT EXECUTE FUNCTION {schema}.notify_relays({channel});

-- Enqueue from any language, inside the caller's transaction. Returns the event id.
CREATE FUNCTION {schema}.enqueue(
    event_type     text,
    aggregate_type text,
    aggregate_id   text,
    payload        jsonb,
    headers        jsonb DEFAULT '{}'
) RETURNS uuid
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
  new_id uuid := {schema}.uuid_v7();
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
  INSERT INTO {schema}.outbox (event_id, event_type, aggregate_type, aggregate_id, payload, headers)
  VALUES (new_id, event_type, aggregate_type, aggregate_id, payload, headers);
  RETURN new_id;
END
$fn$;

-- The inbox: one row per (consumer, event) that a consumer has applied.
CREATE TABLE {schema}.inbox (
    consumer     text NOT NULL,
    event_id     uuid NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);
CREATE INDEX inbox_processed_at_idx ON {schema}.inbox (processed_at);

-- postbox schema, version 5: per-aggregate sequence numbers, per-destination
-- delivery state for fan-out, and the consumer-side sequence tracker.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

-- The last sequence number handed out per aggregate. The producing transaction
-- bumps its aggregate's row (INSERT … ON CONFLICT DO UPDATE), so concurrent
-- producers on one aggregate serialize on that row lock and a rollback returns
-- the number; producers on different aggregates never touch the same row.
-- Rows are kept forever (one small row per aggregate): deleting one would
-- restart its numbering and make consumers take new events for duplicates.
CREATE TABLE {schema}.aggregate_sequences (
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    last_sequence  bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
) WITH (fillfactor = 70);

-- Events committed before this migration have no sequence (NULL); every later
-- one has its aggregate's next number. Nullable, no default: adding it rewrites
-- nothing.
ALTER TABLE {schema}.outbox ADD COLUMN sequence bigint;
ALTER TABLE {schema}.outbox_archive ADD COLUMN sequence bigint;

-- The ordered claim asks "does this aggregate have an earlier event that is not
-- delivered yet?" for each candidate; this index answers it from the open rows
-- only (sent rows leave it).
CREATE INDEX outbox_aggregate_open_idx
    ON {schema}.outbox (aggregate_type, aggregate_id, sequence)
    WHERE status <> 'sent';

-- Enqueue from any language, now numbering the event within its aggregate.
CREATE OR REPLACE FUNCTION {schema}.enqueue(
    event_type     text,
    aggregate_type text,
    aggregate_id   text,
    payload        jsonb,
    headers        jsonb DEFAULT '{}'
) RETURNS uuid
LANGUAGE plpgsql VOLATILE AS $fn$
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
  INSERT INTO {schema}.outbox
    (event_id, event_type, aggregate_type, aggregate_id, payload, headers, sequence)
  VALUES (new_id, event_type, aggregate_type, aggregate_id, payload, headers, seq);
  RETURN new_id;
END
$fn$;

-- Delivery state per (event, destination), for events routed to several
-- destinations. Written only when such an event is not delivered everywhere at
-- its first try: a fan-out that succeeds at once costs no row here. The outbox
-- row stays the unit the relay claims; these rows say which destinations are
-- done (never published to again), which wait for a retry (`available_at`),
-- and which are dead letters. Deleted with their outbox row by retention.
CREATE TABLE {schema}.deliveries (
    outbox_id    bigint NOT NULL,
    destination  text NOT NULL,
    status       {schema}.event_status NOT NULL,
    attempts     integer NOT NULL DEFAULT 0,
    available_at timestamptz NOT NULL DEFAULT now(),
    last_error   text,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    sent_at      timestamptz,
    PRIMARY KEY (outbox_id, destination)
);
CREATE INDEX deliveries_open_idx ON {schema}.deliveries (destination, status)
    WHERE status <> 'sent';

-- Consumer side: the last sequence number a consumer applied per aggregate,
-- advanced in the consumer's own transaction by `inbox_sequence`.
CREATE TABLE {schema}.inbox_sequences (
    consumer       text NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    last_sequence  bigint NOT NULL,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, aggregate_type, aggregate_id)
);

-- Where does `sequence` stand for this consumer and aggregate? Locks the
-- tracker row until the caller's transaction ends, so two deliveries of one
-- aggregate are judged one after the other. Returns the last applied number
-- before this call (0 when none). When `sequence` is the next one, or
-- `accept_gap` is set and it is ahead, the tracker advances to it (undone if
-- the caller's transaction rolls back).
CREATE FUNCTION {schema}.inbox_sequence(
    consumer       text,
    aggregate_type text,
    aggregate_id   text,
    sequence       bigint,
    accept_gap     boolean DEFAULT false
) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
  last bigint;
BEGIN
  IF sequence IS NULL OR sequence < 1 THEN
    RAISE EXCEPTION 'postbox.inbox_sequence: sequence must be 1 or more'
      USING ERRCODE = '22023';
  END IF;
  INSERT INTO {schema}.inbox_sequences AS t (consumer, aggregate_type, aggregate_id, last_sequence)
  VALUES (inbox_sequence.consumer, inbox_sequence.aggregate_type, inbox_sequence.aggregate_id, 0)
  ON CONFLICT ON CONSTRAINT inbox_sequences_pkey DO NOTHING;
  SELECT t.last_sequence INTO last FROM {schema}.inbox_sequences t
  WHERE t.consumer = inbox_sequence.consumer
    AND t.aggregate_type = inbox_sequence.aggregate_type
    AND t.aggregate_id = inbox_sequence.aggregate_id
  FOR UPDATE;
  IF sequence = last + 1 OR (accept_gap AND sequence > last) THEN
    UPDATE {schema}.inbox_sequences t SET last_sequence = inbox_sequence.sequence, updated_at = now()
    WHERE t.consumer = inbox_sequence.consumer
      AND t.aggregate_type = inbox_sequence.aggregate_type
      AND t.aggregate_id = inbox_sequence.aggregate_id;
  END IF;
  RETURN last;
END
$fn$;

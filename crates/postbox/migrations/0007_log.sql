-- postbox schema, version 7: the log — an append-only outbox read by
-- snapshot cursors (log mode).
--
-- An event in the log is never updated or deleted one by one. It records the
-- id of its transaction (`txid`); a reader takes snapshots, and a window of
-- events is exactly those whose transaction is visible in the newer snapshot
-- and was not in the older one. However long a transaction stays open and
-- however commits interleave, its events fall into the first window whose
-- snapshot sees it committed — never skipped, never from a rollback.
--
-- Old events leave by whole partitions: producers write into the current
-- segment of a ring of four; a segment is truncated (or archived) only once
-- every cursor has read past all of its events.

-- Which table producers write to (`outbox`: claim mode, the default; `log`),
-- and the segment of the ring they write into.
CREATE TABLE {schema}.log_settings (
    only_row        boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    producer_target text NOT NULL DEFAULT 'outbox' CHECK (producer_target IN ('outbox', 'log')),
    segment         integer NOT NULL DEFAULT 0 CHECK (segment BETWEEN 0 AND 3),
    rotated_at      timestamptz NOT NULL DEFAULT now()
);
INSERT INTO {schema}.log_settings DEFAULT VALUES;

-- The segment producers write into now.
CREATE FUNCTION {schema}.log_segment() RETURNS integer
LANGUAGE sql STABLE PARALLEL SAFE AS $fn$
  SELECT segment FROM {schema}.log_settings
$fn$;

-- `txid` first: a producer's transaction has its id before the row takes
-- its `id` (every producer bumps aggregate_sequences first in any case).
-- `id` orders events inside a window: for one aggregate, the event with the
-- lower sequence was inserted first (its transaction held the aggregate's
-- counter row until it committed), so reading a window in `id` order keeps
-- per-aggregate order.
CREATE TABLE {schema}.log (
    txid           xid8 NOT NULL DEFAULT pg_current_xact_id(),
    id             bigint GENERATED ALWAYS AS IDENTITY,
    segment        integer NOT NULL DEFAULT {schema}.log_segment(),
    event_id       uuid NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    event_type     text NOT NULL,
    schema_version integer NOT NULL DEFAULT 1,
    payload        jsonb NOT NULL,
    headers        jsonb NOT NULL DEFAULT '{}',
    sequence       bigint,
    created_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT log_event_type_length CHECK (octet_length(event_type) BETWEEN 1 AND 255),
    CONSTRAINT log_aggregate_type_length CHECK (octet_length(aggregate_type) BETWEEN 1 AND 255),
    CONSTRAINT log_aggregate_id_length CHECK (octet_length(aggregate_id) BETWEEN 1 AND 255),
    CONSTRAINT log_schema_version_positive CHECK (schema_version >= 1),
    CONSTRAINT log_headers_object CHECK (jsonb_typeof(headers) = 'object')
) PARTITION BY LIST (segment);

CREATE TABLE {schema}.log_0 PARTITION OF {schema}.log FOR VALUES IN (0);
CREATE TABLE {schema}.log_1 PARTITION OF {schema}.log FOR VALUES IN (1);
CREATE TABLE {schema}.log_2 PARTITION OF {schema}.log FOR VALUES IN (2);
CREATE TABLE {schema}.log_3 PARTITION OF {schema}.log FOR VALUES IN (3);

-- A window is found by transaction id; pages of a window are read by id.
CREATE INDEX log_txid_idx ON {schema}.log (txid, id);
CREATE INDEX log_id_idx ON {schema}.log (id);

-- One cursor per destination. Everything visible in `lo` is done; `hi`, when
-- set, is the window being read (visible in `hi`, not in `lo`), read up to
-- and including `after_id`. A relay holds a cursor under a lease (`owner`,
-- `lease_expires_at`) so two relays never read one cursor at once.
CREATE TABLE {schema}.log_cursors (
    destination      text PRIMARY KEY,
    lo               pg_snapshot NOT NULL DEFAULT '1:1:',
    hi               pg_snapshot,
    after_id         bigint NOT NULL DEFAULT 0,
    owner            uuid,
    lease_expires_at timestamptz,
    delivered        bigint NOT NULL DEFAULT 0,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT log_cursors_destination_length CHECK (octet_length(destination) BETWEEN 1 AND 255)
);

-- Wake relays in log mode as the outbox trigger does in claim mode.
CREATE TRIGGER log_notify AFTER INSERT ON {schema}.log
  FOR EACH STATEMENT EXECUTE FUNCTION {schema}.notify_relays({channel});

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
    -- From the outbox's own sequence: an id names one event in the outbox,
    -- the log and the archive alike.
    id             bigint NOT NULL DEFAULT nextval('{schema}.outbox_id_seq'),
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

-- Move producers to the next segment of the ring once the current one is
-- older than `min_age` and the next one is empty (truncated). True when it
-- moved.
CREATE FUNCTION {schema}.log_rotate(min_age interval) RETURNS boolean
LANGUAGE plpgsql AS $fn$
DECLARE
  cur integer;
  since timestamptz;
  busy boolean;
BEGIN
  SELECT segment, rotated_at INTO cur, since FROM {schema}.log_settings FOR UPDATE;
  IF since > now() - min_age THEN
    RETURN false;
  END IF;
  EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)',
                 ('{schema}.log_' || ((cur + 1) % 4))::regclass) INTO busy;
  IF busy THEN
    RETURN false;
  END IF;
  UPDATE {schema}.log_settings SET segment = (cur + 1) % 4, rotated_at = now();
  RETURN true;
END
$fn$;

-- Empty segment `seg` once every cursor has read past all of its events
-- (keeping them in outbox_archive first with `archive`, except those handed
-- to the outbox, which its own retention archives). Returns how many
-- events it removed, or NULL when the segment is still needed: it is the
-- one producers write into, a cursor has not read it all, no cursor exists
-- yet, or producers hold it (the lock is not waited for beyond 50 ms, so
-- producers never queue behind it for long). Run it in its own transaction.
CREATE FUNCTION {schema}.log_truncate(seg integer, archive boolean) RETURNS bigint
LANGUAGE plpgsql AS $fn$
DECLARE
  part regclass := ('{schema}.log_' || seg)::regclass;
  filled boolean;
  unread boolean;
  n bigint;
BEGIN
  IF seg = (SELECT segment FROM {schema}.log_settings)
     OR NOT EXISTS (SELECT 1 FROM {schema}.log_cursors) THEN
    RETURN NULL;
  END IF;
  -- Nothing to do for an empty segment, and nothing to lock: looked at
  -- without the lock, a row a producer has not committed yet is simply not
  -- there, and it stays.
  EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)', part) INTO filled;
  IF NOT filled THEN
    RETURN 0;
  END IF;
  SET LOCAL lock_timeout = '50ms';
  BEGIN
    EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', part);
  EXCEPTION WHEN lock_not_available THEN
    RETURN NULL;
  END;
  -- Holding the lock, no producer is writing into the segment: every row in
  -- it is committed, and each must be visible in every cursor's `lo`.
  EXECUTE format(
    'SELECT EXISTS (SELECT 1 FROM %s p JOIN {schema}.log_cursors c
                    ON NOT pg_visible_in_snapshot(p.txid, c.lo))', part)
    INTO unread;
  IF unread THEN
    RETURN NULL;
  END IF;
  IF archive THEN
    EXECUTE format(
      'INSERT INTO {schema}.outbox_archive
         (id, event_id, aggregate_type, aggregate_id, event_type, schema_version,
          payload, headers, attempts, created_at, sent_at, sequence)
       SELECT id, event_id, aggregate_type, aggregate_id, event_type, schema_version,
              payload, headers, 1, created_at, NULL, sequence
       FROM %s p
       WHERE NOT EXISTS (SELECT 1 FROM {schema}.outbox o WHERE o.event_id = p.event_id)
         AND NOT EXISTS (SELECT 1 FROM {schema}.outbox_archive a WHERE a.event_id = p.event_id)
       ON CONFLICT (id) DO NOTHING', part);
  END IF;
  EXECUTE format('SELECT count(*) FROM %s', part) INTO n;
  EXECUTE format('TRUNCATE %s', part);
  RETURN n;
END
$fn$;

-- Wake relays in log mode as the outbox trigger does in claim mode.
CREATE TRIGGER log_notify AFTER INSERT ON {schema}.log
  FOR EACH STATEMENT EXECUTE FUNCTION {schema}.notify_relays({channel});

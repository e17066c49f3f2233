-- postbox schema, version 26: consumer groups — readers that pull from the
-- log over SQL, in any language, without a broker.
--
-- A group is a cursor of its own on the log (the same snapshot windows the
-- relay's cursors read) plus the events it has handed out and not yet seen
-- acknowledged. Readers call
--
--   SELECT * FROM {schema}.receive('billing', 100, '30 seconds');
--   SELECT {schema}.ack('billing', ARRAY[receipt, …]);
--   SELECT {schema}.nack('billing', receipt, '10 seconds', 'why');
--
-- `receive` hands out up to `max_events` events, each with a receipt, and
-- hides them from the group's other readers for `visibility`; an event not
-- acknowledged in time is handed out again (with a new receipt: the old one
-- no longer acknowledges it), and after `max_attempts` hand-outs it becomes
-- one of the group's dead letters. Receivers of one group take turns on the
-- group's row for the length of one call, so two readers never get the same
-- event while it is hidden. An ordered group never hands out an aggregate's
-- event while an earlier one of that aggregate is in flight or waiting.
--
-- Every event of a window is either handed out in the call that reads it
-- (filed in `group_batches`) or filed in `group_waiting`, in the
-- transaction that moves the cursor: a
-- reader's crash loses nothing (the events come back when their visibility
-- ends). Segments of the log are truncated only once every group's cursor
-- has read past them and no group still holds one of their events.
--
-- The reading functions run with their owner's rights (SECURITY DEFINER, a
-- fixed search_path, every object named in full); EXECUTE is revoked from
-- PUBLIC and granted to the `<schema>_consumer` role by
-- `postbox migrate --create-roles`. Creating and dropping groups is for the
-- schema's owner (`postbox group create|drop`, or the functions below).
-- `{schema}` is replaced by the quoted schema name when the migration runs.

-- A glob (`*` any run, `?` one character, everything else itself: the
-- router's event-type patterns) as a LIKE pattern with `\` as escape.
CREATE FUNCTION {schema}.glob_like(pattern text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp AS $fn$
  SELECT replace(replace(replace(replace(replace(pattern, '\', '\\'), '%', '\%'), '_', '\_'),
                         '*', '%'), '?', '_')
$fn$;

CREATE TABLE {schema}.consumer_groups (
    name          text PRIMARY KEY,
    -- Event-type globs the group reads (NULL: every type), and the same as
    -- LIKE patterns.
    types         text[],
    type_likes    text[],
    -- Events created before this time are passed over (`--start TIME`).
    start_at      timestamptz,
    ordered       boolean NOT NULL DEFAULT false,
    max_attempts  integer NOT NULL DEFAULT 5,
    -- The cursor, as log_cursors keeps it: everything visible in `lo` is
    -- read; `hi`, when set, is the window being read, up to `after_id`.
    lo            pg_snapshot NOT NULL,
    hi            pg_snapshot,
    after_id      bigint NOT NULL DEFAULT 0,
    -- Hand-outs so far (redeliveries included), and dead letters made.
    received      bigint NOT NULL DEFAULT 0,
    dead_lettered bigint NOT NULL DEFAULT 0,
    created_at    timestamptz NOT NULL DEFAULT now(),
    read_at       timestamptz,
    CONSTRAINT consumer_groups_name_chars CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$'),
    CONSTRAINT consumer_groups_max_attempts_range CHECK (max_attempts BETWEEN 1 AND 1000),
    CONSTRAINT consumer_groups_types_count CHECK (cardinality(types) BETWEEN 1 AND 64)
);

-- Events in flight, by hand-out: each `receive` that hands out events
-- files one row with their ids (and, in parallel arrays, how many times
-- each was handed out, and for an ordered group a hash of each event's
-- aggregate). A receipt names the batch and the event: an `ack` of a whole
-- batch deletes one row, so the cost per event is small and the table
-- stays small. The content stays in the log, under each id.
CREATE TABLE {schema}.group_batches (
    batch_id   uuid PRIMARY KEY,
    group_name text NOT NULL,
    ids        bigint[] NOT NULL,
    attempts   integer[] NOT NULL,
    agg_keys   bigint[],
    visible_at timestamptz NOT NULL,
    handed_at  timestamptz NOT NULL
);
CREATE INDEX group_batches_visible_idx ON {schema}.group_batches (group_name, visible_at);

-- Events waiting to be handed out (again): nacked, not acknowledged in
-- time, scheduled for later (`deliver_at`), or, in an ordered group, behind
-- an earlier event of their aggregate.
CREATE TABLE {schema}.group_waiting (
    group_name text NOT NULL,
    id         bigint NOT NULL,
    agg_key    bigint,
    attempts   integer NOT NULL,
    visible_at timestamptz NOT NULL,
    last_error text,
    PRIMARY KEY (group_name, id)
);
CREATE INDEX group_waiting_visible_idx ON {schema}.group_waiting (group_name, visible_at);
CREATE INDEX group_waiting_aggregate_idx ON {schema}.group_waiting (group_name, agg_key, id)
    WHERE agg_key IS NOT NULL;

-- Events a group gave up on after `max_attempts` hand-outs, copied from the
-- log (which may truncate them afterwards) with the last error a reader
-- gave. Nothing deletes them but dropping the group. A replayed one
-- (`group_replay_dead`) waits in the group again, `replayed_at` set, and is
-- read from here when the log no longer has it.
CREATE TABLE {schema}.group_dead_letters (
    group_name     text NOT NULL,
    id             bigint NOT NULL,
    event_id       uuid NOT NULL,
    event_type     text,
    aggregate_type text,
    aggregate_id   text,
    schema_version integer,
    payload        jsonb,
    headers        jsonb,
    sequence       bigint,
    created_at     timestamptz,
    attempts       integer NOT NULL,
    last_error     text,
    dead_at        timestamptz NOT NULL DEFAULT now(),
    replayed_at    timestamptz,
    PRIMARY KEY (group_name, id)
);

-- Who read a group lately (for status): the reader's application_name (or
-- its backend's pid) and login, renewed at most once a second per reader.
CREATE TABLE {schema}.group_readers (
    group_name text NOT NULL,
    reader     text NOT NULL,
    seen_at    timestamptz NOT NULL,
    PRIMARY KEY (group_name, reader)
);

-- Create group `group_name`, reading from `start`: 'now' (events committed
-- from here on; the default), 'beginning' (everything the log still
-- retains) or a timestamp (retained events created at or after it).
CREATE FUNCTION {schema}.create_group(
    group_name   text,
    start        text DEFAULT 'now',
    types        text[] DEFAULT NULL,
    ordered      boolean DEFAULT false,
    max_attempts integer DEFAULT 5
) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  from_lo  pg_snapshot := '1:1:';
  from_ts  timestamptz;
BEGIN
  IF group_name IS NULL OR group_name !~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$' THEN
    RAISE EXCEPTION 'postbox.create_group: a group name is 1 to 63 letters, digits, ''.'', ''_'' or ''-'', starting with a letter or digit'
      USING ERRCODE = '22023';
  END IF;
  IF start IS NULL OR start = 'now' THEN
    from_lo := pg_current_snapshot();
  ELSIF start <> 'beginning' THEN
    BEGIN
      from_ts := start::timestamptz;
    EXCEPTION WHEN others THEN
      RAISE EXCEPTION 'postbox.create_group: start must be ''now'', ''beginning'' or a timestamp, not %', quote_literal(left(start, 64))
        USING ERRCODE = '22023';
    END;
  END IF;
  IF types IS NOT NULL AND (cardinality(types) NOT BETWEEN 1 AND 64
      OR EXISTS (SELECT 1 FROM unnest(types) t WHERE t IS NULL OR octet_length(t) NOT BETWEEN 1 AND 255)) THEN
    RAISE EXCEPTION 'postbox.create_group: types is 1 to 64 globs of 1 to 255 bytes each'
      USING ERRCODE = '22023';
  END IF;
  IF max_attempts IS NULL OR max_attempts NOT BETWEEN 1 AND 1000 THEN
    RAISE EXCEPTION 'postbox.create_group: max_attempts must be 1 to 1000'
      USING ERRCODE = '22023';
  END IF;
  INSERT INTO {schema}.consumer_groups (name, types, type_likes, start_at, ordered, max_attempts, lo)
  VALUES (create_group.group_name, create_group.types,
          (SELECT array_agg({schema}.glob_like(t)) FROM unnest(create_group.types) t),
          from_ts, coalesce(create_group.ordered, false), create_group.max_attempts, from_lo);
EXCEPTION WHEN unique_violation THEN
  RAISE EXCEPTION 'postbox.create_group: group % exists already', quote_literal(group_name)
    USING ERRCODE = '42710';
END
$fn$;

-- Drop a group with everything it holds (in flight, waiting, dead letters,
-- readers). True when it existed.
CREATE FUNCTION {schema}.drop_group(group_name text) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  DELETE FROM {schema}.group_batches b WHERE b.group_name = drop_group.group_name;
  DELETE FROM {schema}.group_waiting w WHERE w.group_name = drop_group.group_name;
  DELETE FROM {schema}.group_readers r WHERE r.group_name = drop_group.group_name;
  DELETE FROM {schema}.group_dead_letters d WHERE d.group_name = drop_group.group_name;
  DELETE FROM {schema}.consumer_groups g WHERE g.name = drop_group.group_name;
  RETURN FOUND;
END
$fn$;

-- Hand out up to `max_events` (1 to 1000) events of `consumer_group`, each
-- hidden from the group's other readers for `visibility` (1 second to 12
-- hours), with a receipt (`<batch>:<id>`) that acknowledges it. With
-- `wait` (up to 20 seconds), a call that finds nothing to hand out first
-- waits for the log to grow (it may still return no rows): the wait holds
-- no lock, but it holds the calling statement's snapshot, so keep it short
-- on a busy server, or LISTEN on the relays' channel instead. Events that
-- come back (timed out, nacked) come first, then new ones in log order;
-- `attempts` is 1 on an event's first hand-out.
CREATE FUNCTION {schema}.receive(
    consumer_group text,
    max_events     integer DEFAULT 10,
    visibility     interval DEFAULT '30 seconds',
    wait           interval DEFAULT '0 seconds'
) RETURNS TABLE (
    receipt text, id bigint, event_id uuid, event_type text, aggregate_type text,
    aggregate_id text, sequence bigint, schema_version integer, payload jsonb, headers jsonb,
    created_at timestamptz, attempts integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan AS $fn$
DECLARE
  g          record;
  t_now      timestamptz;
  deadline   timestamptz;
  need       integer;
  n          integer;
  n_dead     integer;
  opened     boolean := false;
  w_hi       pg_snapshot;
  w_after    bigint;
  lo_xmax    xid8;
  lo_xip     xid8[];
  blocked    bigint[] := '{}';
  out_ids    bigint[] := '{}';
  out_tries  integer[] := '{}';
  out_keys   bigint[] := '{}';
  ids        bigint[];
  keys       bigint[];
  tries      integer[];
  back_ids   bigint[] := '{}';
  back_tries integer[] := '{}';
  fresh      {schema}.log[] := '{}';
  page_rows  {schema}.log[];
  last_id    bigint;
  batch      uuid;
  reader_name text;
BEGIN
  IF max_events IS NULL OR max_events NOT BETWEEN 1 AND 1000 THEN
    RAISE EXCEPTION 'postbox.receive: max_events must be 1 to 1000' USING ERRCODE = '22023';
  END IF;
  IF visibility IS NULL OR visibility < interval '1 second' OR visibility > interval '12 hours' THEN
    RAISE EXCEPTION 'postbox.receive: visibility must be 1 second to 12 hours' USING ERRCODE = '22023';
  END IF;
  IF wait IS NULL OR wait < interval '0' OR wait > interval '20 seconds' THEN
    RAISE EXCEPTION 'postbox.receive: wait must be 0 to 20 seconds' USING ERRCODE = '22023';
  END IF;

  -- Long poll: look, without a lock, for anything to hand out.
  IF wait > interval '0' THEN
    deadline := clock_timestamp() + wait;
    LOOP
      SELECT k.name, k.lo, k.hi, k.type_likes INTO g
      FROM {schema}.consumer_groups k WHERE k.name = receive.consumer_group;
      EXIT WHEN NOT FOUND;
      EXIT WHEN g.hi IS NOT NULL
        OR EXISTS (SELECT 1 FROM {schema}.group_waiting w
                   WHERE w.group_name = g.name AND w.visible_at <= clock_timestamp())
        OR EXISTS (SELECT 1 FROM {schema}.group_batches b
                   WHERE b.group_name = g.name AND b.visible_at <= clock_timestamp())
        -- (Two look-ups along the txid index: as one with OR, the log
        -- was scanned whole, 40 ms a look at 150,000 events.)
        OR EXISTS (SELECT 1 FROM {schema}.log l
                   WHERE l.txid >= pg_snapshot_xmax(g.lo)
                     AND (g.type_likes IS NULL OR l.event_type LIKE ANY (g.type_likes)))
        OR EXISTS (SELECT 1 FROM {schema}.log l
                   WHERE l.txid = ANY (ARRAY(SELECT pg_snapshot_xip(g.lo)))
                     AND (g.type_likes IS NULL OR l.event_type LIKE ANY (g.type_likes)))
        OR clock_timestamp() >= deadline;
      PERFORM pg_sleep(0.01);
    END LOOP;
  END IF;

  SELECT k.* INTO g FROM {schema}.consumer_groups k
  WHERE k.name = receive.consumer_group FOR UPDATE;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'postbox.receive: no consumer group %', quote_literal(left(consumer_group, 64))
      USING ERRCODE = '42704', HINT = 'Create it with: postbox group create NAME';
  END IF;
  t_now := clock_timestamp();

  -- Batches whose visibility ended: their events wait to be handed out again.
  WITH expired AS (
    DELETE FROM {schema}.group_batches b
    WHERE b.group_name = g.name AND b.visible_at <= t_now
    RETURNING b.ids, b.attempts, b.agg_keys)
  INSERT INTO {schema}.group_waiting (group_name, id, agg_key, attempts, visible_at, last_error)
  SELECT g.name, e.id, e.agg_key, e.attempts, t_now,
         'not acknowledged within its visibility on attempt ' || e.attempts
  FROM expired x, unnest(x.ids, x.attempts, x.agg_keys) AS e(id, attempts, agg_key)
  ON CONFLICT DO NOTHING;

  -- Waiting events that had their max_attempts become dead letters.
  WITH dead AS (
    DELETE FROM {schema}.group_waiting w
    WHERE w.group_name = g.name AND w.visible_at <= t_now AND w.attempts >= g.max_attempts
    RETURNING w.id, w.attempts, w.last_error)
  INSERT INTO {schema}.group_dead_letters
    (group_name, id, event_id, event_type, aggregate_type, aggregate_id, schema_version,
     payload, headers, sequence, created_at, attempts, last_error)
  SELECT g.name, d.id, coalesce(l.event_id, x.event_id),
         coalesce(l.event_type, x.event_type), coalesce(l.aggregate_type, x.aggregate_type),
         coalesce(l.aggregate_id, x.aggregate_id), coalesce(l.schema_version, x.schema_version),
         coalesce(l.payload, x.payload), coalesce(l.headers, x.headers),
         coalesce(l.sequence, x.sequence), coalesce(l.created_at, x.created_at),
         d.attempts, d.last_error
  FROM dead d
  LEFT JOIN {schema}.log l ON l.id = d.id
  LEFT JOIN {schema}.group_dead_letters x ON x.group_name = g.name AND x.id = d.id
  WHERE l.id IS NOT NULL OR x.id IS NOT NULL
  ON CONFLICT ON CONSTRAINT group_dead_letters_pkey DO UPDATE
  SET attempts = EXCLUDED.attempts, last_error = EXCLUDED.last_error,
      dead_at = now(), replayed_at = NULL;
  GET DIAGNOSTICS n_dead = ROW_COUNT;

  -- An ordered group hands out no event of an aggregate in flight.
  IF g.ordered THEN
    blocked := ARRAY(SELECT DISTINCT k.key FROM {schema}.group_batches b,
                            unnest(b.agg_keys) AS k(key)
                     WHERE b.group_name = g.name);
  END IF;

  -- Waiting events first, oldest first; in an ordered group only the first
  -- waiting event of an aggregate none of whose events is in flight.
  WITH picked AS (
    SELECT w.id FROM {schema}.group_waiting w
    LEFT JOIN unnest(blocked) AS k(key) ON k.key = w.agg_key
    WHERE w.group_name = g.name AND w.visible_at <= t_now
      AND (NOT g.ordered OR (k.key IS NULL AND NOT EXISTS (
            SELECT 1 FROM {schema}.group_waiting p
            WHERE p.group_name = g.name AND p.agg_key = w.agg_key AND p.id < w.id)))
    ORDER BY w.id
    LIMIT max_events),
  taken AS (
    DELETE FROM {schema}.group_waiting w USING picked p
    WHERE w.group_name = g.name AND w.id = p.id
    RETURNING w.id, w.attempts + 1 AS attempts, w.agg_key)
  SELECT coalesce(array_agg(t.id ORDER BY t.id), '{}'),
         coalesce(array_agg(t.attempts ORDER BY t.id), '{}'),
         coalesce(array_agg(t.agg_key ORDER BY t.id), '{}')
  INTO out_ids, out_tries, out_keys FROM taken t;
  need := max_events - cardinality(out_ids);
  back_ids := out_ids;
  back_tries := out_tries;
  IF g.ordered THEN
    blocked := blocked || out_keys;
  END IF;

  -- Then new events from the log, window by window.
  WHILE need > 0 LOOP
    IF g.ordered AND (SELECT count(*) FROM (
          SELECT 1 FROM {schema}.group_waiting w WHERE w.group_name = g.name LIMIT 10000) b) >= 10000 THEN
      EXIT;  -- an ordered group's backlog is full: read more once it drains
    END IF;
    lo_xmax := pg_snapshot_xmax(g.lo);
    lo_xip := ARRAY(SELECT pg_snapshot_xip(g.lo));
    IF g.hi IS NULL THEN
      w_hi := pg_current_snapshot();
      opened := true;
      -- The window's floor, found as log_open finds it (migration 18).
      w_after := LEAST(
        (SELECT min(l.id + 0) FROM {schema}.log l
         WHERE l.txid >= lo_xmax AND l.txid < pg_snapshot_xmax(w_hi)
           AND pg_visible_in_snapshot(l.txid, w_hi)),
        (SELECT min(f.id)
         FROM unnest(lo_xip) AS x(txid),
              LATERAL (SELECT l.txid, l.id FROM {schema}.log l
                       WHERE l.txid >= x.txid ORDER BY l.txid, l.id LIMIT 1) f
         WHERE f.txid = x.txid AND pg_visible_in_snapshot(f.txid, w_hi))) - 1;
    ELSE
      w_hi := g.hi;
      w_after := g.after_id;
    END IF;
    n := 0;
    IF w_after IS NOT NULL THEN
      -- Each event of the page is handed out now, or filed to wait: it is
      -- scheduled for later, or (ordered) an earlier event of its aggregate
      -- is in flight, waiting, or earlier in this page.
      WITH page AS (
        SELECT l AS whole, l.id, l.deliver_at,
               CASE WHEN g.ordered THEN pg_catalog.hashtextextended(
                      l.aggregate_type || '/' || l.aggregate_id, 0) END AS agg_key
        FROM {schema}.log l
        WHERE l.id > w_after
          AND pg_visible_in_snapshot(l.txid, w_hi)
          AND (l.txid >= lo_xmax OR l.txid = ANY (lo_xip))
          AND (g.type_likes IS NULL OR l.event_type LIKE ANY (g.type_likes))
          AND (g.start_at IS NULL OR l.created_at >= g.start_at)
        ORDER BY l.id
        LIMIT need),
      judged AS (
        SELECT p.whole, p.id, p.deliver_at, p.agg_key,
               coalesce(p.deliver_at <= t_now, true)
               AND (NOT g.ordered OR (
                     p.id = min(p.id) OVER (PARTITION BY p.agg_key)
                     AND k.key IS NULL
                     AND NOT EXISTS (SELECT 1 FROM {schema}.group_waiting w
                                     WHERE w.group_name = g.name AND w.agg_key = p.agg_key)))
                 AS now_
        FROM page p LEFT JOIN unnest(blocked) AS k(key) ON k.key = p.agg_key),
      filed AS (
        INSERT INTO {schema}.group_waiting (group_name, id, agg_key, attempts, visible_at)
        SELECT g.name, j.id, j.agg_key, 0, GREATEST(t_now, j.deliver_at)
        FROM judged j WHERE NOT j.now_
        ON CONFLICT DO NOTHING)
      SELECT count(*), max(j.id),
             coalesce(array_agg(j.id ORDER BY j.id) FILTER (WHERE j.now_), '{}'),
             coalesce(array_agg(j.agg_key ORDER BY j.id) FILTER (WHERE j.now_), '{}'),
             coalesce(array_agg(j.whole ORDER BY j.id) FILTER (WHERE j.now_), '{}')
      INTO n, last_id, ids, keys, page_rows FROM judged j;
      out_ids := out_ids || ids;
      out_tries := out_tries || array_fill(1, ARRAY[cardinality(ids)]);
      out_keys := out_keys || keys;
      fresh := fresh || page_rows;
    END IF;
    IF n >= need THEN
      -- A full page: the window may hold more.
      g.hi := w_hi;
      g.after_id := last_id;
    ELSE
      -- The window is read: the next one starts where it ends.
      g.lo := w_hi;
      g.hi := NULL;
      g.after_id := 0;
    END IF;
    EXIT WHEN n >= need OR opened;
    need := need - n;
  END LOOP;

  IF cardinality(out_ids) > 0 THEN
    batch := gen_random_uuid();
    INSERT INTO {schema}.group_batches
      (batch_id, group_name, ids, attempts, agg_keys, visible_at, handed_at)
    VALUES (batch, g.name, out_ids, out_tries, CASE WHEN g.ordered THEN out_keys END,
            t_now + visibility, t_now);
  END IF;

  UPDATE {schema}.consumer_groups k
  SET lo = g.lo, hi = g.hi, after_id = g.after_id,
      received = k.received + cardinality(out_ids),
      dead_lettered = k.dead_lettered + n_dead,
      read_at = t_now
  WHERE k.name = g.name;

  reader_name := left(coalesce(nullif(current_setting('application_name', true), ''),
                               'pid ' || pg_backend_pid()) || ' (' || session_user || ')', 200);
  INSERT INTO {schema}.group_readers AS r (group_name, reader, seen_at)
  VALUES (g.name, reader_name, t_now)
  ON CONFLICT (group_name, reader) DO UPDATE SET seen_at = EXCLUDED.seen_at
  WHERE r.seen_at < EXCLUDED.seen_at - interval '1 second';

  -- Events that came back: their content from the log, or for a replayed
  -- dead letter the log no longer has, from the group's copy. (OFFSET 0
  -- keeps each look-up an index probe: flattened, the planner hashed the
  -- whole log.)
  IF cardinality(back_ids) > 0 THEN
    RETURN QUERY
    SELECT batch::text || ':' || h.id, h.id, coalesce(l.event_id, d.event_id),
           coalesce(l.event_type, d.event_type), coalesce(l.aggregate_type, d.aggregate_type),
           coalesce(l.aggregate_id, d.aggregate_id), coalesce(l.sequence, d.sequence),
           coalesce(l.schema_version, d.schema_version), coalesce(l.payload, d.payload),
           coalesce(l.headers, d.headers), coalesce(l.created_at, d.created_at), h.attempts
    FROM unnest(back_ids, back_tries) AS h(id, attempts)
    LEFT JOIN LATERAL (SELECT * FROM {schema}.log x WHERE x.id = h.id OFFSET 0) l ON true
    LEFT JOIN LATERAL (SELECT * FROM {schema}.group_dead_letters y
                       WHERE l.id IS NULL AND y.group_name = g.name AND y.id = h.id
                       OFFSET 0) d ON true
    WHERE l.id IS NOT NULL OR d.id IS NOT NULL
    ORDER BY h.id;
  END IF;
  -- New events, as the page read them (looking each up again by id cost
  -- half the call).
  IF cardinality(fresh) > 0 THEN
    RETURN QUERY
    SELECT batch::text || ':' || f.id, f.id, f.event_id, f.event_type, f.aggregate_type,
           f.aggregate_id, f.sequence, f.schema_version, f.payload, f.headers, f.created_at, 1
    FROM unnest(fresh) AS f
    ORDER BY f.id;
  END IF;
END
$fn$;

-- The batches `receipts` name, each with its event ids in ascending order;
-- a malformed receipt is an error.
CREATE FUNCTION {schema}.group_receipts(caller text, receipts text[])
RETURNS TABLE (batch_id uuid, ids bigint[])
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  IF receipts IS NULL OR cardinality(receipts) > 10000 THEN
    RAISE EXCEPTION 'postbox.%: receipts must be an array of at most 10000', caller
      USING ERRCODE = '22023';
  END IF;
  IF array_position(receipts, NULL) IS NOT NULL THEN
    RAISE EXCEPTION 'postbox.%: a receipt must not be NULL', caller USING ERRCODE = '22023';
  END IF;
  -- (Casts, not a regular expression: checking 1,000 receipts against one
  -- took 9 ms; and one uuid cast per batch, not per receipt.)
  BEGIN
    RETURN QUERY
    SELECT g.batch::uuid, g.ids
    FROM (SELECT split_part(r.x, ':', 1) AS batch,
                 array_agg(e.id ORDER BY e.id) AS ids
          FROM unnest(receipts) r(x),
               LATERAL (SELECT (CASE WHEN split_part(r.x, ':', 3) = ''
                                     THEN split_part(r.x, ':', 2)
                                     ELSE 'malformed' END)::bigint AS id) e
          GROUP BY 1) g;
  EXCEPTION WHEN invalid_text_representation OR numeric_value_out_of_range THEN
    RAISE EXCEPTION 'postbox.%: a receipt is the text receive returned (<batch>:<id>)', caller
      USING ERRCODE = '22023';
  END;
END
$fn$;

-- Acknowledge events of `consumer_group` by their receipts (at most
-- 10,000): they are done for this group. Returns how many receipts still
-- named an event in flight; a receipt whose visibility ended (its event
-- waits to be handed out again, or was) acknowledges nothing.
CREATE FUNCTION {schema}.ack(consumer_group text, receipts text[]) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  r     record;
  b     record;
  total   integer := 0;
  matched integer;
BEGIN
  IF NOT EXISTS (SELECT 1 FROM {schema}.consumer_groups k WHERE k.name = ack.consumer_group) THEN
    RAISE EXCEPTION 'postbox.ack: no consumer group %', quote_literal(left(consumer_group, 64))
      USING ERRCODE = '42704';
  END IF;
  FOR r IN
    SELECT x.batch_id, x.ids AS acked FROM {schema}.group_receipts('ack', receipts) x
  LOOP
    SELECT k.ids, k.attempts, k.agg_keys INTO b FROM {schema}.group_batches k
    WHERE k.batch_id = r.batch_id AND k.group_name = ack.consumer_group
    FOR UPDATE;
    CONTINUE WHEN NOT FOUND;
    -- The whole batch (the usual case): its ids, sorted, are the receipts'.
    -- Otherwise count the matches (IN over a subquery hashes the receipts:
    -- `<@` and `<> ALL` compare every pair).
    IF r.acked = ARRAY(SELECT e.id FROM unnest(b.ids) AS e(id) ORDER BY e.id) THEN
      matched := cardinality(b.ids);
    ELSE
      SELECT count(*) INTO matched FROM unnest(b.ids) AS e(id)
      WHERE e.id IN (SELECT a.id FROM unnest(r.acked) AS a(id));
    END IF;
    IF matched = cardinality(b.ids) THEN
      DELETE FROM {schema}.group_batches k WHERE k.batch_id = r.batch_id;
    ELSIF matched > 0 THEN
      UPDATE {schema}.group_batches k
      SET (ids, attempts, agg_keys) = (
        SELECT array_agg(e.id ORDER BY e.id), array_agg(e.att ORDER BY e.id),
               CASE WHEN k.agg_keys IS NULL THEN NULL ELSE array_agg(e.key ORDER BY e.id) END
        FROM unnest(k.ids, k.attempts, k.agg_keys) AS e(id, att, key)
        WHERE e.id NOT IN (SELECT a.id FROM unnest(r.acked) AS a(id)))
      WHERE k.batch_id = r.batch_id;
    END IF;
    total := total + matched;
  END LOOP;
  RETURN total;
END
$fn$;

-- Give an event back to `consumer_group` before its visibility ends: it is
-- handed out again after `delay` (0 to 12 hours), or becomes a dead letter
-- if it has had its max_attempts. `error` (kept to 500 characters) is
-- recorded as the event's last error. False when the receipt no longer
-- names an event in flight.
CREATE FUNCTION {schema}.nack(
    consumer_group text,
    receipt        text,
    delay          interval DEFAULT '0 seconds',
    error          text DEFAULT NULL
) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  r record;
  b record;
  e record;
BEGIN
  IF delay IS NULL OR delay < interval '0' OR delay > interval '12 hours' THEN
    RAISE EXCEPTION 'postbox.nack: delay must be 0 to 12 hours' USING ERRCODE = '22023';
  END IF;
  IF NOT EXISTS (SELECT 1 FROM {schema}.consumer_groups k WHERE k.name = nack.consumer_group) THEN
    RAISE EXCEPTION 'postbox.nack: no consumer group %', quote_literal(left(consumer_group, 64))
      USING ERRCODE = '42704';
  END IF;
  SELECT x.batch_id, x.ids[1] AS id INTO r
  FROM {schema}.group_receipts('nack', ARRAY[receipt]) x;
  SELECT k.ids, k.attempts, k.agg_keys INTO b FROM {schema}.group_batches k
  WHERE k.batch_id = r.batch_id AND k.group_name = nack.consumer_group
  FOR UPDATE;
  IF NOT FOUND THEN
    RETURN false;
  END IF;
  SELECT u.att, u.key INTO e FROM unnest(b.ids, b.attempts, b.agg_keys) AS u(id, att, key)
  WHERE u.id = r.id;
  IF NOT FOUND THEN
    RETURN false;
  END IF;
  IF cardinality(b.ids) = 1 THEN
    DELETE FROM {schema}.group_batches k WHERE k.batch_id = r.batch_id;
  ELSE
    UPDATE {schema}.group_batches k
    SET (ids, attempts, agg_keys) = (
      SELECT array_agg(u.id ORDER BY u.id), array_agg(u.att ORDER BY u.id),
             CASE WHEN k.agg_keys IS NULL THEN NULL ELSE array_agg(u.key ORDER BY u.id) END
      FROM unnest(k.ids, k.attempts, k.agg_keys) AS u(id, att, key) WHERE u.id <> r.id)
    WHERE k.batch_id = r.batch_id;
  END IF;
  INSERT INTO {schema}.group_waiting (group_name, id, agg_key, attempts, visible_at, last_error)
  VALUES (nack.consumer_group, r.id, e.key, e.att, clock_timestamp() + nack.delay,
          coalesce(left(nack.error, 500), 'nacked on attempt ' || e.att))
  ON CONFLICT DO NOTHING;
  RETURN true;
END
$fn$;

-- Give dead letters of `group_name` (those of `event_ids`, or all when
-- NULL) back to the group: each waits to be handed out again, with a fresh
-- attempt count, and is marked replayed. Returns how many.
CREATE FUNCTION {schema}.group_replay_dead(group_name text, event_ids uuid[] DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  n integer;
BEGIN
  IF NOT EXISTS (SELECT 1 FROM {schema}.consumer_groups k WHERE k.name = group_replay_dead.group_name) THEN
    RAISE EXCEPTION 'postbox.group_replay_dead: no consumer group %',
      quote_literal(left(group_name, 64)) USING ERRCODE = '42704';
  END IF;
  WITH picked AS (
    UPDATE {schema}.group_dead_letters d SET replayed_at = now()
    WHERE d.group_name = group_replay_dead.group_name AND d.replayed_at IS NULL
      AND (group_replay_dead.event_ids IS NULL OR d.event_id = ANY (group_replay_dead.event_ids))
    RETURNING d.id, d.aggregate_type, d.aggregate_id)
  INSERT INTO {schema}.group_waiting AS w (group_name, id, agg_key, attempts, visible_at, last_error)
  SELECT group_replay_dead.group_name, p.id,
         CASE WHEN k.ordered THEN pg_catalog.hashtextextended(
                p.aggregate_type || '/' || p.aggregate_id, 0) END,
         0, now(), 'replayed from the dead letters'
  FROM picked p CROSS JOIN {schema}.consumer_groups k
  WHERE k.name = group_replay_dead.group_name
  ON CONFLICT ON CONSTRAINT group_waiting_pkey DO NOTHING;
  GET DIAGNOSTICS n = ROW_COUNT;
  RETURN n;
END
$fn$;

REVOKE EXECUTE ON FUNCTION
    {schema}.group_replay_dead(text, uuid[]),
    {schema}.create_group(text, text, text[], boolean, integer),
    {schema}.drop_group(text),
    {schema}.receive(text, integer, interval, interval),
    {schema}.group_receipts(text, text[]),
    {schema}.ack(text, text[]),
    {schema}.nack(text, text, interval, text)
  FROM PUBLIC;

-- Migration 7's truncation, which now also waits for consumer groups: a
-- segment is emptied only once every group's cursor has read past all of
-- its events and no group holds one of them in flight or waiting.
CREATE OR REPLACE FUNCTION {schema}.log_truncate(seg integer, archive boolean) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  part regclass := ('{schema}.log_' || seg)::regclass;
  filled boolean;
  unread boolean;
  n bigint;
BEGIN
  IF seg = (SELECT segment FROM {schema}.log_settings)
     OR (NOT EXISTS (SELECT 1 FROM {schema}.log_cursors)
         AND NOT EXISTS (SELECT 1 FROM {schema}.consumer_groups)) THEN
    RETURN NULL;
  END IF;
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
  EXECUTE format(
    'SELECT EXISTS (SELECT 1 FROM %1$s p JOIN {schema}.log_cursors c
                    ON NOT pg_visible_in_snapshot(p.txid, c.lo))
         OR EXISTS (SELECT 1 FROM %1$s p JOIN {schema}.consumer_groups g
                    ON NOT pg_visible_in_snapshot(p.txid, g.lo))
         OR EXISTS (SELECT 1 FROM {schema}.group_waiting w JOIN %1$s p ON p.id = w.id)
         OR EXISTS (SELECT 1 FROM {schema}.group_batches b, unnest(b.ids) AS i(id)
                    JOIN %1$s p ON p.id = i.id)', part)
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

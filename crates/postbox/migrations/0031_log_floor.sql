-- postbox schema, version 31: a window's floor found in fewer steps.
-- A new log window's first page starts at its floor, the lowest id among
-- its events. Migrations 18 and 26 found it by walking the (txid, id) index
-- over every event of the window from `lo`'s xmax on, a heap fetch each
-- until a VACUUM marks the pages all-visible: 0.2 to 0.8 s for a window of
-- a million events, all of it before the first page could go out.
--
-- `log_floor` finds the same id by visiting each transaction of the window
-- instead: the first entry of a transaction in the index is its lowest id,
-- and the next transaction is one descent away. While the transactions it
-- has visited hold 16 ids or more each on average (the span from a
-- transaction's first id to its last), a window written by transactions of
-- many events costs a few index descents per transaction; once they hold
-- fewer, it walks the rest of the window's entries as before, so a window
-- of one-event transactions costs two descents more than it did. The
-- transactions in progress at `lo` are looked up one by one, as before.
-- The answer is the same in every case: the lowest id of a window event
-- visible in `hi`, less one; NULL when the window holds none.
--
-- `log_open` (migration 18) and `receive` (migration 26) are made anew with
-- it, each otherwise as it was; CREATE OR REPLACE keeps their grants.
-- `log_floor` reads with its caller's rights. It is not PUBLIC's: the roles
-- that keep log cursors (the relay role of `postbox migrate --create-roles`,
-- which grants it from now on) get it here, so a relay role made by an
-- earlier version keeps reading after the upgrade; `receive` runs as its
-- owner.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

CREATE FUNCTION {schema}.log_floor(lo pg_snapshot, hi pg_snapshot) RETURNS bigint
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
  hi_xmax  xid8 := pg_snapshot_xmax(hi);
  t        xid8;
  first_id bigint;
  last_id  bigint;
  lowest   bigint;
  visited  bigint := 0;
  spanned  bigint := 0;
BEGIN
  -- Transactions in progress at `lo`: the first entry of each.
  lowest := (SELECT min(f.id)
             FROM unnest(ARRAY(SELECT pg_snapshot_xip(lo))) AS x(txid),
                  LATERAL (SELECT l.txid, l.id FROM {schema}.log l
                           WHERE l.txid >= x.txid
                           ORDER BY l.txid, l.id LIMIT 1) f
             WHERE f.txid = x.txid AND pg_visible_in_snapshot(f.txid, hi));
  -- Transactions from `lo`'s xmax to `hi`'s, one at a time while they are
  -- large.
  SELECT l.txid, l.id INTO t, first_id FROM {schema}.log l
  WHERE l.txid >= pg_snapshot_xmax(lo) AND l.txid < hi_xmax
  ORDER BY l.txid, l.id LIMIT 1;
  WHILE t IS NOT NULL LOOP
    IF pg_visible_in_snapshot(t, hi) THEN
      lowest := LEAST(lowest, first_id);
    END IF;
    -- Its last id: the last entry up to it (`txid = t` would let the
    -- planner walk the id index back from the log's end instead).
    SELECT l.id INTO last_id FROM {schema}.log l
    WHERE l.txid <= t ORDER BY l.txid DESC, l.id DESC LIMIT 1;
    visited := visited + 1;
    spanned := spanned + (last_id - first_id + 1);
    IF spanned < 16 * visited THEN
      -- Small transactions: the rest of the window in one walk (`id + 0`
      -- keeps the planner from answering min(id) along the id index from
      -- the log's start).
      RETURN LEAST(lowest, (SELECT min(l.id + 0) FROM {schema}.log l
                            WHERE l.txid > t AND l.txid < hi_xmax
                              AND pg_visible_in_snapshot(l.txid, hi))) - 1;
    END IF;
    SELECT l.txid, l.id INTO t, first_id FROM {schema}.log l
    WHERE l.txid > t AND l.txid < hi_xmax
    ORDER BY l.txid, l.id LIMIT 1;
  END LOOP;
  RETURN lowest - 1;
END
$fn$;

REVOKE EXECUTE ON FUNCTION {schema}.log_floor(pg_snapshot, pg_snapshot) FROM PUBLIC;

DO $grant$
DECLARE
  g record;
BEGIN
  FOR g IN
    SELECT DISTINCT a.grantee::regrole::text AS grantee
    FROM pg_catalog.pg_class c
    CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) AS a
    WHERE c.oid = '{schema}.log_cursors'::regclass
      AND a.privilege_type = 'UPDATE' AND a.grantee <> 0 AND a.grantee <> c.relowner
  LOOP
    EXECUTE format('GRANT EXECUTE ON FUNCTION {schema}.log_floor(pg_snapshot, pg_snapshot) TO %s',
                   g.grantee);
  END LOOP;
END
$grant$;

-- Migration 18's, with its floor from log_floor.
CREATE OR REPLACE FUNCTION {schema}.log_open(
    for_destination text,
    for_owner       uuid,
    for_part        integer,
    page_size       bigint,
    from_lo         text
) RETURNS TABLE (
    destination text, part integer, parts integer, lo text, hi text, after_id bigint,
    id bigint, event_id uuid, event_type text, aggregate_type text, aggregate_id text,
    schema_version integer, payload text, headers text, created_at timestamptz,
    sequence bigint, attempts integer, scheduled boolean)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
  c       record;
  w_lo    pg_snapshot;
  w_hi    pg_snapshot;
  w_after bigint;
  from_id bigint;
BEGIN
  SELECT k.parts, k.lo, k.hi, k.after_id INTO c
  FROM {schema}.log_cursors k
  WHERE k.destination = for_destination AND k.part = for_part
    AND k.owner = for_owner AND k.lease_expires_at > now();
  IF NOT FOUND THEN
    RETURN;
  END IF;
  IF from_lo IS NOT NULL THEN
    w_lo := from_lo::pg_snapshot;
    w_hi := pg_current_snapshot();
    w_after := 0;
  ELSE
    w_lo := c.lo;
    w_hi := COALESCE(c.hi, pg_current_snapshot());
    w_after := CASE WHEN c.hi IS NULL THEN 0 ELSE c.after_id END;
  END IF;
  IF w_after > 0 THEN
    from_id := w_after;
  ELSE
    from_id := {schema}.log_floor(w_lo, w_hi);
  END IF;
  RETURN QUERY
  SELECT for_destination, for_part, c.parts, w_lo::text, w_hi::text,
         COALESCE(from_id, 0),
         NULL::bigint, NULL::uuid, NULL::text, NULL::text, NULL::text, NULL::integer,
         NULL::text, NULL::text, NULL::timestamptz, NULL::bigint, NULL::integer, NULL::boolean;
  IF from_id IS NOT NULL THEN
    RETURN QUERY
    SELECT NULL::text, NULL::integer, NULL::integer, NULL::text, NULL::text, NULL::bigint,
           p.id, p.event_id, p.event_type, p.aggregate_type, p.aggregate_id, p.schema_version,
           p.payload, p.headers, p.created_at, p.sequence, p.attempts, p.scheduled
    FROM {schema}.log_page(w_lo::text, w_hi::text, from_id, page_size, c.parts, for_part) p;
  END IF;
END
$fn$;

-- Migration 26's, with its floor from log_floor.
CREATE OR REPLACE FUNCTION {schema}.receive(
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
      w_after := {schema}.log_floor(g.lo, w_hi);
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

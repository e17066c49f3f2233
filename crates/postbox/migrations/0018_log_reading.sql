-- postbox schema, version 18: how log mode's relays read the log.
--
-- 1. Inserts into the log announce themselves as such. The log's trigger
-- sends the payload 'log' on the relays' channel; the outbox's still sends
-- ''. A relay in log mode wakes only its log readers for a 'log'
-- notification and leaves its claim loop (which reads the outbox:
-- hand-offs, retries, events written while producers still went to the
-- outbox) asleep, so a producer's commit no longer costs an empty claim on
-- the outbox as well. Relays of an older version treat every notification
-- alike, as before. `notify_relays` keeps its signature and its trigger on
-- the outbox; its second trigger argument, when given, is the payload.
--
-- 2. A page of a window, and a window opened with its first page, are read
-- through two functions, `log_page` and `log_open`, whose statements are
-- planned once per session for any parameters (plan_cache_mode =
-- force_generic_plan). Planned for the parameters of each call, a page of a
-- cursor split into partitions was read by a parallel scan of the whole log
-- and a sort (the planner cannot know how many rows a hash partition
-- keeps), about 30 times a page's cost, until PostgreSQL's plan cache moved
-- to its generic plan, on each connection anew; and opening a window cost
-- 3 ms of planning a call. The one plan both use walks the id index from
-- where the page starts and stops after a page. They read with the caller's
-- rights (the relay role's SELECT on the log and its cursors) and write
-- nothing.
--
-- `{schema}` and `{channel}` are replaced when the migration runs.

CREATE OR REPLACE FUNCTION {schema}.notify_relays() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
  PERFORM pg_notify(TG_ARGV[0], CASE WHEN TG_NARGS > 1 THEN TG_ARGV[1] ELSE '' END);
  RETURN NULL;
END
$fn$;

-- The trigger is made anew with its payload; an operator who disabled it
-- (very high commit rates, polling only) finds it disabled still.
DO $wake$
DECLARE
  was_disabled boolean := EXISTS (
    SELECT 1 FROM pg_catalog.pg_trigger
    WHERE tgrelid = '{schema}.log'::regclass AND tgname = 'log_notify' AND tgenabled = 'D');
BEGIN
  DROP TRIGGER IF EXISTS log_notify ON {schema}.log;
  CREATE TRIGGER log_notify AFTER INSERT ON {schema}.log
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.notify_relays({channel}, 'log');
  IF was_disabled THEN
    ALTER TABLE {schema}.log DISABLE TRIGGER log_notify;
  END IF;
END
$wake$;

-- Up to `page_size` events of the window (`lo`, `hi`: snapshots as text)
-- after id `after_id`, in id order. An event of the window either belongs to
-- a transaction that was in progress at `lo` (its xip list) or to one that
-- started after `lo` (txid >= xmax of lo); either way it must be visible in
-- `hi`. A cursor split into `parts` partitions (migration 14) reads only the
-- events of its partition `part`. A log event is on its first attempt
-- (`attempts` 1: retries happen in the outbox); `scheduled`: its delivery
-- time (migration 12) is still ahead.
CREATE FUNCTION {schema}.log_page(
    lo        text,
    hi        text,
    after_id  bigint,
    page_size bigint,
    parts     integer,
    part      integer
) RETURNS TABLE (
    id bigint, event_id uuid, event_type text, aggregate_type text, aggregate_id text,
    schema_version integer, payload text, headers text, created_at timestamptz,
    sequence bigint, attempts integer, scheduled boolean)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
AS $fn$
BEGIN
  RETURN QUERY
  SELECT l.id, l.event_id, l.event_type, l.aggregate_type, l.aggregate_id, l.schema_version,
         l.payload::text, l.headers::text, l.created_at, l.sequence,
         1, COALESCE(l.deliver_at > now(), false)
  FROM {schema}.log l
  WHERE l.id > log_page.after_id
    AND pg_visible_in_snapshot(l.txid, log_page.hi::pg_snapshot)
    AND (l.txid >= pg_snapshot_xmax(log_page.lo::pg_snapshot)
         OR l.txid = ANY (ARRAY(SELECT pg_snapshot_xip(log_page.lo::pg_snapshot))))
    AND (log_page.parts = 1
         OR {schema}.log_part(l.aggregate_type, l.aggregate_id, log_page.parts) = log_page.part)
  ORDER BY l.id
  LIMIT log_page.page_size;
END
$fn$;

-- The window partition `for_part` of `for_destination`'s cursor reads now,
-- while `for_owner` holds the cursor, and its first page of up to
-- `page_size` events.
-- The window is the open one (`hi` stored), or a new one whose `hi` is the
-- calling statement's snapshot (a STABLE function reads with it); with
-- `from_lo` (a snapshot) a new one from there, whatever the row says (the
-- reader's move that closed the window before, ending at `from_lo`, may
-- still be committing). A new window's first page starts at its floor:
-- the lowest id among its events, found along the (txid, id) index — its
-- transactions are the ones in progress at `lo`, each looked up as the
-- first entry from its txid on, and those from `lo`'s xmax up to `hi`'s —
-- so its cost is the window's size, not the log's (`id + 0` keeps the
-- planner from answering min(id) by walking the id index from the log's
-- start). The first row is the window (event columns NULL; `after_id`
-- where its first page starts, 0 when it holds no event); the page's
-- events follow (window columns NULL). No row at all when `for_owner` does
-- not hold the cursor.
CREATE FUNCTION {schema}.log_open(
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
    from_id := LEAST(
      (SELECT min(l.id + 0) FROM {schema}.log l
       WHERE l.txid >= pg_snapshot_xmax(w_lo)
         AND l.txid < pg_snapshot_xmax(w_hi)
         AND pg_visible_in_snapshot(l.txid, w_hi)),
      (SELECT min(f.id)
       FROM unnest(ARRAY(SELECT pg_snapshot_xip(w_lo))) AS x(txid),
            LATERAL (SELECT l.txid, l.id FROM {schema}.log l
                     WHERE l.txid >= x.txid
                     ORDER BY l.txid, l.id LIMIT 1) f
       WHERE f.txid = x.txid AND pg_visible_in_snapshot(f.txid, w_hi))) - 1;
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

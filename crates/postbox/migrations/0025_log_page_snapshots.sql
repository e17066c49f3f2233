-- postbox schema, version 25: a log page reads its window's snapshots once.
-- `log_page` (migration 18) takes the window's `lo` and `hi` as text and
-- compared each row with `hi::pg_snapshot` and `pg_snapshot_xmax(lo::pg_snapshot)`:
-- under its generic plan those casts are not constants, so every row of a
-- page parsed both snapshots again (their text, in-progress list included).
-- Here they are parsed once per call into variables, which the query reads
-- as parameters. Same signature, rows and order; CREATE OR REPLACE keeps
-- the function's grants.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

CREATE OR REPLACE FUNCTION {schema}.log_page(
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
DECLARE
  w_hi    pg_snapshot := log_page.hi::pg_snapshot;
  lo_xmax xid8 := pg_snapshot_xmax(log_page.lo::pg_snapshot);
  lo_xip  xid8[] := ARRAY(SELECT pg_snapshot_xip(log_page.lo::pg_snapshot));
BEGIN
  RETURN QUERY
  SELECT l.id, l.event_id, l.event_type, l.aggregate_type, l.aggregate_id, l.schema_version,
         l.payload::text, l.headers::text, l.created_at, l.sequence,
         1, COALESCE(l.deliver_at > now(), false)
  FROM {schema}.log l
  WHERE l.id > log_page.after_id
    AND pg_visible_in_snapshot(l.txid, w_hi)
    AND (l.txid >= lo_xmax OR l.txid = ANY (lo_xip))
    AND (log_page.parts = 1
         OR {schema}.log_part(l.aggregate_type, l.aggregate_id, log_page.parts) = log_page.part)
  ORDER BY l.id
  LIMIT log_page.page_size;
END
$fn$;

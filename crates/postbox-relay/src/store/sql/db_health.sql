-- What degrades a queue table in production, in one read of the statistics
-- views: the oldest transaction holding back the xmin horizon (vacuum cannot
-- remove dead rows newer than it), the replication slot holding it back the
-- most, the outbox table's live and dead tuples, and whether autovacuum is
-- on at all. $1 is the schema name.
-- Without pg_monitor (or pg_read_all_stats) other roles' sessions are hidden
-- from pg_stat_activity, and the first columns are NULL.
WITH oldest AS (
    SELECT pid, application_name, state,
           extract(epoch FROM now() - xact_start)::float8 AS age
    FROM pg_stat_activity
    WHERE backend_xmin IS NOT NULL AND xact_start IS NOT NULL AND pid <> pg_backend_pid()
    ORDER BY xact_start
    LIMIT 1),
slot AS (
    SELECT slot_name::text AS slot_name, active,
           GREATEST(age(xmin), age(catalog_xmin))::bigint AS xmin_age
    FROM pg_replication_slots
    WHERE xmin IS NOT NULL OR catalog_xmin IS NOT NULL
    ORDER BY 3 DESC NULLS LAST
    LIMIT 1),
tup AS (
    SELECT n_live_tup, n_dead_tup
    FROM pg_stat_user_tables
    WHERE schemaname = $1 AND relname = 'outbox')
SELECT oldest.pid, oldest.application_name, oldest.state, oldest.age,
       slot.slot_name, slot.active, slot.xmin_age,
       tup.n_live_tup, tup.n_dead_tup,
       current_setting('autovacuum')::bool
FROM (SELECT 1) AS one
LEFT JOIN oldest ON true
LEFT JOIN slot ON true
LEFT JOIN tup ON true

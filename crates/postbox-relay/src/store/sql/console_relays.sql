-- Relays connected to this database now, by client address: their sessions
-- carry application_name 'postbox-relay'. Without pg_monitor (or
-- pg_read_all_stats) other roles' client addresses read as NULL.
SELECT COALESCE(host(client_addr), 'local') AS client,
       count(*) AS connections,
       min(backend_start) AS connected_since,
       max(COALESCE(state_change, backend_start)) AS last_active
FROM pg_catalog.pg_stat_activity
WHERE application_name = $1 AND datname = current_database()
GROUP BY 1
ORDER BY 1

-- The many-outboxes benchmark (`postbox bench --only tenants`): its own
-- databases, named {database} (generated, always `postbox_bench_tn_…`).

-- name: create_database
CREATE DATABASE {database};

-- name: drop_database
DROP DATABASE IF EXISTS {database} WITH (FORCE);

-- name: databases
-- The benchmark's databases left from this or an earlier run ($1: a LIKE pattern).
SELECT datname FROM pg_catalog.pg_database WHERE datname LIKE $1 ORDER BY datname;

-- name: connections
-- Connections the relay holds to the benchmark's databases ($1: a LIKE pattern,
-- $2: the relay's application_name).
SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE datname LIKE $1 AND application_name = $2;

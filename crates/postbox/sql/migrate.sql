-- The migration runner's bookkeeping: the history table and the lock.
-- (The migrations themselves are the numbered files in ../migrations.)

-- name: create_schema
CREATE SCHEMA IF NOT EXISTS {schema};

-- name: create_history
CREATE TABLE IF NOT EXISTS {schema}.schema_migrations (
  version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,
  applied_at timestamptz NOT NULL DEFAULT now());

-- name: select_applied
SELECT version, checksum FROM {schema}.schema_migrations ORDER BY version;

-- name: select_latest
SELECT max(version) FROM {schema}.schema_migrations;

-- name: history_exists
SELECT to_regclass(quote_ident($1) || '.schema_migrations') IS NOT NULL;

-- name: insert_applied
INSERT INTO {schema}.schema_migrations (version, name, checksum) VALUES ($1, $2, $3);

-- name: lock
-- Session-level advisory lock serializing concurrent `migrate` runs on one schema.
SELECT pg_advisory_lock(hashtextextended('postbox.migrate.' || $1, 0));

-- name: unlock
SELECT pg_advisory_unlock(hashtextextended('postbox.migrate.' || $1, 0));

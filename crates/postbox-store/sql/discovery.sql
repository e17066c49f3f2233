-- What a relay serving many outboxes reads to find them.

-- name: outbox_schemas
-- The schemas of this database that hold a migrated postbox outbox (both the
-- outbox table and the migrations ledger), by name.
SELECT n.nspname AS schema
FROM pg_catalog.pg_namespace n
WHERE EXISTS (SELECT FROM pg_catalog.pg_class c
              WHERE c.relnamespace = n.oid AND c.relname = 'outbox' AND c.relkind IN ('r', 'p'))
  AND EXISTS (SELECT FROM pg_catalog.pg_class c
              WHERE c.relnamespace = n.oid AND c.relname = 'schema_migrations' AND c.relkind = 'r')
ORDER BY n.nspname;

-- name: all_schemas
-- Every schema of this database but the system's, by name (for `migrate --schemas`).
SELECT nspname AS schema
FROM pg_catalog.pg_namespace
WHERE nspname NOT LIKE 'pg\_%' AND nspname <> 'information_schema'
ORDER BY nspname;

-- name: databases
-- The databases of the server a client may connect to, by name.
SELECT datname AS database
FROM pg_catalog.pg_database
WHERE datallowconn AND NOT datistemplate
ORDER BY datname;

-- name: outbox_tuples
-- The live and dead tuples of the outbox tables of the schemas in $1 (for
-- the health watch of a relay serving many outboxes: one read per database
-- rather than one per outbox). A table without statistics yet has no row.
SELECT schemaname::text AS schema, n_live_tup AS live_tuples, n_dead_tup AS dead_tuples
FROM pg_catalog.pg_stat_user_tables
WHERE relname = 'outbox' AND schemaname = ANY($1::text[])
ORDER BY schemaname;

-- Statements of `postbox verify`'s delivery checker, in the schema of one run:
-- its own bookkeeping next to postbox's tables. verify_produced holds the
-- business row each producer transaction writes with its events (so it
-- exists exactly when the events were committed); verify_effects counts how
-- often the consumer applied each event.

-- name: create_tables
CREATE TABLE {schema}.verify_produced (event_id uuid PRIMARY KEY);
CREATE TABLE {schema}.verify_effects (event_id uuid PRIMARY KEY, applied int NOT NULL);

-- name: record_produced
-- In the producer's transaction, with the events.
INSERT INTO {schema}.verify_produced (event_id) SELECT unnest($1::uuid[]);

-- name: apply_effect
-- In the consumer's transaction, with the inbox row.
INSERT INTO {schema}.verify_effects (event_id, applied) VALUES ($1, 1)
ON CONFLICT (event_id) DO UPDATE SET applied = verify_effects.applied + 1;

-- name: commit_without_flush
-- The planted bug consumer-async-commit: this transaction's COMMIT returns
-- before its WAL is written, so a PostgreSQL crash can forget it.
SET LOCAL synchronous_commit = off;

-- name: produced_count
SELECT count(*) AS produced FROM {schema}.verify_produced;

-- name: produced
SELECT event_id FROM {schema}.verify_produced;

-- name: effects
SELECT event_id, applied FROM {schema}.verify_effects;

-- name: drop_schema
-- After a run whose checks passed (unless --keep).
DROP SCHEMA {schema} CASCADE;

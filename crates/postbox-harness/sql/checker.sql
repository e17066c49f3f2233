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

-- name: now
SELECT statement_timestamp() AS now;

-- name: replay_range
-- `--replay`: the events of source $2 ('outbox' or 'log', each with the
-- archive) created from $1 until this statement began, in one snapshot (so
-- every one of them committed), with that moment (the range's end). One
-- row with a NULL id when there are none.
SELECT t.to_at, e.event_id
FROM (SELECT statement_timestamp() AS to_at) t
LEFT JOIN (
    SELECT event_id, created_at FROM {schema}.outbox WHERE $2 = 'outbox'
    UNION ALL
    SELECT event_id, created_at FROM {schema}.outbox_archive
    UNION ALL
    SELECT event_id, created_at FROM {schema}.log WHERE $2 = 'log'
) e ON e.created_at >= $1 AND e.created_at < t.to_at;

-- name: last_replay_job
SELECT max(id) AS id FROM {schema}.replay_jobs;

-- name: replay_job_done
SELECT coalesce(bool_or(state = 'done'), false) AS done FROM {schema}.replay_jobs WHERE id = $1;

-- name: replay_from
SELECT (SELECT from_at FROM {schema}.replay_jobs ORDER BY id DESC LIMIT 1) AS from_at;

-- name: drop_schema
-- After a run whose checks passed (unless --keep).
DROP SCHEMA {schema} CASCADE;

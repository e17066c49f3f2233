-- The least-privilege roles of `postbox migrate --create-roles`: one
-- idempotent script; {producer}, {relay} and {monitor} are the role names.

-- name: create_roles
-- Least-privilege roles for postbox's schema {schema}. They are NOLOGIN
-- groups: a DBA grants them to login users (GRANT {relay} TO relay_login).
-- Idempotent: run it again after an upgrade to cover new tables.
DO $roles$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = '{producer}') THEN
    CREATE ROLE {producer} NOLOGIN;
  END IF;
  IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = '{relay}') THEN
    CREATE ROLE {relay} NOLOGIN;
  END IF;
  IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = '{monitor}') THEN
    CREATE ROLE {monitor} NOLOGIN;
  END IF;
END
$roles$;

GRANT USAGE ON SCHEMA {schema} TO {producer}, {relay}, {monitor};

-- Producer: can enqueue (the SQL function, or an INSERT as the Rust library
-- does) and nothing else: it cannot read, change or delete events.
GRANT INSERT ON {schema}.outbox TO {producer};
GRANT EXECUTE ON FUNCTION {schema}.enqueue(text, text, text, jsonb, jsonb) TO {producer};
GRANT EXECUTE ON FUNCTION {schema}.uuid_v7() TO {producer};
-- Enqueueing numbers the event within its aggregate (an upsert of its counter).
GRANT SELECT, INSERT, UPDATE ON {schema}.aggregate_sequences TO {producer};
-- Request idempotency keys are written in the producer's own transaction.
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.idempotency_keys TO {producer};

-- Relay: claims, settles and rescues events, and runs retention.
GRANT SELECT, UPDATE, DELETE ON {schema}.outbox TO {relay};
-- The relay checks at start-up that the schema is migrated.
GRANT SELECT ON {schema}.schema_migrations TO {relay};
GRANT SELECT, INSERT ON {schema}.outbox_archive TO {relay};
GRANT SELECT, DELETE ON {schema}.inbox TO {relay};
-- Per-destination state of fan-out events.
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.deliveries TO {relay};
-- Retention purges expired request idempotency keys.
GRANT SELECT, DELETE ON {schema}.idempotency_keys TO {relay};

-- Monitor: read-only, for `postbox status` and dashboards (every table of
-- the schema as of this run: run it again after an upgrade).
GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {monitor};

-- The operator console's password hashes and session tokens are not for
-- dashboards: the monitor role reads everything else.
REVOKE ALL ON {schema}.console_users, {schema}.console_sessions FROM {monitor};

-- postbox schema, version 15: when logical mode's reader last read each
-- replication slot. PostgreSQL 15 does not say how long a slot has gone
-- unread, and a slot read through the SQL interface is `active` only during
-- each read: the relay records its reads here (every few seconds while it
-- holds the slot), so `postbox status`, `postbox slot status` and the health
-- watch can say that no relay has read a slot for longer than a bound.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

CREATE TABLE {schema}.logical_readers (
    slot_name text PRIMARY KEY,
    read_at   timestamptz NOT NULL
);

-- The relay notes that it read `slot` now. SECURITY DEFINER: the relay role
-- needs no privilege on the table (the monitor role reads it).
CREATE FUNCTION {schema}.logical_read_now(slot text) RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
  INSERT INTO {schema}.logical_readers AS r (slot_name, read_at)
  VALUES (logical_read_now.slot, now())
  ON CONFLICT (slot_name) DO UPDATE SET read_at = EXCLUDED.read_at
$fn$;

REVOKE EXECUTE ON FUNCTION {schema}.logical_read_now(text) FROM PUBLIC;

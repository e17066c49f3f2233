-- postbox schema, version 22: a logical-mode reader that keeps failing is
-- visible outside the relay. The relay notes each failed reading session
-- (how many in a row, since when, the last error with secrets masked) beside
-- its last good read (migration 15); a good read clears them. `postbox slot
-- status`, `postbox status` and the console read the notes, so a reader that
-- fails on every attempt is reported as failing, not only as unread.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

ALTER TABLE {schema}.logical_readers
  ALTER COLUMN read_at DROP NOT NULL,
  ADD COLUMN failures integer NOT NULL DEFAULT 0,
  ADD COLUMN failing_since timestamptz,
  ADD COLUMN last_error text;

-- A good read: now, and no failure outstanding.
CREATE OR REPLACE FUNCTION {schema}.logical_read_now(slot text) RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
  INSERT INTO {schema}.logical_readers AS r (slot_name, read_at)
  VALUES (logical_read_now.slot, now())
  ON CONFLICT (slot_name) DO UPDATE
    SET read_at = EXCLUDED.read_at, failures = 0, failing_since = NULL, last_error = NULL
$fn$;

-- A failed reading session of `slot`; `error` is kept to 500 characters.
-- SECURITY DEFINER like logical_read_now: the relay role writes no table.
CREATE FUNCTION {schema}.logical_read_failed(slot text, error text) RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
  INSERT INTO {schema}.logical_readers AS r (slot_name, read_at, failures, failing_since, last_error)
  VALUES (logical_read_failed.slot, NULL, 1, now(), left(logical_read_failed.error, 500))
  ON CONFLICT (slot_name) DO UPDATE
    SET failures = r.failures + 1,
        failing_since = coalesce(r.failing_since, now()),
        last_error = EXCLUDED.last_error
$fn$;

REVOKE EXECUTE ON FUNCTION {schema}.logical_read_failed(text, text) FROM PUBLIC;

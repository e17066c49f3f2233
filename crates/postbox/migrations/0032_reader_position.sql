-- postbox schema, version 32: logical mode's reader keeps where it confirmed
-- its slot. PostgreSQL 15 writes a logical slot's confirmed position to disk
-- only when the slot's restart position or catalog xmin moves (or at a
-- checkpoint after they did), so a server crash can move the slot back by
-- tens of seconds of events, all of them delivered already: the stream
-- starts over from there and delivers them again. The relay notes the
-- position it confirmed with its read note, the same row update as before,
-- made every second while events are delivered (every 5 s otherwise): one
-- dead row version a second at most, whatever the rate of events. A reader
-- that finds its slot behind that note moves the slot up to it before it
-- reads, so a crash delivers again at most what was confirmed since the
-- last note.
--
-- The note is only ever a position the relay confirmed to the server itself,
-- so it grants nothing new: the relay role can move its slot anyway. A slot
-- dropped and made again starts past any note (WAL positions only grow), the
-- relay ignores the note of a slot it has just created, and a note is read
-- only on the server it was written on (its system identifier is kept with
-- it): a schema restored elsewhere, with its table's rows, brings no
-- position the new server's WAL would mean something else by.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

ALTER TABLE {schema}.logical_readers
  ADD COLUMN confirmed_lsn pg_lsn,
  ADD COLUMN confirmed_on bigint;

-- A good read, and the position the reader confirmed the slot up to (every
-- event before it delivered or handed to the outbox). The one-argument form
-- (migration 22) stays for relays of earlier versions.
CREATE FUNCTION {schema}.logical_read_now(slot text, confirmed pg_lsn) RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
  INSERT INTO {schema}.logical_readers AS r (slot_name, read_at, confirmed_lsn, confirmed_on)
  VALUES (logical_read_now.slot, now(), logical_read_now.confirmed,
          (SELECT system_identifier FROM pg_control_system()))
  ON CONFLICT (slot_name) DO UPDATE
    SET read_at = EXCLUDED.read_at, failures = 0, failing_since = NULL, last_error = NULL,
        confirmed_lsn = EXCLUDED.confirmed_lsn, confirmed_on = EXCLUDED.confirmed_on
$fn$;

REVOKE EXECUTE ON FUNCTION {schema}.logical_read_now(text, pg_lsn) FROM PUBLIC;

-- Whoever may note a read today may note it with its position: a relay role
-- made by an earlier `postbox migrate --create-roles` (which grants the new
-- form from now on) keeps reading after the upgrade.
DO $grant$
DECLARE
  g record;
BEGIN
  FOR g IN
    SELECT DISTINCT a.grantee::regrole::text AS grantee
    FROM pg_catalog.pg_proc p
    CROSS JOIN LATERAL pg_catalog.aclexplode(p.proacl) AS a
    WHERE p.oid = '{schema}.logical_read_now(text)'::regprocedure
      AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner
  LOOP
    EXECUTE format('GRANT EXECUTE ON FUNCTION {schema}.logical_read_now(text, pg_lsn) TO %s',
                   g.grantee);
  END LOOP;
END
$grant$;

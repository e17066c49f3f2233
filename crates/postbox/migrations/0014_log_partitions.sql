-- postbox schema, version 14: one destination's log read by several relays.
-- `{schema}` is replaced by the quoted schema name when the migration runs.
--
-- A destination's cursor may be split into `parts` partitions by a hash of
-- the aggregate (log_part): cursor `part` reads only the events whose
-- aggregate hashes to it, so one aggregate's events are always read by one
-- cursor, in order. Each partition's cursor has its own snapshots and its
-- own lease; relays share a destination's partitions by taking about
-- 1/(relays reading it) of them each. Existing cursors become partition 0
-- of 1: nothing changes until a relay asks for more (`relay.log_partitions`).

ALTER TABLE {schema}.log_cursors
    ADD COLUMN part  integer NOT NULL DEFAULT 0,
    ADD COLUMN parts integer NOT NULL DEFAULT 1,
    ADD CONSTRAINT log_cursors_parts_range CHECK (parts BETWEEN 1 AND 1024),
    ADD CONSTRAINT log_cursors_part_range CHECK (part >= 0 AND part < parts),
    DROP CONSTRAINT log_cursors_pkey;
ALTER TABLE {schema}.log_cursors ADD PRIMARY KEY (destination, part);

-- Which relays read a destination now (a heartbeat each relay's readers
-- renew with their leases): a relay takes at most its fair share of the
-- destination's partitions, ceil(parts / live readers), and gives back what
-- it holds beyond it, so a relay that joins gets work and one that dies
-- (its heartbeat goes stale within a lease) leaves its share to the others.
CREATE TABLE {schema}.log_readers (
    destination text NOT NULL,
    owner       uuid NOT NULL,
    seen_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (destination, owner)
);

-- The partition (0 ≤ part < parts) of an aggregate: PostgreSQL's extended
-- text hash (the one hash partitioning uses, stable across upgrades) of type
-- and id, reduced modulo `parts`.
CREATE FUNCTION {schema}.log_part(aggregate_type text, aggregate_id text, parts integer)
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT AS $fn$
  SELECT (((pg_catalog.hashtextextended(aggregate_type || '/' || aggregate_id, 0) % parts)
           + parts) % parts)::integer
$fn$;

-- Roles that keep cursors (the relay role of `--create-roles`, granted
-- UPDATE on log_cursors by migration 10's time) may now also remove them
-- (re-splitting a destination) and keep the heartbeat.
DO $grants$
DECLARE
  g record;
BEGIN
  FOR g IN
    SELECT DISTINCT a.grantee::regrole::text AS grantee
    FROM pg_catalog.pg_class c
    CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) AS a
    WHERE c.oid = '{schema}.log_cursors'::regclass
      AND a.privilege_type = 'UPDATE' AND a.grantee <> 0 AND a.grantee <> c.relowner
  LOOP
    EXECUTE format('GRANT DELETE ON {schema}.log_cursors TO %s', g.grantee);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.log_readers TO %s', g.grantee);
  END LOOP;
END
$grants$;

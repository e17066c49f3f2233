-- postbox schema, version 30: the destinations relays have delivered to.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

-- A relay records its configuration's destinations here when it starts
-- (one row per name, kept). A name new to a table that already held some
-- is a destination added to a running outbox: in claim and logical mode,
-- where no cursor says where a destination starts, a destination so added
-- with `start = "beginning"` or a time gets a replay job (migration 29,
-- created_by 'relay') of the retained events since then, which the relay
-- runs beside live delivery. The first relay of a schema (an empty table)
-- records its destinations and starts no job: they are the outbox's first.
-- Only the owner and the relay role write it; no function is added, so
-- nothing is executable by PUBLIC.
CREATE TABLE {schema}.destinations_seen (
    name       text PRIMARY KEY CHECK (length(name) BETWEEN 1 AND 200),
    first_seen timestamptz NOT NULL DEFAULT now()
);

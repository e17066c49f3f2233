-- postbox schema, version 27: the events each destination's filters kept
-- from it, counted beside its deliveries (by minute, destination and reading
-- mode), so status, the metrics' readers and the console can say why a
-- destination did not get an event.
-- `{schema}` is replaced by the quoted schema name when the migration runs.
ALTER TABLE {schema}.deliveries_by_minute
    ADD COLUMN filtered bigint NOT NULL DEFAULT 0 CHECK (filtered >= 0);

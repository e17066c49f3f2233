-- postbox schema, version 20: deliveries counted by minute, destination and
-- reading mode, written by each relay every few seconds (one upsert per
-- destination that delivered, none while idle). Log and logical mode leave
-- no `sent` outbox row behind, so this is how status, metrics' readers and
-- the console count their deliveries; claim mode's are counted too, per
-- destination. Rows older than two days are deleted by the relays.
-- `{schema}` is replaced by the quoted schema name when the migration runs.
CREATE TABLE {schema}.deliveries_by_minute (
    minute      timestamptz NOT NULL,
    destination text NOT NULL,
    mode        text NOT NULL CHECK (mode IN ('claim', 'log', 'logical')),
    delivered   bigint NOT NULL CHECK (delivered >= 0),
    PRIMARY KEY (minute, destination, mode)
);

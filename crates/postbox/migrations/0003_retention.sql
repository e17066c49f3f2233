-- postbox schema, version 3: the archive that retention moves sent events to.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

-- Sent events moved out of the hot outbox table by `postbox purge --archive`
-- (or the relay's retention task with `archive = true`). The outbox keeps only
-- the rows relays still work on, so its indexes and dead tuples stay small;
-- the archive is append-only and can be partitioned, dumped or truncated by
-- the operator at will. Lease columns and `status` are not kept: every
-- archived event was sent.
CREATE TABLE {schema}.outbox_archive (
    id             bigint PRIMARY KEY,
    event_id       uuid NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    event_type     text NOT NULL,
    schema_version integer NOT NULL,
    payload        jsonb NOT NULL,
    headers        jsonb NOT NULL,
    attempts       integer NOT NULL,
    created_at     timestamptz NOT NULL,
    sent_at        timestamptz,
    archived_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX outbox_archive_event_id_idx ON {schema}.outbox_archive (event_id);
CREATE INDEX outbox_archive_sent_at_idx ON {schema}.outbox_archive (sent_at);

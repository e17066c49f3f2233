-- postbox schema, version 4: dead-letter resolutions, the audit log and
-- request idempotency keys.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

-- A dead letter an operator dealt with without replaying it under its own id
-- keeps status 'failed' (nothing is lost), and says how it was resolved:
--   'discarded' — given up on, with a reason (`resolution_note`);
--   'replaced'  — replayed as a new operation: `replaced_by` is the copy's event id.
-- A copy made by `postbox dlq replay --new-id` names its original in `replay_of`.
-- Nullable columns without defaults: adding them rewrites nothing.
ALTER TABLE {schema}.outbox
    ADD COLUMN resolved_at     timestamptz,
    ADD COLUMN resolution      text,
    ADD COLUMN resolution_note text,
    ADD COLUMN replaced_by     uuid,
    ADD COLUMN replay_of       uuid,
    ADD CONSTRAINT outbox_resolution_known
        CHECK (resolution IS NULL OR resolution IN ('discarded', 'replaced'));

-- Every operator action on dead letters (and later, the console's), one row per
-- committed batch: who, when, what, which events, how many, why.
CREATE TABLE {schema}.audit_log (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at        timestamptz NOT NULL DEFAULT now(),
    actor     text NOT NULL,
    action    text NOT NULL,
    -- The selection as the operator gave it: {"ids": [...]} or {"all": true, "type": ..., "since": ...}.
    selection jsonb NOT NULL DEFAULT '{}',
    count     bigint NOT NULL,
    reason    text,
    -- One entry per event touched: event_id, and the last_error it had
    -- (and new_event_id for a replay as a new operation).
    details   jsonb NOT NULL DEFAULT '[]',
    CONSTRAINT audit_log_actor_length CHECK (octet_length(actor) BETWEEN 1 AND 255),
    CONSTRAINT audit_log_action_length CHECK (octet_length(action) BETWEEN 1 AND 255)
);
CREATE INDEX audit_log_at_idx ON {schema}.audit_log (at);

-- Request idempotency keys: one row per (scope, key), written in the same
-- transaction as the business change and its events.
CREATE TABLE {schema}.idempotency_keys (
    scope           text NOT NULL,
    key             text NOT NULL,
    fingerprint     text NOT NULL,
    status          text NOT NULL DEFAULT 'in_flight',
    response_status integer,
    response_type   text,
    response_body   bytea,
    created_at      timestamptz NOT NULL DEFAULT now(),
    completed_at    timestamptz,
    expires_at      timestamptz NOT NULL,
    PRIMARY KEY (scope, key),
    CONSTRAINT idempotency_keys_status_known CHECK (status IN ('in_flight', 'completed')),
    CONSTRAINT idempotency_keys_scope_length CHECK (octet_length(scope) BETWEEN 1 AND 255),
    CONSTRAINT idempotency_keys_key_length CHECK (octet_length(key) BETWEEN 1 AND 255)
);
-- Retention: expired keys by age.
CREATE INDEX idempotency_keys_expires_at_idx ON {schema}.idempotency_keys (expires_at);

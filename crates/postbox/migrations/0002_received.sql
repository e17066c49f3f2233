-- postbox schema, version 2: the store of `postbox receive`.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

-- One row per delivery a consumer accepted, kept until the application has
-- processed it (and, once processed, until purged).
--
-- `event_id` is text, not uuid: senders choose their ids (Standard Webhooks
-- `webhook-id` values such as `msg_2KWPBgLlAfxdpx2AI54pPJ85f4W`, CloudEvents
-- `id`s of any form), and deduplication must use them exactly as sent.
-- `body` is bytea: the exact bytes that were signed, whatever their encoding.
-- `id` only orders the take; (consumer, event_id) is the identity.
CREATE TABLE {schema}.received (
    id           bigint GENERATED ALWAYS AS IDENTITY,
    consumer     text NOT NULL,
    event_id     text NOT NULL,
    headers      jsonb NOT NULL DEFAULT '{}',
    body         bytea NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now(),
    processed_at timestamptz,
    PRIMARY KEY (consumer, event_id),
    CONSTRAINT received_consumer_length CHECK (octet_length(consumer) BETWEEN 1 AND 255),
    CONSTRAINT received_event_id_length CHECK (octet_length(event_id) BETWEEN 1 AND 255),
    CONSTRAINT received_headers_object CHECK (jsonb_typeof(headers) = 'object')
);

-- The take reads this index in order: unprocessed deliveries of one consumer.
CREATE INDEX received_unprocessed_idx ON {schema}.received (consumer, id)
    WHERE processed_at IS NULL;
-- Retention: processed deliveries by age.
CREATE INDEX received_processed_at_idx ON {schema}.received (processed_at)
    WHERE processed_at IS NOT NULL;

-- postbox schema, version 24: the inbox from SQL. A consumer written in any
-- language applies each event once by calling, in the transaction that
-- applies the event's effect,
--
--   SELECT {schema}.inbox_apply('billing', '0192…'::uuid);
--
-- true: the first time this consumer sees the event (apply its effect in
-- the same transaction; a rollback forgets the record too); false: already
-- applied (skip the effect, acknowledge the delivery). The same record the
-- Rust `record_inbox` writes, so consumers in several languages can share
-- one inbox. `inbox_sequence` (migration 5) is the per-aggregate order
-- check. Both run with the caller's rights: the caller needs INSERT on
-- `inbox` (and on `inbox_sequences` for the order check), as the Rust calls
-- do. A consumer name is 1 to 255 bytes, as the libraries check.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

CREATE FUNCTION {schema}.inbox_apply(consumer text, event_id uuid)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
  IF consumer IS NULL OR consumer = '' OR octet_length(consumer) > 255 THEN
    RAISE EXCEPTION 'postbox.inbox_apply: the consumer name must be 1 to 255 bytes'
      USING ERRCODE = '22023';
  END IF;
  IF event_id IS NULL THEN
    RAISE EXCEPTION 'postbox.inbox_apply: the event id must not be NULL'
      USING ERRCODE = '22004';
  END IF;
  INSERT INTO {schema}.inbox (consumer, event_id)
  VALUES (inbox_apply.consumer, inbox_apply.event_id)
  ON CONFLICT DO NOTHING;
  RETURN FOUND;
END
$fn$;

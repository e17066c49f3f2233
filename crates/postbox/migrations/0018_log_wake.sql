-- postbox schema, version 18: inserts into the log announce themselves as
-- such. The log's trigger sends the payload 'log' on the relays' channel;
-- the outbox's still sends ''. A relay in log mode wakes only its log
-- readers for a 'log' notification and leaves its claim loop (which reads
-- the outbox: hand-offs, retries, events written while producers still went
-- to the outbox) asleep, so a producer's commit no longer costs an empty
-- claim on the outbox as well. Relays of an older version treat every
-- notification alike, as before.
--
-- `notify_relays` keeps its signature and its trigger on the outbox; its
-- second trigger argument, when given, is the payload.
-- `{schema}` and `{channel}` are replaced when the migration runs.

CREATE OR REPLACE FUNCTION {schema}.notify_relays() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
  PERFORM pg_notify(TG_ARGV[0], CASE WHEN TG_NARGS > 1 THEN TG_ARGV[1] ELSE '' END);
  RETURN NULL;
END
$fn$;

-- The trigger is made anew with its payload; an operator who disabled it
-- (very high commit rates, polling only) finds it disabled still.
DO $wake$
DECLARE
  was_disabled boolean := EXISTS (
    SELECT 1 FROM pg_catalog.pg_trigger
    WHERE tgrelid = '{schema}.log'::regclass AND tgname = 'log_notify' AND tgenabled = 'D');
BEGIN
  DROP TRIGGER IF EXISTS log_notify ON {schema}.log;
  CREATE TRIGGER log_notify AFTER INSERT ON {schema}.log
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.notify_relays({channel}, 'log');
  IF was_disabled THEN
    ALTER TABLE {schema}.log DISABLE TRIGGER log_notify;
  END IF;
END
$wake$;

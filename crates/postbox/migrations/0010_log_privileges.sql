-- postbox schema, version 10: log mode under least privilege.
-- `{schema}` is replaced by the quoted schema name when the migration runs.
--
-- The relay role (`postbox migrate --create-roles`) reads the log and moves
-- its own cursors; everything else it does to the log goes through these
-- functions, which run with their owner's rights (SECURITY DEFINER), a fixed
-- `search_path` and every object of the schema named in full:
-- - log_rotate / log_truncate maintain the ring (a TRUNCATE needs the
--   table's owner, and the relay must not own the log);
-- - log_handoff moves events a destination did not take to the outbox for
--   the retry machinery. It copies each event from the log itself, so a
--   relay can decide only how an event's delivery went (dead or retrying,
--   after how long, with which error), never what the event says: the relay
--   role has no INSERT on the outbox.
-- EXECUTE is revoked from PUBLIC and granted to the relay role by
-- `--create-roles`.

ALTER FUNCTION {schema}.log_rotate(interval)
  SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.log_truncate(integer, boolean)
  SECURITY DEFINER SET search_path = pg_catalog, pg_temp;

-- Hand log events to the outbox for destination `destination`: `ids` and
-- `event_ids` name the log rows (both must match), and per event: `dead`
-- (a dead letter now), `delay_secs` (until the retry), `errors` (already
-- sanitized), `fanout` (it routes to several destinations), `attempts` (so
-- far: 1, or 0 when the sink deferred it without trying). For a fan-out
-- event the outbox row carries per-destination state: this destination's
-- row says what happened, and the destinations its other cursors deliver
-- (`other_event_ids`/`other_destinations`) get a placeholder marked sent
-- with 0 attempts; a later handoff of the same event by one of them
-- replaces its placeholder and puts the outbox row back to pending (taking
-- it from a claim in flight, which then redelivers where needed).
-- Returns how many of the named events it found in the log: the caller
-- rolls back unless that is all of them, so no event is ever skipped.
CREATE FUNCTION {schema}.log_handoff(
    destination        text,
    ids                bigint[],
    event_ids          uuid[],
    dead               boolean[],
    delay_secs         float8[],
    errors             text[],
    fanout             boolean[],
    attempts           integer[],
    other_event_ids    uuid[],
    other_destinations text[]
) RETURNS integer
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
WITH h AS (
    SELECT l.event_id, l.event_type, l.aggregate_type, l.aggregate_id, l.schema_version,
           l.payload, l.headers, l.sequence, l.created_at,
           x.dead, x.delay_secs, x.error, x.fanout, x.attempts
    FROM unnest(log_handoff.ids, log_handoff.event_ids, log_handoff.dead,
                log_handoff.delay_secs, log_handoff.errors, log_handoff.fanout,
                log_handoff.attempts)
      AS x(id, event_id, dead, delay_secs, error, fanout, attempts)
    JOIN {schema}.log l ON l.id = x.id AND l.event_id = x.event_id),
inserted AS (
    INSERT INTO {schema}.outbox
        (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers,
         sequence, created_at, status, attempts, available_at, last_error)
    SELECT event_id, event_type, aggregate_type, aggregate_id, schema_version,
           payload, headers, sequence, created_at,
           CASE WHEN dead THEN 'failed'::{schema}.event_status
                ELSE 'pending'::{schema}.event_status END,
           attempts, now() + make_interval(secs => delay_secs), error
    FROM h
    ON CONFLICT (event_id) DO NOTHING
    RETURNING id, event_id),
rows AS (
    -- Fan-out events only: those whose outbox row existed before this
    -- statement, and those it inserted (not visible to a scan of the table).
    SELECT o.id, h.event_id, h.dead, h.delay_secs, h.error, h.attempts, true AS existed
    FROM h JOIN {schema}.outbox o ON o.event_id = h.event_id
    WHERE h.fanout
    UNION ALL
    SELECT i.id, h.event_id, h.dead, h.delay_secs, h.error, h.attempts, false
    FROM inserted i JOIN h ON h.event_id = i.event_id
    WHERE h.fanout),
mine AS (
    INSERT INTO {schema}.deliveries AS d
        (outbox_id, destination, status, attempts, available_at, last_error, updated_at)
    SELECT r.id, log_handoff.destination,
           CASE WHEN r.dead THEN 'failed'::{schema}.event_status
                ELSE 'pending'::{schema}.event_status END,
           r.attempts, now() + make_interval(secs => r.delay_secs), r.error, now()
    FROM rows r
    ON CONFLICT (outbox_id, destination) DO UPDATE
    SET status = EXCLUDED.status, attempts = EXCLUDED.attempts,
        available_at = EXCLUDED.available_at, last_error = EXCLUDED.last_error,
        updated_at = now()
    WHERE d.attempts = 0 AND d.status = 'sent'
    RETURNING d.outbox_id),
placeholders AS (
    INSERT INTO {schema}.deliveries
        (outbox_id, destination, status, attempts, available_at, updated_at)
    SELECT r.id, p.destination, 'sent'::{schema}.event_status, 0, now(), now()
    FROM unnest(log_handoff.other_event_ids, log_handoff.other_destinations) AS p(event_id, destination)
    JOIN rows r ON r.event_id = p.event_id
    ON CONFLICT (outbox_id, destination) DO NOTHING),
revived AS (
    UPDATE {schema}.outbox o
    SET status = 'pending', available_at = LEAST(o.available_at, now()),
        lease_token = NULL, lease_expires_at = NULL
    FROM rows r
    WHERE o.id = r.id AND r.existed AND o.status <> 'pending'
      AND o.id IN (SELECT outbox_id FROM mine))
SELECT count(*)::integer FROM h
$fn$;

REVOKE EXECUTE ON FUNCTION
    {schema}.log_rotate(interval),
    {schema}.log_truncate(integer, boolean),
    {schema}.log_handoff(text, bigint[], uuid[], boolean[], float8[], text[], boolean[],
                         integer[], uuid[], text[])
  FROM PUBLIC;

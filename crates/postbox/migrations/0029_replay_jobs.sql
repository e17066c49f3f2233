-- postbox schema, version 29: replay jobs.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

-- One row per `postbox replay`: which retained events go again to one
-- destination, and how far it has come. A job reads one source by id —
-- `outbox` (the outbox table) or `log` (the log's retained segments), each
-- with the archive, whose rows keep the ids they had — from just after
-- `after_id` (in (id, event_id) order: an archived log event may share an
-- outbox row's id) up to `hi`, the last id of the range when the job was
-- made, so events committed later are never part of it. Each page's delivery is followed by
-- one update of `after_id` and the counts: a runner killed between the two
-- sends that page again (at least once), never skips one. `state`:
-- running (a runner holds the job's advisory lock, or died holding it),
-- paused (stopped by Ctrl-C), failed (the destination kept refusing),
-- cancelled, done. Until a job is cancelled or done, retention keeps what it
-- still needs: the purge leaves its outbox rows, log_truncate its segments.
-- Only the owner reads or writes it (the monitor role reads it too); no
-- function is added, so nothing is executable by PUBLIC.
CREATE TABLE {schema}.replay_jobs (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    destination    text NOT NULL CHECK (length(destination) BETWEEN 1 AND 200),
    source         text NOT NULL CHECK (source IN ('outbox', 'log')),
    from_at        timestamptz NOT NULL,
    to_at          timestamptz NOT NULL CHECK (to_at > from_at),
    types          text CHECK (length(types) <= 1000),
    type_likes     text[],
    aggregate_type text,
    aggregate_id   text,
    rate           integer CHECK (rate > 0),
    new_ids        boolean NOT NULL DEFAULT false,
    after_id       bigint NOT NULL,
    after_event    uuid NOT NULL DEFAULT '00000000-0000-0000-0000-000000000000',
    hi             bigint NOT NULL,
    total          bigint NOT NULL,
    state          text NOT NULL DEFAULT 'running'
                   CHECK (state IN ('running', 'paused', 'failed', 'cancelled', 'done')),
    delivered      bigint NOT NULL DEFAULT 0,
    filtered       bigint NOT NULL DEFAULT 0,
    rejected       bigint NOT NULL DEFAULT 0,
    last_error     text CHECK (length(last_error) <= 2000),
    created_by     text NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    finished_at    timestamptz
);
CREATE INDEX replay_jobs_open_idx ON {schema}.replay_jobs (source, after_id)
    WHERE state IN ('running', 'paused', 'failed');

-- Log truncation keeps the segments an unfinished replay job still reads
-- (the version of migration 26, with one more condition).
CREATE OR REPLACE FUNCTION {schema}.log_truncate(seg integer, archive boolean) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  part regclass := ('{schema}.log_' || seg)::regclass;
  filled boolean;
  unread boolean;
  n bigint;
BEGIN
  IF seg = (SELECT segment FROM {schema}.log_settings)
     OR (NOT EXISTS (SELECT 1 FROM {schema}.log_cursors)
         AND NOT EXISTS (SELECT 1 FROM {schema}.consumer_groups)) THEN
    RETURN NULL;
  END IF;
  EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)', part) INTO filled;
  IF NOT filled THEN
    RETURN 0;
  END IF;
  SET LOCAL lock_timeout = '50ms';
  BEGIN
    EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', part);
  EXCEPTION WHEN lock_not_available THEN
    RETURN NULL;
  END;
  EXECUTE format(
    'SELECT EXISTS (SELECT 1 FROM %1$s p JOIN {schema}.log_cursors c
                    ON NOT pg_visible_in_snapshot(p.txid, c.lo))
         OR EXISTS (SELECT 1 FROM %1$s p JOIN {schema}.consumer_groups g
                    ON NOT pg_visible_in_snapshot(p.txid, g.lo))
         OR EXISTS (SELECT 1 FROM {schema}.group_waiting w JOIN %1$s p ON p.id = w.id)
         OR EXISTS (SELECT 1 FROM {schema}.group_batches b, unnest(b.ids) AS i(id)
                    JOIN %1$s p ON p.id = i.id)
         OR EXISTS (SELECT 1 FROM {schema}.replay_jobs j JOIN %1$s p
                    ON p.id >= j.after_id AND p.id <= j.hi
                    WHERE j.source = ''log'' AND j.state IN (''running'', ''paused'', ''failed''))', part)
    INTO unread;
  IF unread THEN
    RETURN NULL;
  END IF;
  IF archive THEN
    EXECUTE format(
      'INSERT INTO {schema}.outbox_archive
         (id, event_id, aggregate_type, aggregate_id, event_type, schema_version,
          payload, headers, attempts, created_at, sent_at, sequence)
       SELECT id, event_id, aggregate_type, aggregate_id, event_type, schema_version,
              payload, headers, 1, created_at, NULL, sequence
       FROM %s p
       WHERE NOT EXISTS (SELECT 1 FROM {schema}.outbox o WHERE o.event_id = p.event_id)
         AND NOT EXISTS (SELECT 1 FROM {schema}.outbox_archive a WHERE a.event_id = p.event_id)
       ON CONFLICT (id) DO NOTHING', part);
  END IF;
  EXECUTE format('SELECT count(*) FROM %s', part) INTO n;
  EXECUTE format('TRUNCATE %s', part);
  RETURN n;
END
$fn$;

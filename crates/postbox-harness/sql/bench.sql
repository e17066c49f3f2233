-- Statements behind `postbox bench`: the schema it creates and drops,
-- seeding, the pure-SQL ceiling on postbox's own schema, the naive
-- row-at-a-time relay it is compared to, and the outbox's size.

-- name: server_version
SHOW server_version;

-- name: drop_schema
-- The benchmark's own schema (its name must contain "bench").
DROP SCHEMA IF EXISTS {schema} CASCADE;

-- name: seed
-- Benchmark seed: $1 committed events with a payload of about 200 bytes.
-- With $2 > 0 they belong to $2 aggregates, interleaved (event g is number
-- (g - 1) / $2 + 1 of aggregate g % $2), as producers of many aggregates write
-- them; with $2 = 0 each event is its own aggregate.
INSERT INTO {schema}.outbox (event_id, event_type, aggregate_type, aggregate_id, payload, sequence)
SELECT {schema}.uuid_v7(), 'order.created', 'order',
       CASE WHEN $2 > 0 THEN (g % $2)::text ELSE g::text END,
       jsonb_build_object('order_id', g, 'account_id', g % 97, 'customer', 'customer-' || (g % 1000),
                          'currency', 'EUR', 'total_cents', (g * 7919) % 100000,
                          'items', jsonb_build_array(jsonb_build_object('sku', 'SKU-' || (g % 500), 'qty', 1 + g % 3)),
                          'note', repeat('x', 48)),
       CASE WHEN $2 > 0 THEN (g - 1) / $2 + 1 ELSE 1 END
FROM generate_series(1, $1) g;

-- name: seed_sent
-- Events a replay re-reads (`--replay-beside`): $1 events already
-- delivered (status sent), created at $2, of about 200 bytes each, each its
-- own aggregate; the relay never claims them.
INSERT INTO {schema}.outbox (event_id, event_type, aggregate_type, aggregate_id, payload,
                             status, sent_at, created_at)
SELECT {schema}.uuid_v7(), 'order.created', 'order', g::text,
       jsonb_build_object('order_id', g, 'account_id', g % 97, 'customer', 'customer-' || (g % 1000),
                          'currency', 'EUR', 'total_cents', (g * 7919) % 100000,
                          'note', repeat('x', 48)),
       'sent', $2, $2
FROM generate_series(1, $1) g;

-- name: replayed
-- Events the replay jobs have delivered so far, and for how long they ran
-- (made to finished, or to their last page).
SELECT coalesce(sum(delivered), 0)::bigint AS delivered,
       coalesce(extract(epoch FROM max(coalesce(finished_at, updated_at)) - min(created_at)), 0)::float8
           AS seconds
FROM {schema}.replay_jobs;

-- name: seed_log
-- The same seed appended to the log (log mode): $1 committed events with a payload of about 200 bytes.
-- With $2 > 0 they belong to $2 aggregates, interleaved (event g is number
-- (g - 1) / $2 + 1 of aggregate g % $2), as producers of many aggregates write
-- them; with $2 = 0 each event is its own aggregate.
INSERT INTO {schema}.log (event_id, event_type, aggregate_type, aggregate_id, payload, sequence)
SELECT {schema}.uuid_v7(), 'order.created', 'order',
       CASE WHEN $2 > 0 THEN (g % $2)::text ELSE g::text END,
       jsonb_build_object('order_id', g, 'account_id', g % 97, 'customer', 'customer-' || (g % 1000),
                          'currency', 'EUR', 'total_cents', (g * 7919) % 100000,
                          'items', jsonb_build_array(jsonb_build_object('sku', 'SKU-' || (g % 500), 'qty', 1 + g % 3)),
                          'note', repeat('x', 48)),
       CASE WHEN $2 > 0 THEN (g - 1) / $2 + 1 ELSE 1 END
FROM generate_series(1, $1) g;

-- name: seed_emit
-- The same seed emitted into the WAL (logical mode, no table row): events
-- $1 to $2, one aggregate per event, in the statement's own transaction
-- (the caller runs one statement per transaction it wants).
SELECT count({schema}.emit_one({schema}.uuid_v7(), 'order.created', 'order', g::text, 1,
         jsonb_build_object('order_id', g, 'account_id', g % 97, 'customer', 'customer-' || (g % 1000),
                            'currency', 'EUR', 'total_cents', (g * 7919) % 100000,
                            'items', jsonb_build_array(jsonb_build_object('sku', 'SKU-' || (g % 500), 'qty', 1 + g % 3)),
                            'note', repeat('x', 48)),
         '{}'::jsonb))
FROM generate_series($1::bigint, $2::bigint) g;

-- name: table_rows
-- Rows in the outbox, the log and the aggregates' sequence counters: what
-- producers wrote into tables (the producer run gives every event an
-- aggregate of its own, so each counter row is one insert, never updated).
SELECT (SELECT count(*) FROM {schema}.outbox) + (SELECT count(*) FROM {schema}.log)
       + (SELECT count(*) FROM {schema}.aggregate_sequences) AS table_rows;

-- name: log_analyze
ANALYZE {schema}.log;

-- name: autovacuum_off
-- The sustained run in log mode: no autovacuum on the log's segments nor
-- the outbox, to show that delivery needs none.
ALTER TABLE {schema}.log_0 SET (autovacuum_enabled = false);
ALTER TABLE {schema}.log_1 SET (autovacuum_enabled = false);
ALTER TABLE {schema}.log_2 SET (autovacuum_enabled = false);
ALTER TABLE {schema}.log_3 SET (autovacuum_enabled = false);
ALTER TABLE {schema}.outbox SET (autovacuum_enabled = false);

-- name: wal_lsn
-- Where the WAL is now (for the WAL each drain writes).
SELECT pg_current_wal_lsn()::text AS lsn;

-- name: wal_since
-- WAL bytes written since $1.
SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::bigint AS bytes;

-- name: log_size
-- The log's partitions: table and index sizes in bytes, and dead tuples.
SELECT coalesce(sum(pg_table_size(i.inhrelid)), 0)::bigint AS table_bytes,
       coalesce(sum(pg_indexes_size(i.inhrelid)), 0)::bigint AS index_bytes,
       coalesce(sum(s.n_dead_tup), 0)::bigint AS dead_tuples
FROM pg_inherits i
LEFT JOIN pg_stat_user_tables s ON s.relid = i.inhrelid
WHERE i.inhparent = '{schema}.log'::regclass;

-- name: vacuum_analyze
-- After seeding: the relay starts on a table with fresh statistics.
VACUUM ANALYZE {schema}.outbox;

-- name: ceiling
-- The pure-SQL ceiling on this schema: claim batches of {batch} with a fresh
-- lease token and acknowledge them, as the relay does, with no broker hop.
DO $ceiling$
DECLARE tok uuid; ids bigint[]; n int;
BEGIN
  LOOP
    tok := gen_random_uuid();
    WITH c AS (
      UPDATE {schema}.outbox o
      SET status = 'processing', lease_token = tok,
          lease_expires_at = now() + interval '60 seconds', attempts = o.attempts + 1
      WHERE o.id IN (SELECT id FROM {schema}.outbox
                     WHERE status = 'pending' AND available_at <= now()
                     ORDER BY available_at, id LIMIT {batch} FOR UPDATE SKIP LOCKED)
      RETURNING o.id, o.payload::text)
    SELECT array_agg(id) INTO ids FROM c;
    n := coalesce(array_length(ids, 1), 0);
    EXIT WHEN n = 0;
    COMMIT;
    UPDATE {schema}.outbox
    SET status = 'sent', sent_at = now(), lease_token = NULL, lease_expires_at = NULL, last_error = NULL
    WHERE id = ANY(ids) AND lease_token = tok AND status = 'processing';
    COMMIT;
  END LOOP;
END
$ceiling$;

-- name: log_ceiling_cursor
-- The log ceiling's cursor: one window, from nothing to every event
-- committed now.
CREATE TABLE IF NOT EXISTS {schema}.ceiling_cursor (
    lo pg_snapshot NOT NULL, hi pg_snapshot NOT NULL, after_id bigint NOT NULL);
TRUNCATE {schema}.ceiling_cursor;
INSERT INTO {schema}.ceiling_cursor VALUES ('1:1:', pg_current_snapshot(), 0);

-- name: log_ceiling
-- The pure-SQL ceiling of log mode on this schema: read one window holding
-- every committed log event, page by page of {batch}, with the relay's page
-- query (its text, headers and payload read out), and move a cursor row once
-- per page, each page its own transaction (so this statement runs alone,
-- after log_ceiling_cursor); no broker hop.
DO $ceiling$
DECLARE c record; last bigint; n int; bytes bigint;
BEGIN
  LOOP
    SELECT * INTO c FROM {schema}.ceiling_cursor FOR UPDATE;
    SELECT max(p.id), count(*), sum(length(p.payload) + length(p.headers))
      INTO last, n, bytes
    FROM (SELECT id, payload::text AS payload, headers::text AS headers
          FROM {schema}.log
          WHERE id > c.after_id
            AND pg_visible_in_snapshot(txid, c.hi)
            AND (txid >= pg_snapshot_xmax(c.lo)
                 OR txid = ANY (ARRAY(SELECT pg_snapshot_xip(c.lo))))
          ORDER BY id
          LIMIT {batch}) p;
    EXIT WHEN n = 0;
    UPDATE {schema}.ceiling_cursor SET after_id = last;
    COMMIT;
  END LOOP;
END
$ceiling$;

-- name: log_read_snapshot
-- Every log event committed now, as the upper snapshot of a window from
-- nothing.
SELECT pg_current_snapshot()::text AS hi;

-- name: log_read
-- The wire's bound for a log reader: the relay's page statement, the page
-- of up to $3 events after id $2 of the window ('1:1:', $1), its rows
-- received by the client and not decoded, no cursor moved, nothing sent on.
SELECT * FROM {schema}.log_page('1:1:', $1, $2, $3, 1, 0) ORDER BY id;

-- name: naive_select
-- The naive relay most write-ups start from: 100 unsent rows at a time...
SELECT id, payload::text AS payload FROM {schema}.outbox WHERE status = 'pending' ORDER BY id LIMIT 100;

-- name: naive_mark
-- ...then one UPDATE and one COMMIT per row.
UPDATE {schema}.outbox SET status = 'sent', sent_at = now() WHERE id = $1;

-- name: pending
-- Events not yet delivered: pending (due or not) and in flight.
SELECT count(*) AS pending FROM {schema}.outbox WHERE status IN ('pending', 'processing');

-- name: table_size
-- Outbox table and index sizes in bytes, and dead tuples.
SELECT pg_table_size('{schema}.outbox'::regclass) AS table_bytes,
       pg_indexes_size('{schema}.outbox'::regclass) AS index_bytes,
       coalesce((SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = '{schema}.outbox'::regclass), 0) AS dead_tuples;

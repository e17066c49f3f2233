-- Statements behind `postbox bench --peers pgq`: PgQ (the `pgq` extension,
-- packaged as postgresql-15-pgq3), its queue filled with the bench's events
-- and drained by PgQ's canonical consumer loop. $1 is always the queue name.

-- name: available
-- Whether the server can create the extension.
-- roles: which of the roles the extension makes exist already.
SELECT EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'pgq') AS available,
       EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'pgq') AS installed,
       ARRAY(SELECT rolname::text FROM pg_roles
              WHERE rolname IN ('pgq_reader', 'pgq_writer', 'pgq_admin')) AS roles;

-- name: create_extension
CREATE EXTENSION IF NOT EXISTS pgq;

-- name: drop_extension
-- Only when the bench created it.
DROP EXTENSION IF EXISTS pgq CASCADE;

-- Creating the extension makes these three roles (server-wide) when they do
-- not exist, and dropping it leaves them: after the extension, each role the
-- bench's extension made is dropped too.

-- name: drop_role_pgq_reader
DROP ROLE IF EXISTS pgq_reader;

-- name: drop_role_pgq_writer
DROP ROLE IF EXISTS pgq_writer;

-- name: drop_role_pgq_admin
DROP ROLE IF EXISTS pgq_admin;

-- name: drop_queue
-- An earlier run's queue, if any, with its consumers and events.
SELECT pgq.drop_queue(queue_name, true) FROM pgq.queue WHERE queue_name = $1;

-- name: create_queue
SELECT pgq.create_queue($1);

-- name: tick_every_event
-- The ticker ticks whenever the queue holds a new event (by default it waits
-- for 500 or for 3 seconds).
SELECT pgq.set_queue_config($1, 'ticker_max_count', '1');

-- name: register_consumer
-- The one consumer, $2, reading from the queue's next tick on.
SELECT pgq.register_consumer($1, $2);

-- name: insert_events
-- Events $2 to $3 in the caller's transaction, with the payload every
-- reading mode's seed has (about 200 bytes of JSON); the aggregate in
-- extra1, as a producer would put it.
SELECT count(pgq.insert_event($1, 'order.created',
         jsonb_build_object('order_id', g, 'account_id', g % 97, 'customer', 'customer-' || (g % 1000),
                            'currency', 'EUR', 'total_cents', (g * 7919) % 100000,
                            'items', jsonb_build_array(jsonb_build_object('sku', 'SKU-' || (g % 500), 'qty', 1 + g % 3)),
                            'note', repeat('x', 48))::text,
         'order', g::text, NULL, NULL))
FROM generate_series($2::bigint, $3::bigint) g;

-- name: ticker
-- A tick after each seeding transaction (what pgqd does once a queue holds
-- queue_ticker_max_count new events): each batch is one transaction's events.
SELECT pgq.ticker($1);

-- name: next_batch
-- The consumer's next batch ($2 the consumer), NULL when none is ready.
SELECT pgq.next_batch($1, $2);

-- name: batch_events
SELECT ev_id, ev_time, ev_type, ev_data, ev_extra1, ev_extra2 FROM pgq.get_batch_events($1);

-- name: finish_batch
SELECT pgq.finish_batch($1);

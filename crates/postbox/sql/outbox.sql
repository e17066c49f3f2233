-- The producers' statements: events added in the caller's transaction,
-- through the SECURITY DEFINER functions of migration 8 (the producer role
-- may call them and has no privilege on the tables themselves).

-- name: insert_one
-- One event. The function bumps the aggregate's counter row and inserts the
-- event: concurrent producers on one aggregate wait on its row lock, others
-- never meet. Scheduled: at the time $8, or $9 seconds from now by the
-- database's clock (both NULL: at once).
SELECT {schema}.enqueue_one($1, $2, $3, $4, $5, $6::text::jsonb, $7::text::jsonb,
                            COALESCE($8::timestamptz,
                                     clock_timestamp() + make_interval(secs => $9::float8)));

-- name: insert_many
-- A batch, column-wise. One counter bump per aggregate of the batch, taken in a
-- fixed order so two batches sharing aggregates cannot deadlock; the batch's
-- events of one aggregate are numbered in input order. Scheduled, per event:
-- at the time in $8, or the seconds in $9 from now by the database's clock
-- ($8 and $9 NULL: nothing in the batch is scheduled).
SELECT {schema}.enqueue_many($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int4[],
                             $6::text[]::jsonb[], $7::text[]::jsonb[],
                             (SELECT array_agg(COALESCE(s.at, clock_timestamp()
                                                        + make_interval(secs => s.secs))
                                               ORDER BY s.ord)
                              FROM unnest($8::timestamptz[], $9::float8[])
                                   WITH ORDINALITY AS s(at, secs, ord)));

-- name: emit_one
-- One event written into the WAL only, as a transactional logical message
-- (migrations 11 and 13): decoded by a logical-mode relay if and when the
-- caller's transaction commits. No table row is written. Scheduled: at the
-- time $8, or $9 seconds from now by the database's clock (both NULL: at once).
SELECT {schema}.emit_one($1, $2, $3, $4, $5, $6::text::jsonb, $7::text::jsonb,
                         COALESCE($8::timestamptz,
                                  clock_timestamp() + make_interval(secs => $9::float8)));

-- The producers' statements: events added in the caller's transaction,
-- through the SECURITY DEFINER functions of migration 8 (the producer role
-- may call them and has no privilege on the tables themselves).

-- name: insert_one
-- One event. The function bumps the aggregate's counter row and inserts the
-- event: concurrent producers on one aggregate wait on its row lock, others
-- never meet.
SELECT {schema}.enqueue_one($1, $2, $3, $4, $5, $6::text::jsonb, $7::text::jsonb);

-- name: insert_many
-- A batch, column-wise. One counter bump per aggregate of the batch, taken in a
-- fixed order so two batches sharing aggregates cannot deadlock; the batch's
-- events of one aggregate are numbered in input order.
SELECT {schema}.enqueue_many($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int4[],
                             $6::text[]::jsonb[], $7::text[]::jsonb[]);

-- name: emit_one
-- One event written into the WAL only, as a transactional logical message
-- (migration 11): decoded by a logical-mode relay if and when the caller's
-- transaction commits. No table row is written.
SELECT {schema}.emit_one($1, $2, $3, $4, $5, $6::text::jsonb, $7::text::jsonb);

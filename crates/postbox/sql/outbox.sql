-- The producers' statements: events inserted in the caller's transaction.

-- name: insert_one
-- One event. The aggregate's counter row is bumped in the same statement:
-- concurrent producers on one aggregate wait on its row lock, others never meet.
WITH seq AS (
  INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence)
  VALUES ($3, $4, 1)
  ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_sequence = s.last_sequence + 1
  RETURNING s.last_sequence)
INSERT INTO {schema}.outbox
  (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers, sequence)
SELECT $1, $2, $3, $4, $5, $6::text::jsonb, $7::text::jsonb, seq.last_sequence FROM seq;

-- name: insert_many
-- A batch, column-wise. One counter bump per aggregate of the batch, taken in a
-- fixed order so two batches sharing aggregates cannot deadlock; the batch's
-- events of one aggregate are numbered in input order.
WITH e AS (
  SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int4[], $6::text[], $7::text[])
    WITH ORDINALITY
    AS e(event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers, ord)),
counts AS (
  SELECT aggregate_type, aggregate_id, count(*) AS n FROM e GROUP BY 1, 2),
seq AS (
  INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence)
  SELECT aggregate_type, aggregate_id, n FROM counts ORDER BY aggregate_type, aggregate_id
  ON CONFLICT (aggregate_type, aggregate_id)
  DO UPDATE SET last_sequence = s.last_sequence + EXCLUDED.last_sequence
  RETURNING s.aggregate_type, s.aggregate_id, s.last_sequence)
INSERT INTO {schema}.outbox
  (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers, sequence)
SELECT e.event_id, e.event_type, e.aggregate_type, e.aggregate_id, e.schema_version,
       e.payload::jsonb, e.headers::jsonb,
       seq.last_sequence - c.n
         + row_number() OVER (PARTITION BY e.aggregate_type, e.aggregate_id ORDER BY e.ord)
FROM e
JOIN counts c ON c.aggregate_type = e.aggregate_type AND c.aggregate_id = e.aggregate_id
JOIN seq ON seq.aggregate_type = e.aggregate_type AND seq.aggregate_id = e.aggregate_id
ORDER BY e.ord;

-- Readiness: the database answers and postbox's table is readable.
SELECT 1 FROM {schema}.outbox LIMIT 0

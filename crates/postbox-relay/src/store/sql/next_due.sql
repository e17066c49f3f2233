-- How long until the next pending event is due (NULL: none pending), and
-- whether anything is in flight. Both read partial indexes only.
SELECT extract(epoch FROM (SELECT min(available_at) FROM {schema}.outbox WHERE status = 'pending') - now())::float8,
       EXISTS (SELECT 1 FROM {schema}.outbox WHERE status = 'processing')

-- Outbox table and index sizes in bytes, and dead tuples.
SELECT pg_table_size('{schema}.outbox'::regclass), pg_indexes_size('{schema}.outbox'::regclass),
       coalesce((SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = '{schema}.outbox'::regclass), 0)

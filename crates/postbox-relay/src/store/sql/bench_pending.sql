-- Events not yet delivered: pending (due or not) and in flight.
SELECT count(*) FROM {schema}.outbox WHERE status IN ('pending', 'processing')

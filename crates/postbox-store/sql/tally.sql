-- Deliveries counted by minute, destination and reading mode (migration 20).

-- name: add
-- Add the relay's counts since its last flush to this minute's rows: $1
-- destinations, $2 deliveries and $4 events their filters kept from them
-- (parallel), $3 the reading mode.
INSERT INTO {schema}.deliveries_by_minute AS t (minute, destination, mode, delivered, filtered)
SELECT date_trunc('minute', now()), d.destination, $3, d.delivered, d.filtered
FROM unnest($1::text[], $2::bigint[], $4::bigint[]) AS d(destination, delivered, filtered)
WHERE d.delivered > 0 OR d.filtered > 0
ON CONFLICT (minute, destination, mode)
DO UPDATE SET delivered = t.delivered + EXCLUDED.delivered,
              filtered = t.filtered + EXCLUDED.filtered;

-- name: forget
-- Rows older than two days.
DELETE FROM {schema}.deliveries_by_minute WHERE minute < now() - interval '2 days';

-- name: recent
-- Per destination and mode: deliveries, and events the destination's
-- filters kept from it, over the last $1 minutes.
SELECT destination, mode, sum(delivered)::bigint AS delivered,
       sum(filtered)::bigint AS filtered
FROM {schema}.deliveries_by_minute
WHERE minute >= date_trunc('minute', now()) - make_interval(mins => $1)
GROUP BY destination, mode
ORDER BY destination, mode;

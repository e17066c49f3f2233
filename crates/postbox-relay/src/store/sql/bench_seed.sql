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
FROM generate_series(1, $1) g

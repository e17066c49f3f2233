-- Benchmark seed: $1 committed events with a payload of about 200 bytes.
INSERT INTO {schema}.outbox (event_id, event_type, aggregate_type, aggregate_id, payload)
SELECT {schema}.uuid_v7(), 'order.created', 'order', g::text,
       jsonb_build_object('order_id', g, 'account_id', g % 97, 'customer', 'customer-' || (g % 1000),
                          'currency', 'EUR', 'total_cents', (g * 7919) % 100000,
                          'items', jsonb_build_array(jsonb_build_object('sku', 'SKU-' || (g % 500), 'qty', 1 + g % 3)),
                          'note', repeat('x', 48))
FROM generate_series(1, $1) g

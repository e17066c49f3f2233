-- Statements of `postbox demo`'s shop: its orders and invoices live in the
-- schema {shop}, next to postbox's own schema {schema}.

-- name: reset
-- Only the demo's own schemas are dropped.
DROP SCHEMA IF EXISTS {shop} CASCADE;
DROP SCHEMA IF EXISTS {schema} CASCADE;

-- name: create_shop
CREATE SCHEMA {shop};
CREATE TABLE {shop}.orders (id bigint PRIMARY KEY, customer text NOT NULL,
    total_cents bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE {shop}.invoices (order_id bigint PRIMARY KEY REFERENCES {shop}.orders,
    event_id uuid NOT NULL, created_at timestamptz NOT NULL DEFAULT now());

-- name: place_order
-- The business row, in the same transaction as its order.placed event.
INSERT INTO {shop}.orders (id, customer, total_cents) VALUES ($1, $2, $3);

-- name: invoice_order
-- The billing consumer's effect, in the same transaction as its inbox row.
INSERT INTO {shop}.invoices (order_id, event_id) VALUES ($1, $2);

-- name: totals
-- What the report compares: orders, invoices, and orders without an invoice.
SELECT (SELECT count(*) FROM {shop}.orders) AS orders,
       (SELECT count(*) FROM {shop}.invoices) AS invoices,
       (SELECT count(*) FROM {shop}.orders o WHERE NOT EXISTS
          (SELECT 1 FROM {shop}.invoices i WHERE i.order_id = o.id)) AS missing;

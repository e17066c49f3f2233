-- The shop's own tables, next to postbox's in the same schema (the pool's
-- search_path). Idempotent; the advisory lock serializes shops starting together.
SELECT pg_advisory_xact_lock(hashtext('shop: create tables'));

CREATE TABLE IF NOT EXISTS orders (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer    text NOT NULL,
    items       text[] NOT NULL,
    total_cents bigint NOT NULL CHECK (total_cents >= 0),
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- The consumer's effect: one row per customer, bumped once per order.placed.
CREATE TABLE IF NOT EXISTS customer_stats (
    customer    text PRIMARY KEY,
    orders      bigint NOT NULL,
    spent_cents bigint NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

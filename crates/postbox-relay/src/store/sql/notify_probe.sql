-- A probe on the relays' own channel: LISTEN works when it comes back.
SELECT pg_notify($1, $2)

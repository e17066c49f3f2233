-- Wake the relays after a replay committed (polling would find the rows anyway).
SELECT pg_notify({channel}, '')

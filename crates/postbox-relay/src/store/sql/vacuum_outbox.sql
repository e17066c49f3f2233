-- Make the space of removed and updated outbox rows reusable, and refresh the
-- planner's statistics. Cannot run inside a transaction block.
VACUUM (ANALYZE) {schema}.outbox

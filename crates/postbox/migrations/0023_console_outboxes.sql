-- postbox schema, version 23: a console user's role can be limited to some
-- outboxes. A console serving many outboxes keeps its users in its home
-- schema; `outboxes` names the outboxes a user may see and act in, as
-- patterns `SCHEMA_GLOB` (that schema in any database) or
-- `DATABASE_GLOB/SCHEMA_GLOB`, where `*` matches any run of characters and
-- `?` one. An empty list (the default, and every existing user's) is every
-- outbox. The console checks the patterns on every request about an outbox;
-- this constraint keeps what is stored in their syntax.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

-- The patterns are joined with ',' and matched as exactly as many patterns
-- as the array has elements, so no element can hide a ',' (a CHECK cannot
-- read the elements one by one, and a function would need its own grants).
ALTER TABLE {schema}.console_users
  ADD COLUMN outboxes text[] NOT NULL DEFAULT '{}',
  ADD CONSTRAINT console_users_outboxes_syntax CHECK (
    coalesce(array_ndims(outboxes), 1) = 1
    AND cardinality(outboxes) <= 64
    AND array_position(outboxes, NULL) IS NULL
    AND (cardinality(outboxes) = 0
         OR array_to_string(outboxes, ',') ~ (
              '^([A-Za-z0-9_.$*?-]{1,63}/)?[a-z0-9_*?]{1,63}'
              || '(,([A-Za-z0-9_.$*?-]{1,63}/)?[a-z0-9_*?]{1,63}){'
              || cardinality(outboxes) - 1 || '}$'))
  );

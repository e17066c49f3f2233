-- Remove console user $1 (their sessions go with them). Returns the name when it existed.
DELETE FROM {schema}.console_users WHERE name = $1 RETURNING name

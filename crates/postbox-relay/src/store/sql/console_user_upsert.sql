-- Create console user $1 with role $2 and password hash $3, or replace the
-- role and hash of an existing one. Returns true when the user is new.
INSERT INTO {schema}.console_users AS u (name, role, password_hash)
VALUES ($1, $2, $3)
ON CONFLICT (name) DO UPDATE
SET role = excluded.role, password_hash = excluded.password_hash, updated_at = now()
RETURNING (xmax = 0)

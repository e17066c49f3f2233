-- A new session: token hash $1, user $2, CSRF token $3, lasting $4 seconds.
-- Expired sessions are swept in the same statement.
WITH swept AS (
    DELETE FROM {schema}.console_sessions WHERE expires_at < now())
INSERT INTO {schema}.console_sessions (token_hash, user_name, csrf_token, expires_at)
VALUES ($1, $2, $3, now() + make_interval(secs => $4))

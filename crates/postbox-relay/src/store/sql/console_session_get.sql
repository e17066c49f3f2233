-- The live session whose token hashes to $1: its user, the user's current
-- role, and the session's CSRF token.
SELECT s.user_name, u.role, s.csrf_token
FROM {schema}.console_sessions s
JOIN {schema}.console_users u ON u.name = s.user_name
WHERE s.token_hash = $1 AND s.expires_at > now()

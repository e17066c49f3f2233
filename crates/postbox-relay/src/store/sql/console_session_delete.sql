-- Sign out: end the session whose token hashes to $1.
DELETE FROM {schema}.console_sessions WHERE token_hash = $1

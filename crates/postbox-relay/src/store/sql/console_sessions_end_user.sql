-- End every session of console user $1 (after a password or role change).
DELETE FROM {schema}.console_sessions WHERE user_name = $1

-- One console user by name: role and password hash.
SELECT role, password_hash FROM {schema}.console_users WHERE name = $1

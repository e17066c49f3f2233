-- postbox schema, version 6: the operator console's users and sessions.
-- `{schema}` is replaced by the quoted schema name when the migration runs.
-- The console's actions and sign-in attempts go to the existing audit_log.

-- Console users: a name, a role and an argon2 password hash (PHC string).
-- 'viewer' can look; 'operator' can also replay and discard dead letters.
CREATE TABLE {schema}.console_users (
    name          text PRIMARY KEY,
    role          text NOT NULL,
    password_hash text NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT console_users_name_length CHECK (octet_length(name) BETWEEN 1 AND 64),
    CONSTRAINT console_users_role_known CHECK (role IN ('viewer', 'operator'))
);

-- Signed-in sessions. The cookie carries a random token; only its SHA-256 is
-- stored, so a read of this table cannot be replayed as a cookie. Each
-- session has its own CSRF token, checked on every state-changing request.
CREATE TABLE {schema}.console_sessions (
    token_hash   bytea PRIMARY KEY,
    user_name    text NOT NULL REFERENCES {schema}.console_users (name)
                     ON DELETE CASCADE ON UPDATE CASCADE,
    csrf_token   text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL
);
CREATE INDEX console_sessions_expires_at_idx ON {schema}.console_sessions (expires_at);
CREATE INDEX console_sessions_user_name_idx ON {schema}.console_sessions (user_name);

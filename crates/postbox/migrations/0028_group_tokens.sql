-- postbox schema, version 28: bearer tokens for consumer groups' HTTP API
-- (`postbox group serve`).
--
-- A token is 32 random bytes the CLI makes and prints once
-- (`postbox group token create GROUP`); only its SHA-256 is stored. A
-- token opens one group: `group_token_group` answers which, and nothing
-- else reads this table but the schema's owner (the monitor role's SELECT
-- on every table is revoked from it by `postbox migrate --create-roles`).
-- The tokens are random, not chosen by people, so an unsalted fast hash is
-- the right one: there is no dictionary to try, and a look-up by hash
-- leaks nothing a guess could use. Dropping a group drops its tokens.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

CREATE TABLE {schema}.group_tokens (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    group_name   text NOT NULL REFERENCES {schema}.consumer_groups (name) ON DELETE CASCADE,
    token_hash   bytea NOT NULL UNIQUE CHECK (octet_length(token_hash) = 32),
    label        text CHECK (octet_length(label) <= 200),
    created_by   text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    -- Renewed at most once a minute per token, by the look-up.
    last_used_at timestamptz
);
CREATE INDEX group_tokens_group_idx ON {schema}.group_tokens (group_name);

-- The group the token whose SHA-256 is `token_hash` opens, or NULL. Runs
-- with its owner's rights for the consumer role, which has no table of
-- the schema.
CREATE FUNCTION {schema}.group_token_group(token_hash bytea) RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  found_group text;
  used        timestamptz;
BEGIN
  SELECT t.group_name, t.last_used_at INTO found_group, used
  FROM {schema}.group_tokens t WHERE t.token_hash = group_token_group.token_hash;
  IF found_group IS NOT NULL AND (used IS NULL OR used < now() - interval '1 minute') THEN
    UPDATE {schema}.group_tokens t SET last_used_at = now()
    WHERE t.token_hash = group_token_group.token_hash;
  END IF;
  RETURN found_group;
END
$fn$;

REVOKE EXECUTE ON FUNCTION {schema}.group_token_group(bytea) FROM PUBLIC;

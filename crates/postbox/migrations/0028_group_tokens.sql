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

-- The group the token whose SHA-256 is `token_hash` opens, and the token's
-- id (no row: none). Runs with its owner's rights for the consumer role,
-- which has no table of the schema.
CREATE FUNCTION {schema}.group_token_group(token_hash bytea)
RETURNS TABLE (group_name text, token_id bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  t record;
BEGIN
  SELECT k.id, k.group_name, k.last_used_at INTO t
  FROM {schema}.group_tokens k WHERE k.token_hash = group_token_group.token_hash;
  IF NOT FOUND THEN
    RETURN;
  END IF;
  IF t.last_used_at IS NULL OR t.last_used_at < now() - interval '1 minute' THEN
    UPDATE {schema}.group_tokens k SET last_used_at = now() WHERE k.id = t.id;
  END IF;
  group_name := t.group_name;
  token_id := t.id;
  RETURN NEXT;
END
$fn$;

REVOKE EXECUTE ON FUNCTION {schema}.group_token_group(bytea) FROM PUBLIC;

-- Whether `consumer_group` has anything to hand out now — what `receive`'s
-- long poll looks for, read only: a window open, events that came back or
-- whose visibility ended, or new events of its types in the log. The HTTP
-- API's long polls ask this (it locks and writes nothing) before they call
-- `receive`, which takes the group's row. False for an unknown group.
CREATE FUNCTION {schema}.group_pending(consumer_group text) RETURNS boolean
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  g record;
BEGIN
  SELECT k.name, k.lo, k.hi, k.type_likes INTO g
  FROM {schema}.consumer_groups k WHERE k.name = group_pending.consumer_group;
  IF NOT FOUND THEN
    RETURN false;
  END IF;
  RETURN g.hi IS NOT NULL
    OR EXISTS (SELECT 1 FROM {schema}.group_waiting w
               WHERE w.group_name = g.name AND w.visible_at <= clock_timestamp())
    OR EXISTS (SELECT 1 FROM {schema}.group_batches b
               WHERE b.group_name = g.name AND b.visible_at <= clock_timestamp())
    OR EXISTS (SELECT 1 FROM {schema}.log l
               WHERE l.txid >= pg_snapshot_xmax(g.lo)
                 AND (g.type_likes IS NULL OR l.event_type LIKE ANY (g.type_likes)))
    OR EXISTS (SELECT 1 FROM {schema}.log l
               WHERE l.txid = ANY (ARRAY(SELECT pg_snapshot_xip(g.lo)))
                 AND (g.type_likes IS NULL OR l.event_type LIKE ANY (g.type_likes)));
END
$fn$;

REVOKE EXECUTE ON FUNCTION {schema}.group_pending(text) FROM PUBLIC;

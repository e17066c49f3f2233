-- postbox schema, version 21: the payload limit the libraries enforce
-- (`limits.max_payload_bytes`, migration 19: 1 MiB by default) holds for
-- every way into the schema — the SQL functions, any language, a direct
-- INSERT by the owner: a row trigger on the outbox and the log refuses a
-- larger payload (its size as stored, `pg_column_size`) with SQLSTATE
-- 54000, as `emit_one` does.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

CREATE FUNCTION {schema}.check_payload() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
  max integer := (SELECT l.max_payload_bytes FROM {schema}.limits l);
BEGIN
  IF pg_column_size(NEW.payload) > max THEN
    RAISE EXCEPTION 'postbox: the payload is % bytes, more than the schema''s limit of % bytes (%.limits.max_payload_bytes)',
      pg_column_size(NEW.payload), max, '{schema}'
      USING ERRCODE = '54000';
  END IF;
  RETURN NEW;
END
$fn$;
REVOKE EXECUTE ON FUNCTION {schema}.check_payload() FROM PUBLIC;

CREATE TRIGGER outbox_payload_limit BEFORE INSERT ON {schema}.outbox
FOR EACH ROW EXECUTE FUNCTION {schema}.check_payload();
CREATE TRIGGER log_payload_limit BEFORE INSERT ON {schema}.log
FOR EACH ROW EXECUTE FUNCTION {schema}.check_payload();

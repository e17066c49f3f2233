-- postbox schema, version 21: the payload bound (`limits.max_payload_bytes`,
-- migration 19: 1.5 MiB of JSON text by default, above the libraries'
-- 1 MiB) holds for every way into the schema — the SQL functions, any
-- language, a direct INSERT by the owner: a row trigger on the outbox and
-- the log refuses a larger payload with SQLSTATE 54000, as `emit_one` does.
-- `{schema}` is replaced by the quoted schema name when the migration runs.

CREATE FUNCTION {schema}.check_payload() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
  IF {schema}.limits_payload_too_big(NEW.payload) THEN
    RAISE EXCEPTION 'postbox: the payload is % bytes of JSON, more than the schema''s limit of % bytes (%.limits.max_payload_bytes)',
      octet_length(NEW.payload::text), (SELECT l.max_payload_bytes FROM {schema}.limits l), '{schema}'
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

-- The pure-SQL ceiling on this schema: claim batches of {batch} with a fresh
-- lease token and acknowledge them, as the relay does, with no broker hop.
DO $ceiling$
DECLARE tok uuid; ids bigint[]; n int;
BEGIN
  LOOP
    tok := gen_random_uuid();
    WITH c AS (
      UPDATE {schema}.outbox o
      SET status = 'processing', lease_token = tok,
          lease_expires_at = now() + interval '60 seconds', attempts = o.attempts + 1
      WHERE o.id IN (SELECT id FROM {schema}.outbox
                     WHERE status = 'pending' AND available_at <= now()
                     ORDER BY available_at, id LIMIT {batch} FOR UPDATE SKIP LOCKED)
      RETURNING o.id, o.payload::text)
    SELECT array_agg(id) INTO ids FROM c;
    n := coalesce(array_length(ids, 1), 0);
    EXIT WHEN n = 0;
    COMMIT;
    UPDATE {schema}.outbox
    SET status = 'sent', sent_at = now(), lease_token = NULL, lease_expires_at = NULL, last_error = NULL
    WHERE id = ANY(ids) AND lease_token = tok AND status = 'processing';
    COMMIT;
  END LOOP;
END
$ceiling$

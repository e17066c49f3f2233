-- Events acknowledged per minute over the last $1 minutes (minutes with none
-- are left out), counted among the newest $2 outbox rows (a bounded scan of
-- the primary key: the outbox has no index on sent_at, and adding one would
-- cost every acknowledgement its HOT update) and in the archive (indexed).
WITH recent AS (
    SELECT sent_at FROM {schema}.outbox
    WHERE id > (SELECT COALESCE(max(id), 0) FROM {schema}.outbox) - $2
      AND status = 'sent' AND sent_at >= date_trunc('minute', now()) - make_interval(mins => $1)
    UNION ALL
    SELECT sent_at FROM {schema}.outbox_archive
    WHERE sent_at >= date_trunc('minute', now()) - make_interval(mins => $1))
SELECT date_trunc('minute', sent_at) AS minute, count(*)
FROM recent
GROUP BY 1
ORDER BY 1

-- How many pending events have been attempted how often (0 = never claimed).
SELECT attempts, count(*)
FROM {schema}.outbox
WHERE status = 'pending'
GROUP BY attempts
ORDER BY attempts

-- The relay's hot path: claim under a lease, settle, release, rescue expired
-- leases, per-destination state of fan-out events, and what wakes the relay.
-- {relay_commit} is the relay's commit condition (see RelayCommit).

-- name: claim
-- Claim up to $3 due events for one lease: token $1, lease length $2 seconds.
-- One statement; SKIP LOCKED lets any number of relays claim side by side.
UPDATE {schema}.outbox o
SET status = 'processing',
    lease_token = $1,
    lease_expires_at = now() + make_interval(secs => $2),
    attempts = o.attempts + 1
WHERE o.id IN (
    SELECT id FROM {schema}.outbox
    WHERE status = 'pending' AND available_at <= now()
    ORDER BY available_at, id
    LIMIT $3
    FOR UPDATE SKIP LOCKED)
  AND {relay_commit}
RETURNING o.id, o.event_id, o.event_type, o.aggregate_type, o.aggregate_id, o.schema_version,
          o.payload::text AS payload, o.headers::text AS headers, o.created_at, o.attempts,
          o.sequence;

-- name: claim_ordered
-- Claim up to $3 due events for one lease (token $1, lease length $2 seconds),
-- keeping per-aggregate order for the event types matching the LIKE patterns
-- in $4: such an event is claimed only when no earlier event of its aggregate
-- (among those types) is still undelivered — pending (due or waiting for a
-- retry), in flight, or a dead letter whose type matches a blocking pattern in
-- $5 and that no operator has resolved. So one aggregate never has two events
-- in flight, N+1 never overtakes N, and a retry holds back only its own
-- aggregate. Other events are claimed as by claim.sql.
UPDATE {schema}.outbox o
SET status = 'processing',
    lease_token = $1,
    lease_expires_at = now() + make_interval(secs => $2),
    attempts = o.attempts + 1
WHERE o.id IN (
    SELECT c.id FROM {schema}.outbox c
    WHERE c.status = 'pending' AND c.available_at <= now()
      AND (c.sequence IS NULL
           OR NOT (c.event_type LIKE ANY ($4::text[]))
           OR NOT EXISTS (
               SELECT 1 FROM {schema}.outbox p
               WHERE p.aggregate_type = c.aggregate_type
                 AND p.aggregate_id = c.aggregate_id
                 AND p.sequence < c.sequence
                 AND p.status <> 'sent'
                 AND p.event_type LIKE ANY ($4::text[])
                 AND (p.status <> 'failed'
                      OR (p.resolved_at IS NULL AND p.event_type LIKE ANY ($5::text[])))))
    ORDER BY c.available_at, c.id
    LIMIT $3
    FOR UPDATE SKIP LOCKED)
  AND {relay_commit}
RETURNING o.id, o.event_id, o.event_type, o.aggregate_type, o.aggregate_id, o.schema_version,
          o.payload::text AS payload, o.headers::text AS headers, o.created_at, o.attempts,
          o.sequence;

-- name: ack_delivered
-- Mark delivered events sent, only where lease $2 still holds them.
UPDATE {schema}.outbox
SET status = 'sent', sent_at = now(), lease_token = NULL, lease_expires_at = NULL, last_error = NULL
WHERE id = ANY($1) AND lease_token = $2 AND status = 'processing' AND {relay_commit}
RETURNING id;

-- name: settle_failed
-- Settle events that were not delivered, only where lease $2 still holds them:
-- a rejection, or a retry past its budget of attempts ($3), becomes a dead
-- letter ('failed'); any other retry waits until now() + its delay. An event
-- the sink deferred without trying ($7 false) gets its attempt back.
UPDATE {schema}.outbox o
SET status = CASE WHEN f.reject OR (f.counted AND o.attempts >= f.budget)
                  THEN 'failed'::{schema}.event_status ELSE 'pending'::{schema}.event_status END,
    available_at = CASE WHEN f.reject OR (f.counted AND o.attempts >= f.budget)
                        THEN o.available_at ELSE now() + make_interval(secs => f.delay_secs) END,
    attempts = CASE WHEN f.counted THEN o.attempts ELSE GREATEST(o.attempts - 1, 0) END,
    last_error = f.error,
    lease_token = NULL,
    lease_expires_at = NULL
FROM unnest($1::bigint[], $4::bool[], $5::float8[], $6::text[], $3::int4[], $7::bool[])
     AS f(id, reject, delay_secs, error, budget, counted)
WHERE o.id = f.id AND o.lease_token = $2 AND o.status = 'processing' AND {relay_commit}
RETURNING o.id, o.status = 'failed' AS dead_lettered;

-- name: release
-- Give back claimed events that were never published (graceful shutdown):
-- they are due again at once and the attempt does not count.
UPDATE {schema}.outbox
SET status = 'pending', lease_token = NULL, lease_expires_at = NULL,
    attempts = greatest(attempts - 1, 0)
WHERE id = ANY($1) AND lease_token = $2 AND status = 'processing' AND {relay_commit};

-- name: rescue_expired
-- Reclaim up to $2 events whose lease expired (their relay died or stalled).
-- Cheap: reads only the small set of in-flight rows. An event whose lease
-- expired on its last allowed attempt ($1) becomes a dead letter.
UPDATE {schema}.outbox o
SET status = CASE WHEN o.attempts >= $1
                  THEN 'failed'::{schema}.event_status ELSE 'pending'::{schema}.event_status END,
    last_error = CASE WHEN o.attempts >= $1
                      THEN 'lease expired on attempt ' || o.attempts || ' (relay stopped, or publishing outlived the lease)'
                      ELSE o.last_error END,
    available_at = now(),
    lease_token = NULL,
    lease_expires_at = NULL
WHERE o.id IN (
    SELECT id FROM {schema}.outbox
    WHERE status = 'processing' AND lease_expires_at < now()
    ORDER BY id
    LIMIT $2
    FOR UPDATE SKIP LOCKED)
  AND {relay_commit}
RETURNING o.event_id, o.status = 'failed' AS dead_lettered;

-- name: next_due
-- How long until the next pending event is due (NULL: none pending), and
-- whether anything is in flight. Both read partial indexes only.
SELECT extract(epoch FROM (SELECT min(available_at) FROM {schema}.outbox WHERE status = 'pending') - now())::float8
         AS pending_in_secs,
       EXISTS (SELECT 1 FROM {schema}.outbox WHERE status = 'processing') AS in_flight;

-- name: scheduled_later
-- Pending events due more than $1 seconds from now (a drain does not wait
-- for them): how many, and when the first is due.
SELECT count(*) AS events, min(available_at) AS first_due
FROM {schema}.outbox
WHERE status = 'pending' AND available_at > now() + make_interval(secs => $1);

-- name: delivery_states
-- Per-destination state of the events $1 (fan-out events only have rows):
-- status, attempts so far, and seconds until the destination is due again.
SELECT outbox_id, destination, status::text AS status, attempts,
       GREATEST(extract(epoch FROM available_at - now()), 0)::float8 AS due_in_secs
FROM {schema}.deliveries
WHERE outbox_id = ANY($1);

-- name: record_deliveries
-- Record what one round of publishing did at each destination of fan-out
-- events: delivered ('sent', never published to again), dead ('failed'), or
-- waiting for a retry ('pending', due after the delay). A 'sent' row is never
-- overwritten: a stale relay cannot undo another's delivery.
INSERT INTO {schema}.deliveries AS d
    (outbox_id, destination, status, attempts, available_at, last_error, sent_at, updated_at)
SELECT u.id, u.destination,
       CASE WHEN u.delivered THEN 'sent'::{schema}.event_status
            WHEN u.dead THEN 'failed'::{schema}.event_status
            ELSE 'pending'::{schema}.event_status END,
       u.attempts,
       now() + make_interval(secs => u.delay_secs),
       u.error,
       CASE WHEN u.delivered THEN now() END,
       now()
FROM unnest($1::bigint[], $2::text[], $3::bool[], $4::bool[], $5::int4[], $6::float8[], $7::text[])
     AS u(id, destination, delivered, dead, attempts, delay_secs, error)
WHERE {relay_commit}
ON CONFLICT (outbox_id, destination) DO UPDATE
SET status = EXCLUDED.status,
    attempts = EXCLUDED.attempts,
    available_at = EXCLUDED.available_at,
    last_error = EXCLUDED.last_error,
    sent_at = EXCLUDED.sent_at,
    updated_at = now()
WHERE d.status <> 'sent';

-- name: notify_probe
-- A probe on the relays' own channel: LISTEN works when it comes back.
SELECT pg_notify($1, $2);

-- name: commit_without_flush
-- The {relay_commit} condition under relay.synchronous_commit = false: an
-- uncorrelated subquery, evaluated once per statement before its implicit
-- transaction commits, that turns synchronous_commit off for that
-- transaction only (`true`: local to it).
(SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL;

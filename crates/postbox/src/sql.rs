//! Every statement the library runs, rendered once per schema.
//! (The relay's statements live in `postbox-relay`'s store.)

use crate::Schema;

#[derive(Debug)]
pub(crate) struct Queries {
    pub insert_one: String,
    pub insert_many: String,
    pub inbox_record: String,
    pub inbox_purge: String,
    pub inbox_sequence: String,
    #[cfg_attr(not(feature = "sqlx"), allow(dead_code))]
    pub received: ReceivedQueries,
    #[cfg_attr(not(feature = "sqlx"), allow(dead_code))]
    pub idempotency: IdempotencyQueries,
}

/// The statements behind [`crate::idempotency`] (request idempotency keys).
#[derive(Debug)]
#[cfg_attr(not(feature = "sqlx"), allow(dead_code))]
pub(crate) struct IdempotencyQueries {
    pub lock: String,
    pub insert: String,
    pub select: String,
    pub restart: String,
    pub complete: String,
    pub purge: String,
}

impl IdempotencyQueries {
    fn new(schema: &Schema) -> Self {
        Self {
            // Transaction-level: held until the caller's transaction ends.
            lock: "SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))".to_owned(),
            insert: schema.render(
                "INSERT INTO {schema}.idempotency_keys (scope, key, fingerprint, expires_at) \
                 VALUES ($1, $2, $3, now() + make_interval(secs => $4)) \
                 ON CONFLICT (scope, key) DO NOTHING \
                 RETURNING true",
            ),
            select: schema.render(
                "SELECT fingerprint, status, response_status, response_type, response_body, \
                        expires_at <= now() \
                 FROM {schema}.idempotency_keys WHERE scope = $1 AND key = $2 \
                 FOR UPDATE",
            ),
            restart: schema.render(
                "UPDATE {schema}.idempotency_keys \
                 SET fingerprint = $3, status = 'in_flight', response_status = NULL, \
                     response_type = NULL, response_body = NULL, created_at = now(), \
                     completed_at = NULL, expires_at = now() + make_interval(secs => $4) \
                 WHERE scope = $1 AND key = $2",
            ),
            complete: schema.render(
                "UPDATE {schema}.idempotency_keys \
                 SET status = 'completed', response_status = $3, response_type = $4, \
                     response_body = $5, completed_at = now() \
                 WHERE scope = $1 AND key = $2 AND status = 'in_flight'",
            ),
            purge: schema.render(
                "DELETE FROM {schema}.idempotency_keys WHERE ctid = ANY(ARRAY( \
                   SELECT ctid FROM {schema}.idempotency_keys \
                   WHERE expires_at < now() LIMIT $1 FOR UPDATE SKIP LOCKED))",
            ),
        }
    }
}

/// The statements behind [`crate::received`] (the store of `postbox receive`).
#[derive(Debug)]
#[cfg_attr(not(feature = "sqlx"), allow(dead_code))]
pub(crate) struct ReceivedQueries {
    pub store: String,
    pub take: String,
    pub mark_processed: String,
    pub purge: String,
}

impl Queries {
    pub fn new(schema: &Schema) -> Self {
        Self {
            // The aggregate's counter row is bumped in the same statement: concurrent
            // producers on one aggregate wait on its row lock, others never meet.
            insert_one: schema.render(
                "WITH seq AS ( \
                   INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence) \
                   VALUES ($3, $4, 1) \
                   ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_sequence = s.last_sequence + 1 \
                   RETURNING s.last_sequence) \
                 INSERT INTO {schema}.outbox \
                 (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers, sequence) \
                 SELECT $1, $2, $3, $4, $5, $6::text::jsonb, $7::text::jsonb, seq.last_sequence FROM seq",
            ),
            // One counter bump per aggregate of the batch, taken in a fixed order so
            // two batches sharing aggregates cannot deadlock; the batch's events of
            // one aggregate are numbered in input order.
            insert_many: schema.render(
                "WITH e AS ( \
                   SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int4[], $6::text[], $7::text[]) \
                     WITH ORDINALITY \
                     AS e(event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers, ord)), \
                 counts AS ( \
                   SELECT aggregate_type, aggregate_id, count(*) AS n FROM e GROUP BY 1, 2), \
                 seq AS ( \
                   INSERT INTO {schema}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_sequence) \
                   SELECT aggregate_type, aggregate_id, n FROM counts ORDER BY aggregate_type, aggregate_id \
                   ON CONFLICT (aggregate_type, aggregate_id) \
                   DO UPDATE SET last_sequence = s.last_sequence + EXCLUDED.last_sequence \
                   RETURNING s.aggregate_type, s.aggregate_id, s.last_sequence) \
                 INSERT INTO {schema}.outbox \
                 (event_id, event_type, aggregate_type, aggregate_id, schema_version, payload, headers, sequence) \
                 SELECT e.event_id, e.event_type, e.aggregate_type, e.aggregate_id, e.schema_version, \
                        e.payload::jsonb, e.headers::jsonb, \
                        seq.last_sequence - c.n \
                          + row_number() OVER (PARTITION BY e.aggregate_type, e.aggregate_id ORDER BY e.ord) \
                 FROM e \
                 JOIN counts c ON c.aggregate_type = e.aggregate_type AND c.aggregate_id = e.aggregate_id \
                 JOIN seq ON seq.aggregate_type = e.aggregate_type AND seq.aggregate_id = e.aggregate_id \
                 ORDER BY e.ord",
            ),
            inbox_record: schema.render(
                "INSERT INTO {schema}.inbox (consumer, event_id) VALUES ($1, $2) \
                 ON CONFLICT DO NOTHING",
            ),
            inbox_purge: schema.render(
                "DELETE FROM {schema}.inbox WHERE ctid = ANY(ARRAY( \
                   SELECT ctid FROM {schema}.inbox \
                   WHERE processed_at < now() - make_interval(secs => $1) LIMIT $2))",
            ),
            inbox_sequence: schema.render("SELECT {schema}.inbox_sequence($1, $2, $3, $4, $5)"),
            received: ReceivedQueries::new(schema),
            idempotency: IdempotencyQueries::new(schema),
        }
    }
}

impl ReceivedQueries {
    fn new(schema: &Schema) -> Self {
        Self {
            store: schema.render(
                "INSERT INTO {schema}.received (consumer, event_id, headers, body) \
                 VALUES ($1, $2, $3::text::jsonb, $4) \
                 ON CONFLICT (consumer, event_id) DO NOTHING",
            ),
            take: schema.render(
                "SELECT id, consumer, event_id, headers, body, received_at \
                 FROM {schema}.received \
                 WHERE consumer = $1 AND processed_at IS NULL \
                 ORDER BY id LIMIT $2 \
                 FOR UPDATE SKIP LOCKED",
            ),
            mark_processed: schema.render(
                "UPDATE {schema}.received SET processed_at = now() \
                 WHERE consumer = $1 AND id = ANY($2) AND processed_at IS NULL",
            ),
            purge: schema.render(
                "DELETE FROM {schema}.received WHERE ctid = ANY(ARRAY( \
                   SELECT ctid FROM {schema}.received \
                   WHERE processed_at < now() - make_interval(secs => $1) LIMIT $2))",
            ),
        }
    }
}

/// Column-wise arrays for the batch insert.
pub(crate) struct Columns {
    pub event_ids: Vec<uuid::Uuid>,
    pub event_types: Vec<String>,
    pub aggregate_types: Vec<String>,
    pub aggregate_ids: Vec<String>,
    pub schema_versions: Vec<i32>,
    pub payloads: Vec<String>,
    pub headers: Vec<String>,
}

impl Columns {
    pub fn new(events: &[crate::NewEvent]) -> Self {
        Self {
            event_ids: events.iter().map(|e| e.event_id).collect(),
            event_types: events.iter().map(|e| e.event_type.clone()).collect(),
            aggregate_types: events.iter().map(|e| e.aggregate_type.clone()).collect(),
            aggregate_ids: events.iter().map(|e| e.aggregate_id.clone()).collect(),
            schema_versions: events.iter().map(|e| e.schema_version).collect(),
            payloads: events.iter().map(|e| e.payload.clone()).collect(),
            headers: events.iter().map(|e| e.headers.clone()).collect(),
        }
    }
}

//! The library on [tokio-postgres](https://docs.rs/tokio-postgres): every
//! function takes a [`GenericClient`], so it serves a `Client` and a
//! `Transaction` alike.

use crate::inbox::{check_aggregate, check_consumer};
use crate::otel;
use crate::sql::Columns;
use crate::{Error, InboxOutcome, NewEvent, Outbox, SequenceCheck};
use ::tokio_postgres::GenericClient;
use tracing::Instrument;
use uuid::Uuid;

/// Enqueue one event in the caller's transaction; returns its event id.
pub async fn enqueue<C: GenericClient>(
    outbox: &Outbox,
    client: &C,
    event: &NewEvent,
) -> Result<Uuid, Error> {
    outbox.check(event)?;
    let span = otel::create_span("enqueue", &outbox.schema, Some(event.event_id), 1);
    let headers = otel::headers_with_context(&event.headers, &span);
    client
        .execute(
            &outbox.sql.insert_one,
            &[
                &event.event_id,
                &event.event_type,
                &event.aggregate_type,
                &event.aggregate_id,
                &event.schema_version,
                &event.payload,
                &headers.as_ref(),
                &event.scheduled_at(),
                &event.deliver_after_secs(),
            ],
        )
        .instrument(span)
        .await?;
    Ok(event.event_id)
}

/// Emit one event into the WAL only, in the caller's transaction; returns
/// its event id (see [`crate::sqlx::emit`]: no table row, delivered by a
/// logical-mode relay once the transaction commits).
pub async fn emit<C: GenericClient>(
    outbox: &Outbox,
    client: &C,
    event: &NewEvent,
) -> Result<Uuid, Error> {
    outbox.check(event)?;
    let span = otel::create_span("emit", &outbox.schema, Some(event.event_id), 1);
    let headers = otel::headers_with_context(&event.headers, &span);
    client
        .execute(
            &outbox.sql.emit_one,
            &[
                &event.event_id,
                &event.event_type,
                &event.aggregate_type,
                &event.aggregate_id,
                &event.schema_version,
                &event.payload,
                &headers.as_ref(),
                &event.scheduled_at(),
                &event.deliver_after_secs(),
            ],
        )
        .instrument(span)
        .await?;
    Ok(event.event_id)
}

/// Enqueue many events with one statement in the caller's transaction; returns
/// their ids in input order.
pub async fn enqueue_batch<C: GenericClient>(
    outbox: &Outbox,
    client: &C,
    events: &[NewEvent],
) -> Result<Vec<Uuid>, Error> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    for e in events {
        outbox.check(e)?;
    }
    let span = otel::create_span("enqueue_batch", &outbox.schema, None, events.len());
    let mut c = Columns::new(events);
    otel::fill_headers(&mut c.headers, &span);
    client
        .execute(
            &outbox.sql.insert_many,
            &[
                &c.event_ids,
                &c.event_types,
                &c.aggregate_types,
                &c.aggregate_ids,
                &c.schema_versions,
                &c.payloads,
                &c.headers,
                &c.deliver_ats,
                &c.deliver_after_secs,
            ],
        )
        .instrument(span)
        .await?;
    Ok(c.event_ids)
}

/// Record that `consumer` handles `event_id`, in the caller's transaction.
/// Apply the effect only when this returns [`InboxOutcome::New`].
pub async fn record_inbox<C: GenericClient>(
    outbox: &Outbox,
    client: &C,
    consumer: &str,
    event_id: Uuid,
) -> Result<InboxOutcome, Error> {
    check_consumer(consumer)?;
    let span = otel::record_inbox_span(consumer, event_id);
    let rows = client
        .execute(&outbox.sql.inbox_record, &[&consumer, &event_id])
        .instrument(span)
        .await?;
    Ok(InboxOutcome::from_rows(rows))
}

/// Judge a delivery of an aggregate's event number `sequence` for `consumer`
/// in the caller's transaction; see [`crate::sqlx::check_sequence`]. With
/// `accept_gap`, a number ahead of the next one moves the tracker too (see
/// [`crate::sqlx::accept_gap`]).
pub async fn check_sequence<C: GenericClient>(
    outbox: &Outbox,
    client: &C,
    consumer: &str,
    aggregate: (&str, &str),
    sequence: i64,
    accept_gap: bool,
) -> Result<SequenceCheck, Error> {
    let (aggregate_type, aggregate_id) = aggregate;
    check_aggregate(consumer, aggregate_type, aggregate_id, sequence)?;
    let row = client
        .query_one(
            &outbox.sql.inbox_sequence,
            &[
                &consumer,
                &aggregate_type,
                &aggregate_id,
                &sequence,
                &accept_gap,
            ],
        )
        .await?;
    let last: i64 = row.try_get("last_sequence")?;
    Ok(SequenceCheck::judge(last, sequence))
}

/// Delete up to `limit` inbox rows processed more than `older_than` ago; returns
/// how many went. Call it repeatedly (it is bounded so it never holds locks for long).
pub async fn purge_inbox<C: GenericClient>(
    outbox: &Outbox,
    client: &C,
    older_than: std::time::Duration,
    limit: i64,
) -> Result<u64, Error> {
    let rows = client
        .execute(
            &outbox.sql.inbox_purge,
            &[&older_than.as_secs_f64(), &limit],
        )
        .await?;
    Ok(rows)
}

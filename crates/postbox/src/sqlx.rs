//! The library on [sqlx](https://docs.rs/sqlx): every function takes
//! `&mut PgConnection`, so it serves a plain connection and a transaction
//! (`&mut *tx`) alike.

use crate::inbox::{check_aggregate, check_consumer};
use crate::migrations::{self, Migration};
use crate::otel;
use crate::sql::{Columns, MigrateQueries};
use crate::statements::trusted;
use crate::{Error, InboxOutcome, NewEvent, Outbox, Schema, SequenceCheck};
use ::sqlx::{Connection, PgConnection, Row};
use tracing::Instrument;
use uuid::Uuid;

/// Enqueue one event in the caller's transaction; returns its event id.
///
/// The event is visible to relays only once the caller's transaction commits,
/// and never if it rolls back.
pub async fn enqueue(
    outbox: &Outbox,
    conn: &mut PgConnection,
    event: &NewEvent,
) -> Result<Uuid, Error> {
    outbox.check(event)?;
    let span = otel::create_span("enqueue", &outbox.schema, Some(event.event_id), 1);
    let headers = otel::headers_with_context(&event.headers, &span);
    ::sqlx::query(trusted(&outbox.sql.insert_one))
        .bind(event.event_id)
        .bind(&event.event_type)
        .bind(&event.aggregate_type)
        .bind(&event.aggregate_id)
        .bind(event.schema_version)
        .bind(&event.payload)
        .bind(headers.as_ref())
        .bind(event.scheduled_at())
        .bind(event.deliver_after_secs())
        .execute(conn)
        .instrument(span)
        .await?;
    Ok(event.event_id)
}

/// Emit one event into the WAL only, in the caller's transaction; returns
/// its event id.
///
/// No table row is written: the event is a transactional logical message
/// that a relay in logical mode (`postbox relay --mode logical`) reads from
/// its replication slot once the transaction commits, and never if it rolls
/// back. Emitted events carry no per-aggregate `sequence`; they are delivered
/// in commit order. The server needs `wal_level = logical`, otherwise nothing
/// reads the message. An event scheduled with [`NewEvent::deliver_at`] or
/// [`NewEvent::deliver_after`] is handed by the relay to the outbox, which
/// delivers it at its time.
pub async fn emit(
    outbox: &Outbox,
    conn: &mut PgConnection,
    event: &NewEvent,
) -> Result<Uuid, Error> {
    outbox.check(event)?;
    let span = otel::create_span("emit", &outbox.schema, Some(event.event_id), 1);
    let headers = otel::headers_with_context(&event.headers, &span);
    ::sqlx::query(trusted(&outbox.sql.emit_one))
        .bind(event.event_id)
        .bind(&event.event_type)
        .bind(&event.aggregate_type)
        .bind(&event.aggregate_id)
        .bind(event.schema_version)
        .bind(&event.payload)
        .bind(headers.as_ref())
        .bind(event.scheduled_at())
        .bind(event.deliver_after_secs())
        .execute(conn)
        .instrument(span)
        .await?;
    Ok(event.event_id)
}

/// Enqueue many events with one statement in the caller's transaction; returns
/// their ids in input order.
pub async fn enqueue_batch(
    outbox: &Outbox,
    conn: &mut PgConnection,
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
    ::sqlx::query(trusted(&outbox.sql.insert_many))
        .bind(&c.event_ids)
        .bind(&c.event_types)
        .bind(&c.aggregate_types)
        .bind(&c.aggregate_ids)
        .bind(&c.schema_versions)
        .bind(&c.payloads)
        .bind(&c.headers)
        .bind(&c.deliver_ats)
        .bind(&c.deliver_after_secs)
        .execute(conn)
        .instrument(span)
        .await?;
    Ok(c.event_ids)
}

/// Record that `consumer` handles `event_id`, in the caller's transaction.
///
/// Apply the business effect in the same transaction only when this returns
/// [`InboxOutcome::New`]; a [`InboxOutcome::Duplicate`] was applied before.
pub async fn record_inbox(
    outbox: &Outbox,
    conn: &mut PgConnection,
    consumer: &str,
    event_id: Uuid,
) -> Result<InboxOutcome, Error> {
    check_consumer(consumer)?;
    let span = otel::record_inbox_span(consumer, event_id);
    let done = ::sqlx::query(trusted(&outbox.sql.inbox_record))
        .bind(consumer)
        .bind(event_id)
        .execute(conn)
        .instrument(span)
        .await?;
    Ok(InboxOutcome::from_rows(done.rows_affected()))
}

/// Judge a delivery of `aggregate`'s event number `sequence` for `consumer`,
/// in the caller's transaction: [`SequenceCheck::Apply`] when it is the next
/// one (the tracker advances with the transaction), `Duplicate` when it was
/// applied before, `Gap` when earlier events are missing. The tracker row stays
/// locked until the transaction ends, so deliveries of one aggregate are judged
/// one at a time.
pub async fn check_sequence(
    outbox: &Outbox,
    conn: &mut PgConnection,
    consumer: &str,
    aggregate_type: &str,
    aggregate_id: &str,
    sequence: i64,
) -> Result<SequenceCheck, Error> {
    sequence_call(
        outbox,
        conn,
        consumer,
        aggregate_type,
        aggregate_id,
        sequence,
        false,
    )
    .await
}

/// After a [`SequenceCheck::Gap`] the handler chose to live with (the missing
/// events were skipped upstream, or reconciled another way): move the tracker
/// to `sequence` so later events apply again. Returns the check as it stood.
pub async fn accept_gap(
    outbox: &Outbox,
    conn: &mut PgConnection,
    consumer: &str,
    aggregate_type: &str,
    aggregate_id: &str,
    sequence: i64,
) -> Result<SequenceCheck, Error> {
    sequence_call(
        outbox,
        conn,
        consumer,
        aggregate_type,
        aggregate_id,
        sequence,
        true,
    )
    .await
}

async fn sequence_call(
    outbox: &Outbox,
    conn: &mut PgConnection,
    consumer: &str,
    aggregate_type: &str,
    aggregate_id: &str,
    sequence: i64,
    accept_gap: bool,
) -> Result<SequenceCheck, Error> {
    check_aggregate(consumer, aggregate_type, aggregate_id, sequence)?;
    let last: i64 = ::sqlx::query_scalar(trusted(&outbox.sql.inbox_sequence))
        .bind(consumer)
        .bind(aggregate_type)
        .bind(aggregate_id)
        .bind(sequence)
        .bind(accept_gap)
        .fetch_one(conn)
        .await?;
    Ok(SequenceCheck::judge(last, sequence))
}

/// Delete up to `limit` inbox rows older than `older_than`; returns how many went.
/// Call it repeatedly (it is bounded so it never holds locks for long).
pub async fn purge_inbox(
    outbox: &Outbox,
    conn: &mut PgConnection,
    older_than: std::time::Duration,
    limit: i64,
) -> Result<u64, Error> {
    let done = ::sqlx::query(trusted(&outbox.sql.inbox_purge))
        .bind(older_than.as_secs_f64())
        .bind(limit)
        .execute(conn)
        .await?;
    Ok(done.rows_affected())
}

/// The latest migration applied to `schema`: `None` when postbox was never
/// migrated there. Compare with [`crate::MIGRATIONS`] to know whether
/// `migrate` must run before a relay can.
pub async fn applied_version(
    conn: &mut PgConnection,
    schema: &Schema,
) -> Result<Option<i32>, Error> {
    let sql = MigrateQueries::new(schema);
    let exists: bool = ::sqlx::query_scalar(trusted(&sql.history_exists))
        .bind(schema.name().to_owned())
        .fetch_one(&mut *conn)
        .await?;
    if !exists {
        return Ok(None);
    }
    Ok(::sqlx::query_scalar(trusted(&sql.select_latest))
        .fetch_one(&mut *conn)
        .await?)
}

/// Bring `schema` up to the latest migration; returns the versions applied now
/// (empty when it was already up to date).
///
/// Safe to run from several processes at once: a session advisory lock per
/// schema serializes them, and each migration commits with its history row.
pub async fn migrate(conn: &mut PgConnection, schema: &Schema) -> Result<Vec<i32>, Error> {
    let sql = MigrateQueries::new(schema);
    ::sqlx::query(trusted(&sql.lock))
        .bind(schema.name().to_owned())
        .execute(&mut *conn)
        .await?;
    let result = migrate_locked(conn, schema, &sql).await;
    let unlocked = ::sqlx::query(trusted(&sql.unlock))
        .bind(schema.name().to_owned())
        .execute(&mut *conn)
        .await;
    let applied = result?;
    unlocked?;
    Ok(applied)
}

async fn migrate_locked(
    conn: &mut PgConnection,
    schema: &Schema,
    sql: &MigrateQueries,
) -> Result<Vec<i32>, Error> {
    ::sqlx::query(trusted(&sql.create_schema))
        .execute(&mut *conn)
        .await?;
    ::sqlx::query(trusted(&sql.create_history))
        .execute(&mut *conn)
        .await?;
    let rows = ::sqlx::query(trusted(&sql.select_applied))
        .fetch_all(&mut *conn)
        .await?;
    let applied: Vec<(i32, String)> = rows
        .iter()
        .map(|r| Ok((r.try_get("version")?, r.try_get("checksum")?)))
        .collect::<Result<_, ::sqlx::Error>>()?;
    let mut done = Vec::new();
    let todo: Vec<Migration> = migrations::pending(schema, &applied)?
        .into_iter()
        .copied()
        .collect();
    for m in todo {
        apply(conn, schema, sql, &m)
            .await
            .map_err(|source| Error::Migration {
                version: m.version,
                name: m.name,
                source: Box::new(source),
            })?;
        tracing::info!(schema = %schema, version = m.version, name = m.name, "applied migration");
        done.push(m.version);
    }
    Ok(done)
}

async fn apply(
    conn: &mut PgConnection,
    schema: &Schema,
    sql: &MigrateQueries,
    m: &Migration,
) -> Result<(), Error> {
    let body = schema.render(m.sql);
    let mut tx = conn.begin().await?;
    ::sqlx::Executor::execute(&mut *tx, trusted(&body)).await?;
    ::sqlx::query(trusted(&sql.insert_applied))
        .bind(m.version)
        .bind(m.name.to_owned())
        .bind(m.checksum())
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    /// Library futures must be `Send`, so callers can run them in `tokio::spawn`.
    #[allow(dead_code)]
    fn futures_are_send(
        conn: &'static mut super::PgConnection,
        outbox: &'static super::Outbox,
        event: &'static super::NewEvent,
    ) {
        fn send<T: Send>(_: T) {}
        send(super::enqueue(outbox, conn, event));
        send(super::enqueue_batch(
            outbox,
            conn,
            std::slice::from_ref(event),
        ));
        send(super::record_inbox(outbox, conn, "c", event.event_id()));
        send(super::migrate(conn, outbox.schema()));
    }
}

//! Received deliveries: the store behind `postbox receive`.
//!
//! `postbox receive` accepts signed HTTP deliveries and stores each one **once** per
//! consumer in the table `{schema}.received` (added by migration 2). The application
//! then works through them at its own pace, inside its own transactions:
//!
//! 1. [`take`] locks the next unprocessed deliveries of a consumer
//!    (`FOR UPDATE SKIP LOCKED`, so several workers never get the same row);
//! 2. the application applies each delivery's effect in that same transaction;
//! 3. [`mark_processed`] marks them processed, still in that transaction;
//! 4. the commit makes effect and mark durable together. A rollback (or a crash)
//!    leaves the deliveries unprocessed, to be taken again.
//!
//! ```no_run
//! # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use postbox::{received, Outbox};
//!
//! let outbox = Outbox::default();
//! let mut tx = pool.begin().await?;
//! let batch = received::take(&outbox, &mut tx, "billing", 100).await?;
//! for delivery in &batch {
//!     // apply the effect of `delivery.body` using `&mut *tx` ...
//! }
//! let ids: Vec<i64> = batch.iter().map(|d| d.id).collect();
//! received::mark_processed(&outbox, &mut tx, "billing", &ids).await?;
//! tx.commit().await?;
//! # Ok(()) }
//! ```
//!
//! Event ids are text (senders choose them: a Standard Webhooks `webhook-id`, a
//! CloudEvents `id`), 1 to 255 bytes. Bodies are stored as the exact bytes received.
//!
//! With the features `axum` and `sqlx`, [`http::Receiver`] is the HTTP service
//! itself (signature check, event id, storage, answers), to serve alone as
//! `postbox receive` does or to mount in an application's own router.

use crate::inbox::check_consumer;
use crate::Error;

#[cfg(all(feature = "axum", feature = "sqlx"))]
pub mod http;

/// Counter of deliveries the receiver refused, by `reason` (`signature`,
/// `too_large`, `malformed`, `no_event_id`, `id_mismatch`, `ambiguous`).
pub const RECEIVE_REJECTED: &str = "postbox_receive_rejected_total";
/// Counter of deliveries that were already stored for the `consumer`.
pub const INBOX_DUPLICATES: &str = "postbox_inbox_duplicates_total";

/// Longest event id accepted, in bytes.
pub const MAX_EVENT_ID_BYTES: usize = 255;

/// A delivery to store with [`store`]: who received it, its event id, the request
/// headers worth keeping, and the exact body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewDelivery {
    consumer: String,
    event_id: String,
    headers: serde_json::Map<String, serde_json::Value>,
    body: Vec<u8>,
}

impl NewDelivery {
    /// A delivery with no headers. Fails when the consumer name or the event id is
    /// empty, longer than 255 bytes or contains a NUL character.
    pub fn new(
        consumer: impl Into<String>,
        event_id: impl Into<String>,
        body: impl Into<Vec<u8>>,
    ) -> Result<Self, Error> {
        let consumer = consumer.into();
        check_consumer(&consumer)?;
        let event_id = event_id.into();
        check_event_id(&event_id)?;
        Ok(Self {
            consumer,
            event_id,
            headers: serde_json::Map::new(),
            body: body.into(),
        })
    }

    /// Adds headers. Names are stored in lower case; a name given several times keeps
    /// all its values, joined by `", "` as HTTP does. Fails on an empty name or a NUL
    /// character (which `jsonb` cannot store).
    pub fn headers<I, N, V>(mut self, headers: I) -> Result<Self, Error>
    where
        I: IntoIterator<Item = (N, V)>,
        N: AsRef<str>,
        V: AsRef<str>,
    {
        for (name, value) in headers {
            let (name, value) = (name.as_ref(), value.as_ref());
            if name.is_empty() {
                return Err(invalid_headers("contain an empty name"));
            }
            if name.contains('\0') || value.contains('\0') {
                return Err(invalid_headers("must not contain NUL characters"));
            }
            let name = name.to_ascii_lowercase();
            match self.headers.get_mut(&name) {
                Some(serde_json::Value::String(existing)) => {
                    existing.push_str(", ");
                    existing.push_str(value);
                }
                _ => {
                    self.headers
                        .insert(name, serde_json::Value::String(value.to_owned()));
                }
            }
        }
        Ok(self)
    }

    /// The consumer name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The event id.
    pub fn event_id(&self) -> &str {
        &self.event_id
    }
}

/// A stored delivery, as [`take`] returns it.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ReceivedDelivery {
    /// Position in the store (increasing in arrival order); pass it to [`mark_processed`].
    pub id: i64,
    /// The consumer that received it.
    pub consumer: String,
    /// The sender's event id (unique per consumer).
    pub event_id: String,
    /// The stored request headers: a JSON object of lower-case name to string value.
    pub headers: serde_json::Value,
    /// The exact request body.
    pub body: Vec<u8>,
    /// When it was first stored.
    pub received_at: chrono::DateTime<chrono::Utc>,
}

impl ReceivedDelivery {
    /// The value of a stored header (name in any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name.to_ascii_lowercase())
            .and_then(serde_json::Value::as_str)
    }
}

/// Checks a consumer name as [`NewDelivery::new`] and [`take`] do (1 to 255 bytes,
/// no NUL), so a service can refuse a bad name at start-up.
pub fn check_consumer_name(consumer: &str) -> Result<(), Error> {
    check_consumer(consumer)
}

/// Checks an event id as [`NewDelivery::new`] does (1 to 255 bytes, no NUL).
pub fn check_event_id(event_id: &str) -> Result<(), Error> {
    let reason = if event_id.is_empty() {
        "must not be empty".to_owned()
    } else if event_id.len() > MAX_EVENT_ID_BYTES {
        format!(
            "must be at most {MAX_EVENT_ID_BYTES} bytes, got {}",
            event_id.len()
        )
    } else if event_id.contains('\0') {
        "must not contain NUL characters".to_owned()
    } else {
        return Ok(());
    };
    Err(Error::InvalidEvent {
        field: "event_id",
        reason,
    })
}

fn invalid_headers(reason: &str) -> Error {
    Error::InvalidEvent {
        field: "headers",
        reason: reason.to_owned(),
    }
}

#[cfg(feature = "sqlx")]
pub use self::with_sqlx::{mark_processed, purge, store, take};

#[cfg(feature = "sqlx")]
mod with_sqlx {
    use super::{check_consumer, NewDelivery, ReceivedDelivery};
    use crate::statements::trusted;
    use crate::{Error, InboxOutcome, Outbox};
    use ::sqlx::{PgConnection, Row};

    /// Stores a delivery unless this consumer already has one with the same event id
    /// (`ON CONFLICT DO NOTHING`). Returns [`InboxOutcome::New`] when a row was added,
    /// [`InboxOutcome::Duplicate`] when it was already there.
    ///
    /// Run it on a plain connection (it commits at once) or inside a transaction (it is
    /// durable when that commits); answer the sender only after that.
    pub async fn store(
        outbox: &Outbox,
        conn: &mut PgConnection,
        delivery: &NewDelivery,
    ) -> Result<InboxOutcome, Error> {
        let headers = serde_json::Value::Object(delivery.headers.clone()).to_string();
        let done = ::sqlx::query(trusted(&outbox.sql.received.store))
            .bind(&delivery.consumer)
            .bind(&delivery.event_id)
            .bind(headers)
            .bind(&delivery.body)
            .execute(conn)
            .await?;
        Ok(InboxOutcome::from_rows(done.rows_affected()))
    }

    /// Locks and returns up to `limit` unprocessed deliveries of `consumer`, oldest
    /// first, skipping rows another transaction holds (`FOR UPDATE SKIP LOCKED`).
    ///
    /// Call it inside a transaction: the rows stay locked until it ends. Apply their
    /// effects and call [`mark_processed`] in that same transaction.
    pub async fn take(
        outbox: &Outbox,
        conn: &mut PgConnection,
        consumer: &str,
        limit: u32,
    ) -> Result<Vec<ReceivedDelivery>, Error> {
        check_consumer(consumer)?;
        let rows = ::sqlx::query(trusted(&outbox.sql.received.take))
            .bind(consumer)
            .bind(i64::from(limit))
            .fetch_all(conn)
            .await?;
        rows.iter()
            .map(|row| {
                Ok(ReceivedDelivery {
                    id: row.try_get("id")?,
                    consumer: row.try_get("consumer")?,
                    event_id: row.try_get("event_id")?,
                    headers: row.try_get("headers")?,
                    body: row.try_get("body")?,
                    received_at: row.try_get("received_at")?,
                })
            })
            .collect::<Result<_, ::sqlx::Error>>()
            .map_err(Error::from)
    }

    /// Marks deliveries of `consumer` (by [`ReceivedDelivery::id`]) processed; returns
    /// how many were still unprocessed. Call it in the transaction that applied them.
    pub async fn mark_processed(
        outbox: &Outbox,
        conn: &mut PgConnection,
        consumer: &str,
        ids: &[i64],
    ) -> Result<u64, Error> {
        check_consumer(consumer)?;
        if ids.is_empty() {
            return Ok(0);
        }
        let done = ::sqlx::query(trusted(&outbox.sql.received.mark_processed))
            .bind(consumer)
            .bind(ids)
            .execute(conn)
            .await?;
        Ok(done.rows_affected())
    }

    /// Deletes up to `limit` deliveries processed more than `older_than` ago; returns
    /// how many went. Unprocessed deliveries are never deleted. Call it repeatedly:
    /// it is bounded so it never holds locks for long.
    pub async fn purge(
        outbox: &Outbox,
        conn: &mut PgConnection,
        older_than: std::time::Duration,
        limit: i64,
    ) -> Result<u64, Error> {
        let done = ::sqlx::query(trusted(&outbox.sql.received.purge))
            .bind(older_than.as_secs_f64())
            .bind(limit)
            .execute(conn)
            .await?;
        Ok(done.rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_consumer_and_event_id() {
        assert!(NewDelivery::new("c", "msg_1", b"x".to_vec()).is_ok());
        for (consumer, id) in [
            ("", "id"),
            ("c", ""),
            ("c", "a\0b"),
            ("c\0", "id"),
            (&"c".repeat(256) as &str, "id"),
        ] {
            assert!(
                NewDelivery::new(consumer, id, Vec::new()).is_err(),
                "{consumer:?} {id:?}"
            );
        }
        let long = "i".repeat(MAX_EVENT_ID_BYTES + 1);
        let err = NewDelivery::new("c", long, Vec::new()).unwrap_err();
        assert!(err.to_string().contains("event_id"), "{err}");
        assert!(NewDelivery::new("c", "i".repeat(MAX_EVENT_ID_BYTES), Vec::new()).is_ok());
    }

    #[test]
    fn headers_are_lower_cased_and_repeats_joined() {
        let d = NewDelivery::new("c", "id", Vec::new())
            .unwrap()
            .headers([
                ("Content-Type", "application/json"),
                ("X-A", "1"),
                ("x-a", "2"),
            ])
            .unwrap();
        assert_eq!(
            serde_json::Value::Object(d.headers.clone()),
            serde_json::json!({"content-type": "application/json", "x-a": "1, 2"})
        );
        let d = NewDelivery::new("c", "id", Vec::new()).unwrap();
        assert!(d.clone().headers([("", "v")]).is_err());
        assert!(d.clone().headers([("a", "v\0")]).is_err());
    }
}

//! Request idempotency keys: make command retries safe.
//!
//! A client whose request timed out around `COMMIT` cannot know whether it
//! committed. It retries with the same idempotency key; postbox records the key,
//! a fingerprint of the request and the response **in the same transaction** as
//! the business change and its outbox events, so either all of them exist or
//! none does:
//!
//! - first request: [`begin`] returns [`Begin::Execute`]; do the work, then
//!   [`complete`] with the response, then commit;
//! - a retry of a committed request (same key, same fingerprint): [`begin`]
//!   returns [`Begin::Replay`] with the stored response; do nothing else;
//! - the same key with a different request: [`IdempotencyError::Mismatch`];
//! - the same key while the first request's transaction is still open:
//!   [`IdempotencyError::InFlight`] at once (the caller answers 409 and the
//!   client retries later) — two requests with one key never both execute.
//!
//! **Concurrency.** [`begin`] first takes a transaction-level advisory lock on
//! (schema, scope, key) with `pg_try_advisory_xact_lock`, without waiting: a
//! second request with the key fails fast instead of holding a connection. The
//! lock is released when the first transaction ends; by then its row is
//! committed (a retry replays it) or rolled back (a retry executes). Then
//! `INSERT … ON CONFLICT DO NOTHING` creates the row, or `SELECT … FOR UPDATE`
//! reads the existing one. A committed row still `in_flight` (an application
//! that committed without [`complete`]) also answers `InFlight` until it expires.
//!
//! **Expiry.** Each key lives `ttl` from its first use; an expired key is
//! treated as new. [`purge_expired`] deletes expired keys in bounded batches.
//!
//! With the `axum` feature, [`axum::Idempotent`] applies all this to the
//! `Idempotency-Key` request header.

use crate::statements::trusted;
use crate::{Error, Outbox};
use ::sqlx::{PgConnection, Row};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::time::Duration;

#[cfg(feature = "axum")]
pub mod axum;

/// Longest accepted scope and key: 255 bytes.
pub const MAX_KEY_BYTES: usize = 255;

/// Why an idempotent request cannot run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdempotencyError {
    /// The scope or key is empty, too long or holds a NUL character.
    #[error("invalid idempotency {field}: {reason}")]
    InvalidKey {
        field: &'static str,
        reason: &'static str,
    },
    /// Another request with this key is being processed right now.
    #[error("a request with this idempotency key is still being processed; retry later")]
    InFlight,
    /// This key was used before for a different request.
    #[error("this idempotency key was already used for a different request")]
    Mismatch,
    /// [`complete`] found no in-flight key to complete (it was completed already).
    #[error("the idempotency key is not in flight in this transaction")]
    NotInFlight,
    /// The stored response could not be encoded.
    #[error("the response could not be stored")]
    Response(#[source] serde_json::Error),
    /// The database refused or failed a statement.
    #[error("database error")]
    Database(#[source] Error),
}

impl From<::sqlx::Error> for IdempotencyError {
    fn from(e: ::sqlx::Error) -> Self {
        IdempotencyError::Database(Error::Sqlx(e))
    }
}

/// A validated (scope, key) pair. The scope separates key spaces: per endpoint,
/// per account, or both (`"orders:acct-42"`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdempotencyKey {
    scope: String,
    key: String,
}

impl IdempotencyKey {
    pub fn new(scope: impl Into<String>, key: impl Into<String>) -> Result<Self, IdempotencyError> {
        let scope = scope.into();
        let key = key.into();
        check("scope", &scope)?;
        check("key", &key)?;
        Ok(Self { scope, key })
    }

    pub fn scope(&self) -> &str {
        &self.scope
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// The advisory lock's name: unambiguous for any scope and key.
    fn lock_name(&self, outbox: &Outbox) -> String {
        format!(
            "postbox.idempotency:{}:{}:{}:{}",
            outbox.schema().name(),
            self.scope.len(),
            self.scope,
            self.key
        )
    }
}

fn check(field: &'static str, value: &str) -> Result<(), IdempotencyError> {
    let reason = if value.is_empty() {
        "must not be empty"
    } else if value.len() > MAX_KEY_BYTES {
        "must be at most 255 bytes"
    } else if value.contains('\0') {
        "must not contain NUL characters"
    } else {
        return Ok(());
    };
    Err(IdempotencyError::InvalidKey { field, reason })
}

/// A digest of what a request asks for: a retry must carry the same one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fingerprint(String);

impl Fingerprint {
    /// SHA-256 over `parts`, each length-prefixed (so `["ab", "c"]` and
    /// `["a", "bc"]` differ). E.g. method, path and body bytes.
    pub fn of_parts(parts: &[&[u8]]) -> Self {
        let mut h = Sha256::new();
        for p in parts {
            h.update((p.len() as u64).to_be_bytes());
            h.update(p);
        }
        Self(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }

    /// SHA-256 of a value's JSON serialization (field order as serialized).
    pub fn of_json(value: &impl Serialize) -> Result<Self, IdempotencyError> {
        let bytes = serde_json::to_vec(value).map_err(IdempotencyError::Response)?;
        Ok(Self::of_parts(&[&bytes]))
    }

    /// The digest, hex.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The response stored with a completed key and returned to retries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    /// An HTTP-style status code (or any application code).
    pub status: u16,
    /// The body's media type, when it has one.
    pub content_type: Option<String>,
    pub body: Vec<u8>,
}

impl StoredResponse {
    /// A JSON response.
    pub fn json(status: u16, body: &impl Serialize) -> Result<Self, IdempotencyError> {
        Ok(Self {
            status,
            content_type: Some("application/json".to_owned()),
            body: serde_json::to_vec(body).map_err(IdempotencyError::Response)?,
        })
    }

    /// The body decoded as JSON.
    pub fn json_body<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.body)
    }
}

/// What [`begin`] decided.
#[derive(Debug)]
#[must_use = "an Execute must be completed, a Replay returned to the caller"]
pub enum Begin {
    /// First time (or the key expired): run the command in this transaction,
    /// then call [`complete`] before committing.
    Execute(Pending),
    /// Already done: return this response and change nothing.
    Replay(StoredResponse),
}

/// A key this transaction owns until it completes it.
#[derive(Debug)]
#[must_use = "call idempotency::complete before committing"]
pub struct Pending {
    key: IdempotencyKey,
}

impl Pending {
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }
}

/// Start an idempotent command in the caller's transaction (see the module docs).
pub async fn begin(
    outbox: &Outbox,
    conn: &mut PgConnection,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
    ttl: Duration,
) -> Result<Begin, IdempotencyError> {
    let sql = &outbox.sql.idempotency;
    let locked: bool = ::sqlx::query_scalar(trusted(&sql.lock))
        .bind(key.lock_name(outbox))
        .fetch_one(&mut *conn)
        .await?;
    if !locked {
        return Err(IdempotencyError::InFlight);
    }
    let mut existing = None;
    // Twice at most: an expired row that `purge_expired` deletes between the
    // insert and the select is gone, and the second insert creates the key.
    for _ in 0..2 {
        let inserted: Option<bool> = ::sqlx::query_scalar(trusted(&sql.insert))
            .bind(&key.scope)
            .bind(&key.key)
            .bind(fingerprint.as_str())
            .bind(ttl.as_secs_f64())
            .fetch_optional(&mut *conn)
            .await?;
        if inserted.is_some() {
            return Ok(Begin::Execute(Pending { key: key.clone() }));
        }
        existing = ::sqlx::query(trusted(&sql.select))
            .bind(&key.scope)
            .bind(&key.key)
            .fetch_optional(&mut *conn)
            .await?;
        if existing.is_some() {
            break;
        }
    }
    // Deleted twice in a row under us: not plausible, but retrying later is safe.
    let Some(row) = existing else {
        return Err(IdempotencyError::InFlight);
    };
    let expired: bool = row.try_get("expired")?;
    if expired {
        ::sqlx::query(trusted(&sql.restart))
            .bind(&key.scope)
            .bind(&key.key)
            .bind(fingerprint.as_str())
            .bind(ttl.as_secs_f64())
            .execute(&mut *conn)
            .await?;
        return Ok(Begin::Execute(Pending { key: key.clone() }));
    }
    let stored: String = row.try_get("fingerprint")?;
    if stored != fingerprint.as_str() {
        return Err(IdempotencyError::Mismatch);
    }
    let status: String = row.try_get("status")?;
    if status != "completed" {
        return Err(IdempotencyError::InFlight);
    }
    let code: Option<i32> = row.try_get("response_status")?;
    Ok(Begin::Replay(StoredResponse {
        status: code.and_then(|c| u16::try_from(c).ok()).unwrap_or(200),
        content_type: row.try_get("response_type")?,
        body: row
            .try_get::<Option<Vec<u8>>, _>("response_body")?
            .unwrap_or_default(),
    }))
}

/// Store the response for `pending`'s key, in the same transaction as the
/// command's writes. Commit afterwards; a retry then replays `response`.
pub async fn complete(
    outbox: &Outbox,
    conn: &mut PgConnection,
    pending: Pending,
    response: &StoredResponse,
) -> Result<(), IdempotencyError> {
    let done = ::sqlx::query(trusted(&outbox.sql.idempotency.complete))
        .bind(&pending.key.scope)
        .bind(&pending.key.key)
        .bind(i32::from(response.status))
        .bind(response.content_type.as_deref())
        .bind(&response.body)
        .execute(conn)
        .await?;
    if done.rows_affected() != 1 {
        return Err(IdempotencyError::NotInFlight);
    }
    Ok(())
}

/// Delete up to `limit` expired keys; returns how many went. Call it repeatedly.
pub async fn purge_expired(
    outbox: &Outbox,
    conn: &mut PgConnection,
    limit: i64,
) -> Result<u64, Error> {
    let done = ::sqlx::query(trusted(&outbox.sql.idempotency.purge))
        .bind(limit)
        .execute(conn)
        .await?;
    Ok(done.rows_affected())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_validated() {
        assert!(IdempotencyKey::new("orders", "k1").is_ok());
        assert!(IdempotencyKey::new("", "k1").is_err());
        assert!(IdempotencyKey::new("orders", "x".repeat(256)).is_err());
        assert!(IdempotencyKey::new("orders", "a\0b").is_err());
    }

    #[test]
    fn fingerprints_separate_their_parts() {
        let a = Fingerprint::of_parts(&[b"ab", b"c"]);
        let b = Fingerprint::of_parts(&[b"a", b"bc"]);
        assert_ne!(a, b);
        assert_eq!(a, Fingerprint::of_parts(&[b"ab", b"c"]));
        assert_eq!(a.as_str().len(), 64);
    }
}

//! The `Idempotency-Key` request header for axum handlers (feature `axum`).
//!
//! [`Idempotent`] is an extractor. Before the handler runs it reads the header
//! and the body, fingerprints the request (method, path and query, body), opens
//! a transaction and calls [`begin`](super::begin):
//!
//! | situation | answer (the handler does not run) |
//! |---|---|
//! | header missing and required | `400 Bad Request` |
//! | header empty or longer than 255 bytes | `400 Bad Request` |
//! | first request with the key still in flight | `409 Conflict` |
//! | key used before for a different request | `422 Unprocessable Entity` |
//! | key used before for this request | the stored response, with `Idempotent-Replayed: true` |
//! | database unavailable | `503 Service Unavailable` |
//!
//! Otherwise the handler gets the transaction ([`Idempotent::tx`]), writes its
//! change and its outbox events in it, and finishes with
//! [`Idempotent::commit`], which stores the response with the key, commits, and
//! returns the response. Bodies of refusals are fixed phrases, never error text.
//!
//! ```no_run
//! use axum::{http::StatusCode, response::Response, routing::post, Router};
//! use postbox::idempotency::axum::{Idempotency, Idempotent};
//! use std::time::Duration;
//!
//! async fn create_order(mut req: Idempotent) -> Result<Response, StatusCode> {
//!     let id: i64 = sqlx::query_scalar("INSERT INTO orders DEFAULT VALUES RETURNING id")
//!         .fetch_one(req.tx())
//!         .await
//!         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     // … postbox::sqlx::enqueue(&outbox, req.tx(), &event) …
//!     req.commit_json(StatusCode::CREATED, &serde_json::json!({ "id": id }))
//!         .await
//!         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)
//! }
//!
//! # fn app(pool: sqlx::PgPool) -> Router {
//! let idempotency = Idempotency::new(pool, postbox::Outbox::default(), "orders")
//!     .ttl(Duration::from_secs(24 * 3600))
//!     .required(true);
//! Router::new().route("/orders", post(create_order)).with_state(idempotency)
//! # }
//! ```
//!
//! With a larger application state, implement `FromRef<YourState>` for [`Idempotency`].
//!
//! **Typed bodies.** `Idempotent<Json<T>>` decodes the body as JSON before
//! the key is taken, refusing a body that does not decode with axum's own
//! [`JsonRejection`](::axum::extract::rejection::JsonRejection) (`400`, `422`)
//! — a refused body takes no key, so the client may fix it and send again with
//! the same one. The fingerprint is still taken over the exact bytes.
//!
//! ```no_run
//! use axum::{http::StatusCode, response::Response, Json};
//! use postbox::idempotency::axum::Idempotent;
//!
//! #[derive(serde::Deserialize)]
//! struct NewOrder { sku: String }
//!
//! async fn create_order(mut req: Idempotent<Json<NewOrder>>) -> Result<Response, StatusCode> {
//!     let sku = req.body().sku.clone();
//!     // … insert the order with `sku` and enqueue its event in req.tx() …
//!     req.commit_json(StatusCode::CREATED, &serde_json::json!({ "sku": sku }))
//!         .await
//!         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)
//! }
//! ```

use super::{Begin, Fingerprint, IdempotencyError, IdempotencyKey, Pending, StoredResponse};
use crate::axum::FromBody;
use crate::Outbox;
use ::axum::body::{Body, Bytes};
use ::axum::extract::{FromRef, FromRequest, Request};
use ::axum::http::{header, HeaderValue, StatusCode};
use ::axum::response::{IntoResponse, Response};
use ::sqlx::{PgConnection, PgPool, Postgres, Transaction};
use std::time::Duration;

/// The request header carrying the key.
pub const HEADER: &str = "idempotency-key";
/// Set on a response replayed from storage.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// Where keys live and how they behave, for one group of routes. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Idempotency {
    pool: PgPool,
    outbox: Outbox,
    scope: String,
    ttl: Duration,
    required: bool,
}

impl Idempotency {
    /// Keys in `scope` (e.g. the endpoint), kept 24 hours, required.
    pub fn new(pool: PgPool, outbox: Outbox, scope: impl Into<String>) -> Self {
        Self {
            pool,
            outbox,
            scope: scope.into(),
            ttl: Duration::from_secs(24 * 3600),
            required: true,
        }
    }

    /// How long a key is remembered after its first use.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Refuse requests without the header (`true`, the default), or run them
    /// without idempotency (`false`).
    pub fn required(mut self, required: bool) -> Self {
        self.required = required;
        self
    }
}

/// A request admitted to run once: its body (the exact bytes by default, or
/// decoded: [`FromBody`]), and the transaction to run it in.
pub struct Idempotent<B = Bytes> {
    tx: Transaction<'static, Postgres>,
    pending: Option<Pending>,
    outbox: Outbox,
    body: B,
}

impl<B> std::fmt::Debug for Idempotent<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotent")
            .field("key", &self.pending.as_ref().map(|p| p.key()))
            .finish_non_exhaustive()
    }
}

impl<B> Idempotent<B> {
    /// The transaction holding the key: write the change and its events here.
    pub fn tx(&mut self) -> &mut PgConnection {
        &mut self.tx
    }

    /// The request body (already read: exactly as received, or decoded).
    pub fn body(&self) -> &B {
        &self.body
    }

    /// The key, when the request carried one.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.pending.as_ref().map(Pending::key)
    }

    /// Store `response` with the key, commit, and return it as an axum response.
    pub async fn commit(mut self, response: StoredResponse) -> Result<Response, IdempotencyError> {
        if let Some(pending) = self.pending.take() {
            super::complete(&self.outbox, &mut self.tx, pending, &response).await?;
        }
        self.tx.commit().await?;
        Ok(to_response(response, false))
    }

    /// [`Idempotent::commit`] with a JSON body.
    pub async fn commit_json(
        self,
        status: StatusCode,
        body: &impl serde::Serialize,
    ) -> Result<Response, IdempotencyError> {
        let response = StoredResponse::json(status.as_u16(), body)?;
        self.commit(response).await
    }
}

fn to_response(stored: StoredResponse, replayed: bool) -> Response {
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let mut response = (status, Body::from(stored.body)).into_response();
    if let Some(ct) = stored
        .content_type
        .and_then(|c| HeaderValue::from_str(&c).ok())
    {
        response.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    if replayed {
        response
            .headers_mut()
            .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    }
    response
}

fn refuse(status: StatusCode, phrase: &'static str) -> Response {
    (status, phrase).into_response()
}

impl<S, B> FromRequest<S> for Idempotent<B>
where
    Idempotency: FromRef<S>,
    S: Send + Sync,
    B: FromBody,
{
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let config = Idempotency::from_ref(state);
        let method = req.method().clone();
        let target = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_owned())
            .unwrap_or_default();
        let key = match req.headers().get(HEADER) {
            None if config.required => {
                return Err(refuse(
                    StatusCode::BAD_REQUEST,
                    "this endpoint requires an Idempotency-Key header",
                ))
            }
            None => None,
            Some(v) => {
                let key = v
                    .to_str()
                    .ok()
                    .and_then(|k| IdempotencyKey::new(config.scope.clone(), k.trim()).ok());
                match key {
                    Some(k) => Some(k),
                    None => {
                        return Err(refuse(
                            StatusCode::BAD_REQUEST,
                            "invalid Idempotency-Key header: 1 to 255 visible ASCII characters",
                        ))
                    }
                }
            }
        };
        let body = Bytes::from_request(req, state)
            .await
            .map_err(IntoResponse::into_response)?;
        // Decoded before the key is taken: a body refused here stores nothing.
        let decoded = B::from_body(body.clone()).map_err(IntoResponse::into_response)?;
        let unavailable = |e: &dyn std::error::Error| {
            tracing::warn!(error = %e, "idempotency: database unavailable");
            refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                "service unavailable, retry later",
            )
        };
        let mut tx = config.pool.begin().await.map_err(|e| unavailable(&e))?;
        let pending = match &key {
            None => None,
            Some(key) => {
                let fingerprint =
                    Fingerprint::of_parts(&[method.as_str().as_bytes(), target.as_bytes(), &body]);
                let begun =
                    super::begin(&config.outbox, &mut tx, key, &fingerprint, config.ttl).await;
                let refusal = match begun {
                    Ok(Begin::Execute(p)) => Ok(p),
                    Ok(Begin::Replay(stored)) => Err(to_response(stored, true)),
                    Err(IdempotencyError::InFlight) => Err(refuse(
                        StatusCode::CONFLICT,
                        "a request with this Idempotency-Key is still being processed",
                    )),
                    Err(IdempotencyError::Mismatch) => Err(refuse(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "this Idempotency-Key was used for a different request",
                    )),
                    Err(e) => Err(unavailable(&e)),
                };
                match refusal {
                    Ok(p) => Some(p),
                    Err(response) => {
                        // End the transaction now, releasing its advisory lock: a
                        // dropped transaction rolls back only when its connection
                        // is next used, and an immediate retry would see a false 409.
                        if let Err(e) = tx.rollback().await {
                            tracing::warn!(error = %e, "idempotency: rollback failed");
                        }
                        return Err(response);
                    }
                }
            }
        };
        Ok(Idempotent {
            tx,
            pending,
            outbox: config.outbox.clone(),
            body: decoded,
        })
    }
}

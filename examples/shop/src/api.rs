//! The HTTP API.
//!
//! `POST /orders` runs inside postbox's [`Idempotent`] extractor: the
//! `Idempotency-Key` header is required (400 without it), a retry of a finished
//! request gets the stored response (`Idempotent-Replayed: true`), the same key
//! with another body gets 422, and one still in progress 409. The handler writes
//! the order and its event through `req.tx()` and commits with the response,
//! so the order, the event and the stored response exist together or not at all.

use crate::events::OrderPlaced;
use axum::extract::{FromRef, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use postbox::idempotency::axum::{Idempotency, Idempotent};
use postbox::idempotency::IdempotencyError;
use postbox::{NewEvent, Outbox, Schema};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

/// The router's state.
#[derive(Clone, Debug)]
pub struct App {
    pool: PgPool,
    outbox: Outbox,
    idempotency: Idempotency,
}

impl App {
    /// `pool` resolves the shop's tables (see [`crate::connect`]); postbox's
    /// tables are in `schema`.
    pub fn new(pool: PgPool, schema: Schema) -> Self {
        let outbox = Outbox::new(schema);
        let idempotency = Idempotency::new(pool.clone(), outbox.clone(), "orders");
        Self {
            pool,
            outbox,
            idempotency,
        }
    }
}

impl FromRef<App> for Idempotency {
    fn from_ref(app: &App) -> Self {
        app.idempotency.clone()
    }
}

pub fn router(app: App) -> Router {
    Router::new()
        .route("/orders", post(place_order))
        .route("/orders/{id}", get(get_order))
        .route("/customers/{customer}", get(get_customer))
        .with_state(app)
}

/// The body of `POST /orders`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NewOrder {
    pub customer: String,
    pub items: Vec<String>,
    pub total_cents: i64,
}

impl NewOrder {
    fn validate(&self) -> Result<(), ApiError> {
        if self.customer.is_empty() || self.customer.len() > 100 {
            return Err(ApiError::Invalid("customer must be 1 to 100 bytes"));
        }
        if self.items.is_empty() {
            return Err(ApiError::Invalid("an order needs at least one item"));
        }
        if self.total_cents < 0 {
            return Err(ApiError::Invalid("total_cents must not be negative"));
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Order {
    pub id: i64,
    pub customer: String,
    pub items: Vec<String>,
    pub total_cents: i64,
    pub created_at: DateTime<Utc>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CustomerStats {
    pub customer: String,
    pub orders: i64,
    pub spent_cents: i64,
}

async fn place_order(State(app): State<App>, mut req: Idempotent) -> Result<Response, ApiError> {
    let new: NewOrder = serde_json::from_slice(req.body())?;
    new.validate()?;
    let (id, created_at): (i64, DateTime<Utc>) = sqlx::query_as(
        "INSERT INTO orders (customer, items, total_cents) VALUES ($1, $2, $3) \
         RETURNING id, created_at",
    )
    .bind(&new.customer)
    .bind(&new.items)
    .bind(new.total_cents)
    .fetch_one(req.tx())
    .await?;
    let placed = OrderPlaced {
        order_id: id,
        customer: new.customer.clone(),
        items: new.items.clone(),
        total_cents: new.total_cents,
    };
    postbox::sqlx::enqueue(&app.outbox, req.tx(), &NewEvent::typed(&placed)?).await?;
    let order = Order {
        id,
        customer: new.customer,
        items: new.items,
        total_cents: new.total_cents,
        created_at,
    };
    // Stores the response with the key, and commits order + event + key.
    Ok(req.commit_json(StatusCode::CREATED, &order).await?)
}

async fn get_order(State(app): State<App>, Path(id): Path<i64>) -> Result<Json<Order>, ApiError> {
    let row: Option<(String, Vec<String>, i64, DateTime<Utc>)> =
        sqlx::query_as("SELECT customer, items, total_cents, created_at FROM orders WHERE id = $1")
            .bind(id)
            .fetch_optional(&app.pool)
            .await?;
    let (customer, items, total_cents, created_at) = row.ok_or(ApiError::NotFound)?;
    Ok(Json(Order {
        id,
        customer,
        items,
        total_cents,
        created_at,
    }))
}

async fn get_customer(
    State(app): State<App>,
    Path(customer): Path<String>,
) -> Result<Json<CustomerStats>, ApiError> {
    let row: Option<(i64, i64)> =
        sqlx::query_as("SELECT orders, spent_cents FROM customer_stats WHERE customer = $1")
            .bind(&customer)
            .fetch_optional(&app.pool)
            .await?;
    let (orders, spent_cents) = row.ok_or(ApiError::NotFound)?;
    Ok(Json(CustomerStats {
        customer,
        orders,
        spent_cents,
    }))
}

/// Why a request failed. Server-side failures answer 500 with a fixed phrase;
/// their details go to the log only.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("the body is not a valid order: {0}")]
    Body(#[from] serde_json::Error),
    #[error("{0}")]
    Invalid(&'static str),
    #[error("not found")]
    NotFound,
    #[error("internal error")]
    Database(#[from] sqlx::Error),
    #[error("internal error")]
    Event(#[from] postbox::Error),
    #[error("internal error")]
    Idempotency(#[from] IdempotencyError),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self {
            ApiError::Body(_) | ApiError::Invalid(_) => StatusCode::BAD_REQUEST,
            ApiError::NotFound => StatusCode::NOT_FOUND,
            ApiError::Database(e) => internal(e),
            ApiError::Event(e) => internal(e),
            ApiError::Idempotency(e) => internal(e),
        };
        // Returning before `commit` drops the transaction: nothing of the
        // request stays, and a retry with the same key runs again.
        let body = serde_json::json!({ "error": self.to_string() });
        (status, Json(body)).into_response()
    }
}

fn internal(error: &dyn std::error::Error) -> StatusCode {
    tracing::error!(error = %error, source = ?error.source(), "request failed");
    StatusCode::INTERNAL_SERVER_ERROR
}

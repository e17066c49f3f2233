//! [axum](https://docs.rs/axum) integration: refuse forged deliveries before the
//! handler runs. Enabled with the cargo feature `axum` (which implies `verify`).
//!
//! The [`Verified`] extractor buffers the request body (honouring axum's
//! `DefaultBodyLimit`), checks its signature over those exact bytes with the
//! [`SignatureVerifier`] found in the router state, and only then hands headers and
//! body to the handler. A missing or bad signature is answered `401 Unauthorized`
//! with an empty body, so a sender learns nothing about why; a body over the limit
//! gets `413`, an unreadable one `400`.
//!
//! ```no_run
//! use axum::{routing::post, Router};
//! use postbox::axum::{SignatureVerifier, Verified};
//! use postbox::verify::webhooks;
//!
//! async fn hook(Verified { headers, body }: Verified) -> &'static str {
//!     // `body` is exactly what was signed: parse it now.
//!     let _ = (headers, body);
//!     "ok"
//! }
//!
//! # fn app() -> Result<Router, Box<dyn std::error::Error>> {
//! let verifier = SignatureVerifier::from(webhooks::Verifier::from_env()?);
//! let app: Router = Router::new().route("/hook", post(hook)).with_state(verifier);
//! # Ok(app) }
//! ```
//!
//! With a larger application state, implement `FromRef<YourState>` for
//! [`SignatureVerifier`] (or derive it with axum's `FromRef` macro).
//!
//! To log why a delivery was refused, take `Result<Verified, Rejection>` in the
//! handler and return the [`Rejection`] after logging it: its `Display` and sources
//! name the failed check and never contain a secret.
//!
//! **Typed bodies.** `Verified<Json<T>>` decodes the verified bytes as JSON
//! after the signature check (never before: an unsigned body is not parsed),
//! refusing a body that does not decode with axum's own [`JsonRejection`]
//! (`400` for bad syntax, `422` for valid JSON of the wrong shape). The same
//! [`FromBody`] trait types `Idempotent<Json<T>>` (feature `sqlx`).
//!
//! ```no_run
//! use axum::Json;
//! use postbox::axum::Verified;
//!
//! #[derive(serde::Deserialize)]
//! struct OrderPlaced { order_id: String }
//!
//! async fn hook(Verified { body: Json(event), .. }: Verified<Json<OrderPlaced>>) -> String {
//!     event.order_id
//! }
//! ```

use std::fmt;
use std::sync::Arc;

use ::axum::body::Bytes;
use ::axum::extract::rejection::{BytesRejection, JsonRejection};
use ::axum::extract::{FromRef, FromRequest, Request};
use ::axum::http::{HeaderMap, StatusCode};
use ::axum::response::{IntoResponse, Response};

use crate::verify::{qstash, webhooks};

/// Which signature scheme deliveries must carry, with its keys. Cheap to clone.
#[derive(Clone)]
pub struct SignatureVerifier(Arc<Scheme>);

enum Scheme {
    QStash(qstash::Verifier),
    Webhooks(webhooks::Verifier),
}

impl fmt::Debug for SignatureVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Both verifiers redact their keys in `Debug`.
        match &*self.0 {
            Scheme::QStash(v) => f.debug_tuple("SignatureVerifier").field(v).finish(),
            Scheme::Webhooks(v) => f.debug_tuple("SignatureVerifier").field(v).finish(),
        }
    }
}

impl SignatureVerifier {
    /// Require QStash signatures (`Upstash-Signature`).
    pub fn qstash(verifier: qstash::Verifier) -> Self {
        Self(Arc::new(Scheme::QStash(verifier)))
    }

    /// Require Standard Webhooks signatures (`webhook-id`, `webhook-timestamp`,
    /// `webhook-signature`).
    pub fn webhooks(verifier: webhooks::Verifier) -> Self {
        Self(Arc::new(Scheme::Webhooks(verifier)))
    }

    /// Whether the signature covers the request's id headers (`webhook-id`):
    /// Standard Webhooks signs them, QStash signs only the body.
    pub fn signs_headers(&self) -> bool {
        matches!(&*self.0, Scheme::Webhooks(_))
    }

    /// Verify a request's headers and exact raw body against the system clock.
    pub fn verify(&self, headers: &HeaderMap, body: &[u8]) -> Result<(), SignatureError> {
        match &*self.0 {
            Scheme::QStash(v) => {
                let token = header(headers, qstash::SIGNATURE_HEADER);
                v.verify(token, body)
                    .map(drop)
                    .map_err(SignatureError::QStash)
            }
            Scheme::Webhooks(v) => {
                let found = webhooks::Headers::from_lookup(|name| header(headers, name));
                v.verify(&found, body).map_err(SignatureError::Webhooks)
            }
        }
    }
}

impl From<qstash::Verifier> for SignatureVerifier {
    fn from(verifier: qstash::Verifier) -> Self {
        Self::qstash(verifier)
    }
}

impl From<webhooks::Verifier> for SignatureVerifier {
    fn from(verifier: webhooks::Verifier) -> Self {
        Self::webhooks(verifier)
    }
}

/// A header's value as text; absent when missing or not visible ASCII.
fn header<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Why a signature was refused. Messages name the failed check, never a key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SignatureError {
    /// The QStash token did not verify.
    #[error("QStash signature refused")]
    QStash(#[source] qstash::VerifyError),
    /// The Standard Webhooks signature did not verify.
    #[error("Standard Webhooks signature refused")]
    Webhooks(#[source] webhooks::VerifyError),
}

/// How an extractor that reads the whole body first ([`Verified`],
/// `Idempotent`) hands the body to the handler: the exact bytes
/// ([`Bytes`], the default), or decoded as JSON ([`Json<T>`](::axum::Json))
/// with axum's own rejection when it does not decode.
pub trait FromBody: Sized + Send {
    /// The body, from the bytes as received.
    fn from_body(bytes: Bytes) -> Result<Self, JsonRejection>;
}

impl FromBody for Bytes {
    fn from_body(bytes: Bytes) -> Result<Self, JsonRejection> {
        Ok(bytes)
    }
}

impl<T: serde::de::DeserializeOwned + Send> FromBody for ::axum::Json<T> {
    fn from_body(bytes: Bytes) -> Result<Self, JsonRejection> {
        ::axum::Json::from_bytes(&bytes)
    }
}

/// A request whose signature verified: its headers and its body — the exact
/// raw bytes by default, or decoded ([`FromBody`]) after the check.
#[derive(Debug, Clone)]
pub struct Verified<B = Bytes> {
    /// The request headers.
    pub headers: HeaderMap,
    /// The body whose signature verified.
    pub body: B,
}

/// Why [`Verified`] refused a request. As a response it is a bare status code.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Rejection {
    /// The body could not be read, or is larger than the route's body limit.
    #[error("the request body could not be read")]
    Body(#[source] BytesRejection),
    /// The signature is missing or wrong.
    #[error("the delivery's signature did not verify")]
    Signature(#[source] SignatureError),
    /// The signature verified, but the body did not decode as the handler's type.
    #[error("the verified body did not decode")]
    Decode(#[source] JsonRejection),
}

impl Rejection {
    /// The status answered: 401 for a signature, 413 for a body over the limit,
    /// 400 for another body error; for a body that verified but did not
    /// decode, axum's (400 bad syntax, 422 wrong shape).
    pub fn status(&self) -> StatusCode {
        match self {
            Rejection::Body(e) => e.status(),
            Rejection::Signature(_) => StatusCode::UNAUTHORIZED,
            Rejection::Decode(e) => e.status(),
        }
    }
}

impl IntoResponse for Rejection {
    fn into_response(self) -> Response {
        match self {
            // The sender proved who it is: axum's own explanation helps it.
            Rejection::Decode(e) => e.into_response(),
            // No body: a forger learns nothing about which check failed.
            other => other.status().into_response(),
        }
    }
}

impl<S, B> FromRequest<S> for Verified<B>
where
    S: Send + Sync,
    SignatureVerifier: FromRef<S>,
    B: FromBody,
{
    type Rejection = Rejection;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let verifier = SignatureVerifier::from_ref(state);
        let headers = req.headers().clone();
        let body = Bytes::from_request(req, state)
            .await
            .map_err(Rejection::Body)?;
        match verifier.verify(&headers, &body) {
            Ok(()) => Ok(Verified {
                headers,
                body: B::from_body(body).map_err(Rejection::Decode)?,
            }),
            Err(e) => {
                tracing::debug!(error = %e, reason = %source_text(&e), "refused a delivery");
                Err(Rejection::Signature(e))
            }
        }
    }
}

fn source_text(e: &SignatureError) -> String {
    std::error::Error::source(e).map_or_else(String::new, ToString::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::axum::body::Body;
    use ::axum::extract::DefaultBodyLimit;

    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const KEY: &str = "sig_current_key";
    const URL: &str = "https://example.com/hook";

    fn webhooks_verifier() -> SignatureVerifier {
        webhooks::Verifier::new(SECRET).expect("valid").into()
    }

    fn qstash_verifier() -> SignatureVerifier {
        qstash::Verifier::new(KEY, None)
            .expect("valid")
            .with_expected_url(URL)
            .into()
    }

    fn webhooks_request(body: &[u8], signed: &[u8]) -> Request {
        let now = chrono::Utc::now().timestamp();
        let signature = webhooks::Signer::new(SECRET)
            .expect("valid")
            .sign("msg_1", now, signed);
        Request::builder()
            .method("POST")
            .header("webhook-id", "msg_1")
            .header("webhook-timestamp", now.to_string())
            .header("webhook-signature", signature)
            .body(Body::from(body.to_vec()))
            .expect("request")
    }

    async fn extract(req: Request, state: &SignatureVerifier) -> Result<Verified, Rejection> {
        Verified::from_request(req, state).await
    }

    #[derive(Debug, serde::Deserialize, PartialEq)]
    struct Order {
        a: i64,
    }

    #[tokio::test]
    async fn a_typed_body_decodes_after_the_check_with_axums_rejections() {
        use ::axum::Json;
        let verifier = webhooks_verifier();
        let body = br#"{"a": 1}"#;
        let Verified {
            body: Json(order),
            headers,
        } = Verified::<Json<Order>>::from_request(webhooks_request(body, body), &verifier)
            .await
            .expect("verifies and decodes");
        assert_eq!(order, Order { a: 1 });
        assert_eq!(headers["webhook-id"], "msg_1");

        // Signed, but of the wrong shape: axum's 422, with its explanation.
        let wrong = br#"{"a": "one"}"#;
        let rejection =
            Verified::<Json<Order>>::from_request(webhooks_request(wrong, wrong), &verifier)
                .await
                .expect_err("does not decode");
        assert!(matches!(rejection, Rejection::Decode(_)), "{rejection}");
        assert_eq!(rejection.status(), StatusCode::UNPROCESSABLE_ENTITY);
        let response = rejection.into_response();
        let text = ::axum::body::to_bytes(response.into_body(), 4096)
            .await
            .expect("body");
        assert!(!text.is_empty(), "axum says why");

        // Signed, not JSON at all: 400.
        let junk = b"not json";
        let rejection =
            Verified::<Json<Order>>::from_request(webhooks_request(junk, junk), &verifier)
                .await
                .expect_err("does not parse");
        assert_eq!(rejection.status(), StatusCode::BAD_REQUEST);

        // A forged body is refused before it is parsed: 401, no explanation.
        let rejection = Verified::<Json<Order>>::from_request(
            webhooks_request(br#"{"a": 2}"#, body),
            &verifier,
        )
        .await
        .expect_err("forged");
        assert!(matches!(rejection, Rejection::Signature(_)));
    }

    #[tokio::test]
    async fn webhooks_signature_passes_and_keeps_exact_body() {
        let body = br#"{"a": 1}"#;
        let verified = extract(webhooks_request(body, body), &webhooks_verifier())
            .await
            .expect("verifies");
        assert_eq!(&verified.body[..], body);
        assert_eq!(verified.headers["webhook-id"], "msg_1");
    }

    #[tokio::test]
    async fn tampered_body_is_401_with_empty_body() {
        let rejection = extract(
            webhooks_request(b"{\"a\": 2}", b"{\"a\": 1}"),
            &webhooks_verifier(),
        )
        .await
        .expect_err("refused");
        assert!(matches!(
            rejection,
            Rejection::Signature(SignatureError::Webhooks(
                webhooks::VerifyError::SignatureMismatch
            ))
        ));
        let response = rejection.into_response();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        let bytes = ::axum::body::to_bytes(response.into_body(), 1024)
            .await
            .expect("body");
        assert!(bytes.is_empty());
    }

    #[tokio::test]
    async fn qstash_token_passes_and_wrong_scheme_fails() {
        let body = b"payload";
        let claims = qstash::Claims::new(URL, body, chrono::Utc::now().timestamp(), 60);
        let token = qstash::sign(KEY, &claims).expect("signs");
        let request = || {
            Request::builder()
                .method("POST")
                .header("Upstash-Signature", token.clone())
                .body(Body::from(body.to_vec()))
                .expect("request")
        };
        let verified = extract(request(), &qstash_verifier())
            .await
            .expect("verifies");
        assert_eq!(&verified.body[..], body);
        // A QStash token means nothing to a Standard Webhooks verifier.
        let rejection = extract(request(), &webhooks_verifier())
            .await
            .expect_err("refused");
        assert_eq!(rejection.status(), StatusCode::UNAUTHORIZED);
        // Nor does a missing header.
        let bare = Request::builder()
            .method("POST")
            .body(Body::from(body.to_vec()))
            .expect("request");
        let rejection = extract(bare, &qstash_verifier())
            .await
            .expect_err("refused");
        assert!(matches!(
            rejection,
            Rejection::Signature(SignatureError::QStash(qstash::VerifyError::MissingHeader))
        ));
    }

    #[tokio::test]
    async fn body_over_the_limit_is_413_before_verification() {
        use ::axum::routing::post;
        use ::axum::Router;
        use tower::ServiceExt as _;

        async fn call(app: Router, req: Request) -> StatusCode {
            app.oneshot(req).await.expect("infallible").status()
        }

        let app = Router::new()
            .route(
                "/",
                post(|Verified { body, .. }: Verified| async move { body.len().to_string() }),
            )
            .layer(DefaultBodyLimit::max(8))
            .with_state(webhooks_verifier());
        let big = webhooks_request(&[b'x'; 9], &[b'x'; 9]);
        assert_eq!(call(app.clone(), big).await, StatusCode::PAYLOAD_TOO_LARGE);
        let small = webhooks_request(&[b'x'; 8], &[b'x'; 8]);
        assert_eq!(call(app, small).await, StatusCode::OK);
    }

    #[test]
    fn debug_does_not_show_keys() {
        let text = format!("{:?} {:?}", webhooks_verifier(), qstash_verifier());
        assert!(!text.contains("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"), "{text}");
        assert!(!text.contains(KEY), "{text}");
    }
}

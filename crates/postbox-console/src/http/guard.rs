//! The guard every state-changing request passes through.
//!
//! [`STATE_CHANGING`] names each route that changes state (every method but
//! GET and HEAD) and who may use it. The router mounts every state-changing
//! handler wrapped in [`guarded`], which finds the route's row when the
//! route is mounted and, on each request, before the handler runs,
//!
//! 1. refuses the request if the route has no row (a new route cannot
//!    forget its checks: it is refused until it has one),
//! 2. sends a request without a live session to sign-in,
//! 3. refuses a form without the session's CSRF token,
//! 4. refuses a session whose role is below the route's,
//!
//! and hands the handler the session it checked ([`Checked`]), which only
//! the guard makes. Sign-in itself has no session yet: its row says so, and
//! its handler checks the sign-in form's own token (issued by the console
//! process, bound to the form's cookie) and the sign-in rate limits. Before
//! the guard, the outbox check ([`crate::http::access`]) has refused a user
//! whose role does not apply to the outbox the request is about.

use crate::auth::{self, Role, Session};
use crate::form::FormData;
use crate::http::reply::{internal, Fail};
use crate::Console;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::handler::Handler;
use axum::http::request::Parts;
use axum::http::Method;
use axum::response::{IntoResponse, Response};
use std::future::Future;
use std::pin::Pin;

/// Who may send a state-changing request to a route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// The sign-in form: there is no session yet. Its handler checks the
    /// form's own token (issued by the console process, bound to the form's
    /// cookie) and the sign-in rate limits.
    SignIn,
    /// A live session, the session's CSRF token in the form, and at least
    /// this role (`Viewer`: any signed-in user).
    Session(Role),
}

/// One row of the guard's table: a state-changing route and who may use it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateChangingRoute {
    pub method: Method,
    /// The route's path as the router mounts it (`{id}` is a parameter).
    pub path: &'static str,
    pub access: Access,
}

const fn row(method: Method, path: &'static str, access: Access) -> StateChangingRoute {
    StateChangingRoute {
        method,
        path,
        access,
    }
}

/// Any signed-in user.
const SIGNED_IN: Access = Access::Session(Role::Viewer);
/// An operator.
const OPERATOR: Access = Access::Session(Role::Operator);

/// Every state-changing route the console serves, and who may use it. A
/// state-changing route without a row here is refused (and `tests/guard.rs`
/// fails).
pub(crate) static STATE_CHANGING: &[StateChangingRoute] = &[
    row(Method::POST, "/sign-in", Access::SignIn),
    row(Method::POST, "/sign-out", SIGNED_IN),
    row(Method::POST, "/events/{id}/replay", OPERATOR),
    row(Method::POST, "/events/{id}/discard", OPERATOR),
    row(Method::POST, "/dead-letters/action", OPERATOR),
    row(Method::POST, "/groups/action", OPERATOR),
    row(Method::POST, "/jobs/{id}/cancel", OPERATOR),
    row(Method::POST, "/replays/{id}/cancel", OPERATOR),
];

/// Who may send `method` to the route mounted at `path`; `None` when the
/// table has no row for it.
fn access(method: &Method, path: &str) -> Option<Access> {
    STATE_CHANGING
        .iter()
        .find(|r| r.method == *method && r.path == path)
        .map(|r| r.access)
}

const CSRF_REFUSED: &str = "This form is out of date or did not come from the console (CSRF token missing or wrong). Reload the page and try again.";
const ROLE_REFUSED: &str =
    "Your role (viewer) can look but not replay, discard or cancel. Ask for the operator role.";

/// `handler`, for `method` on the route mounted at `path`, behind the guard.
pub(crate) fn guarded<H>(method: Method, path: &'static str, handler: H) -> Guarded<H> {
    Guarded {
        access: access(&method, path),
        method,
        path,
        handler,
    }
}

/// A state-changing handler behind the guard; made by [`guarded`].
#[derive(Clone)]
pub(crate) struct Guarded<H> {
    /// The route's row, found when the route was mounted.
    access: Option<Access>,
    method: Method,
    path: &'static str,
    handler: H,
}

impl<H, T> Handler<T, Console> for Guarded<H>
where
    H: Handler<T, Console>,
    T: 'static,
{
    type Future = Pin<Box<dyn Future<Output = Response> + Send>>;

    fn call(self, req: Request, console: Console) -> Self::Future {
        Box::pin(async move {
            match self.check(req, &console).await {
                Ok(req) => self.handler.call(req, console).await,
                Err(refused) => refused,
            }
        })
    }
}

impl<H> Guarded<H> {
    /// The request to hand on (its form read and put back, the checked
    /// session among its extensions), or the refusal.
    async fn check(&self, req: Request, console: &Console) -> Result<Request, Response> {
        let Some(access) = self.access else {
            tracing::error!(
                method = %self.method,
                path = self.path,
                "refused: a state-changing route without its row in the console guard's table"
            );
            return Err(Fail::Internal.into_response());
        };
        let Access::Session(needed) = access else {
            return Ok(req);
        };
        let (mut parts, body) = req.into_parts();
        let session = Session::from_request_parts(&mut parts, console).await?;
        // Read the form (within the router's body limit) for its token, then
        // hand the same bytes on to the handler.
        let body = Bytes::from_request(Request::from_parts(parts.clone(), body), &())
            .await
            .map_err(IntoResponse::into_response)?;
        if !auth::same_secret(
            FormData::parse(&body).get("csrf").unwrap_or(""),
            &session.csrf,
        ) {
            return Err(Fail::Forbidden(CSRF_REFUSED).into_response());
        }
        if !session.role.includes(needed) {
            return Err(Fail::Forbidden(ROLE_REFUSED).into_response());
        }
        parts.extensions.insert(Checked(session));
        Ok(Request::from_parts(parts, Body::from(body)))
    }
}

/// The replay and discard requests of `session`'s user, rate limited: their
/// handlers check it once the request's form is read.
pub(crate) fn limit_actions(console: &Console, session: &Session) -> Result<(), Fail> {
    console.inner.actions.check(&session.user).map_err(|wait| {
        Fail::TooMany(
            wait,
            "You have sent many replay or discard requests in a short time.",
        )
    })
}

/// The session the guard checked for this request: live, its CSRF token in
/// the form, its role enough for the route. Only the guard makes one; a
/// handler that asks for it on a route the guard let by unchecked fails.
#[derive(Clone, Debug)]
pub(crate) struct Checked(Session);

impl std::ops::Deref for Checked {
    type Target = Session;

    fn deref(&self) -> &Session {
        &self.0
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Checked {
    type Rejection = Fail;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Fail> {
        parts
            .extensions
            .remove::<Checked>()
            .ok_or_else(|| internal(&"a handler wants a checked session the guard did not give"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ConsoleConfig;
    use axum::http::StatusCode;
    use axum::routing::post;
    use axum::Router;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use tower::ServiceExt;

    #[test]
    fn the_table_has_one_row_per_route_and_only_sign_in_goes_without_a_session() {
        for (i, r) in STATE_CHANGING.iter().enumerate() {
            assert!(
                r.method != Method::GET && r.method != Method::HEAD,
                "{} {} leaves state alone",
                r.method,
                r.path
            );
            assert!(
                STATE_CHANGING[..i]
                    .iter()
                    .all(|o| (&o.method, o.path) != (&r.method, r.path)),
                "{} {} has two rows",
                r.method,
                r.path
            );
        }
        let sign_in: Vec<&str> = STATE_CHANGING
            .iter()
            .filter(|r| r.access == Access::SignIn)
            .map(|r| r.path)
            .collect();
        assert_eq!(sign_in, ["/sign-in"]);
    }

    #[tokio::test]
    async fn a_state_changing_route_without_a_row_is_refused_before_its_handler() {
        // The missing row is found before any session lookup: the pool never connects.
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .unwrap();
        let schema = postbox::Schema::new("postbox").unwrap();
        let console = Console::new(pool, ConsoleConfig::new(schema));
        let ran = Arc::new(AtomicBool::new(false));
        let handler_ran = ran.clone();
        let handler = move || async move {
            handler_ran.store(true, Ordering::SeqCst);
            "changed something"
        };
        let app = Router::new()
            .route(
                "/unlisted",
                post(guarded(Method::POST, "/unlisted", handler)),
            )
            .with_state(console);
        let res = app
            .oneshot(
                Request::post("/unlisted")
                    .body(Body::from("csrf=anything"))
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!ran.load(Ordering::SeqCst), "the handler must not run");
    }
}

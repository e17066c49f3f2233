//! The router. Every route is mounted from one list (the pages' `routes`),
//! behind the outbox check ([`crate::http::access`]: the user's role must
//! apply to the outbox the request is about): a page as it is, a
//! state-changing handler only behind the guard ([`crate::http::guard`]),
//! which checks the request's session, CSRF token and role before its
//! handler runs. Serving many outboxes, a layer in front of the routes
//! ([`choose_outbox`]) takes the outbox prefix off the path, and checks that
//! the user may use that outbox. Every response carries the security headers.

use crate::auth::Session;
use crate::http::outbox::Chosen;
use crate::http::reply::{not_found, Fail};
use crate::http::{access, guard};
use crate::outboxes;
use crate::{Console, Served};
use axum::extract::{FromRequestParts, Request, State};
use axum::handler::Handler;
use axum::http::{header, HeaderValue, Method, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{on, MethodFilter};
use axum::Router;

/// The router being built, and the (method, path) of each route it mounts.
/// Pages are mounted as they are; a state-changing handler only behind the
/// guard.
#[derive(Default)]
pub(crate) struct Routes {
    router: Router<Console>,
    mounted: Vec<(Method, &'static str)>,
}

impl Routes {
    /// A page (GET, and HEAD with it): the handler takes the [`Session`] if
    /// it needs one. Behind the outbox check.
    pub(crate) fn get<H: Handler<T, Console>, T: 'static>(
        mut self,
        path: &'static str,
        handler: H,
    ) -> Self {
        let handler = access::scoped(path, handler);
        self.router = self.router.route(path, on(MethodFilter::GET, handler));
        self.mounted.push((Method::GET, path));
        self
    }

    /// A form's target: behind the outbox check, then the guard, which
    /// needs the route's row.
    pub(crate) fn post<H: Handler<T, Console>, T: 'static>(
        mut self,
        path: &'static str,
        handler: H,
    ) -> Self {
        let handler = access::scoped(path, guard::guarded(Method::POST, path, handler));
        self.router = self.router.route(path, on(MethodFilter::POST, handler));
        self.mounted.push((Method::POST, path));
        self
    }

    /// The method and path of every route mounted, in order.
    pub(crate) fn mounted(self) -> Vec<(Method, &'static str)> {
        self.mounted
    }
}

/// The console's router: `routes`, with the fallback and the security
/// headers; serving many outboxes, behind the layer that chooses the outbox.
pub(crate) fn router(console: Console, routes: Routes) -> Router {
    let pages = routes
        .router
        .fallback(not_found)
        .layer(axum::middleware::map_response(security_headers))
        .with_state(console.clone());
    if !console.inner.serves_many() {
        return pages;
    }
    // The prefix is taken off before the routes see the path.
    let choose = axum::middleware::from_fn_with_state(console, choose_outbox);
    Router::new()
        .fallback_service(tower::Layer::layer(&choose, pages))
        .layer(axum::middleware::map_response(security_headers))
}

/// `/o/<database>/<schema>/REST`: find the outbox, check that the user's
/// role applies to it, hand the request on as `/REST` with the outbox among
/// its extensions. An outbox the console does not serve, or one the user
/// may not use, gets the same clear page (after sign-in, like any page).
async fn choose_outbox(State(console): State<Console>, req: Request, next: Next) -> Response {
    let Some(rest) = req.uri().path().strip_prefix("/o/") else {
        return next.run(req).await;
    };
    let mut parts = rest.splitn(3, '/');
    let database = parts.next().and_then(outboxes::unsegment);
    let schema = parts.next().and_then(outboxes::unsegment);
    let tail = parts.next().unwrap_or("");
    let found = match (&console.inner.served, database, schema) {
        (Served::Many(directory), Some(database), Some(schema)) => {
            directory.find(&database, &schema).await
        }
        _ => None,
    };
    let uri = format!(
        "/{tail}{}",
        req.uri()
            .query()
            .map(|q| format!("?{q}"))
            .unwrap_or_default()
    )
    .parse::<Uri>();
    let (Some(outbox), Ok(uri)) = (found, uri) else {
        let (mut parts, _) = req.into_parts();
        if let Err(sign_in_first) = Session::from_request_parts(&mut parts, &console).await {
            return sign_in_first;
        }
        return Fail::NoOutbox.into_response();
    };
    let mut req = match access::check(&console, req, &outbox).await {
        Ok(req) => req,
        Err(refused) => return refused,
    };
    *req.uri_mut() = uri;
    // Its backlog is sampled for its charts while someone looks at it.
    outbox.viewed();
    req.extensions_mut().insert(Chosen(outbox));
    next.run(req).await
}

async fn security_headers(mut res: Response) -> Response {
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    if !h.contains_key(header::CACHE_CONTROL) {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    res
}

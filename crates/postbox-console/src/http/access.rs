//! Which outboxes a signed-in user may see and act in.
//!
//! A user's role applies to the outboxes its patterns name
//! ([`crate::scope`]; none: every outbox). The check runs before any page or
//! the guard of a state-changing route:
//!
//! - serving many outboxes, for every request under an outbox's prefix, as
//!   soon as [`crate::http::routes`]'s layer has found the outbox (before
//!   routing, so even an address no route answers is refused alike), and
//!   again by every route the router mounts ([`scoped`]);
//! - serving one, by every route the router mounts but those above the
//!   outbox ([`ABOVE_THE_OUTBOX`]: signing in and out, the static files).
//!
//! A refused request is answered exactly as one naming no outbox the
//! console serves (404 "No such outbox"), so it does not tell whether the
//! outbox exists, and is logged (at most 10 lines a minute, the others
//! counted in the next line). The all-outboxes overview lists only the
//! outboxes the user may see ([`visible`]).

use crate::auth::Session;
use crate::http::outbox::Chosen;
use crate::http::reply::Fail;
use crate::http::session::Found;
use crate::outboxes::{Line, Outbox, Overview, Problem};
use crate::{Console, Served};
use axum::extract::{FromRequestParts, Request};
use axum::handler::Handler;
use axum::response::{IntoResponse, Response};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// The routes that are about no outbox, serving one: signing in and out,
/// and the static files. Every other route mounted is about the outbox.
pub(crate) const ABOVE_THE_OUTBOX: &[&str] = &[
    "/sign-in",
    "/sign-out",
    "/static/console.css",
    "/static/console.js",
];

/// The database and the schema of `outbox`, as its user's patterns match them.
fn names<'a>(console: &'a Console, outbox: &'a Outbox) -> (&'a str, &'a str) {
    let schema = outbox.schema.name();
    if outbox.base.is_empty() {
        // Serving one outbox: the home schema, in the home pool's database.
        return (&console.inner.home_database, schema);
    }
    // Serving many, an outbox is named `<database>/<schema>`.
    let database = outbox
        .name
        .strip_suffix(schema)
        .and_then(|d| d.strip_suffix('/'))
        .unwrap_or("");
    (database, schema)
}

/// Whether `session`'s role applies to `outbox`.
pub(crate) fn may_use(console: &Console, session: &Session, outbox: &Outbox) -> bool {
    let (database, schema) = names(console, outbox);
    session.outboxes.allows(database, schema)
}

/// The request, its session found and its user's role applying to
/// `outbox`: the session is among its extensions, so it is read once. A
/// request without a session goes to sign-in; one whose user's patterns do
/// not name `outbox` is refused as if the console did not serve it.
pub(crate) async fn check(
    console: &Console,
    req: Request,
    outbox: &Outbox,
) -> Result<Request, Response> {
    let (mut parts, body) = req.into_parts();
    let session = Session::from_request_parts(&mut parts, console).await?;
    if !may_use(console, &session, outbox) {
        if let Some(left_out) = console.inner.refusals.admit() {
            tracing::warn!(
                user = %session.user,
                outbox = %outbox.name,
                method = %parts.method,
                path = %parts.uri.path(),
                left_out,
                "console: refused a request about an outbox the user's role does not apply to \
                 (left_out: refusals not logged since the last line)"
            );
        }
        return Err(Fail::NoOutbox.into_response());
    }
    parts.extensions.insert(Found(session));
    Ok(Request::from_parts(parts, body))
}

/// `handler`, mounted at `path`, behind the outbox check: serving many
/// outboxes, the outbox the request's prefix chose (checked once already,
/// before routing); serving one, its outbox, unless `path` is above it.
pub(crate) fn scoped<H>(path: &'static str, handler: H) -> Scoped<H> {
    Scoped {
        above: ABOVE_THE_OUTBOX.contains(&path),
        handler,
    }
}

/// A handler behind the outbox check; made by [`scoped`].
#[derive(Clone)]
pub(crate) struct Scoped<H> {
    above: bool,
    handler: H,
}

impl<H, T> Handler<T, Console> for Scoped<H>
where
    H: Handler<T, Console>,
    T: 'static,
{
    type Future = Pin<Box<dyn Future<Output = Response> + Send>>;

    fn call(self, req: Request, console: Console) -> Self::Future {
        Box::pin(async move {
            let outbox: Option<Arc<Outbox>> =
                match (&console.inner.served, req.extensions().get::<Chosen>()) {
                    (_, Some(Chosen(outbox))) => Some(outbox.clone()),
                    (Served::One(outbox), None) if !self.above => Some(outbox.clone()),
                    _ => None,
                };
            let req = match outbox {
                Some(outbox) => match check(&console, req, &outbox).await {
                    Ok(req) => req,
                    Err(refused) => return refused,
                },
                None => req,
            };
            self.handler.call(req, console).await
        })
    }
}

/// The all-outboxes overview's read as `session` may see it: the lines of
/// the outboxes its role applies to, how many outboxes that is, and the
/// problems listing them (a problem names a database or a server: shown to
/// users of every outbox only).
pub(crate) fn visible<'a>(
    console: &Console,
    session: &Session,
    read: &'a Overview,
) -> (Vec<Line>, usize, &'a [Problem]) {
    let lines: Vec<Line> = read
        .lines
        .iter()
        .filter(|l| may_use(console, session, &l.outbox))
        .cloned()
        .collect();
    let outboxes = read
        .known
        .outboxes
        .iter()
        .filter(|o| may_use(console, session, o))
        .count();
    let problems: &[Problem] = if session.outboxes.is_every() {
        &read.known.problems
    } else {
        &[]
    };
    (lines, outboxes, problems)
}

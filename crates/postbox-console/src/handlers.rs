//! Routes: every route is mounted from [`routes`]; a state-changing one
//! behind the guard ([`crate::http::guard`]), which checks the request's session,
//! CSRF token and role before its handler runs. Pages take the signed-in
//! [`Session`], state-changing handlers the guard's [`Checked`] session. Each
//! handler reads or acts through the store and renders a page. No response
//! carries an error's text: failures are logged (sanitized) and answered with
//! fixed phrases.
//!
//! Serving many outboxes, a layer in front of the routes takes the outbox
//! prefix (`/o/<database>/<schema>`) off the path and hands the outbox on as
//! an extension ([`Chosen`]), so every route is the same under each prefix
//! and passes the same guard; the [`Here`] extractor gives a handler its
//! outbox (serving one outbox, always the home schema's).

use crate::auth::{self, ClientAddr, Session, SESSION_COOKIE, SIGN_IN_COOKIE};
use crate::form::FormData;
use crate::http::guard::{self, Checked};
use crate::jobs::JobState;
use crate::limit::Admit;
use crate::outboxes::{self, Outbox};
use crate::views::{self, EventSearch, Frame};
use crate::{assets, Console, Served};
use axum::body::Bytes;
use axum::extract::{FromRequestParts, Path, RawQuery, Request, State};
use axum::handler::Handler;
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{on, MethodFilter};
use axum::Router;
use chrono::{DateTime, NaiveDate, NaiveDateTime, Utc};
use maud::Markup;
use postbox_store::{
    Action, EventQuery, Filter, GroupOf, Selection, StatusFilter, MAX_REASON_BYTES,
};
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

/// Audit actions the console writes itself (replays and discards use `store::dlq`'s).
pub(crate) const ACTION_SIGN_IN: &str = "console.sign_in";
pub(crate) const ACTION_SIGN_IN_FAILED: &str = "console.sign_in_failed";
pub(crate) const ACTION_SIGN_OUT: &str = "console.sign_out";

/// Minutes shown in the delivery-rate chart, and the newest outbox rows it counts among.
const RATE_MINUTES: i32 = 30;
const RATE_WINDOW_ROWS: i64 = 200_000;
/// Event ids one bulk request may name.
const MAX_SELECTED: usize = 10_000;
/// Groups shown on the by-cause page, and dead letters one group action takes.
const MAX_GROUPS: i64 = 200;
const MAX_GROUP_EVENTS: i64 = 100_000;

/// Every route the console serves. The router mounts these and nothing else;
/// each state-changing one needs its row in [`guard::STATE_CHANGING`].
fn routes() -> Routes {
    Routes::default()
        .get("/", overview)
        .get("/sign-in", sign_in_page)
        .post("/sign-in", sign_in)
        .post("/sign-out", sign_out)
        .get("/events", events)
        .get("/events/{id}", event_page)
        .post("/events/{id}/replay", replay_one)
        .post("/events/{id}/discard", discard_one)
        .get("/dead-letters", dead_letters)
        .post("/dead-letters/action", bulk_action)
        .get("/groups", groups)
        .post("/groups/action", group_action)
        .get("/jobs/{id}", job_page)
        .get("/jobs/{id}/progress", job_progress)
        .post("/jobs/{id}/cancel", job_cancel)
        .get("/audit", audit)
        .get("/static/console.css", assets::css)
        .get("/static/console.js", assets::js)
}

pub(crate) fn router(console: Console) -> Router {
    let pages = routes()
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

/// The outbox a request's path prefix chose (serving many outboxes).
#[derive(Clone)]
pub(crate) struct Chosen(pub Arc<Outbox>);

/// `/o/<database>/<schema>/REST`: find the outbox, hand the request on as
/// `/REST` with the outbox among its extensions. An outbox the console does
/// not serve gets a clear page (after sign-in, like any page).
async fn choose_outbox(State(console): State<Console>, mut req: Request, next: Next) -> Response {
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
    *req.uri_mut() = uri;
    // Its backlog is sampled for its charts while someone looks at it.
    outbox.viewed();
    req.extensions_mut().insert(Chosen(outbox));
    next.run(req).await
}

/// Where a request is: one outbox's pages, or above them (the all-outboxes
/// overview and the home schema's sign-in log, serving many).
pub(crate) enum Place {
    Outbox(Arc<Outbox>),
    All,
}

impl FromRequestParts<Console> for Place {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        console: &Console,
    ) -> Result<Self, Self::Rejection> {
        Ok(
            match (&console.inner.served, parts.extensions.get::<Chosen>()) {
                (_, Some(Chosen(outbox))) => Place::Outbox(outbox.clone()),
                (Served::One(outbox), None) => Place::Outbox(outbox.clone()),
                (Served::Many(_), None) => Place::All,
            },
        )
    }
}

/// The outbox a page is about. Serving many, a page of one outbox without a
/// prefix goes to the all-outboxes overview.
pub(crate) struct Here(pub Arc<Outbox>);

impl FromRequestParts<Console> for Here {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, console: &Console) -> Result<Self, Response> {
        match Place::from_request_parts(parts, console).await {
            Ok(Place::Outbox(outbox)) => Ok(Here(outbox)),
            _ => Err(see_other("/")),
        }
    }
}

impl std::ops::Deref for Here {
    type Target = Outbox;

    fn deref(&self) -> &Outbox {
        &self.0
    }
}

/// The frame of a page of `outbox` for `session`.
fn frame<'a>(console: &Console, session: &'a Session, outbox: &'a Outbox) -> Frame<'a> {
    let many = console.inner.serves_many();
    Frame {
        session,
        base: &outbox.base,
        outbox: many.then_some(outbox.name.as_str()),
        many,
    }
}

/// A failed read or action of `outbox`: a clear page when the outbox is
/// missing or out of reach (the others are not affected), else 500.
pub(crate) fn failed(outbox: &Outbox, e: &(dyn std::error::Error + 'static)) -> Fail {
    let mut cause = Some(e);
    while let Some(err) = cause {
        if let Some(why) = err
            .downcast_ref::<sqlx::Error>()
            .and_then(outboxes::unreadable)
        {
            tracing::warn!(
                outbox = %outbox.name,
                error = %postbox::redact::sanitize_error(&e.to_string()),
                "console: cannot read the outbox"
            );
            return Fail::Unreadable {
                outbox: outbox.name.clone(),
                why,
            };
        }
        cause = err.source();
    }
    internal(&e)
}

/// The method and path of every route the router mounts, in order.
pub(crate) fn mounted() -> Vec<(Method, &'static str)> {
    routes().mounted
}

/// The router being built, and the (method, path) of each route it mounts.
/// Pages are mounted as they are; a state-changing handler only behind the
/// guard.
#[derive(Default)]
struct Routes {
    router: Router<Console>,
    mounted: Vec<(Method, &'static str)>,
}

impl Routes {
    /// A page (GET, and HEAD with it): the handler takes the [`Session`] if it needs one.
    fn get<H: Handler<T, Console>, T: 'static>(mut self, path: &'static str, handler: H) -> Self {
        self.router = self.router.route(path, on(MethodFilter::GET, handler));
        self.mounted.push((Method::GET, path));
        self
    }

    /// A form's target: behind the guard, which needs the route's row.
    fn post<H: Handler<T, Console>, T: 'static>(mut self, path: &'static str, handler: H) -> Self {
        let handler = guard::guarded(Method::POST, path, handler);
        self.router = self.router.route(path, on(MethodFilter::POST, handler));
        self.mounted.push((Method::POST, path));
        self
    }
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

/// A refused or failed request, answered with a fixed phrase.
pub(crate) enum Fail {
    Internal,
    NotFound,
    /// A prefix naming no outbox the console serves.
    NoOutbox,
    /// An outbox that cannot be read now (missing tables, database down).
    Unreadable {
        outbox: String,
        why: &'static str,
    },
    Forbidden(&'static str),
    BadRequest(String),
    TooMany(Duration, &'static str),
}

impl IntoResponse for Fail {
    fn into_response(self) -> Response {
        let (status, title, text, retry) = match self {
            Fail::Internal => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "Something went wrong",
                "The console could not complete this request; its log says why. Try again in a moment.".to_owned(),
                None,
            ),
            Fail::NotFound => (
                StatusCode::NOT_FOUND,
                "Not found",
                "There is nothing at this address.".to_owned(),
                None,
            ),
            Fail::NoOutbox => (
                StatusCode::NOT_FOUND,
                "No such outbox",
                "The console serves no outbox at this address: its schema or database is not among those it was started for, or no longer holds an outbox. The overview lists those it serves.".to_owned(),
                None,
            ),
            Fail::Unreadable { outbox, why } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "This outbox cannot be read",
                format!("Outbox {outbox}: {why} The other outboxes are not affected."),
                None,
            ),
            Fail::Forbidden(why) => (StatusCode::FORBIDDEN, "Not allowed", why.to_owned(), None),
            Fail::BadRequest(why) => (StatusCode::BAD_REQUEST, "Cannot do that", why, None),
            Fail::TooMany(wait, what) => (
                StatusCode::TOO_MANY_REQUESTS,
                "Too many requests",
                format!("{what} Try again in {} s.", wait.as_secs().max(1)),
                Some(wait),
            ),
        };
        let mut res = (status, page(views::error_page(title, &text))).into_response();
        if let Some(wait) = retry {
            if let Ok(v) = HeaderValue::from_str(&wait.as_secs().max(1).to_string()) {
                res.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        res
    }
}

/// Log a failure without its secrets and answer 500.
pub(crate) fn internal(e: &dyn std::fmt::Display) -> Fail {
    tracing::error!(
        error = %postbox::redact::sanitize_error(&e.to_string()),
        "console request failed"
    );
    Fail::Internal
}

/// 303 See Other to a local path (the overview if it cannot be a header).
pub(crate) fn see_other(location: &str) -> Response {
    let location =
        HeaderValue::from_str(location).unwrap_or_else(|_| HeaderValue::from_static("/"));
    (StatusCode::SEE_OTHER, [(header::LOCATION, location)]).into_response()
}

fn page(markup: Markup) -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        markup.into_string(),
    )
        .into_response()
}

async fn not_found() -> Fail {
    Fail::NotFound
}

fn limit_actions(console: &Console, session: &Session) -> Result<(), Fail> {
    console.inner.actions.check(&session.user).map_err(|wait| {
        Fail::TooMany(
            wait,
            "You have sent many replay or discard requests in a short time.",
        )
    })
}

/// How often live pages refresh themselves, in milliseconds.
fn refresh_ms(console: &Console) -> u64 {
    u64::try_from(console.inner.config.refresh_every.as_millis())
        .unwrap_or(u64::MAX)
        .max(500)
}

fn parse_id(s: &str) -> Result<Uuid, Fail> {
    s.parse().map_err(|_| Fail::NotFound)
}

/// A time in a form: RFC 3339, `YYYY-MM-DD[THH:MM[:SS]]` in UTC, or a
/// duration meaning that long ago (`90min`, `2h`, `3days`).
pub(crate) fn parse_when(s: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    for fmt in [
        "%Y-%m-%dT%H:%M:%S",
        "%Y-%m-%dT%H:%M",
        "%Y-%m-%d %H:%M:%S",
        "%Y-%m-%d %H:%M",
    ] {
        if let Ok(t) = NaiveDateTime::parse_from_str(s, fmt) {
            return Ok(t.and_utc());
        }
    }
    if let Ok(d) = NaiveDate::parse_from_str(s, "%Y-%m-%d") {
        if let Some(t) = d.and_hms_opt(0, 0, 0) {
            return Ok(t.and_utc());
        }
    }
    let bad = || {
        format!("“{s}” is neither a time (2026-05-01T12:00, UTC) nor a duration ago (2h, 3days).")
    };
    let ago = humantime::parse_duration(s).map_err(|_| bad())?;
    let ago = chrono::Duration::from_std(ago).map_err(|_| bad())?;
    Utc::now().checked_sub_signed(ago).ok_or_else(bad)
}

/// The last `minutes` whole minutes up to now, with the delivered counts found (zeros filled in).
fn minutes_filled(found: &[(DateTime<Utc>, i64)], minutes: i32) -> Vec<(DateTime<Utc>, i64)> {
    let now = Utc::now().timestamp();
    let this_minute = DateTime::from_timestamp(now - now.rem_euclid(60), 0).unwrap_or_default();
    (0..minutes)
        .rev()
        .map(|back| {
            let m = this_minute - chrono::Duration::minutes(i64::from(back));
            let n = found.iter().find(|(t, _)| *t == m).map_or(0, |(_, n)| *n);
            (m, n)
        })
        .collect()
}

// ---------------------------------------------------------------- sign-in

async fn sign_in_page(
    State(console): State<Console>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    let q = FormData::parse(query.unwrap_or_default().as_bytes());
    let next = auth::safe_next(q.get("next"));
    sign_in_form(&console, &headers, StatusCode::OK, &next, "", None)
}

fn sign_in_form(
    console: &Console,
    headers: &HeaderMap,
    status: StatusCode,
    next: &str,
    name: &str,
    error: Option<&str>,
) -> Response {
    let token = auth::random_token();
    let markup = views::sign_in(&views::SignInView {
        csrf: &token,
        next,
        name,
        error,
    });
    let cookie = auth::set_cookie(SIGN_IN_COOKIE, &token, 3600, auth::secure(console, headers));
    let mut res = (status, page(markup)).into_response();
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        res.headers_mut().append(header::SET_COOKIE, v);
    }
    res
}

/// The attempted name as the audit log records it: one line, at most 60 characters.
fn audit_name(name: &str) -> String {
    let clean: String = name.chars().filter(|c| !c.is_control()).take(60).collect();
    if clean.trim().is_empty() {
        "(empty)".to_owned()
    } else {
        clean
    }
}

async fn audit_sign_in(console: &Console, name: &str, ok: bool, outcome: &str, client: &str) {
    let action = if ok {
        ACTION_SIGN_IN
    } else {
        ACTION_SIGN_IN_FAILED
    };
    let details = serde_json::json!({ "outcome": outcome, "client": client });
    if let Err(e) = console
        .inner
        .home
        .audit(
            &auth::actor(&audit_name(name)),
            action,
            &serde_json::json!({}),
            i64::from(ok),
            None,
            &details,
        )
        .await
    {
        internal(&e);
    }
}

async fn sign_in(
    State(console): State<Console>,
    client: ClientAddr,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let form = FormData::parse(&body);
    let name = form.get("name").unwrap_or("");
    let password = form.all("password").next().unwrap_or_default().to_owned();
    let next = auth::safe_next(form.get("next"));
    let expected = auth::cookie(&headers, SIGN_IN_COOKIE).unwrap_or("");
    if !auth::same_secret(form.get("csrf").unwrap_or(""), expected) {
        audit_sign_in(&console, name, false, "csrf", &client.addr).await;
        return sign_in_form(
            &console,
            &headers,
            StatusCode::FORBIDDEN,
            &next,
            name,
            Some("The sign-in form expired or did not come from this console. Please try again."),
        );
    }
    match console.inner.sign_in.admit(name, &client.key) {
        Admit::Now => {}
        Admit::After(delay) => tokio::time::sleep(delay).await,
        Admit::Refuse(wait) => {
            audit_sign_in(&console, name, false, "rate_limited", &client.addr).await;
            return Fail::TooMany(wait, "Too many sign-in attempts.").into_response();
        }
    }
    let user = match console.inner.home.user(name).await {
        Ok(u) => u,
        Err(e) => return internal(&e).into_response(),
    };
    let stored = user.as_ref().map(|u| u.password_hash.clone());
    let matches = tokio::task::spawn_blocking(move || {
        // An unknown name is checked against a decoy: it takes as long to refuse.
        match &stored {
            Some(hash) => auth::verify_password(&password, hash),
            None => auth::verify_password(&password, auth::decoy_hash()),
        }
    })
    .await
    .unwrap_or(false);
    let user = match (user, matches) {
        (Some(u), true) => u,
        (found, _) => {
            let outcome = if found.is_some() {
                "wrong_password"
            } else {
                "unknown_user"
            };
            console.inner.sign_in.failed(name, &client.key);
            audit_sign_in(&console, name, false, outcome, &client.addr).await;
            return sign_in_form(
                &console,
                &headers,
                StatusCode::UNAUTHORIZED,
                &next,
                name,
                Some("Wrong user name or password."),
            );
        }
    };
    if auth::Role::parse(&user.role).is_err() {
        return internal(&"stored role is unknown").into_response();
    }
    let token = auth::random_token();
    let csrf = auth::random_token();
    let lifetime = console.inner.config.session_lifetime;
    if let Err(e) = console
        .inner
        .home
        .create_session(
            &auth::token_hash(&token),
            name,
            &csrf,
            lifetime.as_secs_f64(),
        )
        .await
    {
        return internal(&e).into_response();
    }
    console.inner.sign_in.succeeded(name, &client.key);
    audit_sign_in(&console, name, true, "ok", &client.addr).await;
    let secure = auth::secure(&console, &headers);
    let mut res = see_other(&next);
    for cookie in [
        auth::set_cookie(SESSION_COOKIE, &token, lifetime.as_secs(), secure),
        auth::set_cookie(SIGN_IN_COOKIE, "", 0, secure),
    ] {
        if let Ok(v) = HeaderValue::from_str(&cookie) {
            res.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    res
}

async fn sign_out(
    State(console): State<Console>,
    session: Checked,
    client: ClientAddr,
    headers: HeaderMap,
) -> Result<Response, Fail> {
    console
        .inner
        .home
        .delete_session(&session.token_hash)
        .await
        .map_err(|e| internal(&e))?;
    console
        .inner
        .home
        .audit(
            &session.actor(),
            ACTION_SIGN_OUT,
            &serde_json::json!({}),
            1,
            None,
            &serde_json::json!({ "client": client.addr }),
        )
        .await
        .map_err(|e| internal(&e))?;
    let mut res = see_other("/sign-in");
    let cookie = auth::set_cookie(SESSION_COOKIE, "", 0, auth::secure(&console, &headers));
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        res.headers_mut().append(header::SET_COOKIE, v);
    }
    Ok(res)
}

// ---------------------------------------------------------------- pages

/// `/`: the outbox's overview, or serving many outboxes (without a
/// prefix), the all-outboxes overview.
async fn overview(
    State(console): State<Console>,
    session: Session,
    place: Place,
    RawQuery(query): RawQuery,
) -> Result<Response, Fail> {
    let outbox = match place {
        Place::Outbox(outbox) => outbox,
        Place::All => return all_outboxes(&console, &session, query).await,
    };
    let o = &outbox;
    let counts = o.store.status_counts().await.map_err(|e| failed(o, &e))?;
    let destinations = o
        .store
        .destination_counts()
        .await
        .map_err(|e| failed(o, &e))?;
    let rate = o
        .console
        .delivery_rate(RATE_MINUTES, RATE_WINDOW_ROWS)
        .await
        .map_err(|e| failed(o, &e))?;
    let relays = o.console.relays().await.map_err(|e| failed(o, &e))?;
    let jobs = console.inner.jobs.recent(&o.name, 10);
    // The chart's history ends with the backlog as it is now.
    let backlog = o.console.backlog().await.map_err(|e| failed(o, &e))?;
    let log = o.store.log();
    let producers = log.producer_target().await.map_err(|e| failed(o, &e))?;
    let cursors = log.cursor_lag().await.map_err(|e| failed(o, &e))?;
    let recent = o
        .store
        .tally()
        .recent(RATE_MINUTES)
        .await
        .map_err(|e| failed(o, &e))?;
    let mut history = o.samples.all();
    history.push(crate::samples::Sample {
        at: Utc::now(),
        backlog,
    });
    Ok(page(views::overview(
        &frame(&console, &session, o),
        &views::OverviewView {
            schema: &o.name,
            counts: &counts,
            destinations: &destinations,
            rate: &minutes_filled(&rate, RATE_MINUTES),
            relays: &relays,
            jobs: &jobs,
            history: &history,
            producers,
            cursors: &cursors,
            recent: &recent,
            refresh_ms: refresh_ms(&console),
        },
    )))
}

/// The all-outboxes overview: every outbox's backlog (a database's outboxes
/// read one after the other over its pool; one read shared by every viewer
/// for `overview_cache_for`), those that cannot be read first, then ordered
/// as asked (most dead letters first by default), a page at a time.
async fn all_outboxes(
    console: &Console,
    session: &Session,
    query: Option<String>,
) -> Result<Response, Fail> {
    let Served::Many(directory) = &console.inner.served else {
        return Err(Fail::NotFound);
    };
    let q = FormData::parse(query.unwrap_or_default().as_bytes());
    let order = views::OutboxOrder::parse(q.get("sort"));
    let read = directory.overview().await;
    let known = &read.known;
    let mut lines = read.lines.to_vec();
    let mut total = postbox_store::Backlog::default();
    for b in lines.iter().filter_map(|l| l.backlog.as_ref().ok()) {
        total.pending += b.pending;
        total.retrying += b.retrying;
        total.processing += b.processing;
        total.dead_letters += b.dead_letters;
    }
    let unreadable = lines.iter().filter(|l| l.backlog.is_err()).count();
    // Unreadable first, then the chosen count, largest first; by name within.
    let key = |l: &outboxes::Line| match &l.backlog {
        Err(_) => (0, 0_i64, 0.0_f64),
        Ok(b) => match order {
            views::OutboxOrder::DeadLetters => (1, -b.dead_letters, 0.0),
            views::OutboxOrder::Pending => (1, -(b.pending + b.retrying), 0.0),
            views::OutboxOrder::Retrying => (1, -b.retrying, 0.0),
            views::OutboxOrder::OldestPending => {
                (1, 0, -b.oldest_pending_age_seconds.unwrap_or(-1.0))
            }
            views::OutboxOrder::Name => (1, 0, 0.0),
        },
    };
    lines.sort_by(|a, b| {
        let (ka, kb) = (key(a), key(b));
        ka.0.cmp(&kb.0)
            .then(ka.1.cmp(&kb.1))
            .then(ka.2.total_cmp(&kb.2))
            .then_with(|| a.outbox.name.cmp(&b.outbox.name))
    });
    let per_page = usize::try_from(console.inner.config.page_size.max(1)).unwrap_or(50);
    let pages = lines.len().div_ceil(per_page).max(1);
    let page_no = q
        .get("page")
        .and_then(|p| p.parse::<usize>().ok())
        .unwrap_or(1)
        .clamp(1, pages);
    let shown: Vec<outboxes::Line> = lines
        .into_iter()
        .skip((page_no - 1) * per_page)
        .take(per_page)
        .collect();
    let here = Frame {
        session,
        base: "",
        outbox: None,
        many: true,
    };
    Ok(page(views::outboxes(
        &here,
        &views::OutboxesView {
            lines: &shown,
            problems: &known.problems,
            outboxes: known.outboxes.len(),
            unreadable,
            total,
            order,
            page: page_no,
            pages,
            took: read.took,
            age: read.read_at.elapsed(),
            refresh_ms: refresh_ms(console),
        },
    )))
}

fn with_cursor(path: &str, query: &str, key: &str, cursor: i64) -> String {
    if query.is_empty() {
        format!("{path}?{key}={cursor}")
    } else {
        format!("{path}?{query}&{key}={cursor}")
    }
}

async fn events(
    State(console): State<Console>,
    session: Session,
    outbox: Here,
    RawQuery(query): RawQuery,
) -> Result<Response, Fail> {
    let q = FormData::parse(query.unwrap_or_default().as_bytes());
    let text = |k: &str| q.get(k).unwrap_or("").to_owned();
    let search = EventSearch {
        event_id: text("event_id"),
        aggregate_type: text("aggregate_type"),
        aggregate_id: text("aggregate_id"),
        event_type: text("type"),
        status: text("status"),
        from: text("from"),
        to: text("to"),
    };
    let page_size = console.inner.config.page_size;
    let mut error = None;
    let mut query = EventQuery {
        aggregate_type: q.get("aggregate_type").map(str::to_owned),
        aggregate_id: q.get("aggregate_id").map(str::to_owned),
        event_type: q.get("type").map(str::to_owned),
        before_row: q.get("before").and_then(|b| b.parse().ok()),
        limit: page_size + 1,
        ..EventQuery::default()
    };
    if let Some(id) = q.get("event_id") {
        match id.parse() {
            Ok(id) => query.event_id = Some(id),
            Err(_) => error = Some(format!("“{id}” is not an event id (a UUID).")),
        }
    }
    if let Some(status) = q.get("status") {
        match status.parse() {
            Ok(status) => query.status = Some(status),
            Err(_) => error = Some(format!("“{status}” is not a status.")),
        }
    }
    for (key, slot) in [
        ("from", &mut query.created_from),
        ("to", &mut query.created_before),
    ] {
        if let Some(s) = q.get(key) {
            match parse_when(s) {
                Ok(t) => *slot = Some(t),
                Err(e) => error = Some(e),
            }
        }
    }
    let mut rows = if error.is_some() {
        Vec::new()
    } else {
        outbox
            .console
            .events(&query)
            .await
            .map_err(|e| failed(&outbox, &e))?
    };
    let next = if rows.len() as i64 > page_size {
        rows.truncate(page_size as usize);
        rows.last()
            .map(|r| with_cursor(&outbox.at("/events"), &search.query(), "before", r.row))
    } else {
        None
    };
    Ok(page(views::events(
        &frame(&console, &session, &outbox),
        &search,
        &rows,
        next,
        error.as_deref(),
        refresh_ms(&console),
    )))
}

fn notice_text(code: Option<&str>) -> Option<&'static str> {
    match code? {
        "replayed" => Some("Replayed: the event is pending again under the same id, with its attempts reset, due now."),
        "discarded" => Some("Discarded: the event stays in the table, resolved as discarded with your reason."),
        "not-dead" => Some("Nothing was done: the event is not an unresolved dead letter (any more)."),
        "none-selected" => Some("Nothing was done: select at least one dead letter first."),
        "group-gone" => Some("Nothing was done: that group has no unresolved dead letters any more."),
        _ => None,
    }
}

async fn event_page(
    State(console): State<Console>,
    session: Session,
    outbox: Here,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, Fail> {
    let id = parse_id(&id)?;
    let o = &outbox;
    let Some(mut event) = o.console.event(id).await.map_err(|e| failed(o, &e))? else {
        return Err(Fail::NotFound);
    };
    let redactor = &console.inner.config.redactor;
    redactor.redact(&mut event.payload);
    redactor.redact_headers(&mut event.headers);
    let deliveries = o
        .console
        .deliveries(event.row)
        .await
        .map_err(|e| failed(o, &e))?;
    let audit = o
        .dlq
        .audit_log(50, Some(id))
        .await
        .map_err(|e| failed(o, &e))?;
    let q = FormData::parse(query.unwrap_or_default().as_bytes());
    Ok(page(views::event(
        &frame(&console, &session, o),
        &views::EventView {
            event: &event,
            deliveries: &deliveries,
            audit: &audit,
            redacted: !redactor.is_empty(),
            notice: notice_text(q.get("notice")),
        },
    )))
}

fn check_reason(reason: Option<&str>) -> Result<String, Fail> {
    match reason {
        None => Err(Fail::BadRequest(
            "A reason is required to discard dead letters.".to_owned(),
        )),
        Some(r) if r.len() > MAX_REASON_BYTES || r.contains('\0') => Err(Fail::BadRequest(
            "The reason must be at most 2000 bytes of text.".to_owned(),
        )),
        Some(r) => Ok(r.to_owned()),
    }
}

async fn act_on_one(
    outbox: &Outbox,
    session: &Session,
    id: Uuid,
    action: Action,
) -> Result<Response, Fail> {
    let applied = outbox
        .dlq
        .apply(
            &Selection::Ids(vec![id]),
            &action,
            &session.actor(),
            1,
            |_| {},
        )
        .await
        .map_err(|e| failed(outbox, &e))?;
    let notice = match (applied.count, action) {
        (0, _) => "not-dead",
        (_, Action::Discard { .. }) => "discarded",
        _ => "replayed",
    };
    Ok(see_other(
        &outbox.at(&format!("/events/{id}?notice={notice}")),
    ))
}

async fn replay_one(
    State(console): State<Console>,
    session: Checked,
    outbox: Here,
    Path(id): Path<String>,
) -> Result<Response, Fail> {
    let id = parse_id(&id)?;
    limit_actions(&console, &session)?;
    act_on_one(&outbox, &session, id, Action::Replay).await
}

async fn discard_one(
    State(console): State<Console>,
    session: Checked,
    outbox: Here,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, Fail> {
    let form = FormData::parse(&body);
    let id = parse_id(&id)?;
    let reason = check_reason(form.get("reason"))?;
    limit_actions(&console, &session)?;
    act_on_one(&outbox, &session, id, Action::Discard { reason }).await
}

/// The dead-letter filter of a query or form: (type, since text, filter).
fn dlq_filter(q: &FormData) -> Result<(String, String, Filter), String> {
    let event_type = q.get("type").unwrap_or("").to_owned();
    let since_text = q.get("since").unwrap_or("").to_owned();
    let since = match q.get("since") {
        Some(s) => Some(parse_when(s)?),
        None => None,
    };
    let filter = Filter {
        event_type: q.get("type").map(str::to_owned),
        since,
    };
    Ok((event_type, since_text, filter))
}

async fn dead_letters(
    State(console): State<Console>,
    session: Session,
    outbox: Here,
    RawQuery(query): RawQuery,
) -> Result<Response, Fail> {
    let q = FormData::parse(query.unwrap_or_default().as_bytes());
    let o = &outbox;
    let page_size = console.inner.config.page_size;
    let (event_type, since, filter, error) = match dlq_filter(&q) {
        Ok((t, s, f)) => (t, s, Some(f), None),
        Err(e) => (
            q.get("type").unwrap_or("").to_owned(),
            q.get("since").unwrap_or("").to_owned(),
            None,
            Some(e),
        ),
    };
    let (matching, mut rows) = match &filter {
        Some(f) => {
            let matching = o.dlq.count(f).await.map_err(|e| failed(o, &e))?;
            let rows = o
                .console
                .events(&EventQuery {
                    event_type: f.event_type.clone(),
                    status: Some(StatusFilter::Dead),
                    created_from: f.since,
                    before_row: q.get("before").and_then(|b| b.parse().ok()),
                    limit: page_size + 1,
                    ..EventQuery::default()
                })
                .await
                .map_err(|e| failed(o, &e))?;
            (matching, rows)
        }
        None => (0, Vec::new()),
    };
    let next = if rows.len() as i64 > page_size {
        rows.truncate(page_size as usize);
        let mut base = url::form_urlencoded::Serializer::new(String::new());
        if !event_type.is_empty() {
            base.append_pair("type", &event_type);
        }
        if !since.is_empty() {
            base.append_pair("since", &since);
        }
        rows.last()
            .map(|r| with_cursor(&o.at("/dead-letters"), &base.finish(), "before", r.row))
    } else {
        None
    };
    Ok(page(views::dead_letters(
        &frame(&console, &session, o),
        &views::DeadLettersView {
            event_type: &event_type,
            since: &since,
            matching,
            rows: &rows,
            next,
            error: error.as_deref(),
            notice: notice_text(q.get("notice")),
            refresh_ms: refresh_ms(&console),
        },
    )))
}

async fn bulk_action(
    State(console): State<Console>,
    session: Checked,
    outbox: Here,
    body: Bytes,
) -> Result<Response, Fail> {
    let form = FormData::parse(&body);
    let (event_type, since_text, filter) = dlq_filter(&form).map_err(Fail::BadRequest)?;
    let (verb, all) = match form.get("do") {
        Some("replay-selected") => ("replay", false),
        Some("replay-all") => ("replay", true),
        Some("discard-selected") => ("discard", false),
        Some("discard-all") => ("discard", true),
        _ => return Err(Fail::BadRequest("Unknown action.".to_owned())),
    };
    let action = if verb == "discard" {
        Action::Discard {
            reason: check_reason(form.get("reason"))?,
        }
    } else {
        Action::Replay
    };
    let i = &console.inner;
    let (selection, total, what) = if all {
        let total = outbox
            .dlq
            .count(&filter)
            .await
            .map_err(|e| failed(&outbox, &e))?;
        let mut what = format!("all {total} dead letter(s)");
        if !event_type.is_empty() {
            what.push_str(&format!(" of type {event_type}"));
        }
        if !since_text.is_empty() {
            what.push_str(&format!(" created since {since_text}"));
        }
        (Selection::All(filter), total, what)
    } else {
        let ids = form
            .all("ids")
            .map(|s| s.trim().parse::<Uuid>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| Fail::BadRequest("A selected event id is not a UUID.".to_owned()))?;
        if ids.is_empty() {
            let mut back = url::form_urlencoded::Serializer::new(String::new());
            back.append_pair("notice", "none-selected");
            if !event_type.is_empty() {
                back.append_pair("type", &event_type);
            }
            if !since_text.is_empty() {
                back.append_pair("since", &since_text);
            }
            return Ok(see_other(
                &outbox.at(&format!("/dead-letters?{}", back.finish())),
            ));
        }
        if ids.len() > MAX_SELECTED {
            return Err(Fail::BadRequest(format!(
                "Select at most {MAX_SELECTED} events at once, or act on all that match a filter."
            )));
        }
        let n = ids.len() as u64;
        (
            Selection::Ids(ids),
            n,
            format!("{n} selected dead letter(s)"),
        )
    };
    limit_actions(&console, &session)?;
    let id = i
        .jobs
        .start(
            outbox.name.clone(),
            outbox.dlq.clone(),
            selection,
            action,
            session.actor(),
            session.user.clone(),
            what,
            total,
            i.config.batch_size,
        )
        .map_err(|_| {
            Fail::TooMany(
                Duration::from_secs(5),
                "Several bulk actions are running already; wait for one to finish.",
            )
        })?;
    Ok(see_other(&outbox.at(&format!("/jobs/{id}"))))
}

async fn groups(
    State(console): State<Console>,
    session: Session,
    outbox: Here,
    RawQuery(query): RawQuery,
) -> Result<Response, Fail> {
    let q = FormData::parse(query.unwrap_or_default().as_bytes());
    let of = match q.get("status") {
        Some("retrying") => GroupOf::Retrying,
        _ => GroupOf::DeadLetters,
    };
    let groups = outbox
        .console
        .error_groups(of, MAX_GROUPS)
        .await
        .map_err(|e| failed(&outbox, &e))?;
    Ok(page(views::groups(
        &frame(&console, &session, &outbox),
        &views::GroupsView {
            of,
            groups: &groups,
            notice: notice_text(q.get("notice")),
            refresh_ms: refresh_ms(&console),
        },
    )))
}

/// Replay or discard every dead letter of one group (same last error, same
/// destinations), as a bulk action in the background.
async fn group_action(
    State(console): State<Console>,
    session: Checked,
    outbox: Here,
    body: Bytes,
) -> Result<Response, Fail> {
    let form = FormData::parse(&body);
    let action = match form.get("do") {
        Some("replay") => Action::Replay,
        Some("discard") => Action::Discard {
            reason: check_reason(form.get("reason"))?,
        },
        _ => return Err(Fail::BadRequest("Unknown action.".to_owned())),
    };
    let key = form
        .get("key")
        .filter(|k| k.len() == 32 && k.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| Fail::BadRequest("No group was named.".to_owned()))?;
    let i = &console.inner;
    let found = outbox
        .console
        .error_group_ids(key, MAX_GROUP_EVENTS)
        .await
        .map_err(|e| failed(&outbox, &e))?;
    let Some((_, error)) = found.first().cloned() else {
        return Ok(see_other(&outbox.at("/groups?notice=group-gone")));
    };
    let ids: Vec<Uuid> = found.into_iter().map(|(id, _)| id).collect();
    let total = ids.len() as u64;
    let what = match error {
        Some(e) => format!(
            "{total} dead letter(s) that failed with “{}”",
            views::clip(&e, 80)
        ),
        None => format!("{total} dead letter(s) without an error"),
    };
    limit_actions(&console, &session)?;
    let id = i
        .jobs
        .start(
            outbox.name.clone(),
            outbox.dlq.clone(),
            Selection::Ids(ids),
            action,
            session.actor(),
            session.user.clone(),
            what,
            total,
            i.config.batch_size,
        )
        .map_err(|_| {
            Fail::TooMany(
                Duration::from_secs(5),
                "Several bulk actions are running already; wait for one to finish.",
            )
        })?;
    Ok(see_other(&outbox.at(&format!("/jobs/{id}"))))
}

/// The bulk action `id` names on `outbox`'s dead letters, or 404.
fn find_job(console: &Console, outbox: &Outbox, id: &str) -> Result<crate::jobs::Job, Fail> {
    console
        .inner
        .jobs
        .get(parse_id(id)?)
        .filter(|job| job.outbox == outbox.name)
        .ok_or(Fail::NotFound)
}

async fn job_page(
    State(console): State<Console>,
    session: Session,
    outbox: Here,
    Path(id): Path<String>,
) -> Result<Response, Fail> {
    let job = find_job(&console, &outbox, &id)?;
    Ok(page(views::job(&frame(&console, &session, &outbox), &job)))
}

async fn job_progress(
    State(console): State<Console>,
    _session: Session,
    outbox: Here,
    Path(id): Path<String>,
) -> Result<Response, Fail> {
    let job = find_job(&console, &outbox, &id)?;
    let body = serde_json::json!({
        "done": job.done,
        "total": job.total,
        "state": job.state.as_str(),
        "finished": job.state != JobState::Running,
    });
    Ok((
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response())
}

async fn job_cancel(
    State(console): State<Console>,
    _session: Checked,
    outbox: Here,
    Path(id): Path<String>,
) -> Result<Response, Fail> {
    let job = find_job(&console, &outbox, &id)?;
    console.inner.jobs.cancel(job.id);
    Ok(see_other(&outbox.at(&format!("/jobs/{}", job.id))))
}

/// `/audit`: an outbox's audit log; serving many outboxes, without a prefix,
/// the home schema's (sign-ins and sign-outs).
async fn audit(
    State(console): State<Console>,
    session: Session,
    place: Place,
    RawQuery(query): RawQuery,
) -> Result<Response, Fail> {
    let q = FormData::parse(query.unwrap_or_default().as_bytes());
    let page_size = console.inner.config.page_size;
    let outbox = match place {
        Place::Outbox(outbox) => Some(outbox),
        Place::All => None,
    };
    let log = outbox.as_ref().map_or(&console.inner.home, |o| &o.console);
    let mut entries = log
        .audit_page(
            q.get("before").and_then(|b| b.parse().ok()),
            q.get("action"),
            q.get("actor"),
            (!session.is_operator()).then_some(ACTION_SIGN_IN_FAILED),
            page_size + 1,
        )
        .await
        .map_err(|e| match &outbox {
            Some(o) => failed(o, &e),
            None => internal(&e),
        })?;
    let action = q.get("action").unwrap_or("");
    let here = match &outbox {
        Some(o) => frame(&console, &session, o),
        None => Frame {
            session: &session,
            base: "",
            outbox: None,
            many: true,
        },
    };
    let actor = q.get("actor").unwrap_or("");
    let next = if entries.len() as i64 > page_size {
        entries.truncate(page_size as usize);
        let mut base = url::form_urlencoded::Serializer::new(String::new());
        if !action.is_empty() {
            base.append_pair("action", action);
        }
        if !actor.is_empty() {
            base.append_pair("actor", actor);
        }
        entries
            .last()
            .map(|e| with_cursor(&here.at("/audit"), &base.finish(), "before", e.id))
    } else {
        None
    };
    Ok(page(views::audit(
        &here,
        &views::AuditView {
            entries: &entries,
            sign_in_details: session.is_operator(),
            action,
            actor,
            next,
        },
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_read_as_utc_or_as_durations_ago() {
        assert_eq!(
            parse_when("2026-05-01T12:00").unwrap().to_rfc3339(),
            "2026-05-01T12:00:00+00:00"
        );
        assert_eq!(
            parse_when("2026-05-01").unwrap().to_rfc3339(),
            "2026-05-01T00:00:00+00:00"
        );
        let ago = Utc::now() - parse_when("2h").unwrap();
        assert!((ago.num_minutes() - 120).abs() <= 1);
        assert!(parse_when("<script>").is_err());
    }

    #[test]
    fn the_chart_has_one_slot_per_minute() {
        let filled = minutes_filled(&[], 30);
        assert_eq!(filled.len(), 30);
        assert!(filled
            .windows(2)
            .all(|w| w[1].0 - w[0].0 == chrono::Duration::minutes(1)));
        assert_eq!(filled.last().unwrap().0.timestamp() % 60, 0);
    }
}

//! `/sign-in` and `/sign-out`: the sign-in form (its own CSRF token, which
//! this console process issued and binds to the form's cookie; the sign-in
//! rate limits), sessions made and ended, each attempt in the home schema's
//! audit log.

use crate::auth::{
    self, ACTION_SIGN_IN, ACTION_SIGN_IN_FAILED, ACTION_SIGN_OUT, SESSION_COOKIE, SIGN_IN_COOKIE,
};
use crate::form::FormData;
use crate::http::guard::Checked;
use crate::http::reply::{internal, page, see_other, Fail};
use crate::http::session::ClientAddr;
use crate::limit::Admit;
use crate::views::{layout, Nav};
use crate::Console;
use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use maud::{html, Markup};

pub(super) async fn sign_in_page(
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
    // A fresh nonce in the cookie, and the form's token bound to it.
    let nonce = auth::random_token();
    let lifetime = console.inner.config.sign_in_form_lifetime.as_secs().max(1);
    let Some(token) = console
        .inner
        .sign_in_tokens
        .issue(&nonce, auth::unix_now().saturating_add(lifetime))
    else {
        return internal(&"cannot make the sign-in form's token").into_response();
    };
    let markup = render(&SignInView {
        csrf: &token,
        next,
        name,
        error,
    });
    let cookie = auth::set_cookie(
        SIGN_IN_COOKIE,
        &nonce,
        lifetime,
        auth::secure(console, headers),
    );
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

pub(super) async fn sign_in(
    State(console): State<Console>,
    client: ClientAddr,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let form = FormData::parse(&body);
    let name = form.get("name").unwrap_or("");
    let password = form.all("password").next().unwrap_or_default().to_owned();
    let next = auth::safe_next(form.get("next"));
    // The form's token must be one this process issued for this browser's
    // sign-in cookie, not expired: a token made up, taken from another
    // browser, or from before a restart is refused with a fresh form.
    let nonce = auth::cookie(&headers, SIGN_IN_COOKIE).unwrap_or("");
    if !console
        .inner
        .sign_in_tokens
        .verify(nonce, form.get("csrf").unwrap_or(""), auth::unix_now())
    {
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

pub(super) async fn sign_out(
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

pub(crate) struct SignInView<'a> {
    pub csrf: &'a str,
    pub next: &'a str,
    pub name: &'a str,
    pub error: Option<&'a str>,
}

fn render(v: &SignInView<'_>) -> Markup {
    layout(
        "Sign in",
        None,
        Nav::None,
        html! {
            section.signin {
                h1 { "Sign in" }
                @if let Some(e) = v.error {
                    p.error role="alert" { (e) }
                }
                form method="post" action="/sign-in" {
                    input type="hidden" name="csrf" value=(v.csrf);
                    input type="hidden" name="next" value=(v.next);
                    label for="name" { "User" }
                    input #name type="text" name="name" value=(v.name) autocomplete="username"
                        autocapitalize="none" required autofocus;
                    label for="password" { "Password" }
                    input #password type="password" name="password" autocomplete="current-password" required;
                    button.primary type="submit" { "Sign in" }
                }
            }
        },
    )
}

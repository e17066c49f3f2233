//! The signed-in user and the client's address, as extractors.

use crate::auth::{cookie, token_hash, Role, Session, SESSION_COOKIE};
use crate::http::outbox::Chosen;
use crate::http::reply::{internal, see_other};
use crate::scope::OutboxPatterns;
use crate::Console;
use axum::extract::{ConnectInfo, FromRequestParts};
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use std::net::SocketAddr;

/// Refusal of a request without a session.
pub(crate) struct SignInFirst {
    next: String,
}

impl IntoResponse for SignInFirst {
    fn into_response(self) -> Response {
        let target = if self.next == "/" {
            "/sign-in".to_owned()
        } else {
            let next: String = url::form_urlencoded::byte_serialize(self.next.as_bytes()).collect();
            format!("/sign-in?next={next}")
        };
        see_other(&target)
    }
}

/// A session already found for this request (by the outbox check in front
/// of the routes, [`crate::http::access`]), so that it is read once.
#[derive(Clone)]
pub(crate) struct Found(pub Session);

/// The signed-in user: anyone without a live session goes to the sign-in
/// page, coming back to where they were going.
impl FromRequestParts<Console> for Session {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, console: &Console) -> Result<Self, Response> {
        if let Some(Found(session)) = parts.extensions.get::<Found>() {
            return Ok(session.clone());
        }
        let next = if parts.method == axum::http::Method::GET {
            // Under an outbox's prefix, the path the browser asked for.
            let base = parts
                .extensions
                .get::<Chosen>()
                .map_or("", |c| c.0.base.as_str());
            let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
            format!("{base}{path}")
        } else {
            "/".to_owned()
        };
        let Some(token) = cookie(&parts.headers, SESSION_COOKIE) else {
            return Err(SignInFirst { next }.into_response());
        };
        let hash = token_hash(token);
        let stored = console
            .inner
            .home
            .session(&hash)
            .await
            .map_err(|e| internal(&e).into_response())?;
        let Some(stored) = stored else {
            return Err(SignInFirst { next }.into_response());
        };
        let Ok(role) = Role::parse(&stored.role) else {
            return Err(SignInFirst { next }.into_response());
        };
        // The table's constraint keeps the patterns parseable; should one
        // not parse, the user may see nothing rather than everything.
        let outboxes = OutboxPatterns::from_stored(&stored.outboxes)
            .map_err(|e| internal(&e).into_response())?;
        Ok(Session {
            user: stored.user,
            role,
            outboxes,
            csrf: stored.csrf_token,
            token_hash: hash,
        })
    }
}

/// The client's address, for sign-in limits and the audit log: the TCP
/// peer's, or behind a trusted proxy the one it forwarded (see
/// [`crate::client`]). `key` is what rate limits count it under.
pub(crate) struct ClientAddr {
    pub addr: String,
    pub key: String,
}

impl FromRequestParts<Console> for ClientAddr {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        console: &Console,
    ) -> Result<Self, Self::Rejection> {
        let peer = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0.ip());
        Ok(match peer {
            Some(peer) => {
                let ip = crate::client_addr::client_ip(
                    peer,
                    &parts.headers,
                    &console.inner.config.trusted_proxies,
                );
                ClientAddr {
                    addr: ip.to_string(),
                    key: crate::client_addr::limit_key(ip),
                }
            }
            None => ClientAddr {
                addr: "unknown".to_owned(),
                key: "unknown".to_owned(),
            },
        })
    }
}

//! The outbox a request is about. Serving many outboxes, a layer in front of
//! the routes ([`crate::http::routes`]) takes the outbox prefix
//! (`/o/<database>/<schema>`) off the path and hands the outbox on as an
//! extension ([`Chosen`]), so every route is the same under each prefix and
//! passes the same guard; the [`Here`] extractor gives a handler its outbox
//! (serving one outbox, always the home schema's), and [`Place`] tells the
//! pages that are also above the outboxes where they are.

use crate::auth::Session;
use crate::http::reply::see_other;
use crate::outboxes::Outbox;
use crate::views::Frame;
use crate::{Console, Served};
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::response::Response;
use std::sync::Arc;

/// The outbox a request's path prefix chose (serving many outboxes).
#[derive(Clone)]
pub(crate) struct Chosen(pub Arc<Outbox>);

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
pub(crate) fn frame<'a>(console: &Console, session: &'a Session, outbox: &'a Outbox) -> Frame<'a> {
    let many = console.inner.serves_many();
    Frame {
        session,
        base: &outbox.base,
        outbox: many.then_some(outbox.name.as_str()),
        many,
    }
}

//! The HTTP side of the console, which knows no page: how a request is
//! answered (`reply`: pages, redirects, fixed-phrase failures), the outbox it
//! is about (`outbox`), the signed-in user and the client (`session`), which
//! outboxes the user may see and act in (`access`), the guard in front of
//! every state-changing route (`guard`), and the router that mounts the
//! pages' routes (`routes`).

pub(crate) mod access;
pub(crate) mod guard;
pub(crate) mod outbox;
pub(crate) mod reply;
pub(crate) mod routes;
pub(crate) mod session;

//! What each destination would receive of an event: the event page's
//! "Destinations" preview.
//!
//! The console does not know the relay's routes or run its expressions
//! (the crate does not depend on the relay): whoever starts the console
//! hands it a [`RoutePreview`] (the `postbox` binary's is the one
//! `postbox route test` prints), and the event page shows its answer.
//! Without one, the page says that no preview is configured.

use futures::future::BoxFuture;
pub use postbox_store::StoredEvent;
use serde::Serialize;
use std::collections::BTreeMap;

/// What one destination makes of the event.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Verdict {
    /// It gets the event: this body (the CloudEvents JSON document) and
    /// these headers. `by`: the route or destination whose expressions
    /// shaped it, if any did.
    Sends {
        body: String,
        headers: BTreeMap<String, String>,
        by: Option<String>,
    },
    /// A filter said no (`by`: whose).
    Filtered { by: String },
    /// No route sends this event type there.
    NotRouted,
    /// An expression failed on the event: it would be a dead letter of this
    /// destination only, with this error.
    Fails { error: String },
}

/// One destination's line of the preview.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DestinationPreview {
    pub destination: String,
    #[serde(flatten)]
    pub verdict: Verdict,
}

/// Runs the relay's routes, filters and transforms over one event, without
/// sending anything.
pub trait RoutePreview: Send + Sync + std::fmt::Debug {
    /// One line per destination of the configuration, in its order.
    /// `event`'s `place` is where it came from (`outbox`, `log`, …).
    fn preview<'a>(&'a self, event: &'a StoredEvent) -> BoxFuture<'a, Vec<DestinationPreview>>;
}

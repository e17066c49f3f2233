//! The console's pages: each module is one page (or a few close ones), its
//! handlers and its view together, and [`routes`] is the one list of routes
//! the router mounts. Pages take the signed-in `Session`, state-changing
//! handlers the guard's `Checked` session; each handler reads or acts
//! through the store and renders its page. A page imports no other page:
//! what several share is in `crate::views` (rendering) or `crate::http`
//! (answering a request).

mod audit;
mod dead_letters;
mod event;
mod events;
mod groups;
mod job;
mod overview;
mod replays;
mod sign_in;

use crate::assets;
use crate::http::routes::Routes;

/// Every route the console serves. The router mounts these and nothing else;
/// each state-changing one needs its row in
/// [`crate::http::guard::STATE_CHANGING`].
pub(crate) fn routes() -> Routes {
    Routes::default()
        .get("/", overview::overview)
        .get("/sign-in", sign_in::sign_in_page)
        .post("/sign-in", sign_in::sign_in)
        .post("/sign-out", sign_in::sign_out)
        .get("/events", events::events)
        .get("/events/{id}", event::event_page)
        .post("/events/{id}/replay", event::replay_one)
        .post("/events/{id}/discard", event::discard_one)
        .get("/dead-letters", dead_letters::dead_letters)
        .post("/dead-letters/action", dead_letters::bulk_action)
        .get("/groups", groups::groups)
        .post("/groups/action", groups::group_action)
        .get("/jobs/{id}", job::job_page)
        .get("/jobs/{id}/progress", job::job_progress)
        .post("/jobs/{id}/cancel", job::job_cancel)
        .get("/replays", replays::replays)
        .get("/replays/{id}", replays::replay_page)
        .post("/replays/{id}/cancel", replays::replay_cancel)
        .get("/audit", audit::audit)
        .get("/static/console.css", assets::css)
        .get("/static/console.js", assets::js)
}

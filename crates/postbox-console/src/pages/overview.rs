//! `/`: one outbox's overview (counts, charts, deliveries by destination,
//! destinations, log cursors, replication slots, relays, recent bulk
//! actions), or serving many
//! outboxes, without a prefix, the all-outboxes overview.

use crate::auth::Session;
use crate::form::FormData;
use crate::http::access;
use crate::http::outbox::{frame, Place};
use crate::http::reply::{failed, page, Fail};
use crate::jobs::Job;
use crate::outboxes;
use crate::samples::Sample;
use crate::views::charts::{age_chart, backlog_chart, rate_chart};
use crate::views::{age, layout, live_status, opt_time, time, Frame, Nav};
use crate::{Console, Served};
use axum::extract::{RawQuery, State};
use axum::response::Response;
use chrono::{DateTime, Utc};
use maud::{html, Markup};
use postbox_store::{
    rough_duration, Backlog, CursorLag, DestinationCounts, GroupStatus, ProducerTarget,
    RecentDeliveries, RelaySeen, SlotStatus, StatusCounts, Unread,
};

/// Minutes shown in the delivery-rate chart, and the newest outbox rows it counts among.
const RATE_MINUTES: i32 = 30;
const RATE_WINDOW_ROWS: i64 = 200_000;

/// `/`: the outbox's overview, or serving many outboxes (without a
/// prefix), the all-outboxes overview.
pub(super) async fn overview(
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
    let consumer_groups = o.store.groups().status().await.map_err(|e| failed(o, &e))?;
    // Logical mode: the slots this schema's relays read, and how their
    // readers fare (migration 22 notes a reader's failures).
    let slots: Vec<SlotStatus> = o
        .store
        .logical()
        .status(None)
        .await
        .map_err(|e| failed(o, &e))?
        .into_iter()
        .filter(|s| s.belongs_to(&o.schema))
        .collect();
    let recent = o
        .store
        .tally()
        .recent(RATE_MINUTES)
        .await
        .map_err(|e| failed(o, &e))?;
    let mut history = o.samples.all();
    history.push(Sample {
        at: Utc::now(),
        backlog,
    });
    Ok(page(render(
        &frame(&console, &session, o),
        &OverviewView {
            schema: &o.name,
            counts: &counts,
            destinations: &destinations,
            rate: &minutes_filled(&rate, RATE_MINUTES),
            relays: &relays,
            jobs: &jobs,
            history: &history,
            producers,
            cursors: &cursors,
            consumer_groups: &consumer_groups,
            slots: &slots,
            recent: &recent,
            refresh_ms: console.inner.refresh_ms(),
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
    let order = OutboxOrder::parse(q.get("sort"));
    let read = directory.overview().await;
    // Only the outboxes the user's role applies to.
    let (mut lines, outboxes, problems) = access::visible(console, session, &read);
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
            OutboxOrder::DeadLetters => (1, -b.dead_letters, 0.0),
            OutboxOrder::Pending => (1, -(b.pending + b.retrying), 0.0),
            OutboxOrder::Retrying => (1, -b.retrying, 0.0),
            OutboxOrder::OldestPending => (1, 0, -b.oldest_pending_age_seconds.unwrap_or(-1.0)),
            OutboxOrder::Name => (1, 0, 0.0),
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
    Ok(page(render_outboxes(
        &here,
        &OutboxesView {
            lines: &shown,
            problems,
            outboxes,
            unreadable,
            total,
            order,
            page: page_no,
            pages,
            took: read.took,
            age: read.read_at.elapsed(),
            refresh_ms: console.inner.refresh_ms(),
        },
    )))
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

pub(crate) struct OverviewView<'a> {
    /// The schema's name, or serving many, the outbox's.
    pub schema: &'a str,
    pub counts: &'a StatusCounts,
    pub destinations: &'a [DestinationCounts],
    /// (minute, delivered) for each of the last minutes, oldest first, zeros included.
    pub rate: &'a [(DateTime<Utc>, i64)],
    pub relays: &'a [RelaySeen],
    pub jobs: &'a [Job],
    /// The backlog's samples, oldest first, the last one taken now.
    pub history: &'a [Sample],
    /// Log mode: which table producers write to, and each cursor's lag.
    pub producers: ProducerTarget,
    pub cursors: &'a [CursorLag],
    /// Log mode: the consumer groups that pull from the log.
    pub consumer_groups: &'a [GroupStatus],
    /// Logical mode: the replication slots this schema's relays read.
    pub slots: &'a [SlotStatus],
    /// Deliveries per destination and reading mode over the rate's window.
    pub recent: &'a [RecentDeliveries],
    pub refresh_ms: u64,
}

fn render(here: &Frame<'_>, v: &OverviewView<'_>) -> Markup {
    let c = v.counts;
    let now = v.history.last().map(|s| s.backlog).unwrap_or_default();
    let delivered: i64 = v.rate.iter().map(|(_, n)| n).sum();
    let minutes = v.rate.len();
    layout(
        "Overview",
        Some(here),
        Nav::Overview,
        html! {
            h1 { "Overview " span.sub { @if here.many { "outbox " } @else { "schema " } (v.schema) } }
            (live_status(v.refresh_ms))
            div #overview-live data-live {
            div.cards {
                a.card href=(here.at("/events?status=pending")) {
                    span.label { "Pending" } span.value #pending { (c.pending) }
                    span.hint { (now.retrying) " of them retrying" }
                }
                div.card {
                    span.label { "Scheduled" } span.value #scheduled { (c.scheduled) }
                    span.hint {
                        @if let Some(next) = c.next_scheduled_in_seconds {
                            "the first due in " (age(next))
                        } @else {
                            "for later delivery"
                        }
                    }
                }
                div.card.(if c.oldest_pending_age_seconds.unwrap_or(0.0) > 300.0 { "warn" } else { "" }) {
                    span.label { "Oldest pending" }
                    span.value #oldest-pending {
                        (c.oldest_pending_age_seconds.map_or_else(|| "—".to_owned(), age))
                    }
                }
                a.card href=(here.at("/events?status=processing")) {
                    span.label { "Claimed by a relay" } span.value #processing { (c.processing) }
                }
                a.card href=(here.at("/events?status=sent")) {
                    span.label { "Sent" } span.value { (c.sent) }
                    span.hint { "outbox rows (claim mode, hand-offs)" }
                }
                a.card.(if c.failed > 0 { "bad" } else { "" }) href=(here.at("/dead-letters")) {
                    span.label { "Dead letters" } span.value #dead-letters { (c.failed) }
                }
                div.card {
                    span.label { "Delivered, last " (minutes) " min" }
                    span.value { (delivered) }
                }
            }
            div.charts {
                section {
                    h2 { "Backlog" }
                    (backlog_chart(v.history))
                }
                section {
                    h2 { "Oldest pending event" }
                    (age_chart(v.history))
                }
                section {
                    h2 { "Delivered per minute" }
                    (rate_chart(v.rate))
                }
            }
            section {
                h2 { "Delivered by destination " span.sub { "last " (minutes) " min, every reading mode" } }
                @if v.recent.is_empty() {
                    p.muted { "No delivery counted in this window (relays count their deliveries, and what filters kept from each destination, by minute)." }
                } @else {
                    div.scroll { table #delivered-by-destination {
                        thead { tr { th { "Destination" } th { "Read from" } th.num { "Delivered" } th.num title="Events the destination's filters kept from it" { "Filtered out" } } }
                        tbody {
                            @for r in v.recent {
                                tr {
                                    td { (r.destination) }
                                    td { (match r.mode.as_str() { "claim" => "the outbox", "log" => "the log", "logical" => "the slot", other => other }) }
                                    td.num { (r.delivered) }
                                    td.num { (r.filtered) }
                                }
                            }
                        }
                    } }
                }
            }
            section {
                h2 { "Destinations" }
                @if v.destinations.is_empty() {
                    p.muted { "No per-destination state recorded: fan-out events that reached every destination at the first try leave none." }
                } @else {
                    div.scroll { table {
                        thead { tr { th { "Destination" } th.num { "Retrying" } th.num { "Dead letters" } th.num { "Delivered after retry" } th.num { "Most attempts" } } }
                        tbody {
                            @for d in v.destinations {
                                tr {
                                    td { (d.destination) }
                                    td.num { (d.retrying) }
                                    td.num { (d.dead_letters) }
                                    td.num { (d.delivered_after_retry) }
                                    td.num { (d.max_attempts) }
                                }
                            }
                        }
                    } }
                }
            }
            @if v.producers == ProducerTarget::Log || !v.cursors.is_empty() {
                section {
                    h2 { "Log cursors " span.sub { "producers write to the " (v.producers.as_str()) } }
                    @if v.cursors.is_empty() {
                        p.muted { "No cursor yet: a relay in log mode creates one per destination when it starts." }
                    } @else {
                        div.scroll { table #log-cursors {
                            thead { tr { th { "Destination" } th { "Held by a relay" } th.num { "Behind (events)" } th { "Oldest unread" } th.num { "Delivered" } } }
                            tbody {
                                @for c in v.cursors {
                                    tr.(if c.lag_seconds.unwrap_or(0.0) > 60.0 || c.unread_seconds > 300.0 { "warn" } else { "" }) {
                                        td { (c.destination) }
                                        td {
                                            @if c.held { "yes" }
                                            @else if c.unread_seconds > 300.0 {
                                                "NOT READ for " (age(c.unread_seconds)) ": it keeps the log from being truncated (postbox log drop-cursor " (c.destination) " if the destination was removed)"
                                            } @else { "no" }
                                        }
                                        td.num { (c.lag_events) }
                                        td { (c.lag_seconds.map_or_else(|| "caught up".to_owned(), age)) }
                                        td.num { (c.delivered) }
                                    }
                                }
                            }
                        } }
                    }
                }
            }
            @if !v.consumer_groups.is_empty() {
                section {
                    h2 { "Consumer groups " span.sub { "readers pulling from the log over SQL" } }
                    div.scroll { table #consumer-groups {
                        thead { tr {
                            th { "Group" } th.num { "Unread" } th.num { "In flight" } th.num { "Waiting" }
                            th.num { "Dead letters" } th.num { "Readers (last minute)" } th { "Oldest unacknowledged" } th { "Settings" }
                        } }
                        tbody {
                            @for g in v.consumer_groups {
                                @let idle = g.unread_longer_than(std::time::Duration::from_secs(300));
                                tr.(if idle || g.dead_letters > 0 { "warn" } else { "" }) {
                                    td { (g.name) }
                                    td.num { (g.unread) }
                                    td.num { (g.in_flight) }
                                    td.num { (g.waiting) }
                                    td.num { (g.dead_letters) }
                                    td.num { (g.readers) }
                                    td {
                                        (g.lag_seconds.map_or_else(|| "none".to_owned(), age))
                                        @if idle { " — NOT READ for over 5 minutes: it keeps the log from being truncated (postbox group drop " (g.name) " if it is gone)" }
                                    }
                                    td {
                                        @if g.ordered { "ordered; " }
                                        @if let Some(types) = &g.types { "types " (types.join(", ")) "; " }
                                        "max attempts " (g.max_attempts)
                                    }
                                }
                            }
                        }
                    } }
                }
            }
            @if !v.slots.is_empty() {
                section {
                    h2 { "Replication slots " span.sub { "logical mode" } }
                    div.scroll { table #slots {
                        thead { tr { th { "Slot" } th { "Read by a relay" } th { "Reader" } th.num { "Lag" } th.num { "Retains" } th { "WAL status" } } }
                        tbody {
                            @for s in v.slots {
                                tr.(if s.is_lost() || s.failing().is_some() { "bad" } else if s.unread_for().is_some() { "warn" } else { "" }) {
                                    td { (s.slot_name) }
                                    td {
                                        @match s.unread_for() {
                                            None => "yes",
                                            Some(Unread::For(d)) => { "NOT READ for " (rough_duration(d)) }
                                            Some(Unread::Unknown) => "NOT READ (no read noted)",
                                        }
                                        @if let Some(delivered) = s.behind_note() { br; span.sub { "Of its lag, " (delivered) } }
                                    }
                                    td {
                                        @if let Some(failing) = s.failing() { "FAILING: " (failing) }
                                        @else if s.reader_failures > 0 { "failed " (s.reader_failures) " time(s) since its last good read" }
                                        @else { "ok" }
                                    }
                                    td.num { (megabytes(s.lag_bytes)) }
                                    td.num { (megabytes(s.retained_bytes)) }
                                    td {
                                        (s.wal_status.as_deref().unwrap_or("—"))
                                        @if s.is_lost() { " — INVALIDATED: see postbox slot status" }
                                    }
                                }
                            }
                        }
                    } }
                }
            }
            section {
                h2 { "Relays connected now" }
                @if v.relays.is_empty() {
                    p.warn-text { "No relay is connected to this database (no session named postbox-relay)." }
                } @else {
                    div.scroll { table #relays {
                        thead { tr { th { "Client" } th.num { "Connections" } th { "Connected since" } th { "Last active" } } }
                        tbody {
                            @for r in v.relays {
                                tr {
                                    td { (r.client) }
                                    td.num { (r.connections) }
                                    td { (opt_time(r.connected_since)) }
                                    td { (opt_time(r.last_active)) }
                                }
                            }
                        }
                    } }
                }
                p.muted.small { "Relays of every schema in this database are listed; other roles' addresses show only with pg_monitor." }
            }
            section {
                h2 { "Lost acknowledgements" }
                p.muted { "Not kept in the database: each relay counts them in "
                    code { "postbox_acks_lost_total" } " on its " code { "/metrics" }
                    " endpoint (a settlement refused because a newer lease held the event: a duplicate delivery, never a loss)." }
            }
            @if !v.jobs.is_empty() {
                section {
                    h2 { "Recent bulk actions" }
                    (jobs_table(here, v.jobs))
                }
            }
            }
        },
    )
}

/// Bytes of WAL as megabytes, `—` when unknown.
fn megabytes(bytes: Option<f64>) -> String {
    bytes.map_or_else(|| "—".to_owned(), |b| format!("{:.1} MB", b / 1048576.0))
}

/// How the all-outboxes overview is ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OutboxOrder {
    /// Most dead letters first (the default).
    DeadLetters,
    Pending,
    Retrying,
    OldestPending,
    Name,
}

impl OutboxOrder {
    pub const ALL: [OutboxOrder; 5] = [
        OutboxOrder::DeadLetters,
        OutboxOrder::Pending,
        OutboxOrder::Retrying,
        OutboxOrder::OldestPending,
        OutboxOrder::Name,
    ];

    pub fn key(self) -> &'static str {
        match self {
            OutboxOrder::DeadLetters => "dead",
            OutboxOrder::Pending => "pending",
            OutboxOrder::Retrying => "retrying",
            OutboxOrder::OldestPending => "age",
            OutboxOrder::Name => "name",
        }
    }

    pub fn parse(key: Option<&str>) -> Self {
        Self::ALL
            .into_iter()
            .find(|o| Some(o.key()) == key)
            .unwrap_or(OutboxOrder::DeadLetters)
    }
}

pub(crate) struct OutboxesView<'a> {
    /// This page's lines, in order.
    pub lines: &'a [crate::outboxes::Line],
    /// Servers or databases whose outboxes could not be listed.
    pub problems: &'a [crate::outboxes::Problem],
    /// Outboxes in all, and how many could not be read.
    pub outboxes: usize,
    pub unreadable: usize,
    /// The backlog of every readable outbox together.
    pub total: Backlog,
    pub order: OutboxOrder,
    /// 1-based.
    pub page: usize,
    pub pages: usize,
    /// How long reading every outbox's backlog took.
    pub took: std::time::Duration,
    /// How long ago that read was (the overview's counts are shared for a
    /// few seconds).
    pub age: std::time::Duration,
    pub refresh_ms: u64,
}

fn outboxes_link(order: OutboxOrder, page: usize) -> String {
    let mut q = url::form_urlencoded::Serializer::new(String::new());
    if order != OutboxOrder::DeadLetters {
        q.append_pair("sort", order.key());
    }
    if page > 1 {
        q.append_pair("page", &page.to_string());
    }
    let q = q.finish();
    if q.is_empty() {
        "/".to_owned()
    } else {
        format!("/?{q}")
    }
}

/// The landing page of a console serving many outboxes: one line per
/// outbox, those that cannot be read first, then by the chosen order.
fn render_outboxes(here: &Frame<'_>, v: &OutboxesView<'_>) -> Markup {
    let heading = |order: OutboxOrder, label: &str, num: bool| {
        html! {
            th.num[num] {
                @if v.order == order {
                    span aria-current="true" { (label) " ▾" }
                } @else {
                    a href=(outboxes_link(order, 1)) { (label) }
                }
            }
        }
    };
    layout(
        "All outboxes",
        Some(here),
        Nav::Outboxes,
        html! {
            h1 { "All outboxes" }
            (live_status(v.refresh_ms))
            div #outboxes-live data-live {
                p #outboxes-summary {
                    strong { (v.outboxes) } " outbox(es)"
                    @if v.unreadable > 0 { ", " strong.warn-text { (v.unreadable) } " that cannot be read" }
                    ": " strong { (v.total.pending) } " pending (" (v.total.retrying) " retrying), "
                    strong { (v.total.dead_letters) } " dead letter(s). "
                    span.muted.small {
                        "Read in " (v.took.as_millis()) " ms"
                        @if v.age.as_secs() >= 1 { ", " (v.age.as_secs()) " s ago" }
                        "."
                    }
                }
                @for p in v.problems {
                    p.error.problem role="alert" { strong { (p.what) } ": " (p.why) }
                }
                @if v.lines.is_empty() {
                    p.muted { "No outbox matches the console's selection (yet): outboxes are listed again every few seconds." }
                } @else {
                    div.scroll { table.outboxes.stack #outboxes {
                        thead { tr {
                            (heading(OutboxOrder::Name, "Outbox", false))
                            (heading(OutboxOrder::Pending, "Pending", true))
                            (heading(OutboxOrder::Retrying, "Retrying", true))
                            (heading(OutboxOrder::DeadLetters, "Dead letters", true))
                            (heading(OutboxOrder::OldestPending, "Oldest pending", false))
                        } }
                        tbody {
                            @for line in v.lines {
                                @let o = &line.outbox;
                                @match &line.backlog {
                                    Ok(b) => {
                                        tr data-outbox=(o.name) class=[(b.dead_letters > 0).then_some("bad")] {
                                            td { a href=(o.at("/")) { (o.name) } }
                                            td.num.pending { a href=(o.at("/events?status=pending")) { (b.pending + b.retrying) } }
                                            td.num.retrying { (b.retrying) }
                                            td.num.dead { a href=(o.at("/dead-letters")) { (b.dead_letters) } }
                                            td.age { (b.oldest_pending_age_seconds.map_or_else(|| "—".to_owned(), age)) }
                                        }
                                    }
                                    Err(why) => {
                                        tr.error data-outbox=(o.name) {
                                            td { a href=(o.at("/")) { (o.name) } }
                                            td.error-text colspan="4" { "Cannot be read: " (why) }
                                        }
                                    }
                                }
                            }
                        }
                    } }
                }
                @if v.pages > 1 {
                    p.pager {
                        @if v.page > 1 { a href=(outboxes_link(v.order, v.page - 1)) { "← Previous" } " " }
                        "Page " (v.page) " of " (v.pages)
                        @if v.page < v.pages { " " a href=(outboxes_link(v.order, v.page + 1)) { "Next →" } }
                    }
                }
            }
            p.muted.small { "Pending counts every due event (retrying ones included); scheduled events are left out until due. Outboxes that cannot be read are listed first." }
        },
    )
}

fn jobs_table(here: &Frame<'_>, jobs: &[Job]) -> Markup {
    html! {
        div.scroll { table {
            thead { tr { th { "Started" } th { "By" } th { "Action" } th { "Progress" } th { "State" } } }
            tbody {
                @for j in jobs {
                    tr {
                        td { a href=(here.at(&format!("/jobs/{}", j.id))) { (time(j.started_at)) } }
                        td { (j.owner) }
                        td { (j.verb) " " (j.what) }
                        td.num { (j.done) " / " (j.total) }
                        td { (j.state.as_str()) }
                    }
                }
            }
        } }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

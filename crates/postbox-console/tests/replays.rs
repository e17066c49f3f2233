//! The replay jobs' page (`postbox replay`'s jobs): listed newest first with
//! their progress, one in full, cancelled by operators alone (audited, CSRF
//! and rate limits as for dead letters), each outbox's own.

use crate::outboxes::Many;
use crate::support::{hidden, Harness};
use chrono::{Duration as Span, Utc};
use postbox::statements::trusted;
use postbox_console::{RateLimit, Role};
use postbox_store::{NewReplay, PageDone, ReplayRange, ReplaySource, Replays, Store};
use postbox_testkit::TestDb;
use reqwest::StatusCode;
use uuid::Uuid;

fn replays(db: &TestDb) -> Replays {
    Store::new(db.pool.clone(), db.schema.clone()).replays()
}

/// A running job of `total` events to `destination`, made as `postbox
/// replay` makes one (audited as `replay_start`).
async fn make_job(db: &TestDb, destination: &str, total: i64) -> i64 {
    let to = Utc::now();
    replays(db)
        .create(&NewReplay {
            destination: destination.to_owned(),
            source: ReplaySource::Outbox,
            range: ReplayRange {
                from: to - Span::hours(2),
                to,
                types: Some("order.*".to_owned()),
                type_likes: Some(vec!["order.%".to_owned()]),
                aggregate_type: None,
                aggregate_id: None,
            },
            rate: Some(500),
            new_ids: false,
            hi: 1000,
            total,
            actor: "cli:alice".to_owned(),
        })
        .await
        .unwrap()
}

/// Job `id` past a page: `delivered`, `filtered`, `rejected` more, and an error.
async fn advance(db: &TestDb, id: i64, counts: (i64, i64, i64), error: Option<&str>) {
    let moved = replays(db)
        .advance(
            id,
            &PageDone {
                after_id: 5,
                after_event: Uuid::nil(),
                delivered: counts.0,
                filtered: counts.1,
                rejected: counts.2,
                error: error.map(str::to_owned),
            },
        )
        .await
        .unwrap();
    assert!(moved, "job {id} runs");
}

async fn set_state(db: &TestDb, id: i64, state: &str) {
    let took = replays(db)
        .set_state(id, state, &["running"], None)
        .await
        .unwrap();
    assert_eq!(took.as_deref(), Some(state));
}

async fn state(db: &TestDb, id: i64) -> String {
    replays(db).get(id).await.unwrap().expect("the job").state
}

/// (actor, job) of every `replay_cancel` audit entry, oldest first.
async fn cancels(db: &TestDb) -> Vec<(String, Option<String>)> {
    sqlx::query_as(trusted(&db.sql(
        "SELECT actor, selection->>'replay' FROM {schema}.audit_log \
         WHERE action = 'replay_cancel' ORDER BY id",
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn the_replays_page_lists_jobs_newest_first_with_their_progress() {
    let h = Harness::start().await;
    let failed = make_job(&h.db, "billing", 10).await;
    advance(
        &h.db,
        failed,
        (3, 1, 1),
        Some("<script>alert(1)</script> 400 missing field"),
    )
    .await;
    set_state(&h.db, failed, "failed").await;
    let running = make_job(&h.db, "search", 4).await;
    let done = make_job(&h.db, "archive", 2).await;
    advance(&h.db, done, (2, 0, 0), None).await;
    set_state(&h.db, done, "done").await;

    let mut v = h.signed_in("victor", Role::Viewer).await;
    let page = v.get("/").await;
    assert!(
        page.body.contains("href=\"/replays\""),
        "in the navigation: {}",
        page.body
    );
    let list = v.get("/replays").await;
    assert_eq!(list.status, StatusCode::OK, "{}", list.body);
    let b = &list.body;
    assert!(b.contains("href=\"/replays\" aria-current=\"page\""), "{b}");
    let at = |id: i64| {
        b.find(&format!("id=\"replay-{id}\""))
            .unwrap_or_else(|| panic!("job {id} listed: {b}"))
    };
    assert!(
        at(done) < at(running) && at(running) < at(failed),
        "newest first: {b}"
    );
    for (id, destination) in [(failed, "billing"), (running, "search"), (done, "archive")] {
        assert!(b.contains(&format!("href=\"/replays/{id}\"")), "{b}");
        assert!(b.contains(&format!("<td>{destination}</td>")), "{b}");
    }
    assert!(b.contains("5/10 (50%)"), "handled of the total: {b}");
    assert!(
        b.contains("3 / 1 / 1"),
        "delivered / filtered / refused: {b}"
    );
    assert!(b.contains("2/2 (100%)"), "{b}");
    assert!(b.contains("0/4 (0%)"), "{b}");
    assert!(b.contains("<progress"), "{b}");
    assert!(b.contains("badge bad\">failed<"), "{b}");
    assert!(b.contains("badge busy\">running<"), "{b}");
    assert!(b.contains("by cli:alice"), "{b}");
    assert!(b.contains("<strong>2</strong> open job(s)"), "{b}");
    assert!(b.contains("holds retention back"), "{b}");
    assert!(
        b.contains("&lt;script&gt;alert(1)&lt;/script&gt; 400 missing field"),
        "the last error, escaped: {b}"
    );
    assert!(!b.contains("<script>alert"), "{b}");
    assert!(
        !b.contains("id=\"cancel-"),
        "a viewer sees no cancel button"
    );

    let one = v.get(&format!("/replays/{failed}")).await;
    assert_eq!(one.status, StatusCode::OK, "{}", one.body);
    let b = &one.body;
    assert!(b.contains("id=\"replay-state\">failed<"), "{b}");
    assert!(b.contains("id=\"replay-handled\">5<"), "{b}");
    assert!(b.contains("id=\"replay-total\">10<"), "{b}");
    assert!(b.contains("order.*") && b.contains("500 events/s"), "{b}");
    assert!(b.contains("postbox replay resume"), "{b}");
    assert!(
        b.contains("<pre id=\"replay-last-error\">&lt;script&gt;alert(1)"),
        "{b}"
    );
    assert!(!b.contains("<script>alert"), "{b}");
    assert!(
        !b.contains("id=\"cancel\""),
        "a viewer sees no cancel button"
    );
    for missing in ["/replays/999999", "/replays/0", "/replays/x"] {
        assert_eq!(
            v.get(missing).await.status,
            StatusCode::NOT_FOUND,
            "{missing}"
        );
    }
    h.finish().await;
}

#[tokio::test]
async fn a_viewer_cannot_cancel_a_replay_job() {
    let h = Harness::start().await;
    let job = make_job(&h.db, "billing", 10).await;
    let mut v = h.signed_in("victor", Role::Viewer).await;
    let page = v.get(&format!("/replays/{job}")).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert!(!page.body.contains("id=\"cancel\""), "{}", page.body);
    let csrf = v.csrf.clone();
    let r = v
        .post(&format!("/replays/{job}/cancel"), &[("csrf", &csrf)])
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.body);
    assert!(r.body.contains("Your role (viewer)"), "{}", r.body);
    // An operator's form without the session's token is refused too.
    let mut o = h.signed_in("olga", Role::Operator).await;
    let r = o
        .post(&format!("/replays/{job}/cancel"), &[("csrf", &csrf)])
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.body);
    assert!(r.body.contains("CSRF"), "{}", r.body);
    assert_eq!(state(&h.db, job).await, "running", "still open");
    assert!(cancels(&h.db).await.is_empty(), "nothing audited");
    h.finish().await;
}

#[tokio::test]
async fn an_operator_cancels_an_open_replay_job_and_it_is_audited() {
    let h = Harness::start().await;
    let job = make_job(&h.db, "billing", 10).await;
    let done = make_job(&h.db, "archive", 2).await;
    advance(&h.db, done, (2, 0, 0), None).await;
    set_state(&h.db, done, "done").await;
    let mut o = h.signed_in("olga", Role::Operator).await;
    let list = o.get("/replays").await;
    assert!(
        list.body.contains(&format!("id=\"cancel-{job}\"")),
        "{}",
        list.body
    );
    assert!(
        !list.body.contains(&format!("id=\"cancel-{done}\"")),
        "an ended job has no cancel button: {}",
        list.body
    );
    let page = o.get(&format!("/replays/{job}")).await;
    assert!(page.body.contains("id=\"cancel\""), "{}", page.body);
    let token = hidden(&page.body, "csrf");
    let r = o
        .post(&format!("/replays/{job}/cancel"), &[("csrf", &token)])
        .await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    let back = format!("/replays/{job}?notice=replay-cancelled");
    assert_eq!(r.location.as_deref(), Some(back.as_str()));
    let cancelled = replays(&h.db).get(job).await.unwrap().unwrap();
    assert_eq!(cancelled.state, "cancelled");
    assert!(cancelled.finished_at.is_some());
    assert_eq!(
        cancels(&h.db).await,
        vec![("console:olga".to_owned(), Some(job.to_string()))],
        "one replay_cancel entry, the console user as the actor"
    );
    let shown = o.get(&back).await;
    assert!(
        shown.body.contains("Cancelled, and recorded"),
        "{}",
        shown.body
    );
    assert!(shown.body.contains("id=\"replay-state\">cancelled<"));
    assert!(!shown.body.contains("id=\"cancel\""), "{}", shown.body);

    // Cancelling what has ended does nothing, and audits nothing.
    for id in [job, done] {
        let r = o
            .post(&format!("/replays/{id}/cancel"), &[("csrf", &token)])
            .await;
        assert_eq!(
            r.location,
            Some(format!("/replays/{id}?notice=replay-not-open"))
        );
    }
    assert_eq!(state(&h.db, done).await, "done");
    let r = o.post("/replays/999999/cancel", &[("csrf", &token)]).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(cancels(&h.db).await.len(), 1);
    // The audit page links the entry to its job.
    let audit = o.get("/audit?action=replay_cancel").await;
    assert!(
        audit.body.contains(&format!("href=\"/replays/{job}\"")),
        "{}",
        audit.body
    );
    h.finish().await;
}

#[tokio::test]
async fn replay_cancels_share_the_replay_and_discard_rate_limit() {
    let h = Harness::with(|c| c.action_limit = RateLimit::per_minute(1)).await;
    let ids = h.dead_letters("order.placed", 1).await;
    let job = make_job(&h.db, "billing", 10).await;
    let mut o = h.signed_in("olga", Role::Operator).await;
    let csrf = o.csrf.clone();
    let r = o
        .post(&format!("/events/{}/replay", ids[0]), &[("csrf", &csrf)])
        .await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    let r = o
        .post(&format!("/replays/{job}/cancel"), &[("csrf", &csrf)])
        .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{}", r.body);
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(state(&h.db, job).await, "running");
    assert!(cancels(&h.db).await.is_empty());
    h.finish().await;
}

#[tokio::test]
async fn a_user_limited_to_one_outbox_sees_and_cancels_only_its_replay_jobs() {
    let m = Many::start(2).await;
    // Each outbox numbers its own jobs: both are job 1.
    let a = make_job(&m.tenants[0], "billing", 10).await;
    let b = make_job(&m.tenants[1], "search", 7).await;
    assert_eq!(a, b);
    let schema = m.tenants[0].schema.name().to_owned();
    m.h.limited_user("olga", Role::Operator, &format!("{}/{schema}", m.database))
        .await;
    let mut olga = m.h.signed_in_as("olga").await;
    let mine = olga.get(&m.at(0, "/replays")).await;
    assert_eq!(mine.status, StatusCode::OK, "{}", mine.body);
    assert!(mine.body.contains("<td>billing</td>"), "{}", mine.body);
    assert!(!mine.body.contains("<td>search</td>"), "{}", mine.body);
    assert!(
        mine.body
            .contains(&format!("href=\"{}\"", m.at(0, &format!("/replays/{a}")))),
        "{}",
        mine.body
    );
    let csrf = olga.csrf.clone();
    for path in ["/replays".to_owned(), format!("/replays/{b}")] {
        let r = olga.get(&m.at(1, &path)).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{path}: {}", r.body);
        assert!(r.body.contains("No such outbox"), "{path}: {}", r.body);
    }
    let r = olga
        .post(
            &m.at(1, &format!("/replays/{b}/cancel")),
            &[("csrf", &csrf)],
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.body);
    assert_eq!(state(&m.tenants[1], b).await, "running");
    assert!(cancels(&m.tenants[1]).await.is_empty());

    let r = olga
        .post(
            &m.at(0, &format!("/replays/{a}/cancel")),
            &[("csrf", &csrf)],
        )
        .await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    assert_eq!(state(&m.tenants[0], a).await, "cancelled");
    assert_eq!(state(&m.tenants[1], b).await, "running");
    assert_eq!(
        cancels(&m.tenants[0]).await,
        vec![("console:olga".to_owned(), Some(a.to_string()))]
    );
    m.finish().await;
}

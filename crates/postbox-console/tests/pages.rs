//! The pages and the bulk actions, over HTTP.

use crate::support::{hidden, job_progress, Harness};
use postbox::statements::trusted;
use postbox::NewEvent;
use postbox_console::{PayloadRedactor, Role};
use postbox_testkit::wait_for;
use reqwest::StatusCode;
use serde_json::Value;
use std::time::Duration;
use uuid::Uuid;

#[tokio::test]
async fn the_overview_shows_counts_rate_and_connected_relays() {
    let h = Harness::start().await;
    let dead = h.dead_letters("order.placed", 2).await;
    let events: Vec<NewEvent> = (0..5)
        .map(|i| {
            NewEvent::new("order.paid", "order", i.to_string(), &serde_json::json!({})).unwrap()
        })
        .collect();
    let ids = h.db.enqueue_events(&events).await;
    h.db.exec("UPDATE {schema}.outbox SET status = 'sent', sent_at = now() WHERE event_type = 'order.paid' AND id % 2 = 0")
        .await;
    // A connection that looks like a relay's.
    let options: sqlx::postgres::PgConnectOptions = h.db.url.parse().unwrap();
    let relay = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.application_name("postbox-relay"))
        .await
        .unwrap();
    sqlx::query("SELECT 1").execute(&relay).await.unwrap();

    let mut a = h.signed_in("victor", Role::Viewer).await;
    let page = a.get("/").await;
    assert_eq!(page.status, StatusCode::OK);
    let b = &page.body;
    let sent = ids.len() as i64
        - h.db
            .count("SELECT count(*) FROM {schema}.outbox WHERE status = 'pending'")
            .await;
    assert!(
        b.contains(&format!("id=\"dead-letters\">{}<", dead.len())),
        "{b}"
    );
    assert!(
        b.contains(&format!(
            "<span class=\"label\">Sent</span><span class=\"value\">{sent}</span>"
        )),
        "{b}"
    );
    assert!(b.contains("<svg"), "a chart");
    assert!(b.contains(&format!("peak <strong>{sent}</strong>")), "{b}");
    assert!(b.contains("id=\"relays\""), "{b}");
    assert!(b.contains("postbox_acks_lost_total"));
    relay.close().await;
    h.finish().await;
}

/// The legend's latest value of `series` on the overview page `body`.
fn legend(body: &str, series: &str) -> Option<String> {
    let marker = format!("{series}: <strong>");
    let start = body.find(&marker)? + marker.len();
    let end = body[start..].find('<')? + start;
    Some(body[start..end].to_owned())
}

#[tokio::test]
async fn the_overview_charts_the_backlog_history_with_axes() {
    let h = Harness::with(|c| c.sample_every = Duration::from_millis(200)).await;
    let mut a = h.signed_in("victor", Role::Viewer).await;
    let first = a.get("/").await.body;
    assert_eq!(legend(&first, "dead letters").as_deref(), Some("0"));
    for id in ["backlog-chart", "age-chart", "rate-chart"] {
        assert!(first.contains(&format!("id=\"{id}\"")), "{id}: {first}");
    }
    // Dead letters and retrying events appear; the console's samples record them.
    h.dead_letters("order.placed", 3).await;
    let retrying: Vec<NewEvent> = (0..2)
        .map(|i| {
            NewEvent::new("order.paid", "order", i.to_string(), &serde_json::json!({})).unwrap()
        })
        .collect();
    h.db.enqueue_events(&retrying).await;
    h.db.exec(
        "UPDATE {schema}.outbox SET attempts = 4, available_at = now() + interval '5 minutes', \
         created_at = now() - interval '90 seconds' WHERE event_type = 'order.paid'",
    )
    .await;
    let url = h.url("/");
    let cookies = a.cookies.clone();
    wait_for(
        "a sample with the dead letters",
        Duration::from_secs(20),
        || {
            let (url, cookies) = (url.clone(), cookies.clone());
            async move {
                let page = page_with(&url, &cookies).await;
                // A line (two samples or more) that ends at three dead letters,
                // after a sample without them.
                page.contains("<polyline class=\"s-dead\"")
                    && legend(&page, "dead letters").as_deref() == Some("3")
                    && samples_of(&page, "dead letters").first() == Some(&0.0)
            }
        },
    )
    .await;
    let page = a.get("/").await.body;
    assert_eq!(legend(&page, "retrying").as_deref(), Some("2"));
    assert_eq!(
        legend(&page, "pending").as_deref(),
        Some("0"),
        "retrying are not counted twice"
    );
    let oldest = legend(&page, "oldest pending").unwrap();
    assert!(oldest.starts_with("1m 3"), "{oldest}");
    assert!(page.contains("2 of them retrying"), "{page}");
    // Axes: value ticks from 0 to a round top, and times.
    assert!(page.contains("class=\"tick\""), "{page}");
    assert!(
        page.contains(">5</text>"),
        "dead letters 3 → a top of 5: {page}"
    );
    assert!(page.contains(">0</text>"), "{page}");
    h.finish().await;
}

async fn page_with(url: &str, cookies: &[(String, String)]) -> String {
    let cookie = cookies
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("; ");
    postbox_testkit::http()
        .build()
        .unwrap()
        .get(url)
        .header("cookie", cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The y values (in view-box units, 0 = the bottom line) of a series' points.
fn samples_of(body: &str, series: &str) -> Vec<f64> {
    let marker = format!("data-series=\"{series}\" points=\"");
    let Some(start) = body.find(&marker).map(|i| i + marker.len()) else {
        return Vec::new();
    };
    let end = body[start..].find('"').unwrap() + start;
    body[start..end]
        .split(' ')
        .filter_map(|p| p.split_once(',')?.1.parse::<f64>().ok())
        .map(|y| 170.0 - y)
        .collect()
}

#[tokio::test]
async fn events_are_searched_by_type_aggregate_status_id_and_time_in_pages() {
    let h = Harness::with(|c| c.page_size = 4).await;
    let events: Vec<NewEvent> = (0..6)
        .map(|i| {
            NewEvent::new(
                "order.placed",
                "order",
                format!("<b>{i}</b>"),
                &serde_json::json!({"i": i}),
            )
            .unwrap()
        })
        .chain((0..2).map(|i| {
            NewEvent::new(
                "user.created",
                "user",
                i.to_string(),
                &serde_json::json!({}),
            )
            .unwrap()
        }))
        .collect();
    let ids = h.db.enqueue_events(&events).await;
    let dead = h.dead_letters("order.refunded", 1).await;
    let mut a = h.signed_in("victor", Role::Viewer).await;

    let first = a.get("/events?type=order.placed").await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body.matches("href=\"/events/").count(), 4, "one page");
    assert!(!first.body.contains("<b>"), "user data is escaped");
    assert!(first.body.contains("&lt;b&gt;5&lt;/b&gt;"));
    let next = first
        .body
        .split("<p class=\"pager\"><a href=\"")
        .nth(1)
        .unwrap();
    let next = next.split('"').next().unwrap().replace("&amp;", "&");
    assert!(
        next.starts_with("/events?type=order.placed&before="),
        "{next}"
    );
    let second = a.get(&next).await;
    assert_eq!(second.body.matches("href=\"/events/").count(), 2);
    assert!(!second.body.contains("Older events"));

    let by_id = a.get(&format!("/events?event_id={}", ids[7])).await;
    assert_eq!(by_id.body.matches("href=\"/events/").count(), 1);
    assert!(by_id.body.contains("user.created"));
    let by_agg = a.get("/events?aggregate_type=user&aggregate_id=1").await;
    assert_eq!(by_agg.body.matches("href=\"/events/").count(), 1);
    let by_status = a.get("/events?status=dead").await;
    assert!(by_status.body.contains(&dead[0].to_string()));
    assert_eq!(by_status.body.matches("href=\"/events/").count(), 1);
    let future = a.get("/events?from=2h&to=2999-01-01").await;
    assert_eq!(future.body.matches("href=\"/events/").count(), 4);
    let none = a.get("/events?from=2999-01-01").await;
    assert!(none.body.contains("No events match."));
    let bad = a.get("/events?event_id=%3Cscript%3E&from=soon").await;
    assert_eq!(bad.status, StatusCode::OK);
    assert!(bad.body.contains("is neither a time") || bad.body.contains("is not an event id"));
    assert!(!bad.body.contains("<script>"));
    h.finish().await;
}

#[tokio::test]
async fn an_event_page_shows_why_it_is_stuck_with_redacted_payload() {
    let h = Harness::with(|c| {
        c.redactor = PayloadRedactor::new(&["card.number".to_owned()])
            .unwrap()
            .with_headers(&["authorization".to_owned()]);
    })
    .await;
    let ids = h.dead_letters("order.placed", 1).await;
    h.db.exec(r#"UPDATE {schema}.outbox SET headers = '{"Authorization": "Bearer s3cret", "traceparent": "00-abc"}'"#)
        .await;
    let mut a = h.signed_in("alice", Role::Operator).await;
    let page = a.get(&format!("/events/{}", ids[0])).await;
    assert_eq!(page.status, StatusCode::OK);
    let b = &page.body;
    assert!(b.contains("Dead letter after 20 attempt(s)"), "{b}");
    assert!(b.contains("sink rejected: 400 missing field customer_id"));
    assert!(b.contains("***"), "masked");
    assert!(!b.contains("4111 1111"), "the card number is masked");
    assert!(!b.contains("s3cret"), "the header is masked");
    assert!(b.contains("00-abc"));
    assert!(b.contains("id=\"replay\""));
    assert!(b.contains("Enqueued (number 1 of its aggregate)"));

    let csrf = a.csrf.clone();
    let r = a
        .post(&format!("/events/{}/replay", ids[0]), &[("csrf", &csrf)])
        .await;
    assert_eq!(
        r.location,
        Some(format!("/events/{}?notice=replayed", ids[0]))
    );
    let (status, attempts, _) = h.status(ids[0]).await;
    assert_eq!((status.as_str(), attempts), ("pending", 0));
    let after = a.get(r.location.as_deref().unwrap()).await;
    assert!(after.body.contains("Replayed: the event is pending again"));
    assert!(
        after
            .body
            .contains("Replayed under the same id by console:alice"),
        "timeline"
    );
    let again = a
        .post(&format!("/events/{}/replay", ids[0]), &[("csrf", &csrf)])
        .await;
    assert_eq!(
        again.location,
        Some(format!("/events/{}?notice=not-dead", ids[0]))
    );

    assert_eq!(
        a.get(&format!("/events/{}", Uuid::now_v7())).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        a.get("/events/not-an-id").await.status,
        StatusCode::NOT_FOUND
    );
    h.finish().await;
}

async fn progress(a: &mut crate::support::Agent, job: &str) -> Value {
    let r = a.get(&format!("{job}/progress")).await;
    serde_json::from_str(&r.body).unwrap()
}

#[tokio::test]
async fn replay_all_matching_runs_in_batches_and_is_audited() {
    let h = Harness::with(|c| c.batch_size = 10).await;
    let x = h.dead_letters("order.placed", 25).await;
    let y = h.dead_letters("user.created", 3).await;
    let mut a = h.signed_in("alice", Role::Operator).await;
    let list = a.get("/dead-letters?type=order.placed").await;
    assert!(
        list.body
            .contains("<strong>25</strong> unresolved dead letter(s) match."),
        "{}",
        list.body
    );
    let csrf = a.csrf.clone();
    let r = a
        .post(
            "/dead-letters/action",
            &[
                ("csrf", &csrf),
                ("type", "order.placed"),
                ("since", ""),
                ("do", "replay-all"),
            ],
        )
        .await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    let job = r.location.unwrap();
    assert!(job.starts_with("/jobs/"));
    wait_for("the bulk replay to finish", Duration::from_secs(20), || {
        let p = job_progress(h.url(&format!("{job}/progress")), a.cookies.clone());
        async move { p.await["finished"] == true }
    })
    .await;
    let p = progress(&mut a, &job).await;
    assert_eq!(
        (p["done"].as_u64(), p["total"].as_u64(), p["state"].as_str()),
        (Some(25), Some(25), Some("finished"))
    );
    for id in &x {
        assert_eq!(h.status(*id).await.0, "pending");
    }
    for id in &y {
        assert_eq!(h.status(*id).await.0, "failed");
    }
    let audit = h.audit().await;
    let replays: Vec<i64> = audit
        .iter()
        .filter(|(actor, action, _, _)| action == "dlq.replay" && actor == "console:alice")
        .map(|(_, _, count, _)| *count)
        .collect();
    assert_eq!(replays, vec![10, 10, 5], "one audit entry per batch");
    let selection: Value = sqlx::query_scalar(trusted(
        &h.db
            .sql("SELECT selection FROM {schema}.audit_log WHERE action = 'dlq.replay' LIMIT 1"),
    ))
    .fetch_one(&h.db.pool)
    .await
    .unwrap();
    assert_eq!(
        selection,
        serde_json::json!({"all": true, "type": "order.placed"})
    );
    let page = a.get(&job).await;
    assert!(
        page.body.contains("id=\"job-state\">finished<"),
        "{}",
        page.body
    );
    h.finish().await;
}

#[tokio::test]
async fn discarding_a_selection_needs_a_reason() {
    let h = Harness::start().await;
    let ids = h.dead_letters("order.placed", 3).await;
    let mut a = h.signed_in("alice", Role::Operator).await;
    let csrf = a.csrf.clone();
    let (one, two) = (ids[0].to_string(), ids[1].to_string());
    let r = a
        .post(
            "/dead-letters/action",
            &[("csrf", &csrf), ("do", "discard-selected"), ("ids", &one)],
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.body.contains("A reason is required"));
    let r = a
        .post(
            "/dead-letters/action",
            &[("csrf", &csrf), ("do", "discard-selected")],
        )
        .await;
    assert_eq!(
        r.status,
        StatusCode::BAD_REQUEST,
        "no reason and nothing selected"
    );
    let r = a
        .post(
            "/dead-letters/action",
            &[("csrf", &csrf), ("do", "replay-selected")],
        )
        .await;
    assert_eq!(
        r.location.as_deref(),
        Some("/dead-letters?notice=none-selected")
    );
    let r = a
        .post(
            "/dead-letters/action",
            &[
                ("csrf", &csrf),
                ("do", "discard-selected"),
                ("ids", &one),
                ("ids", &two),
                ("reason", "test orders <b>"),
            ],
        )
        .await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    let job = r.location.unwrap();
    wait_for("the discard to finish", Duration::from_secs(20), || async {
        h.db.count("SELECT count(*) FROM {schema}.outbox WHERE resolution = 'discarded'")
            .await
            == 2
    })
    .await;
    assert_eq!(h.status(ids[2]).await.2, None);
    wait_for("the job to say so", Duration::from_secs(10), || {
        let p = job_progress(h.url(&format!("{job}/progress")), a.cookies.clone());
        async move { p.await["state"] == "finished" }
    })
    .await;
    let audit = a.get("/audit?action=dlq.discard").await;
    assert!(
        audit.body.contains("test orders &lt;b&gt;"),
        "{}",
        audit.body
    );
    assert!(audit.body.contains(&one) && audit.body.contains(&two));
    h.finish().await;
}

#[tokio::test]
async fn a_bulk_action_can_be_cancelled_between_batches() {
    let h = Harness::with(|c| c.batch_size = 1).await;
    let ids = h.dead_letters("order.placed", 12).await;
    // Hold the fifth dead letter so the action waits there.
    let mut holder = h.db.pool.begin().await.unwrap();
    sqlx::query(trusted(&h.db.sql(
        "SELECT 1 FROM {schema}.outbox WHERE event_id = $1 FOR UPDATE",
    )))
    .bind(ids[4])
    .execute(&mut *holder)
    .await
    .unwrap();
    let mut a = h.signed_in("alice", Role::Operator).await;
    let mut v = h.signed_in("victor", Role::Viewer).await;
    let csrf = a.csrf.clone();
    let r = a
        .post(
            "/dead-letters/action",
            &[("csrf", &csrf), ("do", "replay-all")],
        )
        .await;
    let job = r.location.unwrap();
    wait_for("four batches", Duration::from_secs(20), || async {
        h.db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'pending'")
            .await
            == 4
    })
    .await;
    let page = v.get(&job).await;
    assert!(page.body.contains("id=\"job-state\">running<"));
    assert!(
        !page.body.contains("id=\"cancel\""),
        "a viewer sees no cancel button"
    );
    let vcsrf = v.csrf.clone();
    assert_eq!(
        v.post(&format!("{job}/cancel"), &[("csrf", &vcsrf)])
            .await
            .status,
        StatusCode::FORBIDDEN
    );
    let page = a.get(&job).await;
    let token = hidden(&page.body, "csrf");
    let r = a.post(&format!("{job}/cancel"), &[("csrf", &token)]).await;
    assert_eq!(r.location.as_deref(), Some(job.as_str()));
    holder.commit().await.unwrap();
    wait_for("the action to stop", Duration::from_secs(20), || {
        let p = job_progress(h.url(&format!("{job}/progress")), a.cookies.clone());
        async move { p.await["finished"] == true }
    })
    .await;
    let p = progress(&mut a, &job).await;
    assert_eq!(p["state"], "cancelled");
    assert_eq!(
        p["done"], 5,
        "the batch under way when cancelled still commits"
    );
    assert_eq!(
        h.db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'pending'")
            .await,
        5
    );
    let audited: i64 = h.db.count("SELECT COALESCE(sum(count), 0)::bigint FROM {schema}.audit_log WHERE action = 'dlq.replay'").await;
    assert_eq!(audited, 5, "the audit log matches the data");
    h.finish().await;
}

#[tokio::test]
async fn the_audit_log_has_its_own_read_only_page() {
    let h = Harness::with(|c| c.page_size = 3).await;
    let ids = h.dead_letters("order.placed", 1).await;
    let mut a = h.signed_in("alice", Role::Operator).await;
    let csrf = a.csrf.clone();
    a.post(
        &format!("/events/{}/discard", ids[0]),
        &[("csrf", &csrf), ("reason", "duplicate order")],
    )
    .await;
    for _ in 0..3 {
        let mut b = crate::support::Agent::new(&h);
        b.sign_in("alice", "wrong password").await;
    }
    let page = a.get("/audit").await;
    assert_eq!(page.status, StatusCode::OK);
    assert_eq!(
        page.body.matches("<td>console:alice</td>").count(),
        3,
        "one page"
    );
    assert!(page.body.contains("Older entries"));
    let discards = a.get("/audit?action=dlq.discard").await;
    assert!(discards.body.contains("duplicate order"));
    assert!(discards.body.contains(&ids[0].to_string()));
    let mut x = crate::support::Agent::new(&h);
    x.sign_in("<script>alert(1)</script>", "whatever").await;
    let failed = a.get("/audit?action=console.sign_in_failed").await;
    assert!(failed
        .body
        .contains("console:&lt;script&gt;alert(1)&lt;/script&gt;"));
    assert!(!failed.body.contains("<script>alert"));
    let sign_ins = a.get("/audit?action=console.sign_in").await;
    assert_eq!(sign_ins.body.matches("<td>console.sign_in</td>").count(), 1);
    for method in [
        reqwest::Method::POST,
        reqwest::Method::PUT,
        reqwest::Method::DELETE,
    ] {
        let r = postbox_testkit::http()
            .build()
            .unwrap()
            .request(method.clone(), h.url("/audit"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED, "{method}");
    }
    h.finish().await;
}

#[tokio::test]
async fn dead_letters_and_retries_are_grouped_by_cause_and_a_group_is_replayed_whole() {
    let h = Harness::start().await;
    let refused = "redis: Connection refused (os error 111)";
    let rejected = h.dead_letters("order.placed", 25).await;
    let other = h.dead_letters("order.shipped", 5).await;
    let fan_out = h.dead_letters("order.placed", 1).await;
    sqlx::query(trusted(&h.db.sql(
        "UPDATE {schema}.outbox SET last_error = $1 WHERE event_id = ANY($2)",
    )))
    .bind(refused)
    .bind(&other)
    .execute(&h.db.pool)
    .await
    .unwrap();
    // The fan-out dead letter failed at one destination: a group of its own.
    sqlx::query(trusted(&h.db.sql(
        "INSERT INTO {schema}.deliveries (outbox_id, destination, status, attempts, last_error) \
         SELECT id, 'billing', 'failed', 20, last_error FROM {schema}.outbox WHERE event_id = $1",
    )))
    .bind(fan_out[0])
    .execute(&h.db.pool)
    .await
    .unwrap();
    let waiting: Vec<NewEvent> = (0..4)
        .map(|i| {
            NewEvent::new("order.paid", "order", i.to_string(), &serde_json::json!({})).unwrap()
        })
        .collect();
    h.db.enqueue_events(&waiting).await;
    sqlx::query(trusted(&h.db.sql(
        "UPDATE {schema}.outbox SET attempts = 3, available_at = now() + interval '1 hour', last_error = $1 \
         WHERE event_type = 'order.paid'",
    )))
    .bind(refused)
    .execute(&h.db.pool)
    .await
    .unwrap();

    let mut op = h.signed_in("olga", Role::Operator).await;
    let page = op.get("/groups").await;
    assert_eq!(page.status, StatusCode::OK);
    let b = &page.body;
    assert!(
        b.contains("<strong>31</strong> unresolved dead letter(s) in <strong>3</strong> group(s)"),
        "{b}"
    );
    let counts: Vec<&str> = b
        .split("<td class=\"num count\">")
        .skip(1)
        .map(|rest| &rest[..rest.find('<').unwrap()])
        .collect();
    assert_eq!(counts, ["25", "5", "1"], "largest first");
    assert!(b.contains("<td>billing</td>"), "{b}");
    assert!(b.contains("Replay 25") && b.contains("Discard 5"), "{b}");
    let retrying = op.get("/groups?status=retrying").await.body;
    assert!(retrying.contains("<strong>4</strong> event(s) waiting for their next attempt in <strong>1</strong> group(s)"), "{retrying}");
    assert!(
        retrying.contains(refused) && !retrying.contains("Replay 4"),
        "{retrying}"
    );

    // Replay the 25 as one group.
    let key = {
        let start = b.find("data-key=\"").unwrap() + "data-key=\"".len();
        b[start..start + 32].to_owned()
    };
    let csrf = op.csrf.clone();
    let no_reason = op
        .post(
            "/groups/action",
            &[("csrf", &csrf), ("key", &key), ("do", "discard")],
        )
        .await;
    assert_eq!(no_reason.status, StatusCode::BAD_REQUEST);
    let r = op
        .post(
            "/groups/action",
            &[("csrf", &csrf), ("key", &key), ("do", "replay")],
        )
        .await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    let job = r.location.unwrap();
    wait_for(
        "the group replay to finish",
        Duration::from_secs(20),
        || {
            let url = h.url(&format!("{job}/progress"));
            let cookies = op.cookies.clone();
            async move { job_progress(url, cookies).await["finished"] == true }
        },
    )
    .await;
    for id in &rejected {
        assert_eq!(h.status(*id).await.0, "pending");
    }
    for id in other.iter().chain(&fan_out) {
        assert_eq!(
            h.status(*id).await.0,
            "failed",
            "other groups are left alone"
        );
    }
    let replayed: i64 = h
        .db
        .count("SELECT COALESCE(sum(count), 0)::bigint FROM {schema}.audit_log WHERE action = 'dlq.replay' AND actor = 'console:olga'")
        .await;
    assert_eq!(replayed, 25, "audited");
    let again = op
        .post(
            "/groups/action",
            &[("csrf", &csrf), ("key", &key), ("do", "replay")],
        )
        .await;
    assert_eq!(again.location.as_deref(), Some("/groups?notice=group-gone"));

    // A viewer sees the groups, without the actions.
    let mut viewer = h.signed_in("victor", Role::Viewer).await;
    let seen = viewer.get("/groups").await.body;
    assert!(
        seen.contains("<strong>6</strong> unresolved dead letter(s)"),
        "{seen}"
    );
    assert!(!seen.contains("/groups/action"), "{seen}");
    h.finish().await;
}

#[tokio::test]
async fn a_retrying_event_is_called_retrying_with_its_next_attempt() {
    let h = Harness::start().await;
    let events: Vec<NewEvent> = (0..2)
        .map(|i| {
            NewEvent::new("order.paid", "order", i.to_string(), &serde_json::json!({})).unwrap()
        })
        .collect();
    let ids = h.db.enqueue_events(&events).await;
    sqlx::query(trusted(&h.db.sql(
        "UPDATE {schema}.outbox SET attempts = 4, available_at = now() + interval '10 minutes', \
         last_error = 'redis: Connection refused' WHERE event_id = $1",
    )))
    .bind(ids[0])
    .execute(&h.db.pool)
    .await
    .unwrap();
    let next: String = sqlx::query_scalar(trusted(&h.db.sql(
        "SELECT to_char(available_at AT TIME ZONE 'UTC', 'HH24:MI:SS') FROM {schema}.outbox WHERE event_id = $1",
    )))
    .bind(ids[0])
    .fetch_one(&h.db.pool)
    .await
    .unwrap();
    let mut a = h.signed_in("victor", Role::Viewer).await;
    let list = a.get("/events").await.body;
    assert!(
        list.contains(&format!("attempt 4 failed; next at {next} UTC")),
        "{list}"
    );
    assert_eq!(
        list.matches(">retrying<").count(),
        1,
        "the other one is plainly pending"
    );
    let page = a.get(&format!("/events/{}", ids[0])).await.body;
    assert!(
        page.contains("Retrying: attempt 4 failed; the next attempt is at"),
        "{page}"
    );
    assert!(!page.contains("Being delivered"), "{page}");
    // Claimed by a relay: held, for its fifth attempt.
    h.db.exec(
        "UPDATE {schema}.outbox SET status = 'processing', attempts = 5, available_at = now(), \
               lease_expires_at = now() + interval '1 minute', lease_token = gen_random_uuid()",
    )
    .await;
    let page = a.get(&format!("/events/{}", ids[0])).await.body;
    assert!(
        page.contains("Claimed by a relay for attempt 5 (lease until"),
        "{page}"
    );
    let list = a.get("/events").await.body;
    assert!(list.contains("by a relay, attempt 5"), "{list}");
    h.finish().await;
}

/// In log mode the overview shows which table producers write to and how
/// far each destination's cursor is behind.
#[tokio::test]
async fn the_overview_shows_log_cursors_in_log_mode() {
    let h = Harness::start().await;
    let mut a = h.signed_in("victor", Role::Viewer).await;
    let page = a.get("/").await;
    assert!(
        !page.body.contains("Log cursors"),
        "no log section in claim mode"
    );

    let log = postbox_store::Store::new(h.db.pool.clone(), h.db.schema.clone()).log();
    log.set_producer_target(postbox_store::ProducerTarget::Log)
        .await
        .unwrap();
    let page = a.get("/").await;
    assert!(page.body.contains("No cursor yet"), "{}", page.body);

    log.ensure_cursors(&["billing".to_owned()]).await.unwrap();
    let events: Vec<NewEvent> = (0..3)
        .map(|i| {
            NewEvent::new("order.paid", "order", i.to_string(), &serde_json::json!({})).unwrap()
        })
        .collect();
    h.db.enqueue_events(&events).await;
    let page = a.get("/").await;
    let b = &page.body;
    assert!(b.contains("producers write to the log"), "{b}");
    assert!(b.contains("id=\"log-cursors\""), "{b}");
    assert!(
        b.contains("<td>billing</td><td>no</td><td class=\"num\">3</td>"),
        "billing is 3 events behind, held by no relay: {b}"
    );
    h.finish().await;
}

/// The overview shows each consumer group with what it holds.
#[tokio::test]
async fn the_overview_shows_consumer_groups() {
    let h = Harness::start().await;
    let mut a = h.signed_in("victor", Role::Viewer).await;
    let page = a.get("/").await;
    assert!(
        !page.body.contains("Consumer groups"),
        "no groups, no section"
    );
    let store = postbox_store::Store::new(h.db.pool.clone(), h.db.schema.clone());
    let mut ledger = postbox_store::NewGroup::new("ledger");
    ledger.ordered = true;
    store.groups().create(&ledger).await.unwrap();
    h.db.exec(
        "INSERT INTO {schema}.log (event_id, event_type, aggregate_type, aggregate_id, payload) \
         SELECT gen_random_uuid(), 't', 'a', i::text, '{}' FROM generate_series(1, 4) AS i",
    )
    .await;
    store
        .groups()
        .receive(
            "ledger",
            1,
            std::time::Duration::from_secs(60),
            std::time::Duration::ZERO,
        )
        .await
        .unwrap();
    let page = a.get("/").await;
    let b = &page.body;
    assert!(b.contains("id=\"consumer-groups\""), "{b}");
    assert!(
        b.contains("<td>ledger</td><td class=\"num\">3</td><td class=\"num\">1</td>"),
        "3 unread, 1 in flight: {b}"
    );
    assert!(b.contains("ordered; max attempts 5"), "{b}");
    h.finish().await;
}

/// In logical mode the overview shows the schema's replication slot and a
/// reader that keeps failing, with its (masked) error, as the relay noted it,
/// and a slot behind its reader's note.
#[tokio::test]
async fn the_overview_shows_a_failing_logical_reader() {
    let h = Harness::start().await;
    let mut a = h.signed_in("victor", Role::Viewer).await;
    assert!(
        !a.get("/").await.body.contains("id=\"slots\""),
        "no slot yet"
    );

    let slot = postbox_store::default_slot_name(&h.db.schema);
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(&slot)
        .execute(&h.db.pool)
        .await
        .unwrap();
    let _drop = postbox_testkit::SlotGuard(slot.clone());
    let page = a.get("/").await;
    assert!(page.body.contains("id=\"slots\""), "{}", page.body);
    assert!(!page.body.contains("FAILING"), "{}", page.body);

    for _ in 0..3 {
        h.db.exec(&format!(
            "SELECT {{schema}}.logical_read_failed('{slot}', 'the reader broke here')"
        ))
        .await;
    }
    let b = a.get("/").await.body;
    assert!(
        b.contains("FAILING: the relay&#39;s reader failed 3 times in a row")
            || b.contains("FAILING: the relay's reader failed 3 times in a row"),
        "{b}"
    );
    assert!(b.contains("the reader broke here"), "{b}");
    assert!(!b.contains("delivered already"), "no note yet: {b}");

    // A note ahead of the slot (what a server crash leaves): the part of
    // its lag already delivered is shown under it.
    h.db.exec(&format!(
        "SELECT {{schema}}.logical_read_now('{slot}', pg_current_wal_lsn())"
    ))
    .await;
    let b = a.get("/").await.body;
    assert!(b.contains("of WAL were delivered already"), "{b}");
    h.finish().await;
}

/// Events scheduled for later are shown apart from pending ones.
#[tokio::test]
async fn the_overview_shows_scheduled_events_apart_from_pending_ones() {
    let h = Harness::start().await;
    let event = |i: usize| {
        NewEvent::new("order.paid", "order", i.to_string(), &serde_json::json!({})).unwrap()
    };
    let ids =
        h.db.enqueue_events(&[
            event(0),
            event(1).deliver_after(Duration::from_secs(3600)).unwrap(),
            event(2).deliver_after(Duration::from_secs(7200)).unwrap(),
        ])
        .await;
    let mut a = h.signed_in("sam", Role::Viewer).await;
    let page = a.get("/").await;
    assert_eq!(page.status, StatusCode::OK);
    let b = &page.body;
    assert!(b.contains("id=\"pending\">1<"), "{b}");
    assert!(b.contains("id=\"scheduled\">2<"), "{b}");
    assert!(b.contains("the first due in"), "{b}");
    // An event's page says when it was scheduled for; a plain one does not.
    let page = a.get(&format!("/events/{}", ids[1])).await;
    assert!(page.body.contains("id=\"scheduled\""), "{}", page.body);
    assert!(
        page.body.contains("Scheduled: not due before"),
        "{}",
        page.body
    );
    let page = a.get(&format!("/events/{}", ids[0])).await;
    assert!(!page.body.contains("Scheduled for"), "{}", page.body);
    h.finish().await;
}

/// Log and logical mode leave no `sent` outbox row: the overview counts
/// their deliveries from the relays' counts by minute (migration 20), in
/// the delivered card, the chart and the by-destination table.
#[tokio::test]
async fn the_overview_counts_deliveries_in_every_reading_mode() {
    let h = Harness::start().await;
    let tally = postbox_store::Store::new(h.db.pool.clone(), h.db.schema.clone()).tally();
    // What a log-mode relay flushes after delivering 22,000 events to two
    // destinations (fan-out: each took them all), and a logical one 500.
    tally
        .add(
            "log",
            &[
                ("billing".to_owned(), 22_000, 0),
                ("search".to_owned(), 22_000, 37),
            ],
        )
        .await
        .unwrap();
    tally
        .add("logical", &[("audit".to_owned(), 500, 0)])
        .await
        .unwrap();
    let mut a = h.signed_in("victor", Role::Viewer).await;
    let page = a.get("/").await;
    let b = &page.body;
    assert!(
        b.contains("<span class=\"value\">22500</span>"),
        "delivered card: {b}"
    );
    assert!(b.contains("peak <strong>22500</strong>"), "chart: {b}");
    assert!(b.contains("id=\"delivered-by-destination\""), "{b}");
    assert!(
        b.contains(
            "<td>billing</td><td>the log</td><td class=\"num\">22000</td><td class=\"num\">0</td>"
        ),
        "{b}"
    );
    assert!(
        b.contains(
            "<td>search</td><td>the log</td><td class=\"num\">22000</td><td class=\"num\">37</td>"
        ),
        "filtered out: {b}"
    );
    assert!(
        b.contains(
            "<td>audit</td><td>the slot</td><td class=\"num\">500</td><td class=\"num\">0</td>"
        ),
        "{b}"
    );
    h.finish().await;
}

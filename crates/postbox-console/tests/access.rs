//! Access control, sessions, CSRF and rate limits, over HTTP.

use crate::support::{hidden, Agent, Harness, PASSWORD};
use postbox::statements::trusted;
use postbox_console::{RateLimit, Role};
use postbox_testkit::wait_for;
use reqwest::StatusCode;
use std::time::Duration;

#[tokio::test]
async fn unauthenticated_requests_are_sent_to_sign_in_and_change_nothing() {
    let h = Harness::start().await;
    let ids = h.dead_letters("order.placed", 1).await;
    let mut anon = Agent::new(&h);
    for path in [
        "/",
        "/events",
        "/dead-letters",
        "/audit",
        &format!("/events/{}", ids[0]),
    ] {
        let r = anon.get(path).await;
        assert_eq!(r.status, StatusCode::SEE_OTHER, "{path}");
        let to = r.location.unwrap();
        assert!(to.starts_with("/sign-in"), "{path} -> {to}");
    }
    let r = anon.get("/events?type=a").await;
    assert_eq!(
        r.location.as_deref(),
        Some("/sign-in?next=%2Fevents%3Ftype%3Da")
    );
    for path in [
        format!("/events/{}/replay", ids[0]),
        format!("/events/{}/discard", ids[0]),
        "/dead-letters/action".to_owned(),
    ] {
        let r = anon
            .post(
                &path,
                &[("csrf", "guess"), ("do", "replay-all"), ("reason", "x")],
            )
            .await;
        assert_eq!(r.status, StatusCode::SEE_OTHER, "{path}");
        assert_eq!(r.location.as_deref(), Some("/sign-in"));
    }
    assert_eq!(h.status(ids[0]).await.0, "failed");
    assert!(h.audit().await.is_empty());
    // The stylesheet and script need no session; pages carry a strict policy.
    let css = anon.get("/static/console.css").await;
    assert_eq!(css.status, StatusCode::OK);
    let sign_in = anon.get("/sign-in").await;
    let csp = sign_in.headers["content-security-policy"].to_str().unwrap();
    assert!(
        csp.contains("script-src 'self'") && csp.contains("frame-ancestors 'none'"),
        "{csp}"
    );
    h.finish().await;
}

#[tokio::test]
async fn sign_in_checks_the_password_and_audits_every_attempt() {
    let h = Harness::start().await;
    h.user("alice", Role::Operator).await;
    let mut a = Agent::new(&h);

    let wrong = a.sign_in("alice", "not the password").await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    assert!(wrong.body.contains("Wrong user name or password."));
    let unknown = a.sign_in("mallory", PASSWORD).await;
    assert_eq!(unknown.status, StatusCode::UNAUTHORIZED);
    assert!(unknown.body.contains("Wrong user name or password."));

    let ok = a.sign_in("alice", PASSWORD).await;
    assert_eq!(ok.status, StatusCode::SEE_OTHER);
    assert_eq!(ok.location.as_deref(), Some("/"));
    let session = ok
        .cookies
        .iter()
        .find(|c| c.starts_with("postbox_session="))
        .expect("a session cookie");
    assert!(
        session.contains("HttpOnly") && session.contains("SameSite=Strict"),
        "{session}"
    );
    assert!(!session.contains("Secure"), "plain HTTP: {session}");
    let token = session
        .split(';')
        .next()
        .unwrap()
        .split_once('=')
        .unwrap()
        .1;
    let stored: i64 =
        h.db.count("SELECT count(*) FROM {schema}.console_sessions")
            .await;
    assert_eq!(stored, 1);
    let plain: i64 = sqlx::query_scalar(trusted(&h.db.sql(
        "SELECT count(*) FROM {schema}.console_sessions WHERE token_hash = convert_to($1, 'UTF8')",
    )))
    .bind(token)
    .fetch_one(&h.db.pool)
    .await
    .unwrap();
    assert_eq!(plain, 0, "only the token's hash is stored");

    a.refresh_csrf().await;
    let home = a.get("/").await;
    assert!(home.body.contains("alice · operator"), "{}", home.body);
    let csrf = a.csrf.clone();
    let out = a.post("/sign-out", &[("csrf", &csrf)]).await;
    assert_eq!(out.status, StatusCode::SEE_OTHER);
    assert_eq!(a.get("/").await.status, StatusCode::SEE_OTHER, "signed out");

    let audit = h.audit().await;
    let actions: Vec<(&str, &str)> = audit
        .iter()
        .map(|(actor, action, _, _)| (actor.as_str(), action.as_str()))
        .collect();
    assert_eq!(
        actions,
        vec![
            ("console:alice", "console.sign_in_failed"),
            ("console:mallory", "console.sign_in_failed"),
            ("console:alice", "console.sign_in"),
            ("console:alice", "console.sign_out"),
        ]
    );
    let outcomes: Vec<String> = sqlx::query_scalar(trusted(&h.db.sql(
        "SELECT details->>'outcome' FROM {schema}.audit_log WHERE action LIKE 'console.sign_in%' ORDER BY id",
    )))
    .fetch_all(&h.db.pool)
    .await
    .unwrap();
    assert_eq!(outcomes, vec!["wrong_password", "unknown_user", "ok"]);

    // After sign-in only local paths are followed.
    let mut away = Agent::new(&h);
    let form = away.get("/sign-in?next=%2F%2Fevil.example%2F").await;
    assert!(
        form.body.contains("name=\"next\" value=\"/\""),
        "{}",
        form.body
    );
    let token = hidden(&form.body, "csrf");
    let r = away
        .post(
            "/sign-in",
            &[
                ("csrf", &token),
                ("name", "alice"),
                ("password", PASSWORD),
                ("next", "//evil.example/"),
            ],
        )
        .await;
    assert_eq!(r.location.as_deref(), Some("/"));
    away.get("/").await;

    // Behind a TLS proxy the cookie is Secure.
    let mut tls = Agent::new(&h);
    tls.extra.push(("x-forwarded-proto".into(), "https".into()));
    let ok = tls.sign_in("alice", PASSWORD).await;
    assert!(ok
        .cookies
        .iter()
        .any(|c| c.starts_with("postbox_session=") && c.contains("; Secure")));
    h.finish().await;
}

#[tokio::test]
async fn a_viewer_looks_but_cannot_replay_discard_or_cancel() {
    let h = Harness::start().await;
    let ids = h.dead_letters("order.placed", 2).await;
    let mut v = h.signed_in("victor", Role::Viewer).await;
    let page = v.get(&format!("/events/{}", ids[0])).await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(page.body.contains("missing field customer_id"));
    assert!(
        !page.body.contains("id=\"replay\""),
        "no replay button for a viewer"
    );
    let list = v.get("/dead-letters").await;
    assert!(!list.body.contains("Replay selected"));

    let csrf = v.csrf.clone();
    let id0 = ids[0].to_string();
    let refused = [
        v.post(&format!("/events/{id0}/replay"), &[("csrf", &csrf)])
            .await,
        v.post(
            &format!("/events/{id0}/discard"),
            &[("csrf", &csrf), ("reason", "no")],
        )
        .await,
        v.post(
            "/dead-letters/action",
            &[("csrf", &csrf), ("do", "replay-all")],
        )
        .await,
        v.post(
            "/dead-letters/action",
            &[("csrf", &csrf), ("do", "replay-selected"), ("ids", &id0)],
        )
        .await,
    ];
    for r in &refused {
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.body);
        assert!(r.body.contains("viewer"), "{}", r.body);
    }
    assert_eq!(h.status(ids[0]).await.0, "failed");
    assert_eq!(h.status(ids[1]).await.0, "failed");
    assert!(h
        .audit()
        .await
        .iter()
        .all(|(_, action, _, _)| !action.starts_with("dlq.")));

    // Demoting an operator ends their sessions; the new role applies at once.
    let mut op = h.signed_in("olga", Role::Operator).await;
    h.user("olga", Role::Viewer).await;
    assert_eq!(op.get("/").await.status, StatusCode::SEE_OTHER);
    h.finish().await;
}

#[tokio::test]
async fn every_state_changing_request_needs_the_session_csrf_token() {
    let h = Harness::start().await;
    let ids = h.dead_letters("order.placed", 1).await;
    let mut a = h.signed_in("alice", Role::Operator).await;
    let id = ids[0].to_string();
    let replay = format!("/events/{id}/replay");
    for fields in [vec![], vec![("csrf", "0000")], vec![("csrf", "")]] {
        let r = a.post(&replay, &fields).await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{fields:?}: {}", r.body);
        assert!(r.body.contains("CSRF"));
    }
    for (path, fields) in [
        (format!("/events/{id}/discard"), vec![("reason", "x")]),
        (
            "/dead-letters/action".to_owned(),
            vec![("do", "replay-all")],
        ),
        ("/sign-out".to_owned(), vec![]),
    ] {
        let r = a.post(&path, &fields).await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{path}");
    }
    assert_eq!(h.status(ids[0]).await.0, "failed");
    assert_eq!(a.get("/").await.status, StatusCode::OK, "still signed in");

    // Another session's token does not do either.
    let mut b = h.signed_in("bob", Role::Operator).await;
    let other = b.csrf.clone();
    assert_eq!(
        a.post(&replay, &[("csrf", &other)]).await.status,
        StatusCode::FORBIDDEN
    );

    // The sign-in form has its own token, bound to a cookie.
    let mut c = Agent::new(&h);
    let form = c.get("/sign-in").await;
    let token = hidden(&form.body, "csrf");
    c.cookies.clear();
    let r = c
        .post(
            "/sign-in",
            &[("csrf", &token), ("name", "alice"), ("password", PASSWORD)],
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert!(!r.cookies.iter().any(|k| k.starts_with("postbox_session=")));

    let csrf = a.csrf.clone();
    let r = a.post(&replay, &[("csrf", &csrf)]).await;
    assert_eq!(r.status, StatusCode::SEE_OTHER);
    assert_eq!(h.status(ids[0]).await.0, "pending");
    b.get("/").await;
    h.finish().await;
}

#[tokio::test]
async fn sign_in_attempts_are_rate_limited() {
    let h = Harness::with(|c| c.sign_in_limit = RateLimit::per_minute(3)).await;
    h.user("alice", Role::Operator).await;
    let mut a = Agent::new(&h);
    for _ in 0..3 {
        assert_eq!(
            a.sign_in("alice", "guess").await.status,
            StatusCode::UNAUTHORIZED
        );
    }
    let limited = a.sign_in("alice", PASSWORD).await;
    assert_eq!(
        limited.status,
        StatusCode::TOO_MANY_REQUESTS,
        "even the right password waits"
    );
    let retry: u64 = limited.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=20).contains(&retry), "{retry}");
    assert!(!limited
        .cookies
        .iter()
        .any(|k| k.starts_with("postbox_session=")));
    let rate_limited: i64 = h
        .db
        .count("SELECT count(*) FROM {schema}.audit_log WHERE details->>'outcome' = 'rate_limited'")
        .await;
    assert_eq!(rate_limited, 1);
    h.finish().await;
}

#[tokio::test]
async fn replays_and_discards_are_rate_limited_per_user() {
    let h = Harness::with(|c| c.action_limit = RateLimit::per_minute(2)).await;
    let ids = h.dead_letters("order.placed", 3).await;
    let mut a = h.signed_in("alice", Role::Operator).await;
    let csrf = a.csrf.clone();
    for id in &ids[..2] {
        let r = a
            .post(&format!("/events/{id}/replay"), &[("csrf", &csrf)])
            .await;
        assert_eq!(r.status, StatusCode::SEE_OTHER);
    }
    let r = a
        .post(&format!("/events/{}/replay", ids[2]), &[("csrf", &csrf)])
        .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(h.status(ids[2]).await.0, "failed");
    // Another operator has a bucket of their own.
    let mut b = h.signed_in("bob", Role::Operator).await;
    let csrf = b.csrf.clone();
    let r = b
        .post(&format!("/events/{}/replay", ids[2]), &[("csrf", &csrf)])
        .await;
    assert_eq!(r.status, StatusCode::SEE_OTHER);
    assert_eq!(h.status(ids[2]).await.0, "pending");
    h.finish().await;
}

#[tokio::test]
async fn sessions_expire() {
    let h = Harness::with(|c| c.session_lifetime = Duration::from_secs(1)).await;
    let mut a = h.signed_in("alice", Role::Viewer).await;
    wait_for("the session to expire", Duration::from_secs(10), || {
        let url = h.url("/");
        let cookie = a
            .cookies
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("; ");
        async move {
            let client = postbox_testkit::http()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap();
            let r = client
                .get(url)
                .header("cookie", cookie)
                .send()
                .await
                .unwrap();
            r.status() == StatusCode::SEE_OTHER
        }
    })
    .await;
    assert_eq!(a.get("/").await.status, StatusCode::SEE_OTHER);
    h.finish().await;
}

#[tokio::test]
async fn an_attacker_hammering_a_name_cannot_keep_its_user_out() {
    let h = Harness::with(|c| {
        c.sign_in_limit = RateLimit::per_minute(3);
        c.sign_in_delay = Duration::from_millis(300);
    })
    .await;
    h.user("alice", Role::Operator).await;
    // One address guesses until its own limit refuses it.
    let mut attacker = Agent::from_address(&h, "127.0.0.2");
    for _ in 0..3 {
        let r = attacker.sign_in("alice", "guess").await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(
        attacker.sign_in("alice", "guess").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // More addresses keep failing for alice: each gets one guess, then 429.
    for i in 3..7 {
        let mut more = Agent::from_address(&h, &format!("127.0.0.{i}"));
        assert_eq!(
            more.sign_in("alice", "guess").await.status,
            StatusCode::UNAUTHORIZED
        );
        let again = more.sign_in("alice", PASSWORD).await;
        assert_eq!(
            again.status,
            StatusCode::TOO_MANY_REQUESTS,
            "an address that failed for a protected name waits, even with the right password"
        );
    }
    // Alice, from her own address, with the right password: in (after the delay).
    let mut alice = Agent::from_address(&h, "127.0.0.9");
    let started = std::time::Instant::now();
    let ok = alice.sign_in("alice", PASSWORD).await;
    assert_eq!(ok.status, StatusCode::SEE_OTHER, "{}", ok.body);
    assert!(started.elapsed() >= Duration::from_millis(300));
    alice.refresh_csrf().await;
    // The attack goes on: she signs in again, and so does anyone else who knows a password.
    let mut alice_again = Agent::from_address(&h, "127.0.0.9");
    assert_eq!(
        alice_again.sign_in("alice", PASSWORD).await.status,
        StatusCode::SEE_OTHER
    );
    let clients: Vec<String> = sqlx::query_scalar(trusted(&h.db.sql(
        "SELECT details->>'client' FROM {schema}.audit_log WHERE action = 'console.sign_in' ORDER BY id",
    )))
    .fetch_all(&h.db.pool)
    .await
    .unwrap();
    assert_eq!(clients, ["127.0.0.9", "127.0.0.9"]);
    h.finish().await;
}

async fn sign_in_clients(h: &Harness) -> Vec<String> {
    sqlx::query_scalar(trusted(&h.db.sql(
        "SELECT details->>'client' FROM {schema}.audit_log WHERE action LIKE 'console.sign_in%' ORDER BY id",
    )))
    .fetch_all(&h.db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn forwarded_for_is_ignored_from_an_untrusted_peer() {
    let h = Harness::with(|c| c.sign_in_limit = RateLimit::per_minute(2)).await;
    h.user("alice", Role::Viewer).await;
    let mut a = Agent::new(&h);
    for i in 0..2 {
        a.extra = vec![("x-forwarded-for".into(), format!("203.0.113.{i}"))];
        assert_eq!(
            a.sign_in("alice", "guess").await.status,
            StatusCode::UNAUTHORIZED
        );
    }
    a.extra = vec![("x-forwarded-for".into(), "203.0.113.77".into())];
    assert_eq!(
        a.sign_in("alice", "guess").await.status,
        StatusCode::TOO_MANY_REQUESTS,
        "a forged header does not buy a fresh bucket"
    );
    assert_eq!(sign_in_clients(&h).await, ["127.0.0.1"; 3]);
    h.finish().await;
}

#[tokio::test]
async fn forwarded_for_is_honoured_from_a_trusted_proxy() {
    let h = Harness::with(|c| {
        c.sign_in_limit = RateLimit::per_minute(2);
        c.trusted_proxies = vec!["127.0.0.1".parse().unwrap(), "10.0.0.0/8".parse().unwrap()];
    })
    .await;
    h.user("alice", Role::Viewer).await;
    h.user("bob", Role::Viewer).await;
    // Behind the proxy, one client fills its own bucket...
    let mut a = Agent::new(&h);
    a.extra = vec![(
        "x-forwarded-for".into(),
        "198.51.100.1, 203.0.113.5, 10.0.0.3".into(),
    )];
    for _ in 0..2 {
        assert_eq!(
            a.sign_in("bob", "guess").await.status,
            StatusCode::UNAUTHORIZED
        );
    }
    assert_eq!(
        a.sign_in("bob", "guess").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // ...and another client behind the same proxy still signs in.
    let mut b = Agent::new(&h);
    b.extra = vec![("x-forwarded-for".into(), "203.0.113.6".into())];
    assert_eq!(
        b.sign_in("alice", PASSWORD).await.status,
        StatusCode::SEE_OTHER
    );
    // A peer that is not a trusted proxy is its own client, header or not.
    let mut c = Agent::from_address(&h, "127.0.0.2");
    c.extra = vec![("x-forwarded-for".into(), "203.0.113.6".into())];
    assert_eq!(
        c.sign_in("alice", PASSWORD).await.status,
        StatusCode::SEE_OTHER
    );
    assert_eq!(
        sign_in_clients(&h).await,
        [
            "203.0.113.5",
            "203.0.113.5",
            "203.0.113.5",
            "203.0.113.6",
            "127.0.0.2"
        ]
    );
    h.finish().await;
}

#[tokio::test]
async fn only_operators_see_who_failed_to_sign_in_and_why() {
    let h = Harness::start().await;
    h.user("alice", Role::Operator).await;
    let mut stranger = Agent::new(&h);
    stranger.sign_in("alice", "not the password").await;
    stranger.sign_in("zed-unknown", "not the password").await;

    let mut viewer = h.signed_in("victor", Role::Viewer).await;
    let page = viewer.get("/audit").await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(
        page.body.contains("console.sign_in_failed"),
        "{}",
        page.body
    );
    for secret in [
        "zed-unknown",
        "console:alice",
        "wrong_password",
        "unknown_user",
    ] {
        assert!(
            !page.body.contains(secret),
            "a viewer sees {secret}: {}",
            page.body
        );
    }
    assert!(
        page.body.contains("console:victor"),
        "their own sign-in shows"
    );
    assert_eq!(page.body.matches("details for operators").count(), 2);
    // Filtering by a name does not reveal failures either.
    for q in [
        "/audit?actor=console%3Azed-unknown",
        "/audit?actor=console%3Azed-unknown&action=console.sign_in_failed",
        "/audit?actor=console%3Aalice",
    ] {
        let r = viewer.get(q).await;
        assert!(r.body.contains("No entries."), "{q}: {}", r.body);
    }

    let mut op = h.signed_in("olga", Role::Operator).await;
    let page = op.get("/audit").await;
    for shown in [
        "console:zed-unknown",
        "console:alice",
        "wrong_password",
        "unknown_user",
        "from 127.0.0.1",
    ] {
        assert!(
            page.body.contains(shown),
            "an operator misses {shown}: {}",
            page.body
        );
    }
    let r = op.get("/audit?actor=console%3Azed-unknown").await;
    assert!(r.body.contains("unknown_user"), "{}", r.body);
    h.finish().await;
}

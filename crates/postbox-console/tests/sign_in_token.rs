//! The sign-in form's CSRF token: issued by the console process and bound
//! to the form's cookie. A token made up, taken from another browser, from
//! before a restart, or expired is refused with a fresh form that works.

use crate::support::{hidden, Agent, Harness, Reply, PASSWORD};
use postbox_console::{Console, ConsoleConfig, Role};
use reqwest::StatusCode;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const EXPIRED: &str = "The sign-in form expired or did not come from this console";

/// The sign-in form's cookie, as `agent` keeps it.
fn form_cookie(agent: &Agent) -> String {
    agent
        .cookies
        .iter()
        .find(|(k, _)| k == "postbox_sign_in")
        .map(|(_, v)| v.clone())
        .expect("a sign-in cookie")
}

async fn post_sign_in(agent: &mut Agent, token: &str) -> Reply {
    agent
        .post(
            "/sign-in",
            &[
                ("csrf", token),
                ("name", "alice"),
                ("password", PASSWORD),
                ("next", "/"),
            ],
        )
        .await
}

/// A refusal: 403, a fresh form saying why, no session.
fn assert_refused(r: &Reply, what: &str) {
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{what}: {}", r.body);
    assert!(r.body.contains(EXPIRED), "{what}: {}", r.body);
    assert!(
        !r.cookies.iter().any(|c| c.starts_with("postbox_session=")),
        "{what}"
    );
}

/// Posting the form `refused` came with signs in: the refusal always gives a
/// form that works.
async fn fresh_form_works(agent: &mut Agent, refused: &Reply) {
    let token = hidden(&refused.body, "csrf");
    let r = post_sign_in(agent, &token).await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    assert!(r.cookies.iter().any(|c| c.starts_with("postbox_session=")));
    assert_eq!(agent.get("/").await.status, StatusCode::OK);
}

#[tokio::test]
async fn a_sign_in_token_made_up_or_from_another_browser_is_refused() {
    let h = Harness::start().await;
    h.user("alice", Role::Operator).await;

    // The old double-submit: any value, in the cookie and the form alike.
    let mut forger = Agent::new(&h);
    forger
        .cookies
        .push(("postbox_sign_in".into(), "attacker-chosen".into()));
    let r = post_sign_in(&mut forger, "attacker-chosen").await;
    assert_refused(&r, "a made-up token equal to its cookie");
    // The cookie a real form set, with a token made up, or the cookie as token.
    let mut guesser = Agent::new(&h);
    let form = guesser.get("/sign-in").await;
    let real = hidden(&form.body, "csrf");
    let cookie = form_cookie(&guesser);
    let (expires, mac) = real.split_once('.').expect("EXPIRES.MAC");
    let later = expires.parse::<u64>().unwrap() + 3600;
    let flipped: String = mac
        .chars()
        .map(|c| if c == '0' { '1' } else { '0' })
        .collect();
    for (token, what) in [
        (cookie.clone(), "the cookie as the token"),
        (format!("{expires}.{flipped}"), "another MAC"),
        (format!("{later}.{mac}"), "a later expiry"),
        (String::new(), "no token"),
    ] {
        let r = post_sign_in(&mut guesser, &token).await;
        assert_refused(&r, what);
        guesser.cookies.retain(|(k, _)| k != "postbox_sign_in");
        guesser
            .cookies
            .push(("postbox_sign_in".into(), cookie.clone()));
    }

    // A real token from another browser (its own cookie kept).
    let mut victim = Agent::new(&h);
    victim.get("/sign-in").await;
    let mut other = Agent::new(&h);
    let theirs = hidden(&other.get("/sign-in").await.body, "csrf");
    let r = post_sign_in(&mut victim, &theirs).await;
    assert_refused(&r, "another browser's token");
    fresh_form_works(&mut victim, &r).await;

    // The form of this browser works, once and again while it lasts.
    let token = hidden(&other.get("/sign-in").await.body, "csrf");
    let r = post_sign_in(&mut other, &token).await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);

    let failed_csrf: i64 = sqlx::query_scalar(postbox::statements::trusted(&h.db.sql(
        "SELECT count(*) FROM {schema}.audit_log \
         WHERE action = 'console.sign_in_failed' AND details->>'outcome' = 'csrf'",
    )))
    .fetch_one(&h.db.pool)
    .await
    .unwrap();
    assert_eq!(failed_csrf, 6, "each refusal is audited");
    h.finish().await;
}

#[tokio::test]
async fn an_expired_sign_in_form_is_refused_with_one_that_works() {
    let h = Harness::with(|c| c.sign_in_form_lifetime = Duration::from_secs(1)).await;
    h.user("alice", Role::Operator).await;
    let mut a = Agent::new(&h);
    let token = hidden(&a.get("/sign-in").await.body, "csrf");
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let r = post_sign_in(&mut a, &token).await;
    assert_refused(&r, "an expired form");
    fresh_form_works(&mut a, &r).await;
    h.finish().await;
}

#[tokio::test]
async fn a_sign_in_form_from_before_a_restart_is_refused_with_one_that_works() {
    let h = Harness::start().await;
    h.user("alice", Role::Operator).await;
    let mut a = Agent::new(&h);
    let token = hidden(&a.get("/sign-in").await.body, "csrf");

    // The console restarts (another process over the same schema: another
    // key); the browser keeps its cookie and its form.
    let restarted = Console::new(h.db.pool.clone(), ConsoleConfig::new(h.db.schema.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(restarted.serve(listener, stop.clone()));
    let mut b = Agent::at(&format!("http://{addr}"));
    b.cookies = a.cookies.clone();
    let r = post_sign_in(&mut b, &token).await;
    assert_refused(&r, "a form from before the restart");
    fresh_form_works(&mut b, &r).await;
    stop.cancel();
    h.finish().await;
}

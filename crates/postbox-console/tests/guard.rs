//! The guard in front of every state-changing route: its table against the
//! router, and every row refusing what it must, over HTTP against the real
//! database.

use crate::support::{hidden, Agent, Harness};
use postbox_console::{routes, state_changing_routes, Access, Role};
use reqwest::{Method, StatusCode};
use std::collections::BTreeSet;

fn is_safe(method: &Method) -> bool {
    *method == Method::GET || *method == Method::HEAD
}

/// `path` with its `{id}` parameter replaced by `id`.
fn concrete(path: &str, id: &str) -> String {
    path.replace("{id}", id)
}

/// Fields a form on any of these routes would carry, so that a request the
/// guard let by would do something.
fn fields<'a>(id: &'a str, csrf: Option<&'a str>) -> Vec<(&'a str, &'a str)> {
    let mut f = vec![
        ("do", "replay-selected"),
        ("ids", id),
        ("reason", "the guard must stop this"),
    ];
    if let Some(csrf) = csrf {
        f.push(("csrf", csrf));
    }
    f
}

#[tokio::test]
async fn the_guard_table_names_every_state_changing_route_of_the_router() {
    let table: BTreeSet<(String, &str)> = state_changing_routes()
        .iter()
        .map(|r| (r.method.to_string(), r.path))
        .collect();
    assert_eq!(
        table.len(),
        state_changing_routes().len(),
        "one row per route"
    );
    let mounted = routes();
    let changing: BTreeSet<(String, &str)> = mounted
        .iter()
        .filter(|(m, _)| !is_safe(m))
        .map(|(m, p)| (m.to_string(), *p))
        .collect();
    assert_eq!(
        changing, table,
        "the router's state-changing routes and the guard's table differ"
    );

    // The routes as mounted against the router as it answers: a path answers
    // a state-changing method only where the table has its row; elsewhere
    // the method is not routed at all (405).
    let h = Harness::start().await;
    let client = postbox_testkit::http()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let id = uuid::Uuid::now_v7().to_string();
    let paths: BTreeSet<&str> = mounted.iter().map(|(_, p)| *p).collect();
    for path in paths {
        for method in [Method::POST, Method::PUT, Method::PATCH, Method::DELETE] {
            let r = client
                .request(method.clone(), h.url(&concrete(path, &id)))
                .header("content-type", "application/x-www-form-urlencoded")
                .body("csrf=x")
                .send()
                .await
                .unwrap();
            let listed = table.contains(&(method.to_string(), path));
            assert_eq!(
                r.status() != StatusCode::METHOD_NOT_ALLOWED,
                listed,
                "{method} {path} answers {} but the guard's table {} it",
                r.status(),
                if listed { "lists" } else { "does not list" }
            );
        }
    }
    h.finish().await;
}

#[tokio::test]
async fn every_state_changing_route_refuses_a_missing_csrf_token_and_a_wrong_role() {
    let h = Harness::start().await;
    let ids = h.dead_letters("order.placed", 1).await;
    let id = ids[0].to_string();
    let mut op = h.signed_in("olga", Role::Operator).await;
    let mut viewer = h.signed_in("victor", Role::Viewer).await;
    let mut anon = Agent::new(&h);
    let before = h.audit().await;
    let mut checked = 0;

    for row in state_changing_routes() {
        let path = concrete(row.path, &id);
        let what = format!("{} {}", row.method, row.path);
        assert_eq!(row.method, Method::POST, "{what}: the agents post forms");
        match row.access {
            Access::SignIn => {
                // No session yet: the form's own token, bound to its cookie.
                let mut stranger = Agent::new(&h);
                stranger.get("/sign-in").await;
                let r = stranger
                    .post(
                        &path,
                        &[("name", "olga"), ("password", crate::support::PASSWORD)],
                    )
                    .await;
                assert_eq!(r.status, StatusCode::FORBIDDEN, "{what}: {}", r.body);
                assert!(
                    !r.cookies.iter().any(|c| c.starts_with("postbox_session=")),
                    "{what}"
                );
            }
            Access::Session(role) => {
                // No session: sent to sign in.
                let csrf = op.csrf.clone();
                let r = anon.post(&path, &fields(&id, Some(&csrf))).await;
                assert_eq!(r.status, StatusCode::SEE_OTHER, "{what}");
                assert_eq!(r.location.as_deref(), Some("/sign-in"), "{what}");

                // A session whose role is enough, without the token or with another's.
                let others = viewer.csrf.clone();
                for token in [None, Some(""), Some(others.as_str())] {
                    let r = op.post(&path, &fields(&id, token)).await;
                    assert_eq!(
                        r.status,
                        StatusCode::FORBIDDEN,
                        "{what} with token {token:?}: {}",
                        r.body
                    );
                    assert!(r.body.contains("CSRF"), "{what}: {}", r.body);
                }

                // A session with the right token and a role below the route's.
                if role == Role::Operator {
                    let csrf = viewer.csrf.clone();
                    let r = viewer.post(&path, &fields(&id, Some(&csrf))).await;
                    assert_eq!(r.status, StatusCode::FORBIDDEN, "{what}: {}", r.body);
                    assert!(r.body.contains("Your role (viewer)"), "{what}: {}", r.body);
                } else {
                    assert_eq!(role, Role::Viewer, "{what}: no role is below viewer");
                }
            }
        }
        checked += 1;
    }
    assert_eq!(checked, state_changing_routes().len());

    // Nothing changed: the dead letter is still dead, the only entries are
    // the refused sign-ins', and both users are still signed in.
    assert_eq!(h.status(ids[0]).await.0, "failed");
    let after = h.audit().await;
    let new: Vec<(&str, &str)> = after[before.len()..]
        .iter()
        .map(|(actor, action, _, _)| (actor.as_str(), action.as_str()))
        .collect();
    let sign_ins = state_changing_routes()
        .iter()
        .filter(|r| r.access == Access::SignIn)
        .count();
    assert_eq!(
        new,
        vec![("console:olga", "console.sign_in_failed"); sign_ins]
    );
    for agent in [&mut op, &mut viewer] {
        let page = agent.get("/").await;
        assert_eq!(page.status, StatusCode::OK, "still signed in");
        assert_eq!(hidden(&page.body, "csrf"), agent.csrf);
    }
    h.finish().await;
}

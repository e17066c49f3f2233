//! A user's role limited to some outboxes: every page and every
//! state-changing route of another outbox refused like an outbox the console
//! does not serve, and changing nothing; the all-outboxes overview listing
//! only the user's outboxes; a console of one outbox checking it too.

use crate::outboxes::{audit, status, Many};
use crate::support::{dead_letters, hidden, Agent, Harness, Reply};
use postbox_console::{routes, state_changing_routes, Role};
use reqwest::{Method, StatusCode};

/// The routes mounted for GET, their `{id}` replaced by `id`.
fn pages(id: &str) -> Vec<String> {
    routes()
        .into_iter()
        .filter(|(m, _)| *m == Method::GET)
        .map(|(_, p)| p.replace("{id}", id))
        .collect()
}

/// What a form on `path` would carry to change something, were it let by.
fn fields<'a>(path: &str, csrf: &'a str, ids: &'a str, key: &'a str) -> Vec<(&'a str, &'a str)> {
    let what = if path.contains("/groups/") {
        "replay"
    } else {
        "replay-all"
    };
    vec![
        ("csrf", csrf),
        ("do", what),
        ("ids", ids),
        ("key", key),
        ("reason", "not yours to discard"),
        ("name", "olga"),
        ("password", crate::support::PASSWORD),
    ]
}

/// The first dead-letter group's key on a groups page.
fn group_key(page: &str) -> String {
    let marker = "data-key=\"";
    let start = page.find(marker).expect("a group") + marker.len();
    page[start..start + 32].to_owned()
}

fn assert_no_such_outbox(r: &Reply, like: &Reply, what: &str) {
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{what}: {}", r.body);
    assert!(r.body.contains("No such outbox"), "{what}: {}", r.body);
    // Exactly what an outbox the console does not serve gets: nothing tells
    // whether this one exists.
    assert_eq!(
        (r.status, &r.body),
        (like.status, &like.body),
        "{what}: refused unlike an unknown outbox"
    );
}

/// Every page and every state-changing route of tenant 1, as `agent`
/// (limited to tenant 0), is refused like an unknown outbox's; returns how
/// many requests were checked.
async fn refused_everything_of_tenant_1(
    m: &Many,
    agent: &mut Agent,
    id: &str,
    job: &str,
    key: &str,
) -> usize {
    let unknown = |path: &str| format!("/o/{}/t_no_such_outbox{path}", m.database);
    let mut checked = 0;
    for path in pages(id) {
        let path = if path.starts_with("/jobs/") {
            path.replace(id, job)
        } else {
            path
        };
        let r = agent.get(&m.at(1, &path)).await;
        let like = agent.get(&unknown(&path)).await;
        assert_no_such_outbox(&r, &like, &format!("GET {path}"));
        checked += 1;
    }
    let csrf = agent.csrf.clone();
    for row in state_changing_routes() {
        assert_eq!(row.method, Method::POST, "the agents post forms");
        let the_id = if row.path.starts_with("/jobs/") {
            job
        } else {
            id
        };
        let path = row.path.replace("{id}", the_id);
        let form = fields(&path, &csrf, id, key);
        let r = agent.post(&m.at(1, &path), &form).await;
        let like = agent.post(&unknown(&path), &form).await;
        assert_no_such_outbox(&r, &like, &format!("POST {}", row.path));
        checked += 1;
    }
    checked
}

#[tokio::test]
async fn a_user_limited_to_one_outbox_sees_and_changes_nothing_of_another() {
    let m = Many::start(2).await;
    let a = m.tenants[0].schema.name().to_owned();
    let ids_a = dead_letters(&m.tenants[0], "invoice.sent", 2).await;
    let ids_b = dead_letters(&m.tenants[1], "order.placed", 3).await;
    let id_b = ids_b[0].to_string();

    // An operator of every outbox starts a bulk action in tenant 1 (its job
    // page and cancel route are tenant 1's), and reads a group's key there.
    let mut root = m.h.signed_in("root", Role::Operator).await;
    let csrf = root.csrf.clone();
    let started = root
        .post(
            &m.at(1, "/dead-letters/action"),
            &[
                ("csrf", &csrf),
                ("do", "replay-selected"),
                ("ids", &ids_b[2].to_string()),
            ],
        )
        .await;
    assert_eq!(started.status, StatusCode::SEE_OTHER, "{}", started.body);
    let job = started
        .location
        .as_deref()
        .and_then(|l| l.rsplit('/').next())
        .unwrap()
        .to_owned();
    postbox_testkit::wait_for(
        "the bulk replay to finish",
        std::time::Duration::from_secs(10),
        || {
            let db = &m.tenants[1];
            let id = ids_b[2];
            async move { status(db, id).await == "pending" }
        },
    )
    .await;
    let key = group_key(&root.get(&m.at(1, "/groups")).await.body);
    let audit_b = audit(&m.tenants[1]).await;

    // An operator of tenant 0 (named DATABASE/SCHEMA), a viewer of it (named
    // by a glob of its schema alone).
    m.h.limited_user("olga", Role::Operator, &format!("{}/{a}", m.database))
        .await;
    let glob = format!("{}*", &a[..a.len() - 1]);
    m.h.limited_user("victor", Role::Viewer, &glob).await;
    let mut olga = m.h.signed_in_as("olga").await;
    let mut victor = m.h.signed_in_as("victor").await;
    let mut checked = 0;
    for agent in [&mut olga, &mut victor] {
        checked += refused_everything_of_tenant_1(&m, agent, &id_b, &job, &key).await;

        // `/` lists tenant 0 alone.
        let overview = agent.get("/").await;
        assert_eq!(overview.status, StatusCode::OK, "{}", overview.body);
        assert!(overview
            .body
            .contains(&format!("data-outbox=\"{}\"", m.name(0))));
        assert!(!overview.body.contains(&m.name(1)), "{}", overview.body);
        assert!(!overview.body.contains(m.tenants[1].schema.name()));
        assert!(
            overview.body.contains("<strong>1</strong> outbox(es)"),
            "{}",
            overview.body
        );
        // Tenant 0's pages are there.
        for path in ["/", "/dead-letters", "/groups", "/events", "/audit"] {
            let r = agent.get(&m.at(0, path)).await;
            assert_eq!(r.status, StatusCode::OK, "{path}: {}", r.body);
        }
        let page = agent.get(&m.at(0, &format!("/events/{}", ids_a[0]))).await;
        assert_eq!(page.status, StatusCode::OK);
    }
    let per_agent = pages("x").len() + state_changing_routes().len();
    assert_eq!(checked, 2 * per_agent);

    // Nothing of tenant 1 changed: its dead letters, its audit log, its job.
    assert_eq!(status(&m.tenants[1], ids_b[0]).await, "failed");
    assert_eq!(status(&m.tenants[1], ids_b[1]).await, "failed");
    assert_eq!(audit(&m.tenants[1]).await, audit_b);
    let job_page = root.get(&m.at(1, &format!("/jobs/{job}"))).await;
    assert!(
        job_page.body.contains("finished") || job_page.body.contains("done"),
        "{}",
        job_page.body
    );
    // Both are still signed in (the sign-out under tenant 1 was refused too).
    assert_eq!(olga.get("/").await.status, StatusCode::OK);

    // The operator acts in tenant 0; the viewer's role is still a viewer's.
    let csrf = olga.csrf.clone();
    let r = olga
        .post(
            &m.at(0, &format!("/events/{}/replay", ids_a[0])),
            &[("csrf", &csrf)],
        )
        .await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    assert_eq!(status(&m.tenants[0], ids_a[0]).await, "pending");
    let csrf = victor.csrf.clone();
    let r = victor
        .post(
            &m.at(0, &format!("/events/{}/replay", ids_a[1])),
            &[("csrf", &csrf)],
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.body);
    assert_eq!(status(&m.tenants[0], ids_a[1]).await, "failed");

    // Above the outboxes, the home schema's log shows a limited user its
    // sign-ins alone, not what was done to the home schema's own outbox.
    sqlx::query(postbox::statements::trusted(&m.h.db.sql(
        "INSERT INTO {schema}.audit_log (actor, action, count, reason) \
         VALUES ('cli:root', 'dlq.discard', 1, 'home outbox secret reason')",
    )))
    .execute(&m.h.db.pool)
    .await
    .unwrap();
    let log = olga.get("/audit").await;
    assert_eq!(log.status, StatusCode::OK, "{}", log.body);
    assert!(log.body.contains("console.sign_in"), "{}", log.body);
    assert!(
        !log.body.contains("home outbox secret reason"),
        "{}",
        log.body
    );
    let log = root.get("/audit").await;
    assert!(
        log.body.contains("home outbox secret reason"),
        "{}",
        log.body
    );

    // The operator of every outbox sees both and acts in tenant 1.
    let overview = root.get("/").await.body;
    assert!(overview.contains(&format!("data-outbox=\"{}\"", m.name(0))));
    assert!(overview.contains(&format!("data-outbox=\"{}\"", m.name(1))));
    let csrf = root.csrf.clone();
    let r = root
        .post(
            &m.at(1, &format!("/events/{}/replay", ids_b[0])),
            &[("csrf", &csrf)],
        )
        .await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    assert_eq!(status(&m.tenants[1], ids_b[0]).await, "pending");

    // Widened to every outbox (its sessions end): tenant 1 is hers too.
    m.h.limited_user("olga", Role::Operator, "*").await;
    let mut olga = m.h.signed_in_as("olga").await;
    let csrf = olga.csrf.clone();
    let r = olga
        .post(
            &m.at(1, &format!("/events/{}/replay", ids_b[1])),
            &[("csrf", &csrf)],
        )
        .await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    assert_eq!(status(&m.tenants[1], ids_b[1]).await, "pending");
    m.finish().await;
}

#[tokio::test]
async fn a_console_of_one_outbox_checks_its_users_patterns_too() {
    let h = Harness::start().await;
    let ids = h.dead_letters("order.placed", 2).await;
    let id = ids[0].to_string();
    let schema = h.db.schema.name().to_owned();
    let database: String =
        sqlx::query_scalar(postbox::statements::trusted("SELECT current_database()"))
            .fetch_one(&h.db.pool)
            .await
            .unwrap();

    // Patterns that name another schema, or this schema in another database.
    h.limited_user("olga", Role::Operator, "tenant_other,tenant_b*")
        .await;
    h.limited_user(
        "oscar",
        Role::Operator,
        &format!("{database}_other/{schema}"),
    )
    .await;
    let above = ["/sign-in", "/static/console.css", "/static/console.js"];
    for name in ["olga", "oscar"] {
        let mut agent = h.signed_in_as(name).await;
        for path in pages(&id) {
            let r = agent.get(&path).await;
            if above.contains(&path.as_str()) {
                assert_eq!(r.status, StatusCode::OK, "{name}: GET {path}");
                continue;
            }
            assert_eq!(
                r.status,
                StatusCode::NOT_FOUND,
                "{name}: GET {path}: {}",
                r.body
            );
            assert!(
                r.body.contains("No such outbox"),
                "{name}: GET {path}: {}",
                r.body
            );
        }
        let csrf = agent.csrf.clone();
        for row in state_changing_routes() {
            if row.path == "/sign-in" || row.path == "/sign-out" {
                continue;
            }
            let path = row.path.replace("{id}", &id);
            let r = agent.post(&path, &fields(&path, &csrf, &id, "")).await;
            assert_eq!(
                r.status,
                StatusCode::NOT_FOUND,
                "{name}: POST {path}: {}",
                r.body
            );
        }
        assert_eq!(h.status(ids[0]).await.0, "failed");
        assert_eq!(h.status(ids[1]).await.0, "failed");
        // Signing out is above the outbox.
        let r = agent.post("/sign-out", &[("csrf", &csrf)]).await;
        assert_eq!(r.status, StatusCode::SEE_OTHER);
        assert_eq!(agent.get("/").await.status, StatusCode::SEE_OTHER);
    }
    assert!(h
        .audit()
        .await
        .iter()
        .all(|(_, action, _, _)| !action.starts_with("dlq.")));

    // Patterns that name it: its schema, or DATABASE/SCHEMA by globs.
    h.limited_user("olga", Role::Operator, &format!("{}*", &schema[..3]))
        .await;
    h.limited_user("oscar", Role::Operator, &format!("{database}/{schema}"))
        .await;
    for name in ["olga", "oscar"] {
        let mut agent = h.signed_in_as(name).await;
        let page = agent.get("/").await;
        assert_eq!(page.status, StatusCode::OK, "{name}: {}", page.body);
        assert_eq!(hidden(&page.body, "csrf"), agent.csrf);
    }
    let mut olga = h.signed_in_as("olga").await;
    let csrf = olga.csrf.clone();
    let r = olga
        .post(&format!("/events/{id}/replay"), &[("csrf", &csrf)])
        .await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    assert_eq!(h.status(ids[0]).await.0, "pending");
    h.finish().await;
}

#[tokio::test]
async fn the_users_table_keeps_outbox_patterns_in_their_syntax() {
    let h = Harness::start().await;
    h.user("alice", Role::Viewer).await;
    for bad in [
        "{\"Tenant\"}",
        "{\"a/b/c\"}",
        "{\"\"}",
        "{a,\"\"}",
        "{\"tenant,a\"}",
        "{\"db name/tenant\"}",
        "{NULL}",
        "{{a},{b}}",
    ] {
        let r = sqlx::query(postbox::statements::trusted(&h.db.sql(
            "UPDATE {schema}.console_users SET outboxes = $1::text[] WHERE name = 'alice'",
        )))
        .bind(bad)
        .execute(&h.db.pool)
        .await;
        let e = r.expect_err(bad);
        assert!(
            e.to_string().contains("console_users_outboxes_syntax"),
            "{bad}: {e}"
        );
    }
    sqlx::query(postbox::statements::trusted(&h.db.sql(
        "UPDATE {schema}.console_users SET outboxes = '{tenant_a,app_*/t?}' WHERE name = 'alice'",
    )))
    .execute(&h.db.pool)
    .await
    .unwrap();
    // A user from before the migration (no patterns) may use every outbox.
    let mut agent = Agent::new(&h);
    h.user("bob", Role::Viewer).await;
    assert_eq!(
        agent.sign_in("bob", crate::support::PASSWORD).await.status,
        StatusCode::SEE_OTHER
    );
    assert_eq!(agent.get("/").await.status, StatusCode::OK);
    h.finish().await;
}

//! One console over many outboxes: the all-outboxes overview, pages and
//! actions under `/o/<database>/<schema>/`, and outboxes that break.

use crate::support::{dead_letters, Agent, Harness};
use postbox::statements::trusted;
use postbox::{NewEvent, Schema};
use postbox_console::{ConsoleConfig, OutboxSource, Role};
use postbox_testkit::{wait_for, TestDb};
use reqwest::StatusCode;
use sqlx::postgres::PgConnectOptions;
use std::collections::HashSet;
use std::str::FromStr;
use std::time::Duration;
use uuid::Uuid;

/// A console whose home is its own schema, serving `tenants` (and no other
/// schema of the test database).
pub(crate) struct Many {
    pub h: Harness,
    pub tenants: Vec<TestDb>,
    pub database: String,
}

impl Many {
    pub async fn start(n: usize) -> Many {
        Self::start_with(n, |_| {}).await
    }

    /// `n` tenants, the console's config adjusted by `tune`.
    async fn start_with(n: usize, tune: impl FnOnce(&mut ConsoleConfig)) -> Many {
        let mut tenants = Vec::new();
        for _ in 0..n {
            tenants.push(TestDb::new().await);
        }
        let names: HashSet<String> = tenants.iter().map(|t| t.schema.name().to_owned()).collect();
        Self::serving(tenants, names, tune).await
    }

    /// A console serving the schemas `names`; unless `tune` says otherwise,
    /// the overview reads the counts on every request.
    async fn serving(
        tenants: Vec<TestDb>,
        names: HashSet<String>,
        tune: impl FnOnce(&mut ConsoleConfig),
    ) -> Many {
        let connect = PgConnectOptions::from_str(&postbox_testkit::database_url())
            .unwrap()
            .application_name("postbox-console");
        let h = Harness::with(|c| {
            let mut names: Vec<String> = names.into_iter().collect();
            names.sort();
            c.outboxes = names
                .iter()
                .map(|n| OutboxSource::Outbox {
                    connect: connect.clone(),
                    schema: postbox::Schema::new(n).unwrap(),
                    with: (),
                })
                .collect();
            // Listed once: a schema dropped during a test stays known.
            c.rediscover_every = Duration::from_secs(3600);
            c.overview_cache_for = Duration::ZERO;
            tune(c);
        })
        .await;
        let database: String = sqlx::query_scalar(trusted("SELECT current_database()"))
            .fetch_one(&h.db.pool)
            .await
            .unwrap();
        Many {
            h,
            tenants,
            database,
        }
    }

    /// `<database>/<schema>` of tenant `i`.
    pub fn name(&self, i: usize) -> String {
        format!("{}/{}", self.database, self.tenants[i].schema.name())
    }

    /// Tenant `i`'s pages.
    pub fn at(&self, i: usize, path: &str) -> String {
        format!("/o/{}{path}", self.name(i))
    }

    pub async fn finish(self) {
        for t in self.tenants {
            t.drop_schema().await;
        }
        self.h.finish().await;
    }
}

pub(crate) async fn status(db: &TestDb, id: Uuid) -> String {
    sqlx::query_scalar(trusted(
        &db.sql("SELECT status::text FROM {schema}.outbox WHERE event_id = $1"),
    ))
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// (actor, action, count, the selection's outbox) of every audit entry of `db`.
pub(crate) async fn audit(db: &TestDb) -> Vec<(String, String, i64, Option<String>)> {
    sqlx::query_as(trusted(&db.sql(
        "SELECT actor, action, count, selection->>'outbox' FROM {schema}.audit_log ORDER BY id",
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

async fn pending(db: &TestDb, n: usize) {
    let events: Vec<NewEvent> = (0..n)
        .map(|i| {
            NewEvent::new(
                "order.placed",
                "order",
                format!("p-{i}"),
                &serde_json::json!({}),
            )
            .unwrap()
        })
        .collect();
    db.enqueue_events(&events).await;
}

/// The overview's row of `outbox` (its `<tr>…</tr>`).
fn row<'a>(page: &'a str, outbox: &str) -> &'a str {
    let start = page
        .find(&format!("data-outbox=\"{outbox}\""))
        .unwrap_or_else(|| panic!("no row for {outbox} in {page}"));
    let end = page[start..].find("</tr>").unwrap() + start;
    &page[start..end]
}

/// The text of the cell of class `class` in `row`, tags removed.
fn cell(row: &str, class: &str) -> String {
    let marker = format!("class=\"{class}\">");
    let start = row
        .find(&marker)
        .unwrap_or_else(|| panic!("no {class} cell in {row}"))
        + marker.len();
    let end = row[start..].find("</td>").unwrap() + start;
    let mut text = String::new();
    let mut in_tag = false;
    for c in row[start..end].chars() {
        match c {
            '<' => in_tag = true,
            '>' => in_tag = false,
            c if !in_tag => text.push(c),
            _ => {}
        }
    }
    text
}

#[tokio::test]
async fn the_overview_lists_every_outbox_with_its_counts_most_dead_letters_first() {
    let m = Many::start(3).await;
    dead_letters(&m.tenants[0], "invoice.sent", 1).await;
    dead_letters(&m.tenants[1], "order.placed", 3).await;
    pending(&m.tenants[1], 2).await;
    let mut viewer = m.h.signed_in("victor", Role::Viewer).await;

    let page = viewer.get("/").await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    let body = &page.body;
    assert!(body.contains("All outboxes"), "{body}");
    let positions: Vec<usize> = [1, 0, 2]
        .iter()
        .map(|i| {
            body.find(&format!("data-outbox=\"{}\"", m.name(*i)))
                .unwrap()
        })
        .collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "most dead letters first: {positions:?}"
    );
    let busy = row(body, &m.name(1));
    assert_eq!(cell(busy, "num dead"), "3");
    assert_eq!(cell(busy, "num pending"), "2");
    assert_eq!(cell(busy, "num retrying"), "0");
    assert_ne!(cell(busy, "age"), "—");
    assert!(
        busy.contains(&format!("href=\"{}/\"", m.at(1, ""))),
        "{busy}"
    );
    let quiet = row(body, &m.name(2));
    assert_eq!(cell(quiet, "num dead"), "0");
    assert_eq!(cell(quiet, "age"), "—");
    // The home schema is not among the outboxes served.
    assert!(!body.contains(&format!("data-outbox=\"{}/{}\"", m.database, m.h.db.schema)));
    assert!(body.contains("<strong>3</strong> outbox(es)"), "{body}");

    // Ordered by name on request.
    let by_name = viewer.get("/?sort=name").await.body;
    let mut names: Vec<String> = (0..3).map(|i| m.name(i)).collect();
    names.sort();
    let positions: Vec<usize> = names
        .iter()
        .map(|n| by_name.find(&format!("data-outbox=\"{n}\"")).unwrap())
        .collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]));

    // Each outbox's own pages, with links under its prefix.
    let overview = viewer.get(&m.at(1, "/")).await;
    assert_eq!(overview.status, StatusCode::OK, "{}", overview.body);
    assert!(overview.body.contains(&format!("outbox {}", m.name(1))));
    assert!(overview
        .body
        .contains(&format!("href=\"{}\"", m.at(1, "/dead-letters"))));
    let list = viewer.get(&m.at(1, "/dead-letters")).await;
    assert_eq!(list.status, StatusCode::OK);
    assert!(
        list.body.contains("<strong>3</strong> unresolved"),
        "{}",
        list.body
    );
    assert!(list
        .body
        .contains(&format!("href=\"{}/events/", m.at(1, ""))));
    let other = viewer.get(&m.at(0, "/dead-letters")).await;
    assert!(
        other.body.contains("<strong>1</strong> unresolved"),
        "{}",
        other.body
    );

    // An outbox's page without a prefix leads to the overview of them all.
    let bare = viewer.get("/events").await;
    assert_eq!(bare.status, StatusCode::SEE_OTHER);
    assert_eq!(bare.location.as_deref(), Some("/"));
    // Signed out, the sign-in comes back to the outbox's page.
    let mut anon = Agent::new(&m.h);
    let r = anon.get(&m.at(1, "/events?type=a")).await;
    assert_eq!(r.status, StatusCode::SEE_OTHER);
    let next: String =
        url::form_urlencoded::byte_serialize(m.at(1, "/events?type=a").as_bytes()).collect();
    assert_eq!(r.location, Some(format!("/sign-in?next={next}")));
    m.finish().await;
}

#[tokio::test]
async fn an_operator_action_under_one_prefix_touches_only_that_outbox_and_names_it_in_the_audit() {
    let m = Many::start(2).await;
    let a = dead_letters(&m.tenants[0], "invoice.sent", 1).await[0];
    let b = dead_letters(&m.tenants[1], "invoice.sent", 2).await;
    let mut alice = m.h.signed_in("alice", Role::Operator).await;

    let r = alice
        .post(
            &m.at(0, &format!("/events/{a}/replay")),
            &[("csrf", &alice.csrf.clone())],
        )
        .await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    assert_eq!(
        r.location,
        Some(m.at(0, &format!("/events/{a}?notice=replayed")))
    );
    assert_eq!(status(&m.tenants[0], a).await, "pending");
    assert_eq!(status(&m.tenants[1], b[0]).await, "failed");
    // Another outbox's event under this prefix: not this outbox's dead letter.
    let r = alice
        .post(
            &m.at(0, &format!("/events/{}/replay", b[0])),
            &[("csrf", &alice.csrf.clone())],
        )
        .await;
    assert_eq!(
        r.location,
        Some(m.at(0, &format!("/events/{}?notice=not-dead", b[0])))
    );
    assert_eq!(status(&m.tenants[1], b[0]).await, "failed");

    let entries = audit(&m.tenants[0]).await;
    assert_eq!(
        entries,
        [(
            "console:alice".to_owned(),
            "dlq.replay".to_owned(),
            1,
            Some(m.name(0))
        )]
    );
    assert!(audit(&m.tenants[1]).await.is_empty());
    let log = alice.get(&m.at(0, "/audit")).await;
    assert!(log.body.contains("console:alice"), "{}", log.body);

    // A bulk action runs on its own outbox, and its page lives under that prefix.
    let r = alice
        .post(
            &m.at(1, "/dead-letters/action"),
            &[
                ("csrf", &alice.csrf.clone()),
                ("do", "discard-all"),
                ("reason", "tenant closed"),
            ],
        )
        .await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    let job = r.location.unwrap();
    assert!(job.starts_with(&m.at(1, "/jobs/")), "{job}");
    let tenant = &m.tenants[1];
    wait_for("the discard to finish", Duration::from_secs(20), || async {
        audit(tenant).await.iter().map(|e| e.2).sum::<i64>() == 2
    })
    .await;
    assert!(audit(tenant)
        .await
        .iter()
        .all(|e| e.0 == "console:alice" && e.1 == "dlq.discard" && e.3 == Some(m.name(1))));
    assert_eq!(status(&m.tenants[0], a).await, "pending");
    assert_eq!(alice.get(&job).await.status, StatusCode::OK);
    let id = job.rsplit('/').next().unwrap();
    let elsewhere = alice.get(&m.at(0, &format!("/jobs/{id}"))).await;
    assert_eq!(elsewhere.status, StatusCode::NOT_FOUND);
    m.finish().await;
}

#[tokio::test]
async fn a_viewer_cannot_act_under_a_prefix_and_forms_need_the_sessions_token() {
    let m = Many::start(1).await;
    let id = dead_letters(&m.tenants[0], "invoice.sent", 1).await[0];
    let mut victor = m.h.signed_in("victor", Role::Viewer).await;
    let r = victor
        .post(
            &m.at(0, &format!("/events/{id}/replay")),
            &[("csrf", &victor.csrf.clone())],
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let r = victor
        .post(
            &m.at(0, "/dead-letters/action"),
            &[("csrf", &victor.csrf.clone()), ("do", "replay-all")],
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let mut alice = m.h.signed_in("alice", Role::Operator).await;
    let r = alice
        .post(
            &m.at(0, &format!("/events/{id}/replay")),
            &[("csrf", "guess")],
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let mut anon = Agent::new(&m.h);
    let r = anon
        .post(
            &m.at(0, &format!("/events/{id}/replay")),
            &[("csrf", "guess")],
        )
        .await;
    assert_eq!(r.status, StatusCode::SEE_OTHER);
    assert_eq!(r.location.as_deref(), Some("/sign-in"));
    assert_eq!(status(&m.tenants[0], id).await, "failed");
    assert!(audit(&m.tenants[0]).await.is_empty());
    m.finish().await;
}

#[tokio::test]
async fn a_dropped_schema_is_an_error_row_while_the_other_outboxes_still_work() {
    let mut m = Many::start(3).await;
    dead_letters(&m.tenants[0], "invoice.sent", 2).await;
    let mut viewer = m.h.signed_in("victor", Role::Viewer).await;
    assert_eq!(viewer.get("/").await.status, StatusCode::OK);

    let gone = m.tenants.remove(2);
    let gone_name = format!("{}/{}", m.database, gone.schema.name());
    gone.drop_schema().await;

    let page = viewer.get("/").await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    let broken = row(&page.body, &gone_name);
    assert!(broken.contains("Cannot be read"), "{broken}");
    assert!(broken.contains("the schema was dropped"), "{broken}");
    assert!(
        !page.body.contains("does not exist"),
        "no database text: {}",
        page.body
    );
    // Unreadable outboxes come first; the others keep their counts.
    assert!(page.body.find(&gone_name) < page.body.find(&m.name(0)));
    assert_eq!(cell(row(&page.body, &m.name(0)), "num dead"), "2");
    assert!(page.body.contains("that cannot be read"));

    let inside = viewer.get(&format!("/o/{gone_name}/")).await;
    assert_eq!(inside.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        inside.body.contains("This outbox cannot be read"),
        "{}",
        inside.body
    );
    assert!(inside.body.contains("The other outboxes are not affected"));
    assert!(!inside.body.contains("relation"), "{}", inside.body);
    let events = viewer.get(&format!("/o/{gone_name}/events")).await;
    assert_eq!(events.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        viewer.get(&m.at(0, "/dead-letters")).await.status,
        StatusCode::OK
    );
    assert_eq!(viewer.get(&m.at(1, "/")).await.status, StatusCode::OK);

    // A prefix naming no served outbox.
    let nowhere = viewer
        .get(&format!("/o/{}/no_such_schema/", m.database))
        .await;
    assert_eq!(nowhere.status, StatusCode::NOT_FOUND);
    assert!(nowhere.body.contains("No such outbox"), "{}", nowhere.body);
    let home = viewer
        .get(&format!("/o/{}/{}/", m.database, m.h.db.schema))
        .await;
    assert_eq!(
        home.status,
        StatusCode::NOT_FOUND,
        "the home schema is not served"
    );
    m.finish().await;
}

/// The points of the pending line of an outbox overview's backlog chart.
fn chart_points(page: &str) -> usize {
    let chart = &page[page.find("id=\"backlog-chart\"").expect("a backlog chart")..];
    let series = &chart[chart.find("data-series=\"pending\"").unwrap()..];
    let tag = &series[..series.find('>').unwrap()];
    match tag.find("points=\"") {
        Some(at) => {
            let points = &tag[at + 8..];
            points[..points.find('"').unwrap()].split(' ').count()
        }
        None => 1,
    }
}

#[tokio::test]
async fn only_the_outboxes_someone_views_are_sampled_for_their_charts() {
    // The test takes every sample itself.
    let m = Many::start_with(3, |c| c.sample_every = Duration::from_secs(3600)).await;
    let mut viewer = m.h.signed_in("victor", Role::Viewer).await;
    assert_eq!(m.h.console.sample().await, Vec::<String>::new());
    // The overview of them all views none of them.
    assert_eq!(viewer.get("/").await.status, StatusCode::OK);
    assert_eq!(m.h.console.sample().await, Vec::<String>::new());

    assert_eq!(viewer.get(&m.at(1, "/")).await.status, StatusCode::OK);
    assert_eq!(m.h.console.sample().await, [m.name(1)]);
    // Any page of an outbox counts; a viewed outbox stays sampled.
    assert_eq!(viewer.get(&m.at(0, "/events")).await.status, StatusCode::OK);
    let mut both = vec![m.name(0), m.name(1)];
    both.sort();
    assert_eq!(m.h.console.sample().await, both);
    // Its chart shows the samples taken since (two, and the backlog now);
    // the other's one, and the backlog now.
    assert_eq!(chart_points(&viewer.get(&m.at(1, "/")).await.body), 3);
    assert_eq!(chart_points(&viewer.get(&m.at(0, "/")).await.body), 2);
    assert_eq!(chart_points(&viewer.get(&m.at(2, "/")).await.body), 1);
    m.finish().await;

    // Viewed longer ago than `watch_for`: no longer sampled.
    let m = Many::start_with(1, |c| c.watch_for = Duration::ZERO).await;
    let mut viewer = m.h.signed_in("victor", Role::Viewer).await;
    assert_eq!(viewer.get(&m.at(0, "/")).await.status, StatusCode::OK);
    assert_eq!(m.h.console.sample().await, Vec::<String>::new());
    m.finish().await;

    // Serving one outbox, it is always sampled.
    let one = crate::support::Harness::start().await;
    assert_eq!(
        one.console.sample().await,
        [one.db.schema.name().to_owned()]
    );
    one.finish().await;
}

#[tokio::test]
async fn every_viewer_shares_one_read_of_the_overview_for_a_few_seconds() {
    let m = Many::start_with(2, |c| c.overview_cache_for = Duration::from_secs(5)).await;
    let mut victor = m.h.signed_in("victor", Role::Viewer).await;
    let mut vera = m.h.signed_in("vera", Role::Viewer).await;
    let dead = |page: &str| cell(row(page, &m.name(0)), "num dead");
    assert_eq!(dead(&victor.get("/").await.body), "0");
    dead_letters(&m.tenants[0], "invoice.sent", 2).await;
    // Within the cache time, every viewer sees the same read.
    assert_eq!(dead(&vera.get("/").await.body), "0");
    assert_eq!(dead(&victor.get("/").await.body), "0");
    // An outbox's own pages read it now.
    let own = victor.get(&m.at(0, "/dead-letters")).await.body;
    assert!(own.contains("<strong>2</strong> unresolved"), "{own}");
    // Then the overview reads the counts again.
    let vera = tokio::sync::Mutex::new(vera);
    wait_for(
        "the overview's next read",
        Duration::from_secs(30),
        || async { dead(&vera.lock().await.get("/").await.body) == "2" },
    )
    .await;
    m.finish().await;
}

/// How long the all-outboxes overview takes over many outboxes in one
/// database (one pool), read on every request and shared for 3 s (the
/// default), one viewer after the other and ten at once:
/// `POSTBOX_OUTBOXES=520 cargo test --workspace --test main -- --ignored
/// a_hundred_outboxes --nocapture` (100 outboxes without the variable).
#[tokio::test]
#[ignore = "a measurement: prints how long the overview of 100 outboxes takes"]
async fn a_hundred_outboxes_overview_timing() {
    let n: usize = std::env::var("POSTBOX_OUTBOXES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let seed = TestDb::new().await;
    let prefix = postbox_testkit::unique("m_");
    let names: Vec<String> = (0..n).map(|i| format!("{prefix}_{i:03}")).collect();
    let migrations = names.chunks(n.div_ceil(3)).map(|chunk| {
        let pool = seed.pool.clone();
        async move {
            let mut conn = pool.acquire().await.unwrap();
            for name in chunk {
                let schema = Schema::new(name).unwrap();
                postbox::sqlx::migrate(&mut conn, &schema).await.unwrap();
            }
        }
    });
    futures::future::join_all(migrations).await;
    let names: HashSet<String> = names.into_iter().collect();
    let listed = format!("<strong>{n}</strong> outbox(es)");
    for (label, cache) in [
        ("read on every request", Duration::ZERO),
        ("shared for 3 s", Duration::from_secs(3)),
    ] {
        let m = Many::serving(Vec::new(), names.clone(), |c| {
            c.overview_cache_for = cache;
            // Eleven viewers sign in from one address.
            c.sign_in_limit = postbox_console::RateLimit::per_minute(60);
        })
        .await;
        let mut viewer = m.h.signed_in("victor", Role::Viewer).await;
        let mut one_by_one = Vec::new();
        for _ in 0..6 {
            let started = std::time::Instant::now();
            let page = viewer.get("/").await;
            one_by_one.push(started.elapsed());
            assert_eq!(page.status, StatusCode::OK);
            assert!(page.body.contains(&listed), "{}", page.body);
        }
        let mut viewers = Vec::new();
        for i in 0..10 {
            viewers.push(m.h.signed_in(&format!("viewer{i}"), Role::Viewer).await);
        }
        let started = std::time::Instant::now();
        let pages = futures::future::join_all(viewers.iter_mut().map(|v| v.get("/"))).await;
        let ten_at_once = started.elapsed();
        assert!(pages.iter().all(|p| p.body.contains(&listed)));
        println!(
            "overview of {n} outboxes, {label}: one viewer after the other {one_by_one:?} \
             (after the sign-in page read them); ten viewers at once {ten_at_once:?}"
        );
        m.finish().await;
    }
    for n in &names {
        let _ = sqlx::raw_sql(trusted(&format!("DROP SCHEMA {n} CASCADE")))
            .execute(&seed.pool)
            .await;
    }
    seed.drop_schema().await;
}

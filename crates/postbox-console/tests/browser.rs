//! End-to-end in headless Chromium, driven over WebDriver (Debian's
//! `chromium` and `chromium-driver`): an operator signs in, finds why an event
//! is stuck, replays it, sees it delivered by a real relay into Redis, and
//! finds the audit entry. Without Chromium the tests say so and pass, except
//! under CI (`CI=true`), where they fail.
//!
//! `POSTBOX_SCREENSHOTS=DIR cargo test -p postbox-console --test main
//! screenshots -- --ignored` writes the overview and the dead-letter page at
//! phone and desktop widths to DIR.

use crate::support::{dead_letters, Harness, PASSWORD};
use fantoccini::{Client, ClientBuilder, Locator};
use postbox::statements::trusted;
use postbox::NewEvent;
use postbox_console::Role;
use postbox_relay::sinks::SinkOptions;
use postbox_relay::{Relay, RelayConfig, RunMode, Store};
use postbox_testkit::{redis_url, unique, wait_for};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const PATIENCE: Duration = Duration::from_secs(30);

fn chromium() -> PathBuf {
    std::env::var_os("POSTBOX_CHROMIUM").map_or_else(|| "/usr/bin/chromium".into(), PathBuf::from)
}

fn chromedriver() -> PathBuf {
    std::env::var_os("POSTBOX_CHROMEDRIVER")
        .map_or_else(|| "/usr/bin/chromedriver".into(), PathBuf::from)
}

fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// The screen a page is looked at on.
#[derive(Clone, Copy)]
enum Screen {
    Phone,
    Desktop,
}

/// A headless Chromium session and its chromedriver, ended on drop.
struct Browser {
    client: Option<Client>,
    driver: Child,
    profile: PathBuf,
}

impl Browser {
    /// `None` (with a message) when Chromium is not installed and CI is not set.
    async fn start(screen: Screen) -> Option<Browser> {
        let (browser, driver) = (chromium(), chromedriver());
        if !browser.exists() || !driver.exists() {
            assert!(
                !under_ci(),
                "CI is set but {} or {} is missing: install chromium and chromium-driver",
                browser.display(),
                driver.display()
            );
            eprintln!(
                "SKIPPED: browser test needs {} and {} (apt-get install chromium chromium-driver)",
                browser.display(),
                driver.display()
            );
            return None;
        }
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let child = Command::new(&driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let profile = std::env::temp_dir().join(unique("postbox-console-chromium-"));
        let mut b = Browser {
            client: None,
            driver: child,
            profile,
        };
        wait_for("chromedriver to listen", PATIENCE, || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        })
        .await;
        let mut args = vec![
            "--headless=new".to_owned(),
            "--no-sandbox".to_owned(),
            "--disable-gpu".to_owned(),
            "--disable-dev-shm-usage".to_owned(),
            "--disable-background-networking".to_owned(),
            "--disable-component-update".to_owned(),
            "--disable-sync".to_owned(),
            "--disable-quic".to_owned(),
            "--no-first-run".to_owned(),
            "--hide-scrollbars".to_owned(),
            format!("--user-data-dir={}", b.profile.display()),
        ];
        let mut options = serde_json::json!({ "binary": browser.to_string_lossy() });
        match screen {
            Screen::Desktop => args.push("--window-size=1366,900".to_owned()),
            Screen::Phone => {
                options["mobileEmulation"] = serde_json::json!({
                    "deviceMetrics": { "width": 390, "height": 844, "pixelRatio": 2.0, "touch": true }
                });
                args.push("--window-size=390,844".to_owned());
            }
        }
        options["args"] = serde_json::json!(args);
        let mut caps = serde_json::Map::new();
        caps.insert("goog:chromeOptions".to_owned(), options);
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let client = ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
            .expect("a Chromium session");
        b.client = Some(client);
        Some(b)
    }

    fn c(&self) -> &Client {
        self.client.as_ref().expect("a session")
    }

    async fn close(mut self) {
        if let Some(c) = self.client.take() {
            let _ = c.close().await;
        }
    }

    async fn text(&self, css: &str) -> String {
        self.c()
            .wait()
            .at_most(PATIENCE)
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no {css}: {e}"))
            .text()
            .await
            .unwrap()
    }

    async fn click(&self, css: &str) {
        self.c()
            .wait()
            .at_most(PATIENCE)
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no {css}: {e}"))
            .click()
            .await
            .unwrap_or_else(|e| panic!("click {css}: {e}"));
    }

    async fn path(&self) -> String {
        self.c().current_url().await.unwrap().path().to_owned()
    }

    async fn sign_in(&self, base: &str, name: &str) {
        let c = self.c();
        c.goto(&format!("{base}/")).await.unwrap();
        assert_eq!(
            self.path().await,
            "/sign-in",
            "signed-out users land on sign-in"
        );
        c.find(Locator::Css("#name"))
            .await
            .unwrap()
            .send_keys(name)
            .await
            .unwrap();
        c.find(Locator::Css("#password"))
            .await
            .unwrap()
            .send_keys(PASSWORD)
            .await
            .unwrap();
        self.click("form button[type=submit]").await;
        self.text("#dead-letters").await;
        assert_eq!(self.path().await, "/");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// A relay delivering this schema's events into a fresh Redis stream.
fn start_relay(h: &Harness, stream: &str) -> CancellationToken {
    let url = format!("{}?mode=stream&key={stream}", redis_url());
    let sink = postbox_relay::sinks::from_url(&url, &SinkOptions::default()).unwrap();
    let config = RelayConfig {
        poll_interval: Duration::from_millis(100),
        ..RelayConfig::default()
    };
    let relay = Relay::new(
        Store::new(h.db.pool.clone(), h.db.schema.clone()),
        sink,
        config,
    )
    .unwrap();
    let stop = CancellationToken::new();
    let token = stop.clone();
    tokio::spawn(async move { relay.run(RunMode::Forever, token).await });
    stop
}

async fn stream_has(stream: &str, id: Uuid) -> bool {
    use redis::AsyncCommands;
    let mut conn = postbox_testkit::redis().await;
    let reply: redis::streams::StreamRangeReply = conn.xrange_all(stream).await.unwrap();
    reply.ids.iter().any(|e| {
        e.map
            .get("id")
            .and_then(|v| redis::from_redis_value_ref::<String>(v).ok())
            .is_some_and(|v| v == id.to_string())
    })
}

#[tokio::test]
async fn an_operator_finds_a_stuck_event_replays_it_and_sees_the_audit_entry() {
    let Some(b) = Browser::start(Screen::Desktop).await else {
        return;
    };
    let h = Harness::start().await;
    h.user("alice", Role::Operator).await;
    let others: Vec<NewEvent> = (0..3)
        .map(|i| {
            NewEvent::new("order.paid", "order", i.to_string(), &serde_json::json!({})).unwrap()
        })
        .collect();
    h.db.enqueue_events(&others).await;
    let id = dead_letters(&h.db, "order.placed", 1).await[0];
    let stream = unique("console-e2e-");
    let _stream = postbox_testkit::RedisKeyGuard(stream.clone());
    let relay = start_relay(&h, &stream);
    let base = h.url("");

    b.sign_in(&base, "alice").await;
    // Find the dead letter from the navigation.
    b.click("header nav a[href='/dead-letters']").await;
    assert!(b.text("#matching").await.starts_with("1 unresolved"));
    b.click(&format!("a[href='/events/{id}']")).await;
    // Why is it stuck?
    assert!(b
        .text("#diagnosis")
        .await
        .contains("Dead letter after 20 attempt(s)"));
    assert_eq!(
        b.text("#last-error").await,
        "sink rejected: 400 missing field customer_id"
    );
    assert!(
        b.text("#payload").await.contains("4111"),
        "no redaction configured here"
    );
    // Replay it and watch it go out.
    b.click("#replay").await;
    assert!(b.text("p.notice").await.starts_with("Replayed"));
    let c = b.c();
    wait_for("the event page to say sent", PATIENCE, || async move {
        c.refresh().await.unwrap();
        c.find(Locator::Css("#status"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
            .starts_with("sent")
    })
    .await;
    assert!(b.text("#diagnosis").await.starts_with("Delivered"));
    assert!(
        stream_has(&stream, id).await,
        "the relay published it to Redis"
    );
    assert!(b
        .text("#timeline")
        .await
        .contains("Replayed under the same id by console:alice"));
    // The audit log says who did it.
    b.click("header nav a[href='/audit']").await;
    let audit = b.text("#audit").await;
    let first = audit.lines().nth(1).unwrap_or_default().to_owned();
    assert!(audit.contains("console:alice"), "{audit}");
    assert!(audit.contains("dlq.replay"), "{audit}");
    assert!(audit.contains(&id.to_string()), "{audit}");
    assert!(audit.contains("console.sign_in"), "{audit}: {first}");
    // Sign out.
    b.click("header form button[type=submit]").await;
    b.text("#password").await;
    assert_eq!(b.path().await, "/sign-in");
    b.close().await;
    relay.cancel();
    h.finish().await;
}

/// The value of a script expression in the page.
async fn js(b: &Browser, expr: &str) -> serde_json::Value {
    b.c()
        .execute(&format!("return {expr};"), vec![])
        .await
        .unwrap()
}

/// Wait until the script expression `expr` is true in the page.
async fn until_js(b: &Browser, what: &str, expr: &str) {
    let expr = expr.to_owned();
    wait_for(what, PATIENCE, || {
        let expr = expr.clone();
        async move { js(b, &expr).await == serde_json::Value::Bool(true) }
    })
    .await;
}

#[tokio::test]
async fn the_overview_and_dead_letters_update_themselves_and_keep_the_selection() {
    let Some(b) = Browser::start(Screen::Desktop).await else {
        return;
    };
    let h = Harness::with(|c| {
        c.refresh_every = Duration::from_millis(600);
        c.page_size = 100;
    })
    .await;
    h.user("alice", Role::Operator).await;
    let first = dead_letters(&h.db, "order.placed", 60).await;
    let base = h.url("");
    b.sign_in(&base, "alice").await;
    assert_eq!(b.text("#dead-letters").await, "60");
    // A mark on the window tells a reload (which would drop it) from an update.
    js(&b, "(window.stayed = 'yes')").await;
    dead_letters(&h.db, "payment.captured", 5).await;
    until_js(
        &b,
        "the overview to count 65 dead letters",
        "document.getElementById('dead-letters').textContent === '65'",
    )
    .await;
    assert_eq!(js(&b, "window.stayed").await, "yes", "updated in place");
    // The backlog chart is drawn, with its three lines and its axes.
    assert_eq!(
        js(
            &b,
            "document.querySelectorAll('#backlog-chart [data-series]').length"
        )
        .await,
        3
    );
    assert_eq!(
        js(
            &b,
            "document.getElementById('backlog-chart').getBoundingClientRect().height > 100"
        )
        .await,
        true
    );
    assert_eq!(
        js(
            &b,
            "document.querySelectorAll('#backlog-chart text.tick').length"
        )
        .await,
        6
    );

    // The dead-letter list, scrolled down, one row selected: nothing moves.
    b.c().goto(&format!("{base}/dead-letters")).await.unwrap();
    assert!(b.text("#matching").await.starts_with("65 unresolved"));
    js(&b, "(window.stayed = 'yes')").await;
    let target = first[10].to_string();
    js(&b, "window.scrollTo(0, 900)").await;
    js(
        &b,
        &format!("document.querySelector(\"input[value='{target}']\").click()"),
    )
    .await;
    let scrolled = js(&b, "window.scrollY").await;
    until_js(
        &b,
        "updates to pause for the selection",
        "document.getElementById('live-status').dataset.state === 'paused'",
    )
    .await;
    dead_letters(&h.db, "invoice.issued", 3).await;
    until_js(
        &b,
        "another paused round",
        "document.getElementById('live-status').textContent.indexOf('rows are selected') > 0",
    )
    .await;
    assert!(
        b.text("#matching").await.starts_with("65 unresolved"),
        "held still"
    );
    assert_eq!(
        js(
            &b,
            &format!("document.querySelector(\"input[value='{target}']\").checked")
        )
        .await,
        true
    );
    assert_eq!(js(&b, "window.scrollY").await, scrolled);
    // The selection cleared, the list catches up in place: the row under the
    // operator's eyes stays where it was on the screen.
    let row_top = format!(
        "Math.round(document.querySelector(\"input[value='{target}']\").getBoundingClientRect().top)"
    );
    js(&b, &format!("document.querySelector(\"input[value='{target}']\").scrollIntoView({{block: 'center'}})")).await;
    js(
        &b,
        &format!("document.querySelector(\"input[value='{target}']\").click()"),
    )
    .await;
    let top = js(&b, &row_top).await;
    until_js(
        &b,
        "the list to show 68",
        "document.getElementById('matching').textContent.indexOf('68 unresolved') === 0",
    )
    .await;
    assert_eq!(js(&b, "window.stayed").await, "yes", "updated in place");
    assert_eq!(
        js(
            &b,
            "document.querySelectorAll('#dead-letter-rows tr').length"
        )
        .await,
        68
    );
    assert_eq!(js(&b, &row_top).await, top, "the place is kept");

    // At the bottom of the page the bulk actions are still on screen.
    js(&b, "window.scrollTo(0, document.body.scrollHeight)").await;
    let last = first[0].to_string();
    js(
        &b,
        &format!("document.querySelector(\"input[value='{last}']\").click()"),
    )
    .await;
    assert_eq!(b.text("#selected-count").await, "· 1 selected");
    let visible = "(function () { var r = document.querySelector(\"#bulk-toolbar button[value='replay-selected']\").getBoundingClientRect(); return r.top >= 0 && r.bottom <= window.innerHeight; })()";
    assert_eq!(
        js(&b, visible).await,
        true,
        "the toolbar follows the scroll"
    );
    let before = js(&b, "window.scrollY").await;
    b.c()
        .find(Locator::Css(
            "#bulk-toolbar button[value='replay-selected']",
        ))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let c = b.c();
    wait_for("the job page to say finished", PATIENCE, || async move {
        match c.find(Locator::Css("#job-state")).await {
            Ok(e) => e.text().await.is_ok_and(|t| t == "finished"),
            Err(_) => false,
        }
    })
    .await;
    assert!(
        before.as_f64().unwrap() > 1000.0,
        "it was clicked far down the page"
    );
    assert_eq!(h.status(first[0]).await.0, "pending");

    // Signed out meanwhile: the overview stops updating and says so, and
    // does not turn into the sign-in form.
    b.c().goto(&format!("{base}/")).await.unwrap();
    b.text("#dead-letters").await;
    h.db.exec("DELETE FROM {schema}.console_sessions").await;
    until_js(
        &b,
        "updates to stop",
        "document.getElementById('live-status').dataset.state === 'stopped'",
    )
    .await;
    assert!(b.text("#live-status").await.contains("signed out?"));
    assert_eq!(
        js(&b, "document.getElementById('password') === null").await,
        true
    );
    b.close().await;
    h.finish().await;
}

#[tokio::test]
async fn eight_hundred_identical_failures_are_one_line_replayed_at_once() {
    let Some(b) = Browser::start(Screen::Desktop).await else {
        return;
    };
    let h = Harness::with(|c| c.batch_size = 200).await;
    h.user("alice", Role::Operator).await;
    let refused = dead_letters(&h.db, "order.placed", 800).await;
    let other = dead_letters(&h.db, "order.shipped", 3).await;
    sqlx::query(trusted(&h.db.sql(
        "UPDATE {schema}.outbox SET last_error = 'redis: Connection refused (os error 111)' \
         WHERE event_id = ANY($1)",
    )))
    .bind(&refused)
    .execute(&h.db.pool)
    .await
    .unwrap();
    let base = h.url("");
    b.sign_in(&base, "alice").await;
    b.c().goto(&format!("{base}/dead-letters")).await.unwrap();
    b.click("a[href='/groups']").await;
    assert!(b
        .text("#group-summary")
        .await
        .starts_with("803 unresolved dead letter(s) in 2 group(s)"));
    assert_eq!(
        js(&b, "document.querySelectorAll('#groups tbody tr').length").await,
        2
    );
    assert_eq!(b.text("#groups tbody tr:first-child td.count").await, "800");
    assert!(b
        .text("#groups tbody tr:first-child td.error-text")
        .await
        .contains("Connection refused"));
    b.click("#groups tbody tr:first-child button[value=replay]")
        .await;
    let c = b.c();
    wait_for("the confirmation", PATIENCE, || async move {
        c.get_alert_text().await.is_ok()
    })
    .await;
    assert_eq!(
        c.get_alert_text().await.unwrap(),
        "Replay the 800 dead letters of this group?"
    );
    c.accept_alert().await.unwrap();
    wait_for("the job page to say finished", PATIENCE, || async move {
        match c.find(Locator::Css("#job-state")).await {
            Ok(e) => e.text().await.is_ok_and(|t| t == "finished"),
            Err(_) => false,
        }
    })
    .await;
    assert_eq!(b.text("#job-done").await, "800");
    assert_eq!(h.status(refused[0]).await.0, "pending");
    assert_eq!(h.status(refused[799]).await.0, "pending");
    assert_eq!(h.status(other[0]).await.0, "failed");
    b.close().await;
    h.finish().await;
}

#[tokio::test]
async fn on_a_phone_a_bulk_replay_shows_its_progress_until_done() {
    let Some(b) = Browser::start(Screen::Phone).await else {
        return;
    };
    let h = Harness::with(|c| c.batch_size = 5).await;
    h.user("alice", Role::Operator).await;
    let ids = dead_letters(&h.db, "order.placed", 23).await;
    let base = h.url("");
    b.sign_in(&base, "alice").await;
    b.c().goto(&format!("{base}/dead-letters")).await.unwrap();
    assert!(b.text("#matching").await.starts_with("23 unresolved"));
    b.click("button[value='replay-all']").await;
    // The script asks first.
    let c = b.c();
    wait_for("the confirmation", PATIENCE, || async move {
        c.get_alert_text().await.is_ok()
    })
    .await;
    assert_eq!(
        c.get_alert_text().await.unwrap(),
        "Replay all 23 matching dead letters?"
    );
    c.accept_alert().await.unwrap();
    // The job page polls and reloads itself when done.
    wait_for("the job page to say finished", PATIENCE, || async move {
        match c.find(Locator::Css("#job-state")).await {
            Ok(e) => e.text().await.is_ok_and(|t| t == "finished"),
            Err(_) => false,
        }
    })
    .await;
    assert_eq!(b.text("#job-done").await, "23");
    for id in &ids {
        assert_eq!(h.status(*id).await.0, "pending");
    }
    b.close().await;
    h.finish().await;
}

/// Screenshots for people to look at (not run by default).
#[tokio::test]
#[ignore = "writes screenshots; run with --ignored and POSTBOX_SCREENSHOTS=DIR"]
async fn screenshots() {
    let dir = PathBuf::from(
        std::env::var("POSTBOX_SCREENSHOTS")
            .unwrap_or_else(|_| "target/console-screenshots".into()),
    );
    std::fs::create_dir_all(&dir).unwrap();
    let h = Harness::start().await;
    h.user("alice", Role::Operator).await;
    let events: Vec<NewEvent> = (0..40)
        .map(|i| {
            NewEvent::new(
                if i % 4 == 0 {
                    "invoice.issued"
                } else {
                    "order.placed"
                },
                "order",
                format!("{}", 1000 + i),
                &serde_json::json!({"order_id": 1000 + i, "total": 12.5}),
            )
            .unwrap()
        })
        .collect();
    h.db.enqueue_events(&events).await;
    h.db.exec(
        "UPDATE {schema}.outbox SET status = 'sent', \
         sent_at = now() - make_interval(secs => (id * 37) % 1500) WHERE id % 5 <> 0 AND id <= 36;
         UPDATE {schema}.outbox SET attempts = 3, available_at = now() + interval '4 minutes', \
         last_error = 'redis: connection refused (os error 111)' WHERE id > 36",
    )
    .await;
    let dead = dead_letters(&h.db, "payment.captured", 6).await;
    let event = format!("/events/{}", dead[0]);
    Store::new(h.db.pool.clone(), h.db.schema.clone())
        .dead_letters()
        .apply(
            &postbox_store::Selection::Ids(vec![dead[5]]),
            &postbox_store::Action::Discard {
                reason: "test order from the load test".into(),
            },
            "console:alice",
            10,
            |_| {},
        )
        .await
        .unwrap();
    let base = h.url("");
    for (screen, name) in [(Screen::Phone, "phone"), (Screen::Desktop, "desktop")] {
        let Some(b) = Browser::start(screen).await else {
            return;
        };
        b.sign_in(&base, "alice").await;
        for (path, page) in [
            ("/", "overview"),
            ("/dead-letters", "dead-letters"),
            (event.as_str(), "event"),
            ("/events", "events"),
            ("/audit", "audit"),
        ] {
            b.c().goto(&format!("{base}{path}")).await.unwrap();
            b.text("main h1").await;
            let png = b.c().screenshot().await.unwrap();
            let file = dir.join(format!("{page}-{name}.png"));
            std::fs::write(&file, png).unwrap();
            eprintln!("wrote {}", file.display());
        }
        b.close().await;
    }
    h.finish().await;
}

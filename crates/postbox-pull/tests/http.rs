//! `postbox group serve`'s API: a reader receives, acknowledges and gives
//! back events over HTTP with its group's token; a token opens its own
//! group only; a long poll returns when an event commits; bad requests get
//! a 4xx that names the field, never a database error's text.

use postbox::{NewEvent, Outbox};
use postbox_pull::{PullApi, PullOptions};
use postbox_store::{Groups, NewGroup, ProducerTarget, Store};
use postbox_testkit::{wait_for, TestDb};
use reqwest::StatusCode;
use serde_json::{json, Value};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

struct Server {
    db: TestDb,
    groups: Groups,
    base: String,
    client: reqwest::Client,
    stop: CancellationToken,
    served: tokio::task::JoinHandle<()>,
}

impl Server {
    /// A fresh schema whose producers write the log, groups `names`, and the
    /// API served on a free port of 127.0.0.1.
    async fn start(names: &[&str], options: PullOptions) -> Server {
        let db = TestDb::new().await;
        let store = Store::new(db.pool.clone(), db.schema.clone());
        store
            .log()
            .set_producer_target(ProducerTarget::Log)
            .await
            .expect("producers write the log");
        let groups = store.groups();
        for name in names {
            groups
                .create(&NewGroup::new(*name))
                .await
                .expect("create a group");
        }
        let stop = CancellationToken::new();
        let api = PullApi::new(db.pool.clone(), &db.schema, options, stop.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(api.clone().wake_on_notifications(stop.clone()));
        let served = tokio::spawn({
            let stop = stop.clone();
            async move {
                postbox::serve::serve(
                    listener,
                    api.router(),
                    postbox::serve::Limits::default(),
                    stop.cancelled_owned(),
                )
                .await
                .expect("serve");
            }
        });
        let client = postbox_testkit::http().build().unwrap();
        Server {
            db,
            groups,
            base,
            client,
            stop,
            served,
        }
    }

    async fn token(&self, group: &str) -> String {
        self.groups
            .create_token(group, Some("test"), "tester")
            .await
            .expect("make a token")
            .1
    }

    /// Commit `n` events of aggregate `agg` in one transaction.
    async fn produce(&self, n: usize, agg: &str) -> Vec<uuid::Uuid> {
        let events: Vec<NewEvent> = (0..n)
            .map(|i| NewEvent::new("order.placed", "order", agg, &json!({ "i": i })).unwrap())
            .collect();
        let mut tx = self.db.pool.begin().await.unwrap();
        let ids =
            postbox::sqlx::enqueue_batch(&Outbox::new(self.db.schema.clone()), &mut tx, &events)
                .await
                .unwrap();
        tx.commit().await.unwrap();
        ids
    }

    async fn call(&self, token: Option<&str>, path: &str, body: Value) -> (StatusCode, Value) {
        let mut request = self.client.post(format!("{}{path}", self.base)).json(&body);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.expect("the server answers");
        let status = response.status();
        let text = response.text().await.unwrap();
        let value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{path} answered {status} with no JSON ({e}): {text}"));
        (status, value)
    }

    /// A receive of billing waiting up to 20 s, once it has looked once
    /// (the group's `read_at` is set) and found nothing.
    async fn long_poll(&self, token: &str) -> tokio::task::JoinHandle<Value> {
        let poll = {
            let (client, url, token) = (
                self.client.clone(),
                format!("{}/groups/billing/receive", self.base),
                token.to_owned(),
            );
            tokio::spawn(async move {
                client
                    .post(url)
                    .bearer_auth(token)
                    .json(&json!({ "wait_seconds": 20 }))
                    .send()
                    .await
                    .unwrap()
                    .json::<Value>()
                    .await
                    .unwrap()
            })
        };
        wait_for("the poll to look once", Duration::from_secs(30), || {
            let (pool, schema) = (self.db.pool.clone(), self.db.schema.clone());
            async move {
                sqlx::query_scalar::<_, Option<chrono::DateTime<chrono::Utc>>>(
                    postbox::statements::trusted(&schema.render(
                        "SELECT read_at FROM {schema}.consumer_groups WHERE name = 'billing'",
                    )),
                )
                .fetch_one(&pool)
                .await
                .ok()
                .flatten()
                .is_some()
            }
        })
        .await;
        poll
    }

    async fn finish(self) {
        self.stop.cancel();
        let _ = self.served.await;
        self.db.drop_schema().await;
    }
}

fn receipts(answer: &Value) -> Vec<String> {
    answer["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["receipt"].as_str().expect("receipt").to_owned())
        .collect()
}

#[tokio::test]
async fn a_reader_receives_acknowledges_and_gives_back_over_http() {
    let s = Server::start(&["billing"], PullOptions::default()).await;
    let token = s.token("billing").await;
    let ids = s.produce(3, "o-1").await;

    let (status, got) = s
        .call(
            Some(&token),
            "/groups/billing/receive",
            json!({ "max_events": 2 }),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{got}");
    let events = got["events"].as_array().unwrap();
    assert_eq!(events.len(), 2);
    // The event is the CloudEvents document the push sinks send.
    let first = &events[0];
    assert_eq!(first["attempts"], 1);
    assert_eq!(first["event"]["specversion"], "1.0");
    assert_eq!(first["event"]["id"], ids[0].to_string());
    assert_eq!(first["event"]["type"], "order.placed");
    assert_eq!(first["event"]["source"], "postbox");
    assert_eq!(first["event"]["subject"], "o-1");
    assert_eq!(first["event"]["aggregatetype"], "order");
    assert_eq!(first["event"]["data"], json!({ "i": 0 }));

    let (status, acked) = s
        .call(
            Some(&token),
            "/groups/billing/ack",
            json!({ "receipts": receipts(&got) }),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{acked}");
    assert_eq!(acked, json!({ "acknowledged": 2 }));

    // The third, given back at once, comes again with its attempt counted.
    let (_, third) = s
        .call(Some(&token), "/groups/billing/receive", json!({}))
        .await;
    assert_eq!(third["events"][0]["event"]["id"], ids[2].to_string());
    let receipt = receipts(&third).remove(0);
    let (status, nacked) = s
        .call(
            Some(&token),
            "/groups/billing/nack",
            json!({ "receipt": receipt, "error": "the ledger is closed" }),
        )
        .await;
    assert_eq!(
        (status, nacked),
        (StatusCode::OK, json!({ "returned": true }))
    );
    let (_, again) = s
        .call(Some(&token), "/groups/billing/receive", json!({}))
        .await;
    assert_eq!(again["events"][0]["event"]["id"], ids[2].to_string());
    assert_eq!(again["events"][0]["attempts"], 2);
    // The old receipt no longer names it.
    let (_, stale) = s
        .call(
            Some(&token),
            "/groups/billing/ack",
            json!({ "receipts": [receipt] }),
        )
        .await;
    assert_eq!(stale, json!({ "acknowledged": 0 }));
    let (_, done) = s
        .call(
            Some(&token),
            "/groups/billing/ack",
            json!({ "receipts": receipts(&again) }),
        )
        .await;
    assert_eq!(done, json!({ "acknowledged": 1 }));
    let (_, empty) = s
        .call(Some(&token), "/groups/billing/receive", json!({}))
        .await;
    assert_eq!(empty, json!({ "events": [] }));
    s.finish().await;
}

#[tokio::test]
async fn a_token_opens_its_own_group_and_no_other() {
    let s = Server::start(
        &["billing", "shipping"],
        PullOptions {
            token_cache_for: Duration::ZERO,
            ..PullOptions::default()
        },
    )
    .await;
    let billing = s.token("billing").await;
    let shipping = s.token("shipping").await;
    s.produce(1, "o-1").await;

    let (status, body) = s
        .call(Some(&billing), "/groups/shipping/receive", json!({}))
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    let (status, _) = s
        .call(
            Some(&billing),
            "/groups/shipping/ack",
            json!({ "receipts": ["x:1"] }),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, _) = s
        .call(Some(&shipping), "/groups/shipping/receive", json!({}))
        .await;
    assert_eq!(status, StatusCode::OK);

    // No token, a stranger's token, another scheme: 401 with a challenge.
    let response = s
        .client
        .post(format!("{}/groups/billing/receive", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert!(response.headers()["www-authenticate"]
        .to_str()
        .unwrap()
        .starts_with("Bearer"));
    let forged = format!("pbg_{}", "0".repeat(64));
    for token in [forged.as_str(), "hunter2", &billing.to_uppercase()] {
        let (status, body) = s
            .call(Some(token), "/groups/billing/receive", json!({}))
            .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{token}: {body}");
    }

    // A revoked token stops working (no cache here).
    let tokens = s.groups.tokens(Some("billing")).await.unwrap();
    assert_eq!(tokens.len(), 1);
    assert!(s
        .groups
        .revoke_token("billing", tokens[0].id, "tester")
        .await
        .unwrap());
    let (status, _) = s
        .call(Some(&billing), "/groups/billing/receive", json!({}))
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // Dropping a group drops its tokens.
    s.groups
        .drop_group("shipping", "tester", None)
        .await
        .unwrap();
    let (status, _) = s
        .call(Some(&shipping), "/groups/shipping/receive", json!({}))
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    s.finish().await;
}

/// A stranger at the reader's address (a proxy, a NAT) runs the address
/// out of failed tokens: unknown tokens then get 429 without a look-up,
/// and the reader whose token worked lately goes on — with no cache, so
/// its token is looked up on every call.
#[tokio::test]
async fn a_stranger_out_of_failed_tokens_does_not_lock_a_reader_out() {
    let s = Server::start(
        &["billing"],
        PullOptions {
            failed_tokens_per_minute: 3,
            token_cache_for: Duration::ZERO,
            ..PullOptions::default()
        },
    )
    .await;
    let token = s.token("billing").await;
    let (status, _) = s
        .call(Some(&token), "/groups/billing/receive", json!({}))
        .await;
    assert_eq!(status, StatusCode::OK);
    let forged = format!("pbg_{}", "1".repeat(64));
    for _ in 0..3 {
        let (status, _) = s
            .call(Some(&forged), "/groups/billing/receive", json!({}))
            .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
    }
    let response = s
        .client
        .post(format!("{}/groups/billing/receive", s.base))
        .bearer_auth(&forged)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(response.headers().contains_key("retry-after"));
    for _ in 0..3 {
        let (status, _) = s
            .call(Some(&token), "/groups/billing/receive", json!({}))
            .await;
        assert_eq!(status, StatusCode::OK, "the reader is locked out");
    }
    // A token this server has not seen work waits with the stranger.
    let fresh = s.token("billing").await;
    let (status, _) = s
        .call(Some(&fresh), "/groups/billing/receive", json!({}))
        .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    s.finish().await;
}

/// A request without a valid token is refused before its body is read:
/// a stranger cannot make the server buffer a megabyte, or wait for a
/// body that trickles in.
#[tokio::test]
async fn a_strangers_body_is_never_read() {
    let s = Server::start(&["billing"], PullOptions::default()).await;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(1);
    // A body that never ends: answered all the same.
    let trickle = reqwest::Body::wrap_stream(tokio_stream_of(rx));
    let response = s
        .client
        .post(format!("{}/groups/billing/ack", s.base))
        .header("content-length", "1000000")
        .body(trickle)
        .send();
    let response = tokio::time::timeout(Duration::from_secs(15), response)
        .await
        .expect("answered without the body")
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    drop(tx);
    s.finish().await;
}

/// The receiving end of `rx` as a stream (what reqwest takes as a body).
fn tokio_stream_of(
    mut rx: tokio::sync::mpsc::Receiver<Result<Vec<u8>, std::io::Error>>,
) -> impl futures_core::Stream<Item = Result<Vec<u8>, std::io::Error>> + Send + 'static {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// A waiting long poll asks, read only, whether there is anything before
/// it calls receive (which writes the group's row): three idle seconds of
/// looks every 20 ms leave the row as the first look wrote it. And past
/// `max_polls_per_group`, a poll answers at once instead of waiting.
#[tokio::test]
async fn waiting_polls_write_nothing_and_are_bounded_per_group() {
    let s = Server::start(
        &["billing"],
        PullOptions {
            poll_every: Duration::from_millis(20),
            max_polls_per_group: 1,
            ..PullOptions::default()
        },
    )
    .await;
    let token = s.token("billing").await;
    let read_at = || async {
        sqlx::query_scalar::<_, Option<chrono::DateTime<chrono::Utc>>>(
            postbox::statements::trusted(
                &s.db
                    .sql("SELECT read_at FROM {schema}.consumer_groups WHERE name = 'billing'"),
            ),
        )
        .fetch_one(&s.db.pool)
        .await
        .unwrap()
    };
    let waited = {
        let (client, url, token) = (
            s.client.clone(),
            format!("{}/groups/billing/receive", s.base),
            token.clone(),
        );
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            let got: Value = client
                .post(url)
                .bearer_auth(token)
                .json(&json!({ "wait_seconds": 3 }))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            (got, started.elapsed())
        })
    };
    wait_for("the first look", Duration::from_secs(30), || async {
        read_at().await.is_some()
    })
    .await;
    let first = read_at().await.unwrap();
    // A second poll of the group answers at once: one may wait.
    let (status, second) = tokio::time::timeout(
        Duration::from_secs(2),
        s.call(
            Some(&token),
            "/groups/billing/receive",
            json!({ "wait_seconds": 20 }),
        ),
    )
    .await
    .expect("the second poll did not wait");
    assert_eq!((status, second), (StatusCode::OK, json!({ "events": [] })));
    let (got, took) = waited.await.unwrap();
    assert_eq!(got, json!({ "events": [] }));
    assert!(took >= Duration::from_secs(3), "{took:?}");
    // The second poll's own look wrote once; the waiting one's looks never.
    let last = read_at().await.unwrap();
    assert!(
        last - first < chrono::Duration::milliseconds(1500),
        "idle looks wrote the group's row: first {first}, last {last}"
    );
    s.finish().await;
}

/// With the poll's own timer an hour long, only the LISTEN wake-up can end
/// the wait early: the poll must come back with the event, not empty.
#[tokio::test]
async fn a_long_poll_returns_when_an_event_commits() {
    let s = Server::start(
        &["billing"],
        PullOptions {
            poll_every: Duration::from_secs(3600),
            ..PullOptions::default()
        },
    )
    .await;
    let token = s.token("billing").await;
    // Once the server LISTENs, a long poll that starts now waits.
    let listening = format!("postbox_{}", s.db.schema.name());
    wait_for("the server to LISTEN", Duration::from_secs(30), || {
        let (pool, channel) = (s.db.pool.clone(), listening.clone());
        async move {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE query LIKE 'LISTEN %' || $1 || '%')",
            )
            .bind(channel)
            .fetch_one(&pool)
            .await
            .unwrap_or(false)
        }
    })
    .await;
    // Commit once the poll is waiting (it has looked once and found nothing).
    let poll = s.long_poll(&token).await;
    let ids = s.produce(1, "o-9").await;
    // Woken by the commit, well before its 20 s are up (a poll that only
    // looks again at its deadline finds the event too, after 20 s).
    let got = tokio::time::timeout(Duration::from_secs(15), poll)
        .await
        .expect("the commit woke the poll")
        .unwrap();
    assert_eq!(got["events"][0]["event"]["id"], ids[0].to_string(), "{got}");
    s.finish().await;
}

#[tokio::test]
async fn bad_requests_name_the_field_and_never_echo_the_database() {
    let s = Server::start(&["billing"], PullOptions::default()).await;
    let token = s.token("billing").await;
    let cases = [
        (
            "/groups/billing/receive",
            json!({ "max_events": 0 }),
            "max_events",
        ),
        (
            "/groups/billing/receive",
            json!({ "visibility_seconds": 0 }),
            "visibility_seconds",
        ),
        (
            "/groups/billing/receive",
            json!({ "wait_seconds": 60 }),
            "wait_seconds",
        ),
        (
            "/groups/billing/receive",
            json!({ "max": 5 }),
            "unknown field",
        ),
        ("/groups/billing/ack", json!({ "receipts": [] }), "receipts"),
        (
            "/groups/billing/nack",
            json!({ "receipt": "b:1", "delay_seconds": -1 }),
            "delay_seconds",
        ),
    ];
    for (path, body, names) in cases {
        let (status, answer) = s.call(Some(&token), path, body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {body}: {answer}");
        let phrase = answer["error"].as_str().unwrap();
        assert!(phrase.contains(names), "{path} {body}: {phrase}");
    }
    // A NUL, which PostgreSQL would refuse with its own error, is refused first.
    let (status, answer) = s
        .call(
            Some(&token),
            "/groups/billing/ack",
            json!({ "receipts": ["b:\u{0}"] }),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    // A malformed receipt reaches the database, whose error text stays there.
    let (status, answer) = s
        .call(
            Some(&token),
            "/groups/billing/ack",
            json!({ "receipts": ["not-a-receipt"] }),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    assert!(!answer.to_string().contains("postbox.ack"), "{answer}");
    // Not JSON at all.
    let response = s
        .client
        .post(format!("{}/groups/billing/receive", s.base))
        .bearer_auth(&token)
        .body("{\"max_events\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    // Larger than the body limit.
    let response = s
        .client
        .post(format!("{}/groups/billing/ack", s.base))
        .bearer_auth(&token)
        .body(vec![b' '; (1 << 20) + 1])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    s.finish().await;
}

#[tokio::test]
async fn shutting_down_ends_the_long_polls() {
    let s = Server::start(
        &["billing"],
        PullOptions {
            poll_every: Duration::from_secs(3600),
            ..PullOptions::default()
        },
    )
    .await;
    let token = s.token("billing").await;
    let poll = s.long_poll(&token).await;
    s.stop.cancel();
    // Well before its 20 s are up.
    let got = tokio::time::timeout(Duration::from_secs(15), poll)
        .await
        .expect("the poll ended with the server")
        .unwrap();
    assert_eq!(got, json!({ "events": [] }));
    s.finish().await;
}

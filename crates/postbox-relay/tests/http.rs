//! The HTTP webhook sink against real HTTP receivers (axum on 127.0.0.1:0),
//! driven by the real relay on a per-test schema.

use crate::conformance::{self, Fixture, Reader, Received, Spec};
use crate::receiver::{Receiver, Reply, Request};
use crate::support::*;
use async_trait::async_trait;
use axum::http::Method;
use postbox::statements::trusted;
use postbox::verify::webhooks::{Headers, Secret, Verifier};
use postbox::NewEvent;
use postbox_relay::sinks::http::{HttpMode, HttpOptions, HttpSink};
use postbox_relay::sinks::SinkOptions;
use postbox_relay::{Outcome, Relay, RelayConfig, RunMode, Sink};
use postbox_testkit::{wait_for, TestDb};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

pub const SECRET_A: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
pub const SECRET_B: &str = "whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYX";

// ---------------------------------------------------------------------------
// Helpers.

pub fn sink_options(http: HttpOptions) -> SinkOptions {
    SinkOptions {
        source: "shop".into(),
        ..SinkOptions::default()
    }
    .with(http)
}

fn secrets(list: &[&str]) -> Vec<Secret> {
    list.iter().map(|s| Secret::parse(s).unwrap()).collect()
}

fn http_sink(url: &str, http: HttpOptions, signing: &[&str]) -> Arc<HttpSink> {
    Arc::new(HttpSink::new(url, sink_options(http), secrets(signing)).expect("a valid HTTP sink"))
}

async fn row(db: &TestDb, event_id: uuid::Uuid) -> (String, i32, Option<String>) {
    sqlx::query_as(trusted(&db.sql(
        "SELECT status::text, attempts, last_error FROM {schema}.outbox WHERE event_id = $1",
    )))
    .bind(event_id)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

fn verify(
    request: &Request,
    verifier: &Verifier,
) -> Result<(), postbox::verify::webhooks::VerifyError> {
    let headers = Headers::from_lookup(|name| request.header(name));
    verifier.verify(&headers, &request.body)
}

// ---------------------------------------------------------------------------
// Tests.

#[tokio::test]
async fn http_structured_mode_sends_cloudevents_and_forwards_headers() {
    let db = TestDb::new().await;
    let receiver = Receiver::start(|_, _| Reply::ok()).await;
    let events: Vec<NewEvent> = (0..20)
        .map(|i| {
            NewEvent::new(
                "order.created",
                "order",
                format!("o-{i}"),
                &serde_json::json!({"n": i}),
            )
            .unwrap()
            .headers([
                ("x-tenant", "acme".to_owned()),
                ("bad name", "skipped".to_owned()),
                ("x-multiline", "a\nb".to_owned()),
                ("content-type", "text/plain".to_owned()),
                ("x-request", format!("r{i}")),
            ])
            .unwrap()
        })
        .collect();
    let ids = db.enqueue_events(&events).await;
    let http = HttpOptions {
        headers: [("X-Api-Key".to_owned(), "static-key".to_owned())].into(),
        ..HttpOptions::default()
    };
    let sink = http_sink(&receiver.url("/hooks/orders?v=1"), http, &[]);
    let stats = drain(&db, sink, fast_config()).await;
    assert_eq!(stats.delivered, 20);

    let requests = receiver.requests();
    assert_eq!(requests.len(), 20, "one request per event, nothing retried");
    for r in &requests {
        assert_eq!(r.method, Method::POST);
        assert_eq!(r.path, "/hooks/orders?v=1");
        assert_eq!(
            r.header("content-type"),
            Some("application/cloudevents+json")
        );
        assert_eq!(r.header("x-tenant"), Some("acme"));
        assert_eq!(r.header("x-api-key"), Some("static-key"));
        assert!(
            r.header("x-multiline").is_none(),
            "invalid header values are skipped"
        );
        assert!(
            r.header("webhook-signature").is_none(),
            "no secret, no signature"
        );
        assert!(
            r.header("ce-id").is_none(),
            "no ce-* headers in structured mode"
        );
        let body = r.json();
        assert_eq!(body["specversion"], "1.0");
        assert_eq!(body["source"], "shop");
        assert_eq!(body["type"], "order.created");
        assert_eq!(body["aggregatetype"], "order");
        assert_eq!(body["datacontenttype"], "application/json");
        let subject = body["subject"].as_str().unwrap();
        let n: usize = subject.trim_start_matches("o-").parse().unwrap();
        assert_eq!(body["data"], serde_json::json!({"n": n}));
        assert_eq!(r.header("x-request"), Some(format!("r{n}").as_str()));
        let id: uuid::Uuid = body["id"].as_str().unwrap().parse().unwrap();
        assert_eq!(id, ids[n]);
        assert_eq!(
            r.header("webhook-id"),
            Some(id.to_string().as_str()),
            "signed or not"
        );
    }
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'sent'")
            .await,
        20
    );
    db.drop_schema().await;
}

/// A producer's credential headers are not carried to a third party's
/// endpoint unless the destination says so, nor the names it drops.
#[tokio::test]
async fn http_producer_credentials_are_not_forwarded_unless_allowed() {
    let db = TestDb::new().await;
    let event = || {
        NewEvent::new("order.created", "order", "1", &serde_json::json!({}))
            .unwrap()
            .headers([
                ("authorization", "Bearer internal-token".to_owned()),
                ("Cookie", "session=abc".to_owned()),
                ("x-internal-token", "t0k".to_owned()),
                ("x-tenant", "acme".to_owned()),
            ])
            .unwrap()
    };
    for forward in [false, true] {
        db.enqueue_events(&[event()]).await;
        let receiver = Receiver::start(|_, _| Reply::ok()).await;
        let http = HttpOptions {
            forward_credentials: forward,
            drop_headers: vec!["X-Internal-Token".to_owned()],
            ..HttpOptions::default()
        };
        let sink = http_sink(&receiver.url("/hooks"), http, &[]);
        let stats = drain(&db, sink, fast_config()).await;
        assert_eq!(stats.delivered, 1);
        let r = &receiver.requests()[0];
        assert_eq!(r.header("x-tenant"), Some("acme"));
        assert_eq!(r.header("x-internal-token"), None, "dropped by name");
        if forward {
            assert_eq!(r.header("authorization"), Some("Bearer internal-token"));
            assert_eq!(r.header("cookie"), Some("session=abc"));
        } else {
            assert_eq!(r.header("authorization"), None, "not for a third party");
            assert_eq!(r.header("cookie"), None);
        }
    }
    db.drop_schema().await;
}

#[tokio::test]
async fn http_binary_mode_sends_the_payload_and_ce_headers() {
    let db = TestDb::new().await;
    let receiver = Receiver::start(|_, _| Reply::ok()).await;
    let event = NewEvent::new(
        "order.paid",
        "order line",
        "o 1 \"ä\" 100%",
        &serde_json::json!({"total": 10, "currency": "EUR"}),
    )
    .unwrap()
    .schema_version(3)
    .unwrap();
    let id = db.enqueue_events(&[event]).await[0];
    let http = HttpOptions {
        mode: HttpMode::Binary,
        method: "put".into(),
        ..HttpOptions::default()
    };
    let sink = http_sink(&receiver.url("/in"), http, &[SECRET_A]);
    assert_eq!(drain(&db, sink, fast_config()).await.delivered, 1);

    let r = &receiver.requests()[0];
    assert_eq!(r.method, Method::PUT);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(
        r.json(),
        serde_json::json!({"total": 10, "currency": "EUR"})
    );
    assert_eq!(r.header("ce-specversion"), Some("1.0"));
    assert_eq!(r.header("ce-id"), Some(id.to_string().as_str()));
    assert_eq!(r.header("ce-source"), Some("shop"));
    assert_eq!(r.header("ce-type"), Some("order.paid"));
    assert_eq!(
        r.header("ce-subject"),
        Some("o%201%20%22%C3%A4%22%20100%25")
    );
    assert_eq!(r.header("ce-aggregatetype"), Some("order%20line"));
    assert_eq!(r.header("ce-schemaversion"), Some("3"));
    assert_eq!(r.header("ce-sequence"), Some("1"));
    let time = r.header("ce-time").unwrap();
    assert!(
        chrono::DateTime::parse_from_rfc3339(time).is_ok(),
        "ce-time is RFC 3339: {time}"
    );
    // The signature covers the bytes sent: the payload.
    assert_eq!(r.header("webhook-id"), Some(id.to_string().as_str()));
    verify(r, &Verifier::new(SECRET_A).unwrap()).expect("a valid signature");
    db.drop_schema().await;
}

#[tokio::test]
async fn http_signatures_verify_with_each_rotated_secret() {
    let db = TestDb::new().await;
    let receiver = Receiver::start(|_, _| Reply::ok()).await;
    let ids = enqueue(&db, 5).await;
    let sink = http_sink(
        &receiver.url("/signed"),
        HttpOptions::default(),
        &[SECRET_A, SECRET_B],
    );
    assert!(sink.describe().contains("signed(2)"));
    assert_eq!(drain(&db, sink, fast_config()).await.delivered, 5);

    let old = Verifier::new(SECRET_A).unwrap();
    let new = Verifier::new(SECRET_B).unwrap();
    let unrelated = Verifier::new("whsec_c2VjcmV0LWtleS10aGF0LWlzLW5vdC11c2Vk").unwrap();
    let requests = receiver.requests();
    assert_eq!(requests.len(), 5);
    for r in &requests {
        let signatures = r.header("webhook-signature").unwrap();
        assert_eq!(signatures.split(' ').count(), 2, "{signatures}");
        assert!(signatures.split(' ').all(|s| s.starts_with("v1,")));
        verify(r, &old).expect("verifies with the old secret");
        verify(r, &new).expect("verifies with the new secret");
        assert!(verify(r, &unrelated).is_err(), "an unrelated secret fails");
        let id: uuid::Uuid = r.header("webhook-id").unwrap().parse().unwrap();
        assert!(ids.contains(&id), "webhook-id is the event id");
        assert_eq!(r.json()["id"], id.to_string());
        let ts: i64 = r.header("webhook-timestamp").unwrap().parse().unwrap();
        assert!((chrono::Utc::now().timestamp() - ts).abs() < 60);
    }
    db.drop_schema().await;
}

#[tokio::test]
async fn http_retry_after_is_honoured_then_the_event_is_delivered() {
    let db = TestDb::new().await;
    let receiver = Receiver::start(|_, before| match before {
        0 => Reply::Status(503, vec![("retry-after", "1".into())], "busy".into()),
        _ => Reply::ok(),
    })
    .await;
    let id = enqueue(&db, 1).await[0];
    let sink = http_sink(&receiver.url("/"), HttpOptions::default(), &[]);
    let config = RelayConfig {
        backoff_max: Duration::from_secs(10),
        ..fast_config()
    };
    let stats = drain(&db, sink, config).await;
    assert_eq!((stats.delivered, stats.retried), (1, 1));
    let requests = receiver.requests();
    assert_eq!(requests.len(), 2);
    let waited = requests[1].at - requests[0].at;
    assert!(
        waited >= Duration::from_millis(900),
        "the retry came {waited:?} after the 503 asking for 1s"
    );
    let (status, attempts, _) = row(&db, id).await;
    assert_eq!((status.as_str(), attempts), ("sent", 2));
    db.drop_schema().await;
}

#[tokio::test]
async fn http_410_dead_letters_with_the_status_in_last_error() {
    let db = TestDb::new().await;
    let receiver = Receiver::start(|_, _| {
        Reply::Status(
            410,
            Vec::new(),
            format!("endpoint removed; token=abc123 {}", "x".repeat(2000)),
        )
    })
    .await;
    let id = enqueue(&db, 1).await[0];
    let sink = http_sink(&receiver.url("/gone"), HttpOptions::default(), &[]);
    let stats = drain(&db, sink, fast_config()).await;
    assert_eq!((stats.delivered, stats.dead_lettered), (0, 1));
    assert_eq!(receiver.count(), 1, "a 410 is not retried");
    let (status, attempts, error) = row(&db, id).await;
    let error = error.unwrap();
    assert_eq!((status.as_str(), attempts), ("failed", 1));
    assert!(error.starts_with("HTTP 410: endpoint removed"), "{error}");
    assert!(!error.contains("abc123"), "{error}");
    assert!(error.chars().count() <= 220, "{error}");
    db.drop_schema().await;
}

#[tokio::test]
async fn http_redirects_are_not_followed() {
    let receiver = Receiver::start(|r, _| {
        if r.path.starts_with("/moved") {
            Reply::Status(
                308,
                vec![("location", "/elsewhere?token=s3cret".into())],
                String::new(),
            )
        } else {
            Reply::ok()
        }
    })
    .await;
    let sink = http_sink(&receiver.url("/moved"), HttpOptions::default(), &[]);
    let batch = conformance::messages(3, 1);
    let outcomes = sink.publish(&batch).await;
    for o in &outcomes {
        match o {
            Outcome::Retry { error, .. } => {
                assert!(error.contains("HTTP 308"), "{error}");
                assert!(error.contains("redirects are not followed"), "{error}");
                assert!(!error.contains("s3cret"), "{error}");
            }
            other => panic!("expected a retry, got {other:?}"),
        }
    }
    assert_eq!(receiver.count(), 3);
    assert!(
        receiver.requests().iter().all(|r| r.path == "/moved"),
        "the Location was never requested"
    );
}

#[tokio::test]
async fn http_a_receiver_slower_than_the_lease_gets_the_same_webhook_id_again() {
    let db = TestDb::new().await;
    // The first attempt of each event is answered only after its redelivery.
    let receiver = Receiver::start(|_, before| match before {
        0 => Reply::HoldUntilRedelivered,
        _ => Reply::ok(),
    })
    .await;
    let ids = enqueue(&db, 3).await;
    let sink = http_sink(&receiver.url("/slow"), HttpOptions::default(), &[SECRET_A]);
    let config = RelayConfig {
        lease: Duration::from_secs(2),
        publish_timeout: Duration::from_millis(900),
        ..fast_config()
    };
    let relay = Relay::new(store(&db), sink, config).unwrap();
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let stop = stop.clone();
        async move { relay.run(RunMode::Forever, stop).await }
    });
    wait_for(
        "every event is sent after a redelivery",
        Duration::from_secs(60),
        || async {
            db.count("SELECT count(*) FROM {schema}.outbox WHERE status = 'sent'")
                .await
                == 3
        },
    )
    .await;
    stop.cancel();
    let stats = run.await.unwrap();
    assert_eq!(stats.delivered, 3);

    let verifier = Verifier::new(SECRET_A).unwrap();
    let requests = receiver.requests();
    for id in ids {
        let attempts: Vec<&Request> = requests
            .iter()
            .filter(|r| r.header("webhook-id") == Some(id.to_string().as_str()))
            .collect();
        assert!(
            attempts.len() >= 2,
            "{id} was delivered again: {}",
            attempts.len()
        );
        let first = attempts[0].at;
        let answered_later = attempts[1].at - first;
        assert!(
            answered_later > Duration::from_millis(500),
            "{answered_later:?}"
        );
        for r in attempts {
            verify(r, &verifier).expect("every attempt is signed");
        }
    }
    db.drop_schema().await;
}

#[tokio::test]
async fn http_concurrency_limit_is_respected() {
    let db = TestDb::new().await;
    let receiver =
        Receiver::start(|_, _| Reply::Slow(Duration::from_millis(20), Box::new(Reply::ok()))).await;
    enqueue(&db, 120).await;
    let http = HttpOptions {
        concurrency: 4,
        ..HttpOptions::default()
    };
    let sink = http_sink(&receiver.url("/"), http, &[]);
    let stats = drain(&db, sink, fast_config()).await;
    assert_eq!(stats.delivered, 120);
    let max = receiver.max_in_flight();
    assert!(max <= 4, "{max} requests were in flight at once");
    assert!(max >= 2, "requests ran concurrently: at most {max} at once");
    db.drop_schema().await;
}

#[tokio::test]
async fn http_rate_limit_spaces_requests() {
    let receiver = Receiver::start(|_, _| Reply::ok()).await;
    let http = HttpOptions {
        rate_per_second: Some(20.0),
        ..HttpOptions::default()
    };
    let sink = http_sink(&receiver.url("/"), http, &[]);
    // 20 requests use the bucket's burst; 10 more wait for new tokens (~0.5 s).
    let started = Instant::now();
    let outcomes = sink.publish(&conformance::messages(30, 3)).await;
    assert!(
        outcomes.iter().all(|o| *o == Outcome::Delivered),
        "{outcomes:?}"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn http_errors_and_descriptions_never_contain_credentials() {
    let receiver = Receiver::start(|_, _| Reply::Status(500, Vec::new(), "boom".into())).await;
    let url = receiver
        .url("/x?token=q-s3cret")
        .replace("http://", "http://hook-user:p-s3cret@");
    let sink = http_sink(&url, HttpOptions::default(), &[]);
    let outcomes = sink.publish(&conformance::messages(2, 1)).await;
    for o in &outcomes {
        let text = format!("{o:?}");
        assert!(matches!(o, Outcome::Retry { .. }), "{text}");
        assert!(text.contains("HTTP 500: boom"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
    }
    let auth = receiver.requests()[0]
        .header("authorization")
        .unwrap()
        .to_owned();
    assert!(auth.starts_with("Basic "), "user-info becomes Basic auth");
    assert!(!sink.describe().contains("s3cret"), "{}", sink.describe());

    // Nothing listens on this port any more: connection refused.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let url = format!("http://u:p-s3cret@{closed}/x?token=q-s3cret");
    let sink = http_sink(&url, HttpOptions::default(), &[]);
    let outcomes = sink.publish(&conformance::messages(1, 1)).await;
    let text = format!("{outcomes:?}");
    assert!(matches!(outcomes[0], Outcome::Retry { .. }), "{text}");
    assert!(text.contains("cannot connect"), "{text}");
    assert!(!text.contains("s3cret"), "{text}");
    let err = sink.check().await.unwrap_err().to_string();
    assert!(!err.contains("s3cret"), "{err}");
}

/// A receiver whose 401 echoes the bearer token it was sent: the dead
/// letter's stored `last_error` keeps the status and loses the token.
#[tokio::test]
async fn last_error_never_holds_an_echoed_bearer_token() {
    let db = TestDb::new().await;
    enqueue(&db, 2).await;
    let receiver = Receiver::start(|r, _| {
        let sent = r.header("authorization").unwrap_or("none").to_owned();
        Reply::Status(
            401,
            Vec::new(),
            format!("invalid credentials: Authorization: {sent}"),
        )
    })
    .await;
    let http = HttpOptions {
        headers: [(
            "Authorization".to_owned(),
            "Bearer tok-s3cret-42".to_owned(),
        )]
        .into(),
        ..HttpOptions::default()
    };
    let sink = http_sink(&receiver.url("/hooks"), http, &[]);
    let stats = drain(&db, sink, fast_config()).await;
    assert_eq!(stats.dead_lettered, 2);
    assert!(receiver.requests()[0]
        .header("authorization")
        .is_some_and(|a| a.contains("tok-s3cret-42")));
    let errors: Vec<String> = sqlx::query_scalar(trusted(
        &db.sql("SELECT last_error FROM {schema}.outbox WHERE status = 'failed'"),
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(errors.len(), 2);
    for e in &errors {
        assert!(e.contains("HTTP 401"), "{e}");
        assert!(!e.contains("tok-s3cret"), "{e}");
    }
    db.drop_schema().await;
}

#[tokio::test]
async fn http_check_accepts_any_answer() {
    let receiver = Receiver::start(|r, _| {
        if r.method == Method::HEAD {
            Reply::status(405)
        } else {
            Reply::ok()
        }
    })
    .await;
    let sink = http_sink(&receiver.url("/only-post"), HttpOptions::default(), &[]);
    sink.check()
        .await
        .expect("a 405 to HEAD still means reachable");
    let sink = http_sink(&receiver.url("/missing"), HttpOptions::default(), &[]);
    sink.check().await.expect("so does a 404");
}

#[tokio::test]
async fn http_sinks_are_built_from_urls() {
    let sink = postbox_relay::sinks::from_url(
        "https://example.com/hook",
        &sink_options(HttpOptions {
            secret_env: Some("POSTBOX_TEST_UNSET_WEBHOOK_SECRET_VARIABLE".into()),
            ..HttpOptions::default()
        }),
    );
    let err = sink
        .err()
        .expect("a named secret variable must be set")
        .to_string();
    assert!(
        err.contains("http.secret_env")
            && err.contains("POSTBOX_TEST_UNSET_WEBHOOK_SECRET_VARIABLE"),
        "{err}"
    );
    let err = postbox_relay::sinks::from_url(
        "https://example.com/hook",
        &sink_options(HttpOptions {
            concurrency: 5000,
            ..HttpOptions::default()
        }),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("http.concurrency: must be between 1 and 1024"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------
// The conformance suite, with a receiver as the "broker".

/// Reads what a [`Receiver`] answered 2xx, as the suite's messages.
pub struct ReceiverReader(pub Arc<Receiver>);

#[async_trait]
impl Reader for ReceiverReader {
    async fn received(&self) -> Vec<Received> {
        self.0
            .accepted()
            .into_iter()
            .filter(|r| r.method != Method::HEAD) // check()
            .map(|r| Received {
                message_id: r.header("webhook-id").map(str::to_owned),
                key: None,
                body: r.body.to_vec(),
            })
            .collect()
    }
}

#[tokio::test]
async fn http_passes_conformance() {
    let receiver = Arc::new(
        Receiver::start(|r, _| {
            let poisoned = serde_json::from_slice::<serde_json::Value>(&r.body)
                .is_ok_and(|b| b["type"] == "conformance.poison");
            if r.body.len() > 2 * 1024 * 1024 {
                Reply::Status(413, Vec::new(), "too large".into())
            } else if poisoned {
                Reply::Status(422, Vec::new(), "unknown event type".into())
            } else {
                Reply::ok()
            }
        })
        .await,
    );
    let spec = Spec {
        name: "http",
        broker: receiver.url("").trim_start_matches("http://").to_owned(),
        max_payload: conformance::MAX_PAYLOAD,
        // Over the receiver's 2 MiB limit: 413.
        oversize: Some(3 * 1024 * 1024),
        keyed: false,
        poison: Some(|m| m.event_type = "conformance.poison".into()),
        outage: true,
        hang_deadline: Some(Duration::from_secs(20)),
    };
    let reader = ReceiverReader(receiver.clone());
    conformance::run(spec, |proxy| async move {
        let url = format!("http://hook:conf-s3cret@{proxy}/conformance");
        // Requests must start within half of it: 500 events over 7
        // aggregates are 7 lanes of ~70 requests, one after the other.
        let http = HttpOptions {
            timeout: Duration::from_secs(5),
            ..HttpOptions::default()
        };
        let sink: Arc<dyn Sink> = http_sink(&url, http, &[SECRET_A]);
        Fixture {
            sink,
            reader: Box::new(reader),
            secret: Some("conf-s3cret".into()),
            switch: None,
        }
    })
    .await;
}

/// `cargo test --release -p postbox-relay --test main -- --ignored http_throughput --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, not a check"]
async fn http_throughput() {
    const EVENTS: usize = 20_000;
    let receiver = Receiver::start(|_, _| Reply::ok()).await;
    for (mode, concurrency, signed) in [
        (HttpMode::Structured, 16, false),
        (HttpMode::Structured, 64, true),
    ] {
        let db = TestDb::new().await;
        enqueue(&db, EVENTS).await;
        let http = HttpOptions {
            mode,
            concurrency,
            ..HttpOptions::default()
        };
        let signing: &[&str] = if signed { &[SECRET_A] } else { &[] };
        let sink = http_sink(&receiver.url("/throughput"), http, signing);
        let config = RelayConfig {
            batch_size: 500,
            ..fast_config()
        };
        let started = Instant::now();
        let stats = drain(&db, sink, config).await;
        let elapsed = started.elapsed();
        assert_eq!(stats.delivered as usize, EVENTS);
        println!(
            "http ({mode:?}, concurrency {concurrency}, signed {signed}): {EVENTS} events in {elapsed:.2?}: {:.0} events/s",
            EVENTS as f64 / elapsed.as_secs_f64()
        );
        db.drop_schema().await;
    }
}

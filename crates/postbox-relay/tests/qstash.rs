//! The QStash sink against `postbox_testkit::qstash::QstashServer` (a
//! QStash-compatible server started per test), whose deliveries go to a
//! receiver started by the test, driven by the real relay.

use crate::conformance::{self, Fixture, Reader, Received, Spec};
use crate::receiver::{Receiver, Reply, Request};
use crate::support::*;
use async_trait::async_trait;
use postbox::statements::trusted;
use postbox::verify::qstash::Verifier;
use postbox::NewEvent;
use postbox_relay::sinks::qstash::{FlowControl, QstashCredentials, QstashOptions, QstashSink};
use postbox_relay::sinks::SinkOptions;
use postbox_relay::{Outcome, RelayConfig, Sink};
use postbox_testkit::qstash::{Endpoint, EntryAnswer, Failure, QstashServer};
use postbox_testkit::{wait_for, TestDb};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

fn qstash_sink(server: &QstashServer, destination: &str, qstash: QstashOptions) -> Arc<QstashSink> {
    let options = SinkOptions {
        source: "shop".into(),
        ..SinkOptions::default()
    }
    .with(qstash);
    let credentials = QstashCredentials::new(server.token(), server.url());
    Arc::new(
        QstashSink::new(&format!("qstash:{destination}"), options, credentials)
            .expect("a valid QStash sink"),
    )
}

/// Check every delivery the receiver got against a current and a next signing key.
fn verify_deliveries(requests: &[Request], keys: (&str, &str), destination: &str) {
    let verifier = Verifier::new(keys.0, Some(keys.1))
        .unwrap()
        .with_expected_url(destination);
    for r in requests {
        let claims = verifier
            .verify(r.header("upstash-signature"), &r.body)
            .unwrap_or_else(|e| panic!("delivery {:?} does not verify: {e}", r.id()));
        assert_eq!(claims.sub.as_deref(), Some(destination));
        assert_eq!(r.header("user-agent"), Some("Upstash-QStash"));
    }
}

#[tokio::test]
async fn qstash_publishes_one_event_and_its_delivery_verifies() {
    let db = TestDb::new().await;
    let server = QstashServer::start().await;
    let receiver = Receiver::start(|_, _| Reply::ok()).await;
    let destination = receiver.url("/hooks/qstash");
    let event = NewEvent::new(
        "order.created",
        "order",
        "o-1",
        &serde_json::json!({"total": 5}),
    )
    .unwrap()
    .headers([("x-tenant", "acme"), ("upstash-signature", "forged")])
    .unwrap();
    let id = db.enqueue_events(&[event]).await[0];
    let qstash = QstashOptions {
        retries: Some(2),
        forward_headers: [("X-Static".to_owned(), "yes".to_owned())].into(),
        flow_control: Some(FlowControl {
            key: "orders".into(),
            parallelism: Some(4),
            rate: None,
            period: None,
        }),
        ..QstashOptions::default()
    };
    let sink = qstash_sink(&server, &destination, qstash);
    sink.check().await.expect("the token is accepted");
    assert_eq!(drain(&db, sink, fast_config()).await.delivered, 1);

    let published = server.published();
    assert_eq!(published.len(), 1);
    let p = &published[0];
    assert_eq!(p.endpoint, Endpoint::Publish);
    assert_eq!(p.destination, destination);
    assert_eq!(
        p.header("upstash-deduplication-id"),
        Some(id.to_string().as_str())
    );
    assert_eq!(
        p.header("content-type"),
        Some("application/cloudevents+json")
    );
    assert_eq!(p.header("upstash-retries"), Some("2"));
    assert_eq!(p.header("upstash-flow-control-key"), Some("orders"));
    assert_eq!(
        p.header("upstash-flow-control-value"),
        Some("parallelism=4")
    );
    assert_eq!(p.header("upstash-forward-x-tenant"), Some("acme"));
    assert_eq!(p.header("upstash-forward-x-static"), Some("yes"));
    assert!(p.header("upstash-forward-upstash-signature").is_none());
    let body: serde_json::Value = serde_json::from_slice(&p.body).unwrap();
    assert_eq!(body["id"], id.to_string());
    assert_eq!(body["source"], "shop");
    assert_eq!(body["data"], serde_json::json!({"total": 5}));

    wait_for(
        "QStash delivers the message",
        Duration::from_secs(10),
        || async { receiver.count() == 1 },
    )
    .await;
    let delivered = receiver.requests();
    let r = &delivered[0];
    assert_eq!(r.body, p.body, "the body arrives as published");
    assert_eq!(
        r.header("x-tenant"),
        Some("acme"),
        "the Upstash-Forward- prefix is stripped"
    );
    assert_eq!(r.header("x-static"), Some("yes"));
    assert_eq!(
        r.header("content-type"),
        Some("application/cloudevents+json")
    );
    let keys = (server.current_signing_key(), server.next_signing_key());
    verify_deliveries(&delivered, (&keys.0, &keys.1), &destination);
    db.drop_schema().await;
}

#[tokio::test]
async fn qstash_batches_many_events_and_every_delivery_verifies() {
    let db = TestDb::new().await;
    let server = QstashServer::start().await;
    let receiver = Receiver::start(|_, _| Reply::ok()).await;
    let destination = receiver.url("/batch?tenant=acme");
    let ids = enqueue(&db, 250).await;
    let sink = qstash_sink(&server, &destination, QstashOptions::default());
    let sink_after = sink.clone();
    let config = RelayConfig {
        batch_size: 250,
        ..fast_config()
    };
    assert_eq!(drain(&db, sink, config).await.delivered, 250);

    let calls = server.calls();
    let sizes: Vec<usize> = calls.iter().map(|c| c.entries.len()).collect();
    assert!(
        calls
            .iter()
            .all(|c| c.endpoint == Endpoint::Batch && c.status == 200),
        "a destination with a query goes through /v2/batch: {calls:?}"
    );
    assert_eq!(sizes, vec![100, 100, 50], "at most 100 entries per request");
    let published: HashSet<String> = server
        .published()
        .iter()
        .map(|p| p.header("upstash-deduplication-id").unwrap().to_owned())
        .collect();
    let want: HashSet<String> = ids.iter().map(|id| id.to_string()).collect();
    assert_eq!(published, want);

    wait_for(
        "QStash delivers all 250",
        Duration::from_secs(30),
        || async { receiver.count() >= 250 },
    )
    .await;
    // The keys rotate; a receiver holding the (old) current and next key
    // accepts deliveries signed before and after the rotation.
    let keys = (server.current_signing_key(), server.next_signing_key());
    server.rotate_signing_keys();
    let more = conformance::messages(5, 5);
    assert_eq!(sink_after.publish(&more).await, vec![Outcome::Delivered; 5]);
    wait_for(
        "QStash delivers 5 more",
        Duration::from_secs(30),
        || async { receiver.count() >= 255 },
    )
    .await;
    let delivered = receiver.requests();
    assert_eq!(delivered.len(), 255, "each message delivered once");
    assert!(delivered.iter().all(|r| r.path == "/batch?tenant=acme"));
    verify_deliveries(&delivered, (&keys.0, &keys.1), &destination);
    let old_key_only = Verifier::new(&keys.0, None).unwrap();
    for (i, r) in delivered.iter().enumerate() {
        let verified = old_key_only.verify(r.header("upstash-signature"), &r.body);
        assert_eq!(
            verified.is_ok(),
            i < 250,
            "delivery {i} is signed with the key of its time"
        );
    }
    db.drop_schema().await;
}

#[tokio::test]
async fn qstash_answers_a_duplicate_with_202_and_it_counts_as_delivered() {
    let server = QstashServer::start().await;
    let receiver = Receiver::start(|_, _| Reply::ok()).await;
    let sink = qstash_sink(&server, &receiver.url("/dup"), QstashOptions::default());
    let batch = conformance::messages(3, 3);

    assert_eq!(sink.publish(&batch[..1]).await, vec![Outcome::Delivered]);
    // The relay retries after an ambiguous failure: same event id.
    assert_eq!(sink.publish(&batch[..1]).await, vec![Outcome::Delivered]);
    assert_eq!(sink.publish(&batch).await, vec![Outcome::Delivered; 3]);

    let calls = server.calls();
    assert_eq!(calls[0].status, 201);
    assert!(matches!(calls[0].entries[0], EntryAnswer::New(_)));
    assert_eq!(calls[1].status, 202, "a duplicate publish: {:?}", calls[1]);
    assert_eq!(
        calls[1].entries[0],
        EntryAnswer::Duplicate(match &calls[0].entries[0] {
            EntryAnswer::New(id) => id.clone(),
            other => panic!("{other:?}"),
        })
    );
    assert_eq!(calls[2].endpoint, Endpoint::Batch);
    assert!(matches!(calls[2].entries[0], EntryAnswer::Duplicate(_)));
    assert!(matches!(calls[2].entries[1], EntryAnswer::New(_)));
    assert_eq!(server.published().len(), 3, "each event enqueued once");
    wait_for("three deliveries", Duration::from_secs(10), || async {
        receiver.count() == 3
    })
    .await;
}

#[tokio::test]
async fn qstash_rejects_a_refused_token_naming_qstash_token() {
    let db = TestDb::new().await;
    let server = QstashServer::start().await;
    let wrong = "wrong-token-value-123";
    let options = SinkOptions::default();
    let sink = Arc::new(
        QstashSink::new(
            "qstash:https://example.com/hook",
            options,
            QstashCredentials::new(wrong, server.url()),
        )
        .unwrap(),
    );
    let err = sink.check().await.unwrap_err().to_string();
    assert!(
        err.contains("QSTASH_TOKEN") && !err.contains(wrong),
        "{err}"
    );

    let id = enqueue(&db, 1).await[0];
    let stats = drain(&db, sink.clone(), fast_config()).await;
    assert_eq!((stats.delivered, stats.dead_lettered), (0, 1));
    let (status, error): (String, String) = sqlx::query_as(trusted(
        &db.sql("SELECT status::text, last_error FROM {schema}.outbox WHERE event_id = $1"),
    ))
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(status, "failed");
    assert!(
        error.contains("HTTP 401") && error.contains("QSTASH_TOKEN"),
        "{error}"
    );
    assert!(!error.contains(wrong));
    // A batch is refused the same way.
    for o in sink.publish(&conformance::messages(3, 1)).await {
        assert!(
            matches!(&o, Outcome::Reject { error } if error.contains("QSTASH_TOKEN")),
            "{o:?}"
        );
    }
    assert!(server.published().is_empty());

    // The switch: the right token, refused for a while.
    server.fail_next(1, Failure::Unauthorized);
    let good = qstash_sink(
        &server,
        "https://example.com/hook",
        QstashOptions::default(),
    );
    let outcome = good.publish(&conformance::messages(1, 1)).await;
    assert!(matches!(&outcome[0], Outcome::Reject { error } if error.contains("QSTASH_TOKEN")));

    if std::env::var_os("QSTASH_TOKEN").is_none() {
        let err = postbox_relay::sinks::from_url(
            "qstash:https://example.com/hook",
            &SinkOptions::default(),
        )
        .err()
        .expect("no token in the environment")
        .to_string();
        assert!(err.contains("QSTASH_TOKEN is not set"), "{err}");
    }
    db.drop_schema().await;
}

#[tokio::test]
async fn qstash_429_is_retried_after_the_reset() {
    let db = TestDb::new().await;
    let server = QstashServer::start().await;
    let sink = qstash_sink(
        &server,
        "https://example.com/hook",
        QstashOptions::default(),
    );

    server.fail_next(
        1,
        Failure::RateLimited {
            reset_in: Duration::from_secs(2),
        },
    );
    let outcomes = sink.publish(&conformance::messages(1, 1)).await;
    match &outcomes[0] {
        Outcome::Retry { error, after } => {
            assert!(error.contains("HTTP 429"), "{error}");
            let after = after.expect("a delay from Burst-RateLimit-Reset");
            assert!(
                after >= Duration::from_millis(500) && after <= Duration::from_secs(2),
                "{after:?}"
            );
        }
        other => panic!("expected a retry, got {other:?}"),
    }

    // Through the relay: the batch is limited once, retried after the reset, delivered.
    let ids = enqueue(&db, 30).await;
    server.fail_next(
        1,
        Failure::RateLimited {
            reset_in: Duration::from_secs(1),
        },
    );
    let config = RelayConfig {
        backoff_max: Duration::from_secs(10),
        ..fast_config()
    };
    let stats = drain(&db, sink, config).await;
    assert_eq!((stats.delivered, stats.retried), (30, 30));
    let accepted: HashSet<String> = server
        .published()
        .iter()
        .filter_map(|p| p.header("upstash-deduplication-id").map(str::to_owned))
        .collect();
    assert!(ids.iter().all(|id| accepted.contains(&id.to_string())));
    let statuses: Vec<u16> = server.calls().iter().map(|c| c.status).collect();
    assert_eq!(statuses, vec![429, 429, 200], "{statuses:?}");
    db.drop_schema().await;
}

#[tokio::test]
async fn qstash_500_is_retried() {
    let db = TestDb::new().await;
    let server = QstashServer::start().await;
    let sink = qstash_sink(
        &server,
        "https://example.com/hook",
        QstashOptions::default(),
    );
    server.fail_next(2, Failure::ServerError);
    enqueue(&db, 1).await;
    let stats = drain(&db, sink, fast_config()).await;
    assert_eq!((stats.delivered, stats.retried), (1, 2));
    let statuses: Vec<u16> = server.calls().iter().map(|c| c.status).collect();
    assert_eq!(statuses, vec![500, 500, 201]);
    db.drop_schema().await;
}

// ---------------------------------------------------------------------------
// The conformance suite, with the QStash server as the broker.

struct QstashReader(Arc<QstashServer>);

#[async_trait]
impl Reader for QstashReader {
    async fn received(&self) -> Vec<Received> {
        self.0
            .published()
            .into_iter()
            .map(|p| Received {
                message_id: p.header("upstash-deduplication-id").map(str::to_owned),
                key: None,
                body: p.body,
            })
            .collect()
    }
}

#[tokio::test]
async fn qstash_passes_conformance() {
    let server = Arc::new(QstashServer::start().await);
    let receiver = Receiver::start(|_, _| Reply::ok()).await;
    let destination = receiver.url("/conformance");
    let spec = Spec {
        name: "qstash",
        broker: server.addr().to_string(),
        max_payload: conformance::MAX_PAYLOAD,
        // Over the test server's 2 MiB message limit: 413.
        oversize: Some(3 * 1024 * 1024),
        keyed: false,
        poison: None,
        outage: true,
        hang_deadline: Some(Duration::from_secs(20)),
    };
    let token = server.token().to_owned();
    let reader = QstashReader(server.clone());
    conformance::run(spec, |proxy| async move {
        let options = SinkOptions::default().with(QstashOptions {
            // Requests must start within half of it (5 batch requests
            // for the suite's 500 events).
            request_timeout: Duration::from_secs(4),
            ..QstashOptions::default()
        });
        let credentials = QstashCredentials::new(token.clone(), format!("http://{proxy}"));
        let sink: Arc<dyn Sink> = Arc::new(
            QstashSink::new(&format!("qstash:{destination}"), options, credentials).unwrap(),
        );
        Fixture {
            sink,
            reader: Box::new(reader),
            secret: Some(token),
            switch: None,
        }
    })
    .await;
}

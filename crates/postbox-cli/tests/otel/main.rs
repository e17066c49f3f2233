//! OpenTelemetry: one trace from a producer's request, through `postbox
//! relay` (exporting over OTLP/HTTP to a receiver this test runs), to a
//! consumer's `record_inbox`; and no export unless the environment asks.
//!
//! A test binary of its own: the producer's and consumer's spans are
//! recorded by a subscriber installed as the process's global default before
//! any span is made, so every callsite of the library registers with it. (A
//! thread-scoped subscriber in the shared test binary missed the library's
//! `enqueue` span now and then: another test's thread could register the
//! callsite first, with no subscriber to be interested in it.)

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use postbox::{NewEvent, Outbox};
use postbox_testkit::{redis, redis_url, unique, wait_for, TestDb};
use redis::AsyncCommands;
use std::sync::OnceLock;
use std::time::Duration;
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;

#[path = "../common/otlp.rs"]
mod otlp;
use otlp::{Receiver, Seen};

/// `postbox relay --drain` to a Redis list, with `env` added to a
/// environment free of `OTEL_*`; returns its stderr.
async fn relay_drain(db: &TestDb, key: &str, env: &[(&str, &str)]) -> String {
    let sink = format!("{}?key={key}", redis_url());
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_postbox"));
    command
        .args(["relay", "--sink", &sink, "--drain"])
        .env("DATABASE_URL", &db.url)
        .env("POSTBOX_SCHEMA", db.schema.name())
        .env("POSTBOX_LOG", "info")
        .env_remove("POSTBOX_CONFIG")
        .env_remove("POSTBOX_SINK");
    for (name, _) in std::env::vars() {
        if name.starts_with("OTEL_") {
            command.env_remove(name);
        }
    }
    command.envs(env.iter().copied());
    let out = command.output().await.expect("run postbox relay");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "relay failed: {stderr}");
    stderr
}

/// The test process's own spans (producer and consumer), kept in memory by
/// the global subscriber, installed once for the whole binary.
fn tracing_in_memory() -> &'static (InMemorySpanExporter, SdkTracerProvider) {
    static KEPT: OnceLock<(InMemorySpanExporter, SdkTracerProvider)> = OnceLock::new();
    KEPT.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::set_global_default(subscriber)
            .expect("the only global subscriber of this test binary");
        (exporter, provider)
    })
}

fn from_sdk(span: &opentelemetry_sdk::trace::SpanData) -> Seen {
    Seen {
        name: span.name.to_string(),
        trace_id: span.span_context.trace_id().to_string(),
        span_id: span.span_context.span_id().to_string(),
        parent_span_id: span.parent_span_id.to_string(),
        attributes: span
            .attributes
            .iter()
            .map(|kv| (kv.key.to_string(), kv.value.to_string()))
            .collect(),
        links: span
            .links
            .iter()
            .map(|l| l.span_context.span_id().to_string())
            .collect(),
        service: String::new(),
    }
}

#[track_caller]
fn one<'a>(spans: &'a [Seen], what: &str, matches: impl Fn(&Seen) -> bool) -> &'a Seen {
    let found: Vec<&Seen> = spans.iter().filter(|s| matches(s)).collect();
    assert_eq!(found.len(), 1, "expected one {what} span among {spans:#?}");
    found[0]
}

#[tokio::test]
async fn one_trace_runs_from_the_producers_request_through_the_relay_to_the_consumer() {
    let receiver = Receiver::start().await;
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let (memory, provider) = tracing_in_memory();

    // The producer: an event enqueued while handling a request.
    let request = tracing::info_span!("handle_order");
    let event =
        NewEvent::new("order.placed", "order", "o-1", &serde_json::json!({"n": 1})).unwrap();
    let event_id = async {
        let mut tx = db.pool.begin().await.unwrap();
        let id = postbox::sqlx::enqueue(&outbox, &mut tx, &event)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        id
    }
    .instrument(request.clone())
    .await;
    drop(request);
    let id = event_id.to_string();

    // The relay: a separate process exporting to the receiver.
    let key = unique("otel:");
    let stderr = relay_drain(
        &db,
        &key,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint.as_str()),
            ("OTEL_SERVICE_NAME", "relay-under-test"),
        ],
    )
    .await;
    assert!(
        stderr.contains("exporting OpenTelemetry traces over OTLP/HTTP"),
        "{stderr}"
    );

    // The consumer: takes the delivery from Redis, records it in the inbox
    // under a span continuing the context the delivery carries.
    let mut redis = redis().await;
    let body: String = redis.rpop(&key, None).await.unwrap();
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["id"], id);
    let traceparent = body["traceparent"]
        .as_str()
        .expect("a traceparent attribute");
    let consumer = postbox::otel::receive_span("billing", event_id, Some(traceparent), None);
    async {
        let mut tx = db.pool.begin().await.unwrap();
        let outcome = postbox::sqlx::record_inbox(&outbox, &mut tx, "billing", event_id)
            .await
            .unwrap();
        assert!(outcome.is_new());
        tx.commit().await.unwrap();
    }
    .instrument(consumer.clone())
    .await;
    drop(consumer);

    // The relay flushed before it exited; wait for the receiver to hold it.
    wait_for("the relay's publish span", Duration::from_secs(30), || {
        let found = receiver
            .spans()
            .iter()
            .any(|s| s.attribute("messaging.message.id") == Some(id.as_str()));
        async move { found }
    })
    .await;
    let _ = provider.force_flush();
    let local: Vec<Seen> = memory
        .get_finished_spans()
        .unwrap()
        .iter()
        .map(from_sdk)
        .collect();
    let relay = receiver.spans();

    let request = one(&local, "request", |s| s.name == "handle_order");
    let enqueue = one(&local, "enqueue", |s| {
        s.name == format!("enqueue {}", db.schema)
    });
    let receive = one(&local, "receive", |s| s.name == "receive billing");
    let inbox = one(&local, "record_inbox", |s| s.name == "record_inbox billing");
    let publish = one(&relay, "per-event publish", |s| {
        s.name.starts_with("publish ") && s.attribute("messaging.message.id") == Some(id.as_str())
    });
    let claim = one(&relay, "claim", |s| {
        s.name == format!("claim {}", db.schema)
    });
    let settle = one(&relay, "settle", |s| {
        s.name == format!("settle {}", db.schema)
    });

    // One trace: request → enqueue → relay publish → receive → record_inbox.
    let trace = &request.trace_id;
    for span in [enqueue, publish, receive, inbox] {
        assert_eq!(&span.trace_id, trace, "{span:#?}");
    }
    assert_eq!(enqueue.parent_span_id, request.span_id);
    assert_eq!(publish.parent_span_id, enqueue.span_id, "{publish:#?}");
    assert_eq!(receive.parent_span_id, publish.span_id);
    assert_eq!(inbox.parent_span_id, receive.span_id);
    // The delivery carried the relay's publish span, not the producer's.
    assert_eq!(&traceparent[36..52], publish.span_id);

    // Attributes after the messaging conventions.
    assert_eq!(
        enqueue.attribute("messaging.operation.type"),
        Some("create")
    );
    assert_eq!(enqueue.attribute("messaging.message.id"), Some(id.as_str()));
    assert_eq!(publish.attribute("messaging.system"), Some("postbox"));
    assert_eq!(
        publish.attribute("messaging.operation.type"),
        Some("publish")
    );
    assert_eq!(
        receive.attribute("messaging.operation.type"),
        Some("receive")
    );
    assert_eq!(inbox.attribute("messaging.operation.type"), Some("process"));
    // The batch spans live in the relay's own trace, linked to the event.
    for batch in [claim, settle] {
        assert_eq!(batch.attribute("messaging.batch.message_count"), Some("1"));
        assert!(batch.links.contains(&enqueue.span_id), "{batch:#?}");
    }
    assert_eq!(settle.attribute("messaging.operation.type"), Some("settle"));
    assert_eq!(publish.service, "relay-under-test");
    db.drop_schema().await;
}

#[tokio::test]
async fn nothing_is_exported_unless_the_environment_asks() {
    // Whichever test starts first installs the global subscriber before any
    // span is made.
    tracing_in_memory();
    let receiver = Receiver::start().await;
    let db = TestDb::new().await;
    let key = unique("otel:");
    let event = NewEvent::new("order.placed", "order", "o-1", &serde_json::json!({})).unwrap();

    // No OTEL_* at all: no exporter starts.
    db.enqueue_events(std::slice::from_ref(&event)).await;
    let stderr = relay_drain(&db, &key, &[]).await;
    assert!(!stderr.contains("OpenTelemetry"), "{stderr}");

    // An endpoint, but the SDK switched off: the relay delivers and exits
    // (an exporter would have flushed by then) and the receiver got nothing.
    let event = NewEvent::new("order.placed", "order", "o-2", &serde_json::json!({})).unwrap();
    db.enqueue_events(std::slice::from_ref(&event)).await;
    let stderr = relay_drain(
        &db,
        &key,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint.as_str()),
            ("OTEL_SDK_DISABLED", "true"),
        ],
    )
    .await;
    assert!(!stderr.contains("OpenTelemetry"), "{stderr}");
    let mut redis = redis().await;
    let delivered: usize = redis.llen(&key).await.unwrap();
    assert_eq!(delivered, 2, "both relays delivered");
    assert_eq!(receiver.requests(), 0);

    // The same run with the SDK on exports: the check above can fail.
    let event = NewEvent::new("order.placed", "order", "o-3", &serde_json::json!({})).unwrap();
    db.enqueue_events(std::slice::from_ref(&event)).await;
    relay_drain(
        &db,
        &key,
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint.as_str())],
    )
    .await;
    assert!(receiver.requests() > 0);
    let _: () = redis.del(&key).await.unwrap();
    db.drop_schema().await;
}

//! The RabbitMQ sink against the local broker: the conformance suite,
//! unroutable messages, message properties, and a throughput probe.

use crate::conformance::{self, Fixture, Reader, Received, Spec};
use async_trait::async_trait;
use lapin::options::{
    BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use postbox_relay::sinks::amqp::AmqpSink;
use postbox_relay::sinks::SinkOptions;
use postbox_relay::{Outcome, Sink, SinkError};
use std::time::Duration;
use tokio::sync::Mutex;

/// The RabbitMQ broker tests run against (`HOST:PORT`, user guest/guest).
fn broker() -> String {
    std::env::var("POSTBOX_TEST_AMQP").unwrap_or_else(|_| "127.0.0.1:5672".to_owned())
}

/// A topic exchange with one queue bound to `binding`, read with basic.get.
struct QueueReader {
    _connection: Connection,
    channel: Channel,
    exchange: String,
    queue: String,
    read: Mutex<Vec<Received>>,
    /// Every delivery's properties, for property checks.
    properties: Mutex<Vec<lapin::BasicProperties>>,
}

impl QueueReader {
    async fn new(exchange: &str, binding: &str) -> Self {
        let connection = Connection::connect(
            &format!("amqp://guest:guest@{}/%2f", broker()),
            ConnectionProperties::default(),
        )
        .await
        .expect("connect to RabbitMQ (is rabbitmq-server running? see DEVELOPERS.md)");
        let channel = connection.create_channel().await.expect("a channel");
        channel
            .exchange_declare(
                ShortString::from(exchange),
                ExchangeKind::Topic,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("declare the test exchange");
        let queue = format!("{exchange}.q");
        channel
            .queue_declare(
                ShortString::from(queue.as_str()),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("declare the test queue");
        channel
            .queue_bind(
                ShortString::from(queue.as_str()),
                ShortString::from(exchange),
                ShortString::from(binding),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind the test queue");
        Self {
            _connection: connection,
            channel,
            exchange: exchange.to_owned(),
            queue,
            read: Mutex::new(Vec::new()),
            properties: Mutex::new(Vec::new()),
        }
    }
}

#[async_trait]
impl Reader for QueueReader {
    async fn received(&self) -> Vec<Received> {
        let mut read = self.read.lock().await;
        let mut properties = self.properties.lock().await;
        while let Some(got) = self
            .channel
            .basic_get(
                ShortString::from(self.queue.as_str()),
                BasicGetOptions { no_ack: true },
            )
            .await
            .expect("basic.get")
        {
            let delivery = got.delivery;
            read.push(Received {
                message_id: delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.to_string()),
                key: None,
                body: delivery.data,
            });
            properties.push(delivery.properties);
        }
        read.clone()
    }

    async fn cleanup(&self) {
        let _ = self
            .channel
            .queue_delete(
                ShortString::from(self.queue.as_str()),
                QueueDeleteOptions::default(),
            )
            .await;
        let _ = self
            .channel
            .exchange_delete(
                ShortString::from(self.exchange.as_str()),
                ExchangeDeleteOptions::default(),
            )
            .await;
    }
}

fn sink(url: &str) -> AmqpSink {
    AmqpSink::from_url(url, SinkOptions::default()).expect("a valid AMQP sink URL")
}

#[tokio::test]
async fn amqp_passes_conformance() {
    let exchange = postbox_testkit::unique("conformance.");
    let spec = Spec {
        name: "amqp",
        broker: broker(),
        max_payload: conformance::MAX_PAYLOAD,
        oversize: None,
        keyed: false,
        // Only `conformance.#` is bound: any other routing key is returned.
        poison: Some(|m| m.event_type = "nobody.listens".into()),
        outage: true,
        hang_deadline: Some(Duration::from_secs(10)),
    };
    let reader = QueueReader::new(&exchange, "conformance.#").await;
    conformance::run(spec, |proxy| async move {
        let url = format!("amqp://guest:guest@{proxy}/%2f?exchange={exchange}&timeout=2s");
        let sink = postbox_relay::sinks::from_url(&url, &SinkOptions::default())
            .expect("a valid AMQP sink URL");
        Fixture {
            sink,
            reader: Box::new(reader),
            // No outcome or description may name the credentials.
            secret: Some("guest".into()),
            switch: None,
        }
    })
    .await;
}

#[tokio::test]
async fn amqp_sets_properties_and_cloudevents_headers() {
    let exchange = postbox_testkit::unique("props.");
    let reader = QueueReader::new(&exchange, "#").await;
    let s = sink(&format!(
        "amqp://{}?exchange={exchange}&routing_key={{aggregate_type}}.{{aggregate_id}}",
        broker()
    ));
    s.check().await.expect("the exchange exists");
    let batch = conformance::messages(1, 1);
    assert_eq!(s.publish(&batch).await, vec![Outcome::Delivered]);
    let m = &batch[0];
    let id = m.event_id.hyphenated().to_string();
    postbox_testkit::wait_for("the message arrives", Duration::from_secs(10), || async {
        !reader.received().await.is_empty()
    })
    .await;
    let properties = reader.properties.lock().await[0].clone();
    assert_eq!(
        properties.message_id().as_ref().map(|s| s.as_str()),
        Some(id.as_str())
    );
    assert_eq!(properties.delivery_mode(), &Some(2));
    assert_eq!(
        properties.content_type().as_ref().map(|s| s.as_str()),
        Some("application/cloudevents+json")
    );
    assert_eq!(
        properties.kind().as_ref().map(|s| s.as_str()),
        Some("conformance.item.created")
    );
    let headers = properties
        .headers()
        .clone()
        .expect("headers")
        .inner()
        .clone();
    let text = |name: &str| match headers.get(name) {
        Some(AMQPValue::LongString(s)) => s.to_string(),
        other => panic!("header {name}: {other:?}"),
    };
    assert_eq!(text("cloudEvents_id"), id);
    assert_eq!(text("cloudEvents_type"), "conformance.item.created");
    assert_eq!(text("cloudEvents_source"), "postbox");
    assert_eq!(text("cloudEvents_subject"), "agg-0");
    assert_eq!(text("cloudEvents_aggregatetype"), "item");
    assert_eq!(text("x-conformance"), "m0");
    assert_eq!(
        headers.get("cloudEvents_schemaversion"),
        Some(&AMQPValue::LongInt(1))
    );
    reader.cleanup().await;
}

#[tokio::test]
async fn amqp_unroutable_is_a_reject_or_a_retry_as_configured() {
    let exchange = postbox_testkit::unique("unroutable.");
    let reader = QueueReader::new(&exchange, "bound.#").await;
    let batch = conformance::messages(1, 1);

    let rejecting = sink(&format!("amqp://{}?exchange={exchange}", broker()));
    match &rejecting.publish(&batch).await[0] {
        Outcome::Reject { error } => assert!(
            error.contains("unroutable") && error.contains("NO_ROUTE"),
            "{error}"
        ),
        other => panic!("expected a reject, got {other:?}"),
    }
    let retrying = sink(&format!(
        "amqp://{}?exchange={exchange}&unroutable=retry",
        broker()
    ));
    assert!(
        matches!(&retrying.publish(&batch).await[0], Outcome::Retry { error, .. } if error.contains("unroutable"))
    );
    reader.cleanup().await;
}

#[tokio::test]
async fn amqp_missing_exchange_fails_the_check_and_retries_then_recovers() {
    let exchange = postbox_testkit::unique("missing.");
    let s = sink(&format!(
        "amqp://guest:guest@{}/%2f?exchange={exchange}&timeout=5s",
        broker()
    ));
    let err = s.check().await.expect_err("the exchange does not exist");
    assert!(matches!(err, SinkError::Misconfigured { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("does not exist") && text.contains("NOT_FOUND"),
        "{text}"
    );
    assert!(!text.contains("ShortString"), "no client internals: {text}");
    assert!(!text.contains("guest"), "{text}");

    // Publishing to a missing exchange closes the channel: a retry, not a reject.
    let batch = conformance::messages(2, 1);
    for o in s.publish(&batch).await {
        assert!(matches!(o, Outcome::Retry { .. }), "{o:?}");
    }
    // Once the exchange exists the same sink delivers (it reopened its channel).
    let reader = QueueReader::new(&exchange, "#").await;
    s.check().await.expect("the exchange exists now");
    assert_eq!(s.publish(&batch).await, vec![Outcome::Delivered; 2]);
    reader.cleanup().await;
}

#[tokio::test]
async fn amqp_wrong_password_is_unreachable_without_the_password() {
    let s = sink(&format!(
        "amqp://guest:not-the-pw-42@{}/%2f?exchange=&timeout=5s",
        broker()
    ));
    let err = s.check().await.expect_err("the password is wrong");
    assert!(!err.to_string().contains("not-the-pw-42"), "{err}");
    for o in s.publish(&conformance::messages(1, 1)).await {
        match o {
            Outcome::Retry { error, .. } => assert!(!error.contains("not-the-pw-42"), "{error}"),
            other => panic!("expected a retry, got {other:?}"),
        }
    }
}

/// Throughput: 100,000 events through `Sink::publish` in batches of 500.
/// `cargo test -p postbox-relay --test main --release -- --ignored --nocapture amqp_throughput`
#[tokio::test]
#[ignore = "a measurement, not a check"]
async fn amqp_throughput() {
    let exchange = postbox_testkit::unique("throughput.");
    let reader = QueueReader::new(&exchange, "#").await;
    let s = sink(&format!("amqp://{}?exchange={exchange}", broker()));
    let rate = conformance::throughput(&s, 100_000, conformance::MAX_BATCH).await;
    println!(
        "amqp (persistent messages, publisher confirms, one transient queue): {rate:.0} events/s"
    );
    reader.cleanup().await;
}

#[tokio::test]
async fn amqp_sink_started_while_the_broker_is_down_delivers_once_it_is_up() {
    let exchange = postbox_testkit::unique("late.");
    let reader = QueueReader::new(&exchange, "#").await;
    let proxy = postbox_testkit::proxy::Proxy::start(&broker()).await;
    proxy.stop();
    let s = sink(&format!(
        "amqp://{}?exchange={exchange}&timeout=2s",
        proxy.host_port()
    ));
    let batch = conformance::messages(3, 1);
    for o in s.publish(&batch).await {
        assert!(matches!(o, Outcome::Retry { .. }), "{o:?}");
    }
    proxy.restore();
    assert_eq!(s.publish(&batch).await, vec![Outcome::Delivered; 3]);
    reader.cleanup().await;
}

#[tokio::test]
async fn amqp_returned_messages_are_matched_to_their_own_events() {
    // The broker acknowledges many messages at once; each returned message
    // must still be reported for its own event, not a neighbour's.
    let exchange = postbox_testkit::unique("mixed.");
    let reader = QueueReader::new(&exchange, "conformance.#").await;
    let s = sink(&format!("amqp://{}?exchange={exchange}", broker()));
    for _ in 0..3 {
        let mut batch = conformance::messages(300, 5);
        for m in batch.iter_mut().step_by(7) {
            m.event_type = "nobody.listens".into();
        }
        let outcomes = s.publish(&batch).await;
        for (i, (m, o)) in batch.iter().zip(&outcomes).enumerate() {
            if m.event_type == "nobody.listens" {
                assert!(matches!(o, Outcome::Reject { .. }), "outcome {i}: {o:?}");
            } else {
                assert_eq!(*o, Outcome::Delivered, "outcome {i}");
            }
        }
    }
    reader.cleanup().await;
}

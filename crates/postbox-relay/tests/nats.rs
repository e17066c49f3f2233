//! The NATS JetStream sink against the local nats-server (with JetStream):
//! the conformance suite, stream creation and checks, and a throughput probe.

use crate::conformance::{self, Fixture, Reader, Received, Spec};
use async_nats::jetstream;
use async_trait::async_trait;
use postbox_relay::sinks::nats::NatsSink;
use postbox_relay::sinks::SinkOptions;
use postbox_relay::{Outcome, Sink, SinkError};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

/// The NATS server tests run against (`HOST:PORT`).
fn broker() -> String {
    std::env::var("POSTBOX_TEST_NATS").unwrap_or_else(|_| "127.0.0.1:4222".to_owned())
}

async fn jetstream() -> jetstream::Context {
    let client = async_nats::connect(broker())
        .await
        .expect("connect to NATS (is nats-server running with -js? see DEVELOPERS.md)");
    jetstream::new(client)
}

/// Reads a stream from its first sequence on, remembering what it has read.
struct StreamReader {
    js: jetstream::Context,
    stream: String,
    read: Mutex<(u64, Vec<Received>)>,
}

impl StreamReader {
    async fn new(stream: &str) -> Self {
        Self {
            js: jetstream().await,
            stream: stream.to_owned(),
            read: Mutex::new((1, Vec::new())),
        }
    }
}

#[async_trait]
impl Reader for StreamReader {
    async fn received(&self) -> Vec<Received> {
        let mut read = self.read.lock().await;
        let Ok(mut stream) = self.js.get_stream(&self.stream).await else {
            return read.1.clone();
        };
        let last = stream.info().await.map_or(0, |i| i.state.last_sequence);
        while read.0 <= last {
            let seq = read.0;
            let message = stream
                .get_raw_message(seq)
                .await
                .unwrap_or_else(|e| panic!("read sequence {seq} of {}: {e}", self.stream));
            read.1.push(Received {
                message_id: message
                    .headers
                    .get("Nats-Msg-Id")
                    .map(|v| v.as_str().to_owned()),
                key: None,
                body: message.payload.to_vec(),
            });
            read.0 += 1;
        }
        read.1.clone()
    }

    async fn cleanup(&self) {
        let _ = self.js.delete_stream(&self.stream).await;
    }
}

fn unique_names() -> (String, String) {
    let stream = postbox_testkit::unique("CONF_").to_uppercase();
    let prefix = postbox_testkit::unique("conf");
    (stream, prefix)
}

#[tokio::test]
async fn nats_passes_conformance() {
    let (stream, prefix) = unique_names();
    let spec = Spec {
        name: "nats",
        broker: broker(),
        // The server's max_payload (1 MiB here) bounds body + headers.
        max_payload: conformance::MAX_PAYLOAD - 8 * 1024,
        oversize: Some(conformance::MAX_PAYLOAD),
        keyed: false,
        // A space cannot be part of a NATS subject.
        poison: Some(|m| m.event_type = "conformance.has space".into()),
        outage: true,
        hang_deadline: Some(Duration::from_secs(10)),
    };
    conformance::run(spec, |proxy| async move {
        // The server needs no credentials; they must still never leak.
        let url = format!(
            "nats://app:s3cr3t-nats@{proxy}?subject={prefix}.{{aggregate_type}}.{{event_type}}&stream={stream}&timeout=2s"
        );
        let sink = postbox_relay::sinks::from_url(&url, &SinkOptions::default()).expect("a valid NATS sink URL");
        Fixture {
            sink,
            reader: Box::new(StreamReader::new(&stream).await),
            secret: Some("s3cr3t-nats".into()),
            switch: None,
        }
    })
    .await;
}

#[tokio::test]
async fn nats_creates_a_stream_that_captures_multi_token_subjects() {
    let (stream, prefix) = unique_names();
    let url = format!(
        "nats://{}?subject={prefix}.{{event_type}}&stream={stream}",
        broker()
    );
    let sink = NatsSink::from_url(&url, SinkOptions::default()).unwrap();
    sink.check().await.expect("check creates the stream");
    let js = jetstream().await;
    let mut info = js.get_stream(&stream).await.expect("the stream exists");
    let subjects = info.info().await.unwrap().config.subjects.clone();
    assert_eq!(subjects, vec![format!("{prefix}.>")]);

    // A second sink (another relay) finds the stream and leaves it alone.
    NatsSink::from_url(&url, SinkOptions::default())
        .unwrap()
        .check()
        .await
        .expect("check finds the existing stream");

    let mut batch = conformance::messages(2, 1);
    batch[1].event_type = "a.much.longer.dotted.type".into();
    assert_eq!(sink.publish(&batch).await, vec![Outcome::Delivered; 2]);
    let state = info.info().await.unwrap().state.clone();
    assert_eq!(state.messages, 2);

    // The same event id again is stored once (JetStream's duplicate window).
    assert_eq!(sink.publish(&batch[..1]).await, vec![Outcome::Delivered]);
    assert_eq!(info.info().await.unwrap().state.messages, 2);
    js.delete_stream(&stream).await.unwrap();
}

#[tokio::test]
async fn nats_without_a_capturing_stream_fails_the_check_and_retries() {
    let (_, prefix) = unique_names();
    let url = format!(
        "nats://{}?subject={prefix}.{{event_type}}&timeout=2s",
        broker()
    );
    let sink = NatsSink::from_url(&url, SinkOptions::default()).unwrap();
    let err = sink
        .check()
        .await
        .expect_err("no stream captures the subjects");
    assert!(matches!(err, SinkError::Misconfigured { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&format!(
            "no JetStream stream captures subjects matching {prefix}.>"
        )),
        "{text}"
    );

    let outcomes = sink.publish(&conformance::messages(2, 1)).await;
    for o in &outcomes {
        match o {
            Outcome::Retry { error, .. } => assert!(
                error.contains("no JetStream stream captures subject"),
                "{error}"
            ),
            other => panic!("expected a retry, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn nats_with_an_existing_stream_publishes_without_stream_parameter() {
    let (stream, prefix) = unique_names();
    let js = jetstream().await;
    js.create_stream(jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![format!("{prefix}.>")],
        ..Default::default()
    })
    .await
    .unwrap();
    let url = format!("nats://{}?subject={prefix}.{{aggregate_id}}", broker());
    let sink = NatsSink::from_url(&url, SinkOptions::default()).unwrap();
    sink.check().await.expect("a stream captures the subjects");
    let mut batch = conformance::messages(3, 3);
    batch[2].headers.insert("bad\nname".into(), "v".into());
    let outcomes = sink.publish(&batch).await;
    assert_eq!(outcomes[..2], [Outcome::Delivered, Outcome::Delivered]);
    assert!(
        matches!(&outcomes[2], Outcome::Reject { error } if error.contains("cannot be carried by NATS")),
        "{outcomes:?}"
    );
    js.delete_stream(&stream).await.unwrap();
}

#[tokio::test]
async fn nats_check_fails_clearly_when_the_server_is_down() {
    let proxy = postbox_testkit::proxy::Proxy::start(&broker()).await;
    proxy.stop();
    let url = format!("nats://{}?stream=NOPE&timeout=1s", proxy.host_port());
    let sink = NatsSink::from_url(&url, SinkOptions::default()).unwrap();
    let err = sink.check().await.expect_err("the server is down");
    assert!(err.to_string().contains("is unreachable"), "{err}");
}

/// Throughput: 100,000 events through `Sink::publish` in batches of 500.
/// `cargo test -p postbox-relay --test main --release -- --ignored --nocapture nats_throughput`
#[tokio::test]
#[ignore = "a measurement, not a check"]
async fn nats_throughput() {
    let (stream, prefix) = unique_names();
    let url = format!(
        "nats://{}?subject={prefix}.{{event_type}}&stream={stream}",
        broker()
    );
    let sink: Arc<dyn Sink> = Arc::new(NatsSink::from_url(&url, SinkOptions::default()).unwrap());
    sink.check().await.expect("the stream is created");
    let rate = crate::conformance::throughput(&*sink, 100_000, 500).await;
    println!("nats: {rate:.0} events/s");
    jetstream().await.delete_stream(&stream).await.unwrap();
}

#[tokio::test]
async fn nats_sink_started_while_the_server_is_down_delivers_once_it_is_up() {
    let (stream, prefix) = unique_names();
    let proxy = postbox_testkit::proxy::Proxy::start(&broker()).await;
    proxy.stop();
    let url = format!(
        "nats://{}?subject={prefix}.{{event_type}}&stream={stream}&timeout=1s",
        proxy.host_port()
    );
    let sink = NatsSink::from_url(&url, SinkOptions::default()).unwrap();
    let batch = conformance::messages(3, 1);
    for o in sink.publish(&batch).await {
        assert!(matches!(o, Outcome::Retry { .. }), "{o:?}");
    }
    proxy.restore();
    sink.check()
        .await
        .expect("the server is up and the stream is created");
    assert_eq!(sink.publish(&batch).await, vec![Outcome::Delivered; 3]);
    jetstream().await.delete_stream(&stream).await.unwrap();
}

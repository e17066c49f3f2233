//! The Amazon SQS, SNS and Kinesis sinks against moto in server mode (an
//! AWS-compatible server, `moto_server -H 127.0.0.1 -p 5000`, which `.ci/run`
//! starts; `POSTBOX_TEST_AWS` names another `HOST:PORT`): the conformance
//! suite through the fault proxy, FIFO deduplication and grouping, missing
//! queues, topics and streams, and a throughput probe. Each test creates its
//! own queue, topic or stream under a unique name.

use crate::conformance::{self, Fixture, Reader, Received, Spec};
use async_trait::async_trait;
use aws_config::{BehaviorVersion, Region, SdkConfig};
use postbox_relay::sinks::SinkOptions;
use postbox_relay::{Outcome, Sink, SinkError};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

const REGION: &str = "us-east-1";
/// The secret the sinks under test hold: it must never show.
const SECRET: &str = "s3cr3t-aws-key";
const KEY_ID: &str = "AKIDPOSTBOXTEST";

/// The moto server, `HOST:PORT`.
fn broker() -> String {
    std::env::var("POSTBOX_TEST_AWS").unwrap_or_else(|_| "127.0.0.1:5000".to_owned())
}

/// A sink URL's parameters pointing at `host_port` (moto, or the proxy in front of it).
fn params(host_port: &str) -> String {
    params_with(host_port, "10s")
}

/// The same with another call timeout. moto is one Python process serving
/// every test at once, and each message it takes costs time proportional to
/// the messages already in the queue (more so in FIFO queues): generous.
fn params_with(host_port: &str, timeout: &str) -> String {
    format!("region={REGION}&endpoint=http://{host_port}&timeout={timeout}")
}

/// The SDK configuration the tests' own clients use, straight to moto.
async fn sdk() -> SdkConfig {
    aws_config::defaults(BehaviorVersion::latest())
        .region(Region::new(REGION))
        .endpoint_url(format!("http://{}", broker()))
        .credentials_provider(aws_credential_types::Credentials::new(
            KEY_ID, SECRET, None, None, "tests",
        ))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .load()
        .await
}

/// A name the services accept (letters, digits, `-`, `_`).
fn unique(prefix: &str) -> String {
    postbox_testkit::unique(prefix)
}

#[cfg(feature = "sqs")]
mod sqs {
    use super::*;
    use aws_sdk_sqs::types::{MessageSystemAttributeName, QueueAttributeName};
    use postbox_relay::sinks::sqs::SqsSink;

    pub(super) async fn client() -> aws_sdk_sqs::Client {
        aws_sdk_sqs::Client::new(&sdk().await)
    }

    /// Create a queue; returns its URL.
    pub(super) async fn create_queue(name: &str) -> String {
        let mut create = client().await.create_queue().queue_name(name);
        if name.ends_with(".fifo") {
            create = create.attributes(QueueAttributeName::FifoQueue, "true");
        }
        create
            .send()
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "create queue {name} (is moto_server running on {}? see .ci/run): {e:?}",
                    broker()
                )
            })
            .queue_url()
            .expect("a queue URL")
            .to_owned()
    }

    /// Reads a queue, deleting what it read and remembering it.
    pub(super) struct QueueReader {
        pub client: aws_sdk_sqs::Client,
        pub url: String,
        pub read: Mutex<Vec<Received>>,
    }

    impl QueueReader {
        pub(super) async fn new(url: String) -> Self {
            Self {
                client: client().await,
                url,
                read: Mutex::new(Vec::new()),
            }
        }
    }

    #[async_trait]
    impl Reader for QueueReader {
        async fn received(&self) -> Vec<Received> {
            let mut read = self.read.lock().await;
            loop {
                let answer = self
                    .client
                    .receive_message()
                    .queue_url(&self.url)
                    .max_number_of_messages(10)
                    .wait_time_seconds(0)
                    .message_attribute_names("All")
                    .message_system_attribute_names(MessageSystemAttributeName::All)
                    .send()
                    .await
                    .expect("receive messages");
                let messages = answer.messages();
                if messages.is_empty() {
                    break;
                }
                let mut delete = self.client.delete_message_batch().queue_url(&self.url);
                for (n, m) in messages.iter().enumerate() {
                    let attribute = |name: &str| {
                        m.message_attributes()
                            .and_then(|a| a.get(name))
                            .and_then(|v| v.string_value())
                            .map(str::to_owned)
                    };
                    let system = |name: MessageSystemAttributeName| {
                        m.attributes().and_then(|a| a.get(&name)).cloned()
                    };
                    let dedup = system(MessageSystemAttributeName::MessageDeduplicationId);
                    if let (Some(d), Some(id)) = (&dedup, attribute("ce-id")) {
                        assert_eq!(*d, id, "the deduplication id is the event id");
                    }
                    read.push(Received {
                        message_id: dedup.or_else(|| attribute("ce-id")),
                        key: system(MessageSystemAttributeName::MessageGroupId),
                        body: m.body().unwrap_or_default().as_bytes().to_vec(),
                    });
                    delete = delete.entries(
                        aws_sdk_sqs::types::DeleteMessageBatchRequestEntry::builder()
                            .id(n.to_string())
                            .receipt_handle(m.receipt_handle().unwrap_or_default())
                            .build()
                            .expect("a delete entry"),
                    );
                }
                delete.send().await.expect("delete received messages");
            }
            read.clone()
        }

        async fn cleanup(&self) {
            let _ = self.client.delete_queue().queue_url(&self.url).send().await;
        }
    }

    async fn conformance_for(name: String) {
        let fifo = name.ends_with(".fifo");
        // A FIFO batch of 500 keeps moto busy for many seconds (see `params_with`).
        let (timeout, hang) = if fifo { ("20s", 50) } else { ("10s", 25) };
        let url = create_queue(&name).await;
        let spec = Spec {
            name: if fifo { "sqs (fifo)" } else { "sqs" },
            broker: broker(),
            // The queue's MaximumMessageSize (1 MiB) bounds body plus attributes.
            max_payload: conformance::MAX_PAYLOAD - 8 * 1024,
            oversize: Some(conformance::MAX_PAYLOAD),
            keyed: fifo,
            poison: Some(if fifo {
                // Not a MessageGroupId.
                |m| m.aggregate_id = "has space".into()
            } else {
                // A character SQS refuses in an attribute.
                |m| m.event_type = "conformance.\u{1}".into()
            }),
            outage: true,
            hang_deadline: Some(Duration::from_secs(hang)),
        };
        conformance::run(spec, |proxy| async move {
            let sink = SqsSink::from_url(
                &format!("sqs://{name}?{}", params_with(&proxy, timeout)),
                SinkOptions::default(),
            )
            .expect("a valid SQS sink URL")
            .with_credentials(KEY_ID, SECRET);
            Fixture {
                sink: Arc::new(sink),
                reader: Box::new(QueueReader::new(url).await),
                secret: Some(SECRET.into()),
                switch: None,
            }
        })
        .await;
    }

    #[tokio::test]
    async fn sqs_standard_passes_conformance() {
        conformance_for(unique("conf-")).await;
    }

    #[tokio::test]
    async fn sqs_fifo_passes_conformance() {
        conformance_for(format!("{}.fifo", unique("conf-"))).await;
    }

    #[tokio::test]
    async fn sqs_fifo_drops_a_resent_event() {
        let name = format!("{}.fifo", unique("dedup-"));
        let url = create_queue(&name).await;
        let sink = SqsSink::from_url(
            &format!("sqs://{name}?{}", params(&broker())),
            SinkOptions::default(),
        )
        .unwrap()
        .with_credentials(KEY_ID, SECRET);
        let batch = conformance::messages(3, 2);
        assert_eq!(sink.publish(&batch).await, vec![Outcome::Delivered; 3]);
        // The relay resends after an ambiguous failure: the same event ids.
        assert_eq!(sink.publish(&batch).await, vec![Outcome::Delivered; 3]);
        let reader = QueueReader::new(url).await;
        let received = reader.received().await;
        assert_eq!(received.len(), 3, "{received:?}");
        reader.cleanup().await;
    }

    #[tokio::test]
    async fn sqs_without_the_queue_fails_the_check_and_retries() {
        let sink = SqsSink::from_url(
            &format!("sqs://{}?{}", unique("missing-"), params(&broker())),
            SinkOptions::default(),
        )
        .unwrap()
        .with_credentials(KEY_ID, SECRET);
        match sink.check().await {
            Err(SinkError::Misconfigured { reason, .. }) => {
                assert!(reason.contains("does not exist"), "{reason}")
            }
            other => panic!("expected a misconfigured sink, got {other:?}"),
        }
        let outcomes = sink.publish(&conformance::messages(2, 1)).await;
        assert!(
            outcomes.iter().all(|o| matches!(o, Outcome::Retry { .. })),
            "{outcomes:?}"
        );
    }

    #[tokio::test]
    async fn the_relay_delivers_to_sqs_with_attributes() {
        let db = postbox_testkit::TestDb::new().await;
        let name = unique("relay-");
        let url = create_queue(&name).await;
        let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let event = postbox::NewEvent::new(
            "order.created",
            "order",
            "o-1",
            &serde_json::json!({"total": 5}),
        )
        .unwrap()
        .headers([("traceparent", traceparent), ("x-tenant", "acme")])
        .unwrap();
        let id = db.enqueue_events(&[event]).await[0];
        let sink = SqsSink::from_url(
            &format!("sqs://{name}?{}", params(&broker())),
            SinkOptions {
                source: "shop".into(),
                ..SinkOptions::default()
            },
        )
        .unwrap()
        .with_credentials(KEY_ID, SECRET);
        sink.check().await.expect("the queue is found");
        let stats = crate::support::drain(&db, Arc::new(sink), crate::support::fast_config()).await;
        assert_eq!(stats.delivered, 1);

        let answer = client()
            .await
            .receive_message()
            .queue_url(&url)
            .message_attribute_names("All")
            .send()
            .await
            .unwrap();
        let m = &answer.messages()[0];
        let attribute = |name: &str| {
            let v = m.message_attributes().and_then(|a| a.get(name)).cloned();
            v.map(|v| {
                (
                    v.data_type().to_owned(),
                    v.string_value().unwrap_or_default().to_owned(),
                )
            })
        };
        let s = |t: &str, v: &str| Some((t.to_owned(), v.to_owned()));
        assert_eq!(
            attribute("ce-id"),
            s("String", &id.hyphenated().to_string())
        );
        assert_eq!(attribute("ce-type"), s("String", "order.created"));
        assert_eq!(attribute("ce-source"), s("String", "shop"));
        assert_eq!(attribute("ce-subject"), s("String", "o-1"));
        assert_eq!(attribute("ce-aggregatetype"), s("String", "order"));
        assert_eq!(attribute("ce-schemaversion"), s("Number", "1"));
        assert_eq!(attribute("traceparent"), s("String", traceparent));
        assert_eq!(
            attribute("postbox-headers"),
            s("String", r#"{"x-tenant":"acme"}"#)
        );
        let body: serde_json::Value = serde_json::from_str(m.body().unwrap()).unwrap();
        assert_eq!(body["traceparent"], traceparent);
        assert_eq!(body["data"]["total"], 5);
        let _ = client().await.delete_queue().queue_url(url).send().await;
    }

    /// Throughput: `cargo test -p postbox-relay --test main --release -- --ignored --nocapture throughput`
    #[tokio::test]
    #[ignore = "a measurement, not a check"]
    async fn sqs_throughput() {
        for name in [unique("tp-"), format!("{}.fifo", unique("tp-"))] {
            let url = create_queue(&name).await;
            let sink = SqsSink::from_url(
                &format!("sqs://{name}?{}", params(&broker())),
                SinkOptions::default(),
            )
            .unwrap()
            .with_credentials(KEY_ID, SECRET);
            let rate = conformance::throughput(&sink, 20_000, conformance::MAX_BATCH).await;
            println!("sqs ({name}): {rate:.0} events/s");
            let _ = client().await.delete_queue().queue_url(url).send().await;
        }
    }
}

#[cfg(all(feature = "sns", feature = "sqs"))]
mod sns {
    use super::sqs::{create_queue, QueueReader};
    use super::*;
    use postbox_relay::sinks::sns::SnsSink;

    async fn client() -> aws_sdk_sns::Client {
        aws_sdk_sns::Client::new(&sdk().await)
    }

    /// A topic with a queue subscribed (raw delivery, so the queue gets the
    /// message and its attributes as published); returns the topic's ARN and
    /// the queue's URL.
    async fn topic_with_queue(name: &str) -> (String, String) {
        let fifo = name.ends_with(".fifo");
        let sns = client().await;
        let mut create = sns.create_topic().name(name);
        if fifo {
            create = create.attributes("FifoTopic", "true");
        }
        let arn = create
            .send()
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "create topic {name} (is moto_server running on {}?): {e:?}",
                    broker()
                )
            })
            .topic_arn()
            .expect("a topic ARN")
            .to_owned();
        let queue = if fifo {
            format!("{}.fifo", unique("sub-"))
        } else {
            unique("sub-")
        };
        let queue_url = create_queue(&queue).await;
        let queue_arn = format!("arn:aws:sqs:{REGION}:123456789012:{queue}");
        sns.subscribe()
            .topic_arn(&arn)
            .protocol("sqs")
            .endpoint(queue_arn)
            .attributes("RawMessageDelivery", "true")
            .send()
            .await
            .expect("subscribe the queue");
        (arn, queue_url)
    }

    #[tokio::test]
    async fn sns_passes_conformance() {
        let name = unique("conf-");
        let (arn, queue_url) = topic_with_queue(&name).await;
        let spec = Spec {
            name: "sns",
            broker: broker(),
            max_payload: postbox_relay::sinks::sns::MAX_MESSAGE - 8 * 1024,
            oversize: Some(postbox_relay::sinks::sns::MAX_MESSAGE),
            keyed: false,
            poison: Some(|m| m.event_type = "conformance.\u{1}".into()),
            outage: true,
            hang_deadline: Some(Duration::from_secs(25)),
        };
        conformance::run(spec, |proxy| async move {
            let sink = SnsSink::from_url(
                &format!("sns://{name}?{}", params(&proxy)),
                SinkOptions::default(),
            )
            .expect("a valid SNS sink URL")
            .with_credentials(KEY_ID, SECRET);
            Fixture {
                sink: Arc::new(sink),
                reader: Box::new(QueueReader::new(queue_url).await),
                secret: Some(SECRET.into()),
                switch: None,
            }
        })
        .await;
        let _ = client().await.delete_topic().topic_arn(arn).send().await;
    }

    #[tokio::test]
    async fn sns_fifo_groups_by_aggregate_and_carries_attributes() {
        let name = format!("{}.fifo", unique("fifo-"));
        let (arn, queue_url) = topic_with_queue(&name).await;
        let sink = SnsSink::from_url(
            &format!("sns://{name}?{}", params(&broker())),
            SinkOptions {
                source: "shop".into(),
                ..SinkOptions::default()
            },
        )
        .unwrap()
        .with_credentials(KEY_ID, SECRET);
        sink.check().await.expect("the topic is found");
        let mut batch = conformance::messages(4, 2);
        batch[0].headers.insert(
            "traceparent".into(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        );
        assert_eq!(sink.publish(&batch).await, vec![Outcome::Delivered; 4]);
        let reader = QueueReader::new(queue_url).await;
        let received = reader.received().await;
        assert_eq!(received.len(), 4, "{received:?}");
        // Each event once, grouped by its aggregate, with its id as the
        // deduplication id; each group in input order.
        let mut last: HashMap<String, usize> = HashMap::new();
        for r in &received {
            let id = r.message_id.as_deref().expect("a deduplication id");
            let (position, m) = batch
                .iter()
                .enumerate()
                .find(|(_, m)| m.event_id.hyphenated().to_string() == id)
                .expect("an event of the batch");
            assert_eq!(r.key.as_deref(), Some(m.aggregate_id.as_str()));
            if let Some(before) = last.insert(m.aggregate_id.clone(), position) {
                assert!(before < position, "{} out of order", m.aggregate_id);
            }
        }
        reader.cleanup().await;
        let _ = client().await.delete_topic().topic_arn(arn).send().await;
    }

    #[tokio::test]
    async fn sns_without_the_topic_fails_the_check() {
        let sink = SnsSink::from_url(
            &format!("sns://{}?{}", unique("missing-"), params(&broker())),
            SinkOptions::default(),
        )
        .unwrap()
        .with_credentials(KEY_ID, SECRET);
        match sink.check().await {
            Err(SinkError::Misconfigured { reason, .. }) => {
                assert!(reason.contains("does not exist"), "{reason}")
            }
            other => panic!("expected a misconfigured sink, got {other:?}"),
        }
    }
}

#[cfg(feature = "kinesis")]
mod kinesis {
    use super::*;
    use aws_sdk_kinesis::types::ShardIteratorType;
    use postbox_relay::sinks::kinesis::KinesisSink;

    async fn client() -> aws_sdk_kinesis::Client {
        aws_sdk_kinesis::Client::new(&sdk().await)
    }

    async fn create_stream(name: &str) {
        client()
            .await
            .create_stream()
            .stream_name(name)
            .shard_count(1)
            .send()
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "create stream {name} (is moto_server running on {}?): {e:?}",
                    broker()
                )
            });
    }

    /// Reads the stream's one shard from its start.
    struct StreamReader {
        client: aws_sdk_kinesis::Client,
        stream: String,
        state: Mutex<(Option<String>, Vec<Received>)>,
    }

    #[async_trait]
    impl Reader for StreamReader {
        async fn received(&self) -> Vec<Received> {
            let mut state = self.state.lock().await;
            if state.0.is_none() {
                let shards = self
                    .client
                    .list_shards()
                    .stream_name(&self.stream)
                    .send()
                    .await
                    .expect("list shards");
                let shard = shards.shards()[0].shard_id().to_owned();
                let iterator = self
                    .client
                    .get_shard_iterator()
                    .stream_name(&self.stream)
                    .shard_id(shard)
                    .shard_iterator_type(ShardIteratorType::TrimHorizon)
                    .send()
                    .await
                    .expect("a shard iterator");
                state.0 = iterator.shard_iterator().map(str::to_owned);
            }
            while let Some(iterator) = state.0.clone() {
                let page = self
                    .client
                    .get_records()
                    .shard_iterator(iterator)
                    .limit(1000)
                    .send()
                    .await
                    .expect("get records");
                let records = page.records();
                for r in records {
                    let body = r.data().as_ref().to_vec();
                    // Records have no id field: the document's id is the one consumers use.
                    let id = serde_json::from_slice::<serde_json::Value>(&body)
                        .ok()
                        .and_then(|v| v["id"].as_str().map(str::to_owned));
                    state.1.push(Received {
                        message_id: id,
                        key: r.partition_key().map(str::to_owned),
                        body,
                    });
                }
                state.0 = page.next_shard_iterator().map(str::to_owned);
                if records.is_empty() {
                    break;
                }
            }
            state.1.clone()
        }

        async fn cleanup(&self) {
            let _ = self
                .client
                .delete_stream()
                .stream_name(&self.stream)
                .send()
                .await;
        }
    }

    #[tokio::test]
    async fn kinesis_passes_conformance() {
        let name = unique("conf-");
        create_stream(&name).await;
        let spec = Spec {
            name: "kinesis",
            broker: broker(),
            max_payload: postbox_relay::sinks::kinesis::MAX_RECORD - 8 * 1024,
            oversize: Some(postbox_relay::sinks::kinesis::MAX_RECORD),
            keyed: true,
            // Not a partition key.
            poison: Some(|m| m.aggregate_id = "k".repeat(300)),
            outage: true,
            hang_deadline: Some(Duration::from_secs(25)),
        };
        conformance::run(spec, |proxy| async move {
            let sink = KinesisSink::from_url(
                &format!("kinesis://{name}?{}", params(&proxy)),
                SinkOptions::default(),
            )
            .expect("a valid Kinesis sink URL")
            .with_credentials(KEY_ID, SECRET);
            Fixture {
                sink: Arc::new(sink),
                reader: Box::new(StreamReader {
                    client: client().await,
                    stream: name,
                    state: Mutex::new((None, Vec::new())),
                }),
                secret: Some(SECRET.into()),
                switch: None,
            }
        })
        .await;
    }

    #[tokio::test]
    async fn kinesis_without_the_stream_fails_the_check() {
        let sink = KinesisSink::from_url(
            &format!("kinesis://{}?{}", unique("missing-"), params(&broker())),
            SinkOptions::default(),
        )
        .unwrap()
        .with_credentials(KEY_ID, SECRET);
        match sink.check().await {
            Err(SinkError::Misconfigured { reason, .. }) => {
                assert!(reason.contains("does not exist"), "{reason}")
            }
            other => panic!("expected a misconfigured sink, got {other:?}"),
        }
    }

    /// Throughput: `cargo test -p postbox-relay --test main --release -- --ignored --nocapture throughput`
    #[tokio::test]
    #[ignore = "a measurement, not a check"]
    async fn kinesis_throughput() {
        let name = unique("tp-");
        create_stream(&name).await;
        let sink = KinesisSink::from_url(
            &format!("kinesis://{name}?{}", params(&broker())),
            SinkOptions::default(),
        )
        .unwrap()
        .with_credentials(KEY_ID, SECRET);
        let rate = conformance::throughput(&sink, 20_000, conformance::MAX_BATCH).await;
        println!("kinesis: {rate:.0} events/s");
        let _ = client()
            .await
            .delete_stream()
            .stream_name(name)
            .send()
            .await;
    }
}

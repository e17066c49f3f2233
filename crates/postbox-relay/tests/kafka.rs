//! The Kafka sink (cargo feature `kafka`, which `cargo test --workspace`
//! builds: postbox-cli turns it on by default). No Kafka broker runs on the
//! development machines or in CI. With the feature, the suite runs against
//! librdkafka's mock cluster (real Kafka protocol over TCP, in-process, with
//! brokers that can be taken down); against a real cluster only when
//! `KAFKA_BROKERS` names one (`HOST:PORT[,HOST:PORT]`; the test creates its
//! topics), otherwise that test prints why it was skipped and passes. `.ci/run`
//! starts tansu, an Apache-Kafka-compatible broker, and sets it.

#[cfg(not(feature = "kafka"))]
#[test]
fn kafka_conformance_skipped_without_the_feature() {
    println!("skipped: the kafka sink is not built; run with --features kafka and KAFKA_BROKERS=HOST:PORT");
}

#[cfg(feature = "kafka")]
mod with_feature {
    use crate::conformance::{self, Fixture, Reader, Received, Spec, Switch};
    use async_trait::async_trait;
    use postbox_relay::sinks::kafka::KafkaSink;
    use postbox_relay::sinks::SinkOptions;
    use postbox_relay::Sink;
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::{Headers, Message as _};
    use rdkafka::ClientConfig;
    use std::time::Duration;
    use tokio::sync::Mutex;

    fn brokers() -> Option<String> {
        match std::env::var("KAFKA_BROKERS") {
            Ok(b) if !b.trim().is_empty() => Some(b),
            _ => {
                println!("skipped: KAFKA_BROKERS is not set (no Kafka broker runs here); set it to HOST:PORT to run");
                None
            }
        }
    }

    /// Create `topic` (one partition) on a real cluster: brokers need not
    /// create topics on first use (tansu does not).
    async fn create_topic(brokers: &str, topic: &str) {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()
            .expect("a Kafka admin client");
        let created = admin
            .create_topics(
                &[NewTopic::new(topic, 1, TopicReplication::Fixed(1))],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .expect("the CreateTopics request");
        for result in created {
            result.unwrap_or_else(|(name, code)| panic!("create topic {name}: {code}"));
        }
    }

    /// Reads one topic from the beginning with a fresh consumer group.
    struct TopicReader {
        consumer: std::sync::Arc<BaseConsumer>,
        read: Mutex<Vec<Received>>,
    }

    impl TopicReader {
        fn new(brokers: &str, topic: &str) -> Self {
            let consumer: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", brokers)
                .set("group.id", postbox_testkit::unique("conformance-"))
                .set("auto.offset.reset", "earliest")
                .set("enable.auto.commit", "false")
                .create()
                .expect("a Kafka consumer");
            consumer.subscribe(&[topic]).expect("subscribe");
            Self {
                consumer: std::sync::Arc::new(consumer),
                read: Mutex::new(Vec::new()),
            }
        }
    }

    #[async_trait]
    impl Reader for TopicReader {
        async fn received(&self) -> Vec<Received> {
            let mut read = self.read.lock().await;
            let consumer = self.consumer.clone();
            let fresh = tokio::task::spawn_blocking(move || {
                let mut out = Vec::new();
                while let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
                    let message_id = m.headers().and_then(|h| {
                        h.iter()
                            .find(|h| h.key == "ce_id")
                            .and_then(|h| h.value)
                            .and_then(|v| String::from_utf8(v.to_vec()).ok())
                    });
                    out.push(Received {
                        message_id,
                        key: m.key().and_then(|k| String::from_utf8(k.to_vec()).ok()),
                        body: m.payload().unwrap_or_default().to_vec(),
                    });
                }
                out
            })
            .await
            .expect("poll the consumer");
            read.extend(fresh);
            read.clone()
        }
    }

    #[tokio::test]
    async fn kafka_passes_conformance() {
        let Some(brokers) = brokers() else { return };
        let topic = postbox_testkit::unique("conformance-");
        let spec = Spec {
            name: "kafka",
            broker: brokers.split(',').next().unwrap_or_default().to_owned(),
            // The default message.max.bytes (producer and broker) is about 1 MB.
            max_payload: 1_000_000 - 8 * 1024,
            oversize: Some(conformance::MAX_PAYLOAD),
            keyed: true,
            // An invalid topic name is rejected before it reaches the broker.
            poison: Some(|m| m.event_type = "has space".into()),
            // Clients reach the brokers they are told about, bypassing a proxy.
            outage: false,
            hang_deadline: None,
        };
        // Every suite message has this event type; the poisoned one renders an invalid topic.
        let name = format!("{topic}.conformance.item.created");
        create_topic(&brokers, &name).await;
        let reader = TopicReader::new(&brokers, &name);
        conformance::run(spec, |_proxy| async move {
            let url = format!("kafka://{brokers}?topic={topic}.{{event_type}}&timeout=10s");
            let sink = postbox_relay::sinks::from_url(&url, &SinkOptions::default())
                .expect("a valid Kafka sink URL");
            Fixture {
                sink,
                reader: Box::new(reader),
                secret: None,
                switch: None,
            }
        })
        .await;
    }

    /// librdkafka's mock cluster, owned by a thread of its own (it is not
    /// `Send`); dropping this stops it.
    struct MockKafka {
        bootstrap: String,
        commands: std::sync::mpsc::Sender<(bool, std::sync::mpsc::Sender<()>)>,
    }

    impl MockKafka {
        fn start(brokers: i32) -> MockKafka {
            let (commands, inbox) =
                std::sync::mpsc::channel::<(bool, std::sync::mpsc::Sender<()>)>();
            let (started, bootstrap) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let cluster =
                    rdkafka::mocking::MockCluster::new(brokers).expect("a mock Kafka cluster");
                let _ = started.send(cluster.bootstrap_servers());
                while let Ok((up, done)) = inbox.recv() {
                    let result = if up {
                        cluster.broker_up(-1)
                    } else {
                        cluster.broker_down(-1)
                    };
                    result.expect("switch the mock brokers");
                    let _ = done.send(());
                }
            });
            MockKafka {
                bootstrap: bootstrap.recv().expect("the mock cluster started"),
                commands,
            }
        }

        fn set(&self, up: bool) {
            let (done, wait) = std::sync::mpsc::channel();
            self.commands
                .send((up, done))
                .expect("the mock cluster thread is running");
            wait.recv().expect("the mock cluster switched");
        }
    }

    impl Switch for MockKafka {
        fn down(&self) {
            self.set(false);
        }
        fn up(&self) {
            self.set(true);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kafka_mock_cluster_passes_conformance() {
        let mock = MockKafka::start(3);
        let brokers = mock.bootstrap.clone();
        let topic = postbox_testkit::unique("conformance-");
        let spec = Spec {
            name: "kafka (mock cluster)",
            // Unused: the mock cluster is switched directly.
            broker: brokers.split(',').next().unwrap_or_default().to_owned(),
            // The producer's default message.max.bytes is 1,000,000.
            max_payload: 1_000_000 - 8 * 1024,
            oversize: Some(conformance::MAX_PAYLOAD),
            keyed: true,
            poison: Some(|m| m.event_type = "has space".into()),
            outage: true,
            hang_deadline: None,
        };
        let reader = TopicReader::new(&brokers, &format!("{topic}.conformance.item.created"));
        conformance::run(spec, |_proxy| async move {
            let url = format!("kafka://{brokers}?topic={topic}.{{event_type}}&timeout=3s");
            let sink = postbox_relay::sinks::from_url(&url, &SinkOptions::default())
                .expect("a valid Kafka sink URL");
            Fixture {
                sink,
                reader: Box::new(reader),
                secret: None,
                switch: Some(Box::new(mock)),
            }
        })
        .await;
    }

    #[tokio::test]
    async fn kafka_unreachable_broker_is_a_retry() {
        // A port nothing listens on: every record times out and is retried.
        let url = "kafka://127.0.0.1:1?topic=postbox-unreachable&timeout=1s";
        let sink = KafkaSink::from_url(url, SinkOptions::default()).unwrap();
        assert!(sink.check().await.is_err());
        for o in sink.publish(&conformance::messages(3, 1)).await {
            assert!(matches!(o, postbox_relay::Outcome::Retry { .. }), "{o:?}");
        }
    }

    /// Throughput against the mock cluster (librdkafka's in-process brokers; a
    /// real cluster writes to disk and replicates).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a measurement, not a check"]
    async fn kafka_mock_cluster_throughput() {
        let mock = MockKafka::start(3);
        let topic = postbox_testkit::unique("throughput-");
        let url = format!("kafka://{}?topic={topic}", mock.bootstrap);
        let sink = KafkaSink::from_url(&url, SinkOptions::default()).unwrap();
        let rate = conformance::throughput(&sink, 100_000, conformance::MAX_BATCH).await;
        println!("kafka (mock cluster, 3 brokers): {rate:.0} events/s");
    }

    /// `KAFKA_BROKERS=… cargo test -p postbox-relay --features kafka --test main --release -- --ignored --nocapture kafka_throughput`
    #[tokio::test]
    #[ignore = "a measurement, not a check"]
    async fn kafka_throughput() {
        let Some(brokers) = brokers() else { return };
        let topic = postbox_testkit::unique("throughput-");
        create_topic(&brokers, &topic).await;
        let sink = KafkaSink::from_url(
            &format!("kafka://{brokers}?topic={topic}"),
            SinkOptions::default(),
        )
        .unwrap();
        let rate = conformance::throughput(&sink, 100_000, conformance::MAX_BATCH).await;
        println!("kafka: {rate:.0} events/s");
    }
}

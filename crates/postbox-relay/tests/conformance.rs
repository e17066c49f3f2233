//! The sink conformance suite: what every sink must do, checked against a real
//! broker. Each sink's integration tests call [`run`] with a [`Spec`] and a
//! factory that builds the sink (pointed at a [`Proxy`] in front of the
//! broker) and a [`Reader`] that reads back what the broker received.
//!
//! The suite checks, in order:
//!
//! 1. **One outcome per input, in input order**: a mixed batch (with a message
//!    the sink must reject, where the transport has such a thing) gets exactly
//!    one outcome per message, at the message's position.
//! 2. **Native id**: every received message carries the event id in the
//!    transport's message-id / deduplication field, matching the body's
//!    CloudEvents `id`.
//! 3. **Ordering key**: where the transport has a partition/ordering key, it is
//!    the aggregate id; on every transport the messages of one aggregate arrive
//!    in input order.
//! 4. **Maximum batch**: a batch of the relay's default batch size (500) is
//!    delivered whole.
//! 5. **Largest payload**: a payload near the largest the transport takes is
//!    delivered intact; one over the transport's limit is rejected, not retried.
//! 6. **Broker down**: with the broker unreachable (connections refused and
//!    reset), every outcome is a retry — never delivered, never rejected — and
//!    the start-up check fails.
//! 7. **Broker back**: the same sink object delivers again, without a restart.
//! 8. **Broker hanging** (optional): with the broker silent, publish still
//!    answers (retries) within the sink's timeout, then recovers.
//!
//! Throughout, no outcome error and no `describe()` contains the secret of the
//! sink's URL.

use async_trait::async_trait;
use chrono::Utc;
use futures::FutureExt;
use postbox_relay::{Message, Outcome, Sink};
use postbox_testkit::proxy::Proxy;
use postbox_testkit::wait_for;
use serde_json::value::RawValue;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// The relay's default batch size.
pub const MAX_BATCH: usize = 500;
/// The relay's default maximum payload (1 MiB).
pub const MAX_PAYLOAD: usize = 1024 * 1024;
/// How long delivery may take to resume after the broker returns.
const RECOVERY: Duration = Duration::from_secs(60);
/// How long the broker may take to make received messages readable.
const VISIBLE: Duration = Duration::from_secs(15);

/// One message as the broker holds it.
#[derive(Clone, Debug)]
pub struct Received {
    /// The transport's native message id / dedup field (`Nats-Msg-Id`, AMQP `message_id`, …).
    pub message_id: Option<String>,
    /// The partition / ordering key, where the transport has one.
    pub key: Option<String>,
    /// The body as received.
    pub body: Vec<u8>,
}

/// Reads back what the destination received.
#[async_trait]
pub trait Reader: Send + Sync {
    /// Every message received so far, in arrival order (duplicates included).
    async fn received(&self) -> Vec<Received>;

    /// Remove what the test created on the broker (called once the suite
    /// ends, passing or failing).
    async fn cleanup(&self) {}
}

/// Takes the broker down and brings it back, for transports a TCP proxy cannot
/// stand in front of (Kafka clients connect to the addresses the cluster advertises).
pub trait Switch: Send + Sync {
    /// The broker refuses and drops connections.
    fn down(&self);
    /// The broker is back.
    fn up(&self);
}

/// What a factory builds for the suite.
pub struct Fixture {
    pub sink: Arc<dyn Sink>,
    pub reader: Box<dyn Reader>,
    /// A credential in the sink's URL that must never appear in `describe()` or outcomes.
    pub secret: Option<String>,
    /// Takes the broker down instead of the proxy, when set.
    pub switch: Option<Box<dyn Switch>>,
}

/// What the suite may expect of one transport.
pub struct Spec {
    /// For messages: `"redis"`, `"nats"`, …
    pub name: &'static str,
    /// The real broker, `HOST:PORT`; the suite puts a proxy in front of it.
    pub broker: String,
    /// The largest payload (bytes of the JSON `data`) the transport must deliver.
    pub max_payload: usize,
    /// A payload size the transport must reject (over its hard limit), if it has one.
    pub oversize: Option<usize>,
    /// Whether [`Received::key`] is the aggregate id (a partition / ordering key).
    pub keyed: bool,
    /// Turn a message into one the sink must reject (e.g. unroutable), if the transport can.
    pub poison: Option<fn(&mut Message)>,
    /// Whether the broker can be taken down (through the proxy, or the fixture's [`Switch`]).
    pub outage: bool,
    /// If set, also check a hanging broker (through the proxy): publish must answer within this time.
    pub hang_deadline: Option<Duration>,
}

/// A message of the suite: event type with dots, aggregate `agg-<i % aggregates>`.
pub fn message(i: usize, aggregates: usize, payload: &str) -> Message {
    let mut headers = BTreeMap::new();
    headers.insert("x-conformance".to_owned(), format!("m{i}"));
    Message {
        event_id: Uuid::now_v7(),
        event_type: "conformance.item.created".to_owned(),
        aggregate_type: "item".to_owned(),
        aggregate_id: format!("agg-{}", i % aggregates.max(1)),
        schema_version: 1,
        payload: RawValue::from_string(payload.to_owned()).expect("valid JSON payload"),
        headers,
        created_at: Utc::now(),
        attempt: 1,
        sequence: Some(i as i64 / aggregates.max(1) as i64 + 1),
        source: None,
    }
}

/// `n` small messages over `aggregates` aggregates.
pub fn messages(n: usize, aggregates: usize) -> Vec<Message> {
    (0..n)
        .map(|i| message(i, aggregates, &format!(r#"{{"n":{i}}}"#)))
        .collect()
}

/// A JSON payload of exactly `bytes` bytes (a string of `x`).
pub fn payload_of(bytes: usize) -> String {
    assert!(bytes >= 2);
    format!("\"{}\"", "x".repeat(bytes - 2))
}

struct Suite<'a> {
    spec: &'a Spec,
    fixture: &'a Fixture,
}

impl Suite<'_> {
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        let outcomes = self.fixture.sink.publish(batch).await;
        assert_eq!(
            outcomes.len(),
            batch.len(),
            "{}: one outcome per message",
            self.spec.name
        );
        if let Some(secret) = &self.fixture.secret {
            for o in &outcomes {
                let text = format!("{o:?}");
                assert!(
                    !text.contains(secret.as_str()),
                    "{}: an outcome leaks the secret: {text}",
                    self.spec.name
                );
            }
        }
        outcomes
    }

    /// Wait until every id in `ids` has been received; return everything received.
    async fn wait_received(&self, what: &str, ids: &[Uuid]) -> Vec<Received> {
        let reader = &*self.fixture.reader;
        let want: HashSet<String> = ids.iter().map(|id| id.hyphenated().to_string()).collect();
        let want = &want;
        let all_seen = |got: &[Received]| {
            let seen: HashSet<&str> = got.iter().filter_map(|r| r.message_id.as_deref()).collect();
            want.iter().all(|id| seen.contains(id.as_str()))
        };
        wait_for(
            &format!("{}: {what}", self.spec.name),
            VISIBLE,
            || async move { all_seen(&reader.received().await) },
        )
        .await;
        reader.received().await
    }

    fn check_messages(&self, sent: &[Message], received: &[Received]) {
        let name = self.spec.name;
        let by_id: HashMap<String, &Message> = sent
            .iter()
            .map(|m| (m.event_id.hyphenated().to_string(), m))
            .collect();
        let mut first_position: HashMap<String, usize> = HashMap::new();
        for (pos, r) in received.iter().enumerate() {
            let Some(id) = r.message_id.as_deref() else {
                panic!("{name}: a received message has no native message id");
            };
            let Some(m) = by_id.get(id) else { continue };
            first_position.entry(id.to_owned()).or_insert(pos);
            let body: serde_json::Value = serde_json::from_slice(&r.body)
                .unwrap_or_else(|e| panic!("{name}: the body of {id} is not JSON: {e}"));
            assert_eq!(
                body["id"], id,
                "{name}: the native id is the CloudEvents id"
            );
            assert_eq!(body["type"], m.event_type.as_str(), "{name}: type of {id}");
            assert_eq!(
                body["subject"],
                m.aggregate_id.as_str(),
                "{name}: subject of {id}"
            );
            let data: serde_json::Value =
                serde_json::from_str(m.payload.get()).expect("payload JSON");
            assert_eq!(body["data"], data, "{name}: data of {id} arrives intact");
            if self.spec.keyed {
                assert_eq!(
                    r.key.as_deref(),
                    Some(m.aggregate_id.as_str()),
                    "{name}: the ordering key of {id} is the aggregate id"
                );
            }
        }
        // Per aggregate, first arrivals follow input order.
        let mut by_aggregate: HashMap<&str, Vec<usize>> = HashMap::new();
        for m in sent {
            if let Some(pos) = first_position.get(&m.event_id.hyphenated().to_string()) {
                by_aggregate.entry(&m.aggregate_id).or_default().push(*pos);
            }
        }
        for (aggregate, positions) in by_aggregate {
            assert!(
                positions.windows(2).all(|w| w[0] < w[1]),
                "{name}: events of aggregate {aggregate} arrived out of input order: {positions:?}"
            );
        }
    }

    fn check_describe(&self) {
        let described = self.fixture.sink.describe();
        if let Some(secret) = &self.fixture.secret {
            assert!(
                !described.contains(secret.as_str()),
                "{}: describe() leaks the secret: {described}",
                self.spec.name
            );
        }
    }

    /// Publish `batch` until every outcome is delivered (the broker may take a moment to come back).
    async fn publish_until_delivered(&self, what: &str, batch: &[Message]) {
        let deadline = Instant::now() + RECOVERY;
        loop {
            let outcomes = self.publish(batch).await;
            assert!(
                !outcomes.iter().any(|o| matches!(o, Outcome::Reject { .. })),
                "{}: {what}: a message was rejected: {outcomes:?}",
                self.spec.name
            );
            if outcomes.iter().all(|o| *o == Outcome::Delivered) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{}: {what}: still not delivered after {RECOVERY:?}: {:?}",
                self.spec.name,
                outcomes.first()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Not delivered, to be tried again: a retry, or a deferral (never tried).
fn assert_all_retries(name: &str, what: &str, outcomes: &[Outcome]) {
    for (i, o) in outcomes.iter().enumerate() {
        assert!(
            matches!(o, Outcome::Retry { .. } | Outcome::Deferred { .. }),
            "{name}: {what}: outcome {i} is {o:?}, expected a retry"
        );
    }
}

/// Run the whole suite for one transport.
pub async fn run<F, Fut>(spec: Spec, make: F)
where
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = Fixture>,
{
    let proxy = Proxy::start(&spec.broker).await;
    let fixture = make(proxy.host_port()).await;
    // What the broker kept is removed even when a check fails (the suite
    // proving itself fails on purpose), then the failure goes on.
    let checked = AssertUnwindSafe(checks(&spec, &fixture, &proxy))
        .catch_unwind()
        .await;
    fixture.reader.cleanup().await;
    if let Err(panic) = checked {
        std::panic::resume_unwind(panic);
    }
}

/// The suite's checks, in order, on one fixture.
async fn checks(spec: &Spec, fixture: &Fixture, proxy: &Proxy) {
    let name = spec.name;
    let suite = Suite { spec, fixture };
    suite.check_describe();
    fixture
        .sink
        .check()
        .await
        .unwrap_or_else(|e| panic!("{name}: check() while the broker is up: {e}"));

    let started = Instant::now();
    let phase = |what: &str| eprintln!("{name}: {what} ok at {:?}", started.elapsed());

    // 1–3. One outcome per input, in order; native id; key; per-aggregate order.
    let mut batch = messages(12, 3);
    let poisoned = spec.poison.map(|poison| {
        poison(&mut batch[5]);
        5
    });
    let outcomes = suite.publish(&batch).await;
    for (i, o) in outcomes.iter().enumerate() {
        if Some(i) == poisoned {
            assert!(
                matches!(o, Outcome::Reject { .. }),
                "{name}: outcome {i} is {o:?}, expected a reject"
            );
        } else {
            assert_eq!(*o, Outcome::Delivered, "{name}: outcome {i}");
        }
    }
    let delivered: Vec<Uuid> = batch
        .iter()
        .enumerate()
        .filter(|(i, _)| Some(*i) != poisoned)
        .map(|(_, m)| m.event_id)
        .collect();
    let received = suite
        .wait_received("the first batch arrives", &delivered)
        .await;
    suite.check_messages(&batch, &received);
    phase("outcomes, ids, keys and order");
    if let Some(p) = poisoned {
        let id = batch[p].event_id.hyphenated().to_string();
        assert!(
            !received
                .iter()
                .any(|r| r.message_id.as_deref() == Some(id.as_str())),
            "{name}: the rejected message was delivered"
        );
    }

    // 4. A batch of the relay's default size.
    let big = messages(MAX_BATCH, 7);
    let outcomes = suite.publish(&big).await;
    assert!(
        outcomes.iter().all(|o| *o == Outcome::Delivered),
        "{name}: a batch of {MAX_BATCH}: {:?}",
        outcomes.iter().find(|o| **o != Outcome::Delivered)
    );
    let ids: Vec<Uuid> = big.iter().map(|m| m.event_id).collect();
    let received = suite.wait_received("the maximum batch arrives", &ids).await;
    suite.check_messages(&big, &received);
    phase("maximum batch");

    // 5. The largest payload, and one over the limit.
    let large = vec![message(0, 1, &payload_of(spec.max_payload))];
    assert_eq!(
        suite.publish(&large).await,
        vec![Outcome::Delivered],
        "{name}: a {}-byte payload",
        spec.max_payload
    );
    let received = suite
        .wait_received("the large payload arrives", &[large[0].event_id])
        .await;
    suite.check_messages(&large, &received);
    if let Some(over) = spec.oversize {
        let huge = vec![message(0, 1, &payload_of(over))];
        let outcomes = suite.publish(&huge).await;
        assert!(
            matches!(outcomes[0], Outcome::Reject { .. }),
            "{name}: a {over}-byte payload is over the limit: {outcomes:?}"
        );
    }
    phase("largest payload");

    if spec.outage {
        // 6. Broker down: retries only, and check() fails.
        match &fixture.switch {
            Some(switch) => switch.down(),
            None => proxy.stop(),
        }
        let down = messages(5, 2);
        for attempt in 1..=2 {
            let outcomes = suite.publish(&down).await;
            assert_all_retries(name, &format!("broker down, attempt {attempt}"), &outcomes);
        }
        assert!(
            fixture.sink.check().await.is_err(),
            "{name}: check() passes with the broker down"
        );
        phase("broker down");

        // 7. Broker back: the same sink delivers again.
        match &fixture.switch {
            Some(switch) => switch.up(),
            None => proxy.restore(),
        }
        suite
            .publish_until_delivered("after the broker returned", &down)
            .await;
        let ids: Vec<Uuid> = down.iter().map(|m| m.event_id).collect();
        let received = suite
            .wait_received("the batch retried after the outage arrives", &ids)
            .await;
        suite.check_messages(&down, &received);
        phase("broker back");

        // 8. Broker hanging: publish still answers, with retries.
        if let (Some(deadline), None) = (spec.hang_deadline, &fixture.switch) {
            proxy.hang();
            let hung = messages(3, 1);
            // The first attempt may fail fast on the reset connection; the
            // second one meets the silent broker.
            for attempt in 1..=2 {
                let started = Instant::now();
                let outcomes = suite.publish(&hung).await;
                let took = started.elapsed();
                assert!(
                    took < deadline,
                    "{name}: publish to a hanging broker took {took:?} (limit {deadline:?})"
                );
                assert_all_retries(
                    name,
                    &format!("broker hanging, attempt {attempt}"),
                    &outcomes,
                );
            }
            proxy.restore();
            suite
                .publish_until_delivered("after the broker stopped hanging", &hung)
                .await;
            phase("broker hanging");
        }
    }
    suite.check_describe();
}

/// Publish `total` small events (~100-byte payloads) in batches of `batch`
/// straight through [`Sink::publish`]; returns events per second. Every
/// outcome must be delivered.
#[cfg(any(
    feature = "redis",
    feature = "nats",
    feature = "amqp",
    feature = "kafka",
    feature = "sqs",
    feature = "kinesis"
))]
pub async fn throughput(sink: &dyn Sink, total: usize, batch: usize) -> f64 {
    let events: Vec<Message> = (0..total)
        .map(|i| {
            let payload = format!(
                r#"{{"order_id":{i},"customer":"c-{}","total_cents":{},"currency":"EUR","lines":3}}"#,
                i % 977,
                i * 7 % 100_000
            );
            message(i, 1000, &payload)
        })
        .collect();
    let started = Instant::now();
    for chunk in events.chunks(batch) {
        let outcomes = sink.publish(chunk).await;
        assert!(
            outcomes.iter().all(|o| *o == Outcome::Delivered),
            "throughput run: {:?}",
            outcomes.iter().find(|o| **o != Outcome::Delivered)
        );
    }
    total as f64 / started.elapsed().as_secs_f64()
}

/// The suite against the Redis sink, and against broken wrappers of it.
#[cfg(feature = "redis")]
mod with_redis {
    use super::*;

    // ---------------------------------------------------------------------------
    // Redis: the model sink passes the suite too (stream mode, whose entries carry
    // the event id in their `id` field).

    struct RedisStreamReader {
        key: String,
    }

    #[async_trait]
    impl Reader for RedisStreamReader {
        async fn received(&self) -> Vec<Received> {
            let mut conn = postbox_testkit::redis().await;
            let entries: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
                .arg(&self.key)
                .arg("-")
                .arg("+")
                .query_async(&mut conn)
                .await
                .expect("XRANGE");
            entries
                .ids
                .into_iter()
                .map(|entry| {
                    let field = |name: &str| -> Option<Vec<u8>> {
                        entry
                            .map
                            .get(name)
                            .and_then(|v| redis::from_redis_value_ref::<Vec<u8>>(v).ok())
                    };
                    Received {
                        message_id: field("id").and_then(|v| String::from_utf8(v).ok()),
                        key: None,
                        body: field("body").unwrap_or_default(),
                    }
                })
                .collect()
        }

        async fn cleanup(&self) {
            let mut conn = postbox_testkit::redis().await;
            let _: Result<(), _> = redis::cmd("DEL")
                .arg(&self.key)
                .query_async(&mut conn)
                .await;
        }
    }

    fn redis_broker() -> String {
        let url = postbox_testkit::redis_url();
        let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
        let authority = rest.split(['/', '?']).next().unwrap_or(rest);
        let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        if host_port.contains(':') {
            host_port.to_owned()
        } else {
            format!("{host_port}:6379")
        }
    }

    #[tokio::test]
    async fn redis_stream_passes_conformance() {
        let key = postbox_testkit::unique("conformance:");
        let spec = Spec {
            name: "redis",
            broker: redis_broker(),
            max_payload: MAX_PAYLOAD,
            oversize: None,
            keyed: false,
            poison: None,
            outage: true,
            hang_deadline: Some(Duration::from_secs(60)),
        };
        run(spec, |proxy| async move {
            let url = format!("redis://{proxy}/0?mode=stream&key={key}");
            let sink = postbox_relay::sinks::from_url(&url, &Default::default())
                .expect("a valid Redis sink URL");
            Fixture {
                sink,
                reader: Box::new(RedisStreamReader { key }),
                secret: None,
                switch: None,
            }
        })
        .await;
    }

    /// Throughput: `cargo test -p postbox-relay --test main --release -- --ignored --nocapture throughput`
    #[tokio::test]
    #[ignore = "a measurement, not a check"]
    async fn redis_throughput() {
        for mode in ["list", "stream"] {
            let key = postbox_testkit::unique("throughput:");
            let url = format!(
                "{}/0?mode={mode}&key={key}",
                postbox_testkit::redis_url().trim_end_matches('/')
            );
            let sink = postbox_relay::sinks::from_url(&url, &Default::default())
                .expect("a valid Redis sink URL");
            let rate = throughput(&*sink, 100_000, MAX_BATCH).await;
            println!("redis ({mode}): {rate:.0} events/s");
            RedisStreamReader { key }.cleanup().await;
        }
    }

    // ---------------------------------------------------------------------------
    // The suite checks itself: a sink that breaks one rule must fail it.

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Flaw {
        /// None: the control, which must pass.
        None,
        /// Reports a failed publish as delivered.
        DeliveredWhenDown,
        /// Dead-letters a failed publish instead of retrying it.
        RejectedWhenDown,
        /// Returns the outcomes in reverse order.
        Reversed,
        /// Returns one outcome too few.
        OneShort,
        /// Reports delivered without sending anything.
        SendsNothing,
    }

    /// The Redis sink behind a wrapper that rejects `conformance.poison` events
    /// itself (so the order check has a reject to find) and then breaks one rule.
    struct Flawed {
        inner: Arc<dyn Sink>,
        flaw: Flaw,
    }

    #[async_trait]
    impl Sink for Flawed {
        async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
            let poisoned = |m: &Message| m.event_type == "conformance.poison";
            let sendable: Vec<Message> = batch.iter().filter(|m| !poisoned(m)).cloned().collect();
            let mut sent = if self.flaw == Flaw::SendsNothing {
                vec![Outcome::Delivered; sendable.len()]
            } else {
                self.inner.publish(&sendable).await
            }
            .into_iter();
            let mut outcomes: Vec<Outcome> = batch
                .iter()
                .map(|m| match poisoned(m) {
                    true => Outcome::reject("poison"),
                    false => sent.next().unwrap_or_else(|| Outcome::retry("missing")),
                })
                .collect();
            match self.flaw {
                Flaw::DeliveredWhenDown | Flaw::RejectedWhenDown => {
                    for o in &mut outcomes {
                        if matches!(o, Outcome::Retry { .. }) {
                            *o = match self.flaw {
                                Flaw::DeliveredWhenDown => Outcome::Delivered,
                                _ => Outcome::reject("gave up"),
                            };
                        }
                    }
                }
                Flaw::Reversed => outcomes.reverse(),
                Flaw::OneShort => {
                    outcomes.pop();
                }
                Flaw::None | Flaw::SendsNothing => {}
            }
            outcomes
        }

        async fn check(&self) -> Result<(), postbox_relay::SinkError> {
            self.inner.check().await
        }

        fn describe(&self) -> String {
            self.inner.describe()
        }
    }

    async fn run_flawed(flaw: Flaw) {
        let key = postbox_testkit::unique("selftest:");
        let spec = Spec {
            name: "redis (flawed)",
            broker: redis_broker(),
            max_payload: 64 * 1024,
            oversize: None,
            keyed: false,
            poison: Some(|m| m.event_type = "conformance.poison".into()),
            outage: true,
            hang_deadline: None,
        };
        run(spec, |proxy| async move {
            let url = format!("redis://{proxy}/0?mode=stream&key={key}");
            let inner = postbox_relay::sinks::from_url(&url, &Default::default())
                .expect("a valid Redis sink URL");
            Fixture {
                sink: Arc::new(Flawed { inner, flaw }),
                reader: Box::new(RedisStreamReader { key }),
                secret: None,
                switch: None,
            }
        })
        .await;
    }

    #[tokio::test]
    async fn conformance_suite_catches_flawed_sinks() {
        let flaws = [
            Flaw::None,
            Flaw::DeliveredWhenDown,
            Flaw::RejectedWhenDown,
            Flaw::Reversed,
            Flaw::OneShort,
            Flaw::SendsNothing,
        ];
        let runs = flaws.map(|flaw| tokio::spawn(run_flawed(flaw)));
        for (flaw, result) in flaws.iter().zip(futures::future::join_all(runs).await) {
            match (flaw, result) {
                (Flaw::None, Ok(())) => {}
                (Flaw::None, Err(e)) => panic!("the control run failed: {e}"),
                (flaw, Ok(())) => panic!("the suite passed a sink with the flaw {flaw:?}"),
                (_, Err(e)) => assert!(e.is_panic(), "{e}"),
            }
        }
    }
}

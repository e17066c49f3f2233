//! Hostile input (issue 9) on the relay side: CloudEvents encoding of any
//! message, event-type globs against a reference matcher and against
//! Postgres' `LIKE`, routing and settings built from arbitrary values, and
//! claiming rows that only the SQL function could have written.
//!
//! A failure prints its shrunk input, which is the reproduction; no regression
//! files are written. `PROPTEST_CASES` runs more cases, `PROPTEST_RNG_SEED`
//! fixes the seed.

use async_trait::async_trait;
use chrono::{DateTime, SecondsFormat, Utc};
use postbox::statements::trusted;
use postbox_relay::cloudevents::{binary_headers, encode_header_value, to_json};
use postbox_relay::router::Pattern;
use postbox_relay::{
    Destination, HealthConfig, Message, Outcome, PoisonPolicy, RelayConfig, RetentionConfig,
    RouteConfig, Router, Sink, SinkError, Store,
};
use postbox_testkit::TestDb;
use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use proptest::test_runner::{TestCaseError, TestRunner};
use serde_json::value::RawValue;
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use postbox_testkit::proptest_config as config;

/// Pieces of text that have broken encoders somewhere.
const FRAGMENTS: &[&str] = &[
    "'",
    "\"",
    "\\",
    "%",
    "%25",
    "%zz",
    "%0",
    "+",
    " ",
    "\t",
    "\n",
    "\r\n",
    "\0",
    "\u{1}",
    "\u{7f}",
    "\u{85}",
    "\u{a0}",
    ",",
    ";",
    ":",
    "=",
    "/",
    "?",
    "#",
    "&",
    "{}",
    "[",
    "\u{200f}",
    "\u{202e}",
    "e\u{301}",
    "\u{feff}",
    "\u{fffd}",
    "\u{ffff}",
    "\u{10ffff}",
    "🦀",
    "👨‍👩‍👧",
    "é",
    "中文",
    "order.created",
    "$$",
    "';--",
];

/// A string of up to `max_pieces` fragments and arbitrary characters (NUL included).
fn hostile(max_pieces: usize) -> BoxedStrategy<String> {
    vec(
        prop_oneof![
            3 => proptest::sample::select(FRAGMENTS).prop_map(str::to_owned),
            1 => any::<char>().prop_map(String::from),
        ],
        0..=max_pieces,
    )
    .prop_map(|p| p.concat())
    .boxed()
}

/// JSON with hostile keys and strings and numbers of every range.
fn json_value() -> BoxedStrategy<Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        hostile(6).prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..6).prop_map(Value::Array),
            vec((hostile(3), inner), 0..6).prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
    .boxed()
}

/// Payload text as Postgres returns it, or as a producer wrote it (with
/// insignificant whitespace).
fn payload_text() -> BoxedStrategy<String> {
    prop_oneof![
        json_value().prop_map(|v| v.to_string()),
        json_value().prop_map(|v| serde_json::to_string_pretty(&v).expect("serializes")),
        Just("[]".to_owned()),
        Just("\"\"".to_owned()),
        Just(r#""\u0000 \ud83e\udd80""#.to_owned()),
        (1usize..2_000).prop_map(|n| format!("{}1{}", "[".repeat(n), "]".repeat(n))),
        (1usize..200_000).prop_map(|n| format!("\"{}\"", "x".repeat(n))),
    ]
    .boxed()
}

fn message() -> impl Strategy<Value = Message> {
    (
        (
            any::<u128>(),
            hostile(10),
            hostile(10),
            hostile(10),
            any::<i32>(),
            payload_text(),
        ),
        (
            btree_map(
                prop_oneof![
                    Just("traceparent".to_owned()),
                    Just("tracestate".to_owned()),
                    hostile(3),
                ],
                hostile(6),
                0..4,
            ),
            // Years 1 to 9999, any microsecond.
            -62_135_596_800i64..253_402_300_799,
            0u32..1_000_000_000,
            any::<i32>(),
            proptest::option::of(any::<i64>()),
        ),
    )
        .prop_map(
            |(
                (id, event_type, aggregate_type, aggregate_id, schema_version, payload),
                (headers, secs, nanos, attempt, sequence),
            )| Message {
                event_id: uuid::Uuid::from_u128(id),
                event_type,
                aggregate_type,
                aggregate_id,
                schema_version,
                payload: RawValue::from_string(payload).expect("valid JSON"),
                headers,
                created_at: DateTime::from_timestamp(secs, nanos).expect("in range"),
                attempt,
                sequence,
                source: None,
            },
        )
}

fn source() -> BoxedStrategy<String> {
    prop_oneof![Just("postbox".to_owned()), hostile(8)].boxed()
}

proptest! {
    #![proptest_config(config(256))]

    /// The structured body is always valid JSON carrying every attribute
    /// unchanged: `data` is the payload, `id` the event id, `sequence` the
    /// sequence (absent when unknown).
    #[test]
    fn structured_cloudevents_carry_every_attribute(m in message(), source in source()) {
        let text = to_json(&m, &source);
        // Typed, with `data` kept raw: serde_json reads raw values of any
        // depth, while a `Value` stops at 128 levels.
        let doc: Structured = serde_json::from_str(&text).expect("to_json writes valid JSON");
        prop_assert_eq!(doc.data.get(), m.payload.get(), "data is the payload, verbatim");
        prop_assert_eq!(doc.specversion.as_str(), "1.0");
        prop_assert_eq!(doc.id, m.event_id.hyphenated().to_string());
        prop_assert_eq!(doc.source, source);
        prop_assert_eq!(&doc.event_type, &m.event_type);
        prop_assert_eq!(&doc.subject, &m.aggregate_id);
        prop_assert_eq!(&doc.aggregatetype, &m.aggregate_type);
        prop_assert_eq!(doc.datacontenttype.as_str(), "application/json");
        prop_assert_eq!(doc.schemaversion, m.schema_version);
        prop_assert_eq!(doc.sequence, m.sequence);
        prop_assert_eq!(doc.traceparent.as_ref(), m.headers.get("traceparent"));
        prop_assert_eq!(doc.tracestate.as_ref(), m.headers.get("tracestate"));
        let time = DateTime::parse_from_rfc3339(&doc.time).expect("RFC 3339");
        let micros = m.created_at.timestamp_micros();
        prop_assert_eq!(time.with_timezone(&Utc).timestamp_micros(), micros);
    }

    /// Binary-mode headers are printable ASCII without spaces, valid HTTP
    /// header values, and percent-decode to the original attributes.
    #[test]
    fn binary_headers_are_valid_and_decode_back(m in message(), source in source()) {
        let headers = binary_headers(&m, &source);
        let time = m.created_at.to_rfc3339_opts(SecondsFormat::Micros, true);
        let mut expected: Vec<(&str, String)> = vec![
            ("ce-specversion", "1.0".to_owned()),
            ("ce-id", m.event_id.hyphenated().to_string()),
            ("ce-source", source.clone()),
            ("ce-type", m.event_type.clone()),
            ("ce-subject", m.aggregate_id.clone()),
            ("ce-time", time),
            ("ce-aggregatetype", m.aggregate_type.clone()),
            ("ce-schemaversion", m.schema_version.to_string()),
        ];
        if let Some(s) = m.sequence {
            expected.push(("ce-sequence", s.to_string()));
        }
        prop_assert_eq!(headers.len(), expected.len());
        for ((name, value), (want_name, want)) in headers.iter().zip(&expected) {
            prop_assert_eq!(name, want_name);
            prop_assert!(axum::http::HeaderName::from_static(name).as_str() == *name);
            prop_assert!(
                value.bytes().all(|b| (0x21..0x7f).contains(&b)),
                "{name}: {value:?} is not printable ASCII"
            );
            prop_assert!(axum::http::HeaderValue::from_str(value).is_ok(), "{name}: {value:?}");
            let decoded = percent_encoding::percent_decode_str(value)
                .decode_utf8()
                .expect("UTF-8 after decoding");
            prop_assert_eq!(decoded.as_ref(), want.as_str(), "{}", name);
        }
    }

    /// `encode_header_value` alone: printable ASCII, and a lossless round trip.
    #[test]
    fn header_values_round_trip(s in prop_oneof![hostile(20), any::<String>()]) {
        let encoded = encode_header_value(&s);
        prop_assert!(encoded.bytes().all(|b| (0x21..0x7f).contains(&b)), "{encoded:?}");
        let decoded = percent_encoding::percent_decode_str(&encoded)
            .decode_utf8()
            .expect("UTF-8");
        prop_assert_eq!(decoded.as_ref(), s.as_str());
    }
}

/// A structured-mode document, every member required or absent as the spec says.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Structured {
    specversion: String,
    id: String,
    source: String,
    #[serde(rename = "type")]
    event_type: String,
    subject: String,
    time: String,
    datacontenttype: String,
    aggregatetype: String,
    schemaversion: i32,
    sequence: Option<i64>,
    traceparent: Option<String>,
    tracestate: Option<String>,
    data: Box<RawValue>,
}

// ---------------------------------------------------------------------------
// Event-type globs.

/// The reference glob: `*` any run of characters (none included), `?` exactly
/// one character, anything else itself. Plain recursion over characters.
fn reference_match(pattern: &[char], text: &[char]) -> bool {
    match pattern.split_first() {
        None => text.is_empty(),
        Some(('*', rest)) => (0..=text.len()).any(|i| reference_match(rest, &text[i..])),
        Some(('?', rest)) => !text.is_empty() && reference_match(rest, &text[1..]),
        Some((c, rest)) => text.first() == Some(c) && reference_match(rest, &text[1..]),
    }
}

fn glob_chars(max: usize) -> BoxedStrategy<String> {
    vec(
        proptest::sample::select(vec!['a', 'b', '.', '*', '?', 'é', '%', '_', '\\', '🦀']),
        0..=max,
    )
    .prop_map(|c| c.into_iter().collect())
    .boxed()
}

/// A text that often matches `pattern`: each `*` and `?` filled in at random.
fn text_for(pattern: &str) -> BoxedStrategy<String> {
    let parts: Vec<BoxedStrategy<String>> = pattern
        .chars()
        .map(|c| match c {
            '*' => glob_chars(3)
                .prop_map(|s| s.replace(['*', '?'], ""))
                .boxed(),
            '?' => proptest::sample::select(vec!["a", "é", "🦀", ".", "*"])
                .prop_map(str::to_owned)
                .boxed(),
            c => Just(c.to_string()).boxed(),
        })
        .collect();
    parts.prop_map(|p| p.concat()).boxed()
}

fn pattern_and_text() -> BoxedStrategy<(String, String)> {
    glob_chars(8)
        .prop_flat_map(|p| {
            let text = prop_oneof![glob_chars(10), text_for(&p)];
            (Just(p), text)
        })
        .boxed()
}

proptest! {
    #![proptest_config(config(512))]

    /// `Pattern::matches` agrees with the reference matcher.
    #[test]
    fn globs_agree_with_the_reference((pattern, text) in pattern_and_text()) {
        match Pattern::parse(&pattern) {
            Err(_) => prop_assert!(pattern.is_empty()),
            Ok(p) => {
                let pc: Vec<char> = pattern.chars().collect();
                let tc: Vec<char> = text.chars().collect();
                prop_assert_eq!(p.matches(&text), reference_match(&pc, &tc), "{:?} vs {:?}", pattern, text);
            }
        }
    }

    /// Patterns of any text are accepted exactly when 1 to 255 bytes long and
    /// free of control characters, and never panic when matched.
    #[test]
    fn any_pattern_parses_or_is_refused(pattern in prop_oneof![hostile(12), any::<String>(), "[a.*?]{250,260}"], text in hostile(12)) {
        let valid = !pattern.is_empty()
            && pattern.len() <= postbox::MAX_NAME_BYTES
            && !pattern.chars().any(char::is_control);
        match Pattern::parse(&pattern) {
            Ok(p) => {
                prop_assert!(valid);
                let _ = p.matches(&text);
                let _ = p.like();
            }
            Err(reason) => {
                prop_assert!(!valid);
                prop_assert!(!reason.is_empty());
            }
        }
    }
}

/// The ordered claim asks Postgres `event_type LIKE pattern.like()`: the same
/// answer as `Pattern::matches` for every pattern and text.
#[test]
fn globs_agree_with_postgres_like() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let db = rt.block_on(TestDb::empty());
    let mut runner = TestRunner::new(config(24));
    let result = runner.run(&vec(pattern_and_text(), 1..48), |cases| {
        let cases: Vec<(Pattern, String)> = cases
            .into_iter()
            .filter_map(|(p, t)| Pattern::parse(&p).ok().map(|p| (p, t)))
            .collect();
        let texts: Vec<&str> = cases.iter().map(|(_, t)| t.as_str()).collect();
        let likes: Vec<String> = cases.iter().map(|(p, _)| p.like()).collect();
        let answers: Vec<bool> = rt
            .block_on(
                sqlx::query_scalar(
                    "SELECT t LIKE p FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS c(t, p, i) \
                     ORDER BY i",
                )
                .bind(&texts)
                .bind(&likes)
                .fetch_all(&db.pool),
            )
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        for ((p, t), sql) in cases.iter().zip(answers) {
            prop_assert_eq!(p.matches(t), sql, "{:?} (LIKE {:?}) vs {:?}", p, p.like(), t);
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    rt.block_on(db.drop_schema());
}

// ---------------------------------------------------------------------------
// Routing and settings from arbitrary values.

struct Nothing;

#[async_trait]
impl Sink for Nothing {
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        vec![Outcome::Delivered; batch.len()]
    }
    async fn check(&self) -> Result<(), SinkError> {
        Ok(())
    }
    fn describe(&self) -> String {
        "nothing".into()
    }
}

fn destination_name() -> BoxedStrategy<String> {
    prop_oneof![
        4 => proptest::sample::select(vec!["a", "b", "billing", "search-1", "x_y", "Z9"]).prop_map(str::to_owned),
        1 => hostile(4),
        1 => "[a-z]{60,70}",
    ]
    .boxed()
}

/// A route that mostly names the given destinations (and sometimes others),
/// with mostly sensible globs (and sometimes empty, huge or control-laden ones).
fn route_config(names: Vec<String>) -> impl Strategy<Value = RouteConfig> {
    let known = if names.is_empty() {
        destination_name()
    } else {
        proptest::sample::select(names).boxed()
    };
    (
        prop_oneof![
            5 => vec(glob_chars(6).prop_filter("non-empty", |g| !g.is_empty()), 1..4),
            1 => vec(
                prop_oneof![glob_chars(6), hostile(4), "[a.*]{250,260}"],
                0..4,
            ),
        ],
        prop_oneof![
            5 => vec(known, 1..4),
            1 => vec(destination_name(), 0..4),
        ],
        any::<bool>(),
        prop_oneof![Just(PoisonPolicy::Block), Just(PoisonPolicy::Skip)],
    )
        .prop_map(|(matches, to, ordered, poison)| RouteConfig {
            matches,
            to,
            ordered,
            poison,
            ..RouteConfig::default()
        })
}

fn destinations_and_routes() -> impl Strategy<Value = (Vec<String>, Vec<RouteConfig>)> {
    prop_oneof![
        4 => proptest::sample::subsequence(vec!["a", "b", "billing", "search-1", "x_y", "Z9"], 1..4)
            .prop_map(|n| n.into_iter().map(str::to_owned).collect::<Vec<_>>()),
        1 => vec(destination_name(), 0..4),
    ]
    .prop_flat_map(|names| (Just(names.clone()), vec(route_config(names), 0..4)))
}

/// Whether `Router::new` must accept these destinations and routes.
fn routes_valid(names: &[String], routes: &[RouteConfig]) -> bool {
    let name_ok = |n: &String| {
        !n.is_empty()
            && n.len() <= 64
            && n.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    };
    let unique = names
        .iter()
        .enumerate()
        .all(|(i, n)| !names[..i].contains(n));
    !names.is_empty()
        && names.iter().all(name_ok)
        && unique
        && !routes.is_empty()
        && routes.iter().all(|r| {
            !r.matches.is_empty()
                && r.matches.iter().all(|p| Pattern::parse(p).is_ok())
                && !r.to.is_empty()
                && r.to.iter().all(|t| names.contains(t))
        })
}

proptest! {
    #![proptest_config(config(256))]

    /// `Router::new` never panics; it accepts exactly the valid configurations
    /// (naming the field otherwise), and the router it builds sends each event
    /// type to the union of the destinations of the routes matching it.
    #[test]
    fn routers_from_arbitrary_routes(
        (names, routes) in destinations_and_routes(),
        event_types in vec(glob_chars(8).prop_map(|s| s.replace(['*', '?'], "")), 1..8),
    ) {
        let destinations: Vec<Destination> = names
            .iter()
            .map(|n| Destination::new(n.clone(), Arc::new(Nothing) ))
            .collect();
        let valid = routes_valid(&names, &routes);
        match Router::new(destinations, &routes) {
            Err(e) => {
                prop_assert!(!valid, "refused a valid configuration: {e}");
                prop_assert!(!e.field.is_empty());
                prop_assert!(e.to_string().starts_with("invalid configuration: "), "{e}");
            }
            Ok(router) => {
                prop_assert!(valid, "accepted an invalid configuration");
                for t in &event_types {
                    let tc: Vec<char> = t.chars().collect();
                    let mut want: Vec<usize> = Vec::new();
                    for r in &routes {
                        let hit = r.matches.iter().any(|p| {
                            reference_match(&p.chars().collect::<Vec<_>>(), &tc)
                        });
                        if hit {
                            for to in &r.to {
                                let d = names.iter().position(|n| n == to).expect("known");
                                if !want.contains(&d) {
                                    want.push(d);
                                }
                            }
                        }
                    }
                    prop_assert_eq!(router.targets(t), want, "event type {:?}", t);
                }
                let order = router.claim_order();
                prop_assert_eq!(order.is_some(), routes.iter().any(|r| r.ordered));
                let router = router.all_ordered(PoisonPolicy::Skip);
                prop_assert!(router.claim_order().is_some());
            }
        }
    }
}

fn duration() -> BoxedStrategy<Duration> {
    prop_oneof![
        Just(Duration::ZERO),
        Just(Duration::MAX),
        Just(Duration::from_secs(u64::MAX)),
        Just(Duration::from_nanos(1)),
        (0u64..100_000).prop_map(Duration::from_millis),
        (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
    ]
    .boxed()
}

fn relay_config() -> impl Strategy<Value = RelayConfig> {
    (
        (
            prop_oneof![any::<u32>(), 0u32..20_000],
            duration(),
            duration(),
            duration(),
            any::<i32>(),
        ),
        (
            duration(),
            duration(),
            duration(),
            any::<bool>(),
            duration(),
        ),
    )
        .prop_map(
            |(
                (batch_size, poll_interval, lease, publish_timeout, max_attempts),
                (backoff_base, backoff_max, rescue_interval, listen, shutdown_timeout),
            )| RelayConfig {
                mode: postbox_relay::ReadMode::Claim,
                log_segment_age: Duration::from_secs(60),
                batch_size,
                poll_interval,
                lease,
                publish_timeout,
                max_attempts,
                backoff_base,
                backoff_max,
                rescue_interval,
                listen,
                shutdown_timeout,
                synchronous_commit: true,
                ..RelayConfig::default()
            },
        )
}

proptest! {
    #![proptest_config(config(256))]

    /// `RelayConfig::validate` never panics, however large the durations,
    /// and names a `relay.` field when it refuses.
    #[test]
    fn relay_config_validation_never_panics(c in relay_config()) {
        if let Err(e) = c.validate() {
            prop_assert!(e.field.starts_with("relay."), "{e}");
        } else {
            prop_assert!(c.publish_timeout.checked_mul(2).is_some_and(|d| d < c.lease));
        }
    }

    /// Same for `[health]` (with NaN and infinite ratios) and `[retention]`.
    #[test]
    fn health_and_retention_validation_never_panic(
        enabled in any::<bool>(),
        (interval, max_transaction_age, repeat_warning, older_than, pause, every) in
            (duration(), duration(), duration(), duration(), duration(), duration()),
        max_slot_xmin_age in any::<i64>(),
        max_dead_tuple_ratio in prop_oneof![
            any::<f64>(),
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(-0.0),
            Just(1.0),
        ],
        min_dead_tuples in any::<i64>(),
        batch_size in any::<u32>(),
        flags in any::<(bool, bool)>(),
    ) {
        let health = HealthConfig {
            enabled,
            interval,
            max_transaction_age,
            max_slot_xmin_age,
            max_dead_tuple_ratio,
            min_dead_tuples,
            repeat_warning,
        };
        match health.validate() {
            Err(e) => prop_assert!(e.field.starts_with("health."), "{e}"),
            Ok(()) => prop_assert!((0.0..=1.0).contains(&max_dead_tuple_ratio)),
        }
        let retention = RetentionConfig {
            enabled,
            older_than,
            archive: flags.0,
            inbox: flags.1,
            batch_size,
            pause,
            interval: every,
            vacuum: flags.0,
        };
        if let Err(e) = retention.validate() {
            prop_assert!(e.field.starts_with("retention."), "{e}");
        }
    }
}

// ---------------------------------------------------------------------------
// Claiming what only the SQL function can write.

/// Enqueue an odd event between two plain ones through the SQL function and
/// claim them. The SQL function stores JSON of any depth Postgres can parse
/// (see the library's hostile tests), and a claim decodes every row of its
/// batch: one odd row must not take its neighbours down with it.
async fn claim_next_to(db: &TestDb, payload: &str, headers: &str) -> Result<Message, String> {
    let sql = db.sql("SELECT {schema}.enqueue($1, 'doc', $2, $3::text::jsonb, $4::text::jsonb)");
    for (event_type, id, payload, headers) in [
        ("plain", "1", "{\"a\": 1}", "{}"),
        ("odd", "2", payload, headers),
        ("plain", "3", "[2]", "{\"h\": \"v\"}"),
    ] {
        sqlx::query(trusted(&sql))
            .bind(event_type)
            .bind(id)
            .bind(payload)
            .bind(headers)
            .execute(&db.pool)
            .await
            .map_err(|e| format!("enqueue: {e}"))?;
    }
    let store = Store::new(db.pool.clone(), db.schema.clone());
    let claim = store
        .claim(10, Duration::from_secs(60), None)
        .await
        .map_err(|e| format!("the claim failed for the whole batch: {e}"))?;
    let types: Vec<&str> = claim.events.iter().map(|m| m.event_type.as_str()).collect();
    if types.iter().filter(|t| **t == "plain").count() != 2 {
        return Err(format!("the plain events were not handed out: {types:?}"));
    }
    let odd = claim
        .events
        .into_iter()
        .find(|m| m.event_type == "odd")
        .ok_or("the odd event was neither handed out nor refused")?;
    if odd.payload.get() != payload {
        return Err("the odd payload was altered".into());
    }
    Ok(postbox_relay::message(odd))
}

#[tokio::test]
async fn a_deeply_nested_payload_is_claimed_verbatim() {
    let db = TestDb::new().await;
    let payload = format!("{}1{}", "[".repeat(5_000), "]".repeat(5_000));
    claim_next_to(&db, &payload, "{}").await.unwrap();
    db.drop_schema().await;
}

#[tokio::test]
async fn a_deeply_nested_header_value_does_not_block_its_batch() {
    let db = TestDb::new().await;
    let deep = format!("{}1{}", "[".repeat(5_000), "]".repeat(5_000));
    let headers = format!("{{\"h\": {deep}, \"x\": \"y\"}}");
    let odd = claim_next_to(&db, "{}", &headers).await.unwrap();
    // A value too deep to re-encode travels as its JSON text, verbatim.
    assert!(
        odd.headers["h"] == deep,
        "the deep header value was altered"
    );
    assert_eq!(odd.headers["x"], "y");
    db.drop_schema().await;
}

#[tokio::test]
async fn hostile_header_names_and_values_are_claimed_verbatim() {
    let db = TestDb::new().await;
    let headers = serde_json::json!({
        "": "empty name",
        "x-'\";--": "$$\\u0000\u{202e}🦀\u{ffff}",
        "n": 12,
        "o": {"nested": [1, "two"]},
    });
    let odd = claim_next_to(&db, "{}", &headers.to_string())
        .await
        .unwrap();
    let want: BTreeMap<String, String> = headers
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| match v {
            Value::String(s) => (k.clone(), s.clone()),
            other => (k.clone(), other.to_string()),
        })
        .collect();
    assert_eq!(odd.headers, want);
    db.drop_schema().await;
}

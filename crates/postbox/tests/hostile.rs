//! Hostile input (issue 9): property tests that feed the signature verifiers,
//! the event builder, `enqueue` and the SQL function `<schema>.enqueue(...)`
//! huge, malformed and unusual input. Every case ends in a clear error or a
//! faithful round trip: no panic, no verification without the right key, no
//! altered or partial row.
//!
//! A failure prints its shrunk input, which is the reproduction; no regression
//! files are written. `PROPTEST_CASES` runs more cases, `PROPTEST_RNG_SEED`
//! fixes the seed.

use postbox::statements::trusted;
use postbox::verify::{qstash, webhooks};
use postbox::{Error, NewEvent, Outbox, MAX_NAME_BYTES};
use postbox_testkit::TestDb;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{TestCaseError, TestRunner};
use serde_json::Value;
use sqlx::Row;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Proptest settings: `cases` cases (or `PROPTEST_CASES` when set, for a
use postbox_testkit::proptest_config as config;

/// Run a property that needs the database: one runtime and one schema for the
/// whole property, one case after another.
fn db_property<S, F, Fut>(cases: u32, strategy: S, test: F)
where
    S: Strategy,
    S::Value: std::fmt::Debug,
    F: Fn(Arc<TestDb>, S::Value) -> Fut,
    Fut: std::future::Future<Output = Result<(), TestCaseError>>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let db = Arc::new(rt.block_on(TestDb::new()));
    let mut runner = TestRunner::new(config(cases));
    let result = runner.run(&strategy, |value| rt.block_on(test(db.clone(), value)));
    if let Err(e) = result {
        panic!("{e}");
    }
    if let Ok(db) = Arc::try_unwrap(db) {
        rt.block_on(db.drop_schema());
    }
}

// ---------------------------------------------------------------------------
// Hostile strings.

/// Fragments that have broken SQL, JSON, shells or Unicode handling somewhere.
const FRAGMENTS: &[&str] = &[
    "'",
    "''",
    "\"",
    "\";--",
    "'; DROP TABLE outbox; --",
    "$$",
    "$fn$",
    "\\",
    "\\\\",
    "\\'",
    "\\u0000",   // the six characters, not NUL: storable
    "\\\\u0000", // likewise, after an escaped backslash
    "%",
    "_",
    "*",
    "?",
    "{schema}",
    "E'\\x00'",
    "NULL",
    "null",
    "{}",
    "[",
    "}",
    ":",
    ",",
    " ",
    "\t",
    "\n",
    "\r\n",
    "\u{1}",
    "\u{1f}",
    "\u{7f}",
    "\u{85}",
    "\u{a0}",
    "\u{200b}", // zero-width space
    "\u{200f}", // right-to-left mark
    "\u{202e}", // right-to-left override
    "\u{2066}", // left-to-right isolate
    "e\u{301}", // e + combining acute
    "\u{301}",  // a lone combining mark
    "\u{fe0f}", // variation selector
    "\u{feff}", // byte order mark
    "\u{fffd}", // replacement character
    "\u{fffe}", // noncharacter
    "\u{ffff}", // noncharacter
    "\u{10ffff}",
    "🦀",
    "👨‍👩‍👧", // ZWJ sequence
    "🇺🇦", // regional indicators
    "é",
    "ß",
    "İ",
    "ﬁ",
    "Ω",
    "中文",
    "a",
    "order.created",
];

/// A fragment or any single character; NUL only when `nul`.
fn piece(nul: bool) -> BoxedStrategy<String> {
    let fragment = proptest::sample::select(FRAGMENTS).prop_map(str::to_owned);
    let any_char = any::<char>().prop_map(String::from);
    if nul {
        prop_oneof![
            6 => fragment,
            3 => any_char,
            1 => Just("\0".to_owned()),
        ]
        .boxed()
    } else {
        prop_oneof![
            6 => fragment,
            3 => any_char.prop_filter("no NUL", |s| s != "\0"),
        ]
        .boxed()
    }
}

/// A string of hostile pieces (possibly empty, possibly with NUL when `nul`).
fn hostile(max_pieces: usize, nul: bool) -> BoxedStrategy<String> {
    vec(piece(nul), 0..=max_pieces)
        .prop_map(|p| p.concat())
        .boxed()
}

/// Exactly `target` bytes: `filler` as often as it fits, then ASCII `a`s.
fn exact_len(target: usize, filler: char) -> String {
    let mut s = String::with_capacity(target);
    while s.len() + filler.len_utf8() <= target {
        s.push(filler);
    }
    while s.len() < target {
        s.push('a');
    }
    s
}

/// A name argument: hostile text, or a string right around the 255-byte limit
/// built from multi-byte characters.
fn name_arg() -> BoxedStrategy<String> {
    let around_limit = (
        (MAX_NAME_BYTES - 2)..=(MAX_NAME_BYTES + 2),
        proptest::sample::select(vec!['x', 'é', '中', '🦀', '\u{ffff}', '\'']),
    )
        .prop_map(|(n, c)| exact_len(n, c));
    prop_oneof![
        8 => hostile(12, false),
        1 => hostile(12, true),
        2 => around_limit,
        1 => hostile(3, false).prop_map(|s| s.repeat(40)),
    ]
    .boxed()
}

/// JSON with hostile strings in keys and values, and numbers of every range
/// (jsonb keeps a number's value, not its spelling: see `json_eq`).
fn json_value(nul: bool) -> BoxedStrategy<Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        hostile(8, nul).prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            vec(inner.clone(), 0..6).prop_map(Value::Array),
            vec((hostile(4, nul), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
    .boxed()
}

/// Whether `v` holds a NUL anywhere (which neither text nor jsonb can store).
fn json_has_nul(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(a) => a.iter().any(json_has_nul),
        Value::Object(o) => o.iter().any(|(k, v)| k.contains('\0') || json_has_nul(v)),
        _ => false,
    }
}

/// JSON equality as jsonb defines it: numbers compare by value (jsonb writes
/// `1e2` as `100` and `-0` as `0`), everything else exactly. Floats may differ
/// in the last bits: jsonb keeps the exact decimal, but serde_json's default
/// float parser is only nearly exact on some spellings (`0.000…0635` against
/// `6.35e-16`); the exact comparison is made by Postgres in `assert_stored`.
fn json_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            match (x.as_i64(), y.as_i64(), x.as_u64(), y.as_u64()) {
                (Some(x), Some(y), _, _) => x == y,
                (_, _, Some(x), Some(y)) => x == y,
                _ => {
                    let x = x.as_f64().unwrap_or(f64::NAN);
                    let y = y.as_f64().unwrap_or(f64::NAN);
                    x == y || (x - y).abs() <= 4.0 * f64::EPSILON * x.abs().max(y.abs())
                }
            }
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| json_eq(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| json_eq(v, w)))
        }
        _ => a == b,
    }
}

// ---------------------------------------------------------------------------
// Standard Webhooks.

const WH_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const WH_SECRET_B64: &str = "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const NOW: i64 = 1_700_000_000;

/// A header value an attacker might send.
fn header_text() -> BoxedStrategy<String> {
    let b64 = "[A-Za-z0-9+/=_-]{0,64}";
    prop_oneof![
        3 => hostile(10, true),
        2 => any::<String>(),
        // Plausible signature lists: `v1,`-prefixed base64-ish entries.
        2 => vec(
            (
                proptest::sample::select(vec!["v1", "v1a", "v2", "V1", "", "v1 "]),
                b64,
            )
                .prop_map(|(v, s)| format!("{v},{s}")),
            0..5
        )
        .prop_map(|e| e.join(" ")),
        // Digits, some beyond i64, signs, exponents.
        1 => "[-+]?[0-9]{0,25}(e[0-9]{1,3})?",
        // Huge values.
        1 => (hostile(2, true), 1usize..40_000).prop_map(|(s, n)| s.repeat(n.min(200_000 / s.len().max(1)))),
    ]
    .boxed()
}

/// A request body: bytes of any value (not UTF-8 in general), now and then
/// 64 KiB to 1 MiB (rarely: hashing a megabyte is slow in a debug build).
fn body_bytes() -> BoxedStrategy<Vec<u8>> {
    prop_oneof![
        14 => vec(any::<u8>(), 0..512),
        1 => (any::<u8>(), (1usize << 16)..=(1 << 20) + 1).prop_map(|(b, n)| vec![b; n]),
        1 => Just(Vec::new()),
    ]
    .boxed()
}

proptest! {
    #![proptest_config(config(256))]

    /// Arbitrary header values and bodies never panic and never verify.
    #[test]
    fn webhooks_reject_arbitrary_headers(
        id in proptest::option::of(header_text()),
        timestamp in proptest::option::of(prop_oneof![header_text(), Just(NOW.to_string())]),
        signature in proptest::option::of(header_text()),
        body in body_bytes(),
        now in prop_oneof![Just(NOW), any::<i64>()],
    ) {
        let verifier = webhooks::Verifier::new(WH_SECRET).expect("valid secret");
        let headers = webhooks::Headers {
            id: id.as_deref(),
            timestamp: timestamp.as_deref(),
            signature: signature.as_deref(),
        };
        let result = verifier.verify_at(&headers, &body, now);
        prop_assert!(result.is_err(), "an unsigned delivery verified");
        let text = result.unwrap_err().to_string();
        prop_assert!(!text.is_empty());
        prop_assert!(!text.contains(WH_SECRET_B64), "{text}");
    }

    /// Secrets of any shape either parse or fail with a message that does not echo them.
    #[test]
    fn webhooks_secrets_parse_or_fail_without_echo(raw in prop_oneof![
        hostile(10, true),
        "(whsec_)?[A-Za-z0-9+/=_ -]{0,80}",
    ]) {
        for result in [
            webhooks::Verifier::new(&raw).map(|_| ()),
            webhooks::Verifier::from_env_value(&raw).map(|_| ()),
            webhooks::Signer::new(&raw).map(|_| ()),
        ] {
            if let Err(e) = result {
                let text = e.to_string();
                let payload = raw.trim().trim_start_matches("whsec_");
                prop_assert!(
                    payload.len() < 8 || !text.contains(payload),
                    "{text} echoes {raw:?}"
                );
            }
        }
    }

    /// A delivery signed with the right key verifies, whatever its id and body;
    /// changing one byte of the body, of the id or of the signature fails it.
    #[test]
    fn webhooks_signed_round_trip_and_tamper(
        key in vec(any::<u8>(), 1..96),
        other_key in vec(any::<u8>(), 1..96),
        id in hostile(10, true).prop_filter("not blank", |s| !s.trim().is_empty()),
        skew in -300i64..=300,
        body in body_bytes(),
        index in any::<proptest::sample::Index>(),
        flip in 1u8..=255,
    ) {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD;
        let secret = format!("whsec_{}", b64.encode(&key));
        let signer = webhooks::Signer::new(&secret).expect("valid secret");
        let verifier = webhooks::Verifier::new(&secret).expect("valid secret");
        let ts = NOW + skew;
        let ts_text = ts.to_string();
        let signature = signer.sign(&id, ts, &body);
        let good = webhooks::Headers::new(&id, &ts_text, &signature);
        prop_assert_eq!(verifier.verify_at(&good, &body, NOW), Ok(()));

        // Another key does not verify it.
        if other_key != key {
            let other = webhooks::Verifier::new(&format!("whsec_{}", b64.encode(&other_key)))
                .expect("valid secret");
            prop_assert_eq!(
                other.verify_at(&good, &body, NOW),
                Err(webhooks::VerifyError::SignatureMismatch)
            );
        }

        // One byte of the body.
        if !body.is_empty() {
            let mut tampered = body.clone();
            tampered[index.index(body.len())] ^= flip;
            prop_assert_eq!(
                verifier.verify_at(&good, &tampered, NOW),
                Err(webhooks::VerifyError::SignatureMismatch)
            );
        }

        // One byte of the MAC.
        let mut mac = b64.decode(signature.trim_start_matches("v1,")).expect("base64");
        let i = index.index(mac.len());
        mac[i] ^= flip;
        let forged = format!("v1,{}", b64.encode(&mac));
        prop_assert_eq!(
            verifier.verify_at(&webhooks::Headers::new(&id, &ts_text, &forged), &body, NOW),
            Err(webhooks::VerifyError::SignatureMismatch)
        );

        // One character of the signature's base64 data (not its padding).
        let data = signature.trim_start_matches("v1,").trim_end_matches('=');
        let at = index.index(data.len());
        let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let old = data.as_bytes()[at];
        let new = alphabet[(alphabet.iter().position(|&c| c == old).expect("base64 char")
            + usize::from(flip)) % 64];
        if new != old {
            let mut chars = data.as_bytes().to_vec();
            chars[at] = new;
            let forged = format!("v1,{}", String::from_utf8(chars).expect("ascii"));
            prop_assert_eq!(
                verifier.verify_at(&webhooks::Headers::new(&id, &ts_text, &forged), &body, NOW),
                Err(webhooks::VerifyError::SignatureMismatch)
            );
        }

        // One ASCII byte of the id (same length, so the signed text really differs).
        let mut id_bytes = id.clone().into_bytes();
        let at = index.index(id_bytes.len());
        if id_bytes[at].is_ascii() {
            id_bytes[at] ^= 1;
            let other_id = String::from_utf8(id_bytes).expect("still UTF-8");
            let headers = webhooks::Headers::new(&other_id, &ts_text, &signature);
            prop_assert!(verifier.verify_at(&headers, &body, NOW).is_err());
        }
    }
}

// ---------------------------------------------------------------------------
// QStash.

const QS_CURRENT: &str = "sig_7kYjw48mhY7kAjqNGcy6cr29RJ6r";
const QS_NEXT: &str = "sig_5ZB6DVzB1wjE8S6rZ7eenA8Pdnhs";

fn b64url(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

fn hmac_sha256(key: &[u8], message: &[u8]) -> Vec<u8> {
    use hmac::Mac as _;
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(key).expect("any key length");
    mac.update(message);
    mac.finalize().into_bytes().to_vec()
}

/// A JSON number or near-number as it might appear in `exp`/`nbf`/`iat`.
fn numeric_claim() -> BoxedStrategy<Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        Just(serde_json::json!(i64::MAX)),
        Just(serde_json::json!(i64::MIN)),
        Just(serde_json::json!(1e308)),
        Just(serde_json::json!(-1e308)),
        (NOW - 10..NOW + 10).prop_map(Value::from),
        Just(Value::Null),
        hostile(3, true).prop_map(Value::String),
        Just(serde_json::json!([1])),
    ]
    .boxed()
}

/// A JWT header: `alg` of any kind, sometimes duplicated or missing.
fn jwt_header() -> BoxedStrategy<String> {
    let alg = prop_oneof![
        Just("HS256".to_owned()),
        Just("none".to_owned()),
        Just("None".to_owned()),
        Just("NONE".to_owned()),
        Just("hs256".to_owned()),
        Just("HS256 ".to_owned()),
        Just("HS512".to_owned()),
        Just("RS256".to_owned()),
        Just("ES256".to_owned()),
        hostile(4, true),
    ];
    prop_oneof![
        alg.clone()
            .prop_map(|a| serde_json::json!({"alg": a, "typ": "JWT"}).to_string()),
        alg.prop_map(|a| format!(r#"{{"alg":"HS256","alg":{}}}"#, Value::String(a))),
        Just(r#"{"typ":"JWT"}"#.to_owned()),
        Just(r#"{"alg":null}"#.to_owned()),
        Just(r#"{"alg":256}"#.to_owned()),
        Just("[]".to_owned()),
        hostile(6, true),
    ]
    .boxed()
}

/// Claims: right or wrong issuer, hash and times of any size, extra junk.
fn jwt_claims(body: Vec<u8>) -> BoxedStrategy<String> {
    let iss = prop_oneof![
        Just(Value::from("Upstash")),
        Just(Value::from("upstash")),
        Just(Value::Null),
        hostile(3, true).prop_map(Value::String),
    ];
    let hash = prop_oneof![
        Just(qstash::body_hash(&body)),
        Just(qstash::body_hash(&body).trim_end_matches('=').to_owned()),
        Just(qstash::body_hash(b"")),
        "[A-Za-z0-9_=-]{0,50}",
    ];
    (
        iss,
        proptest::option::of(numeric_claim()),
        proptest::option::of(numeric_claim()),
        proptest::option::of(numeric_claim()),
        proptest::option::of(hash),
        hostile(4, true),
    )
        .prop_map(|(iss, exp, nbf, iat, body, junk)| {
            let mut c = serde_json::Map::new();
            c.insert("iss".into(), iss);
            exp.map(|v| c.insert("exp".into(), v));
            nbf.map(|v| c.insert("nbf".into(), v));
            iat.map(|v| c.insert("iat".into(), v));
            body.map(|v| c.insert("body".into(), Value::String(v)));
            c.insert(junk, Value::from("?"));
            Value::Object(c).to_string()
        })
        .boxed()
}

/// Three random segments, or a token of random header and claims with a
/// signature that is empty, random, or made with a key the verifier does not hold.
fn forged_token(body: Vec<u8>) -> BoxedStrategy<String> {
    let segment = "[A-Za-z0-9_=+/.-]{0,60}";
    let random_parts = vec(segment, 0..6).prop_map(|p| p.join("."));
    let structured = (
        jwt_header(),
        jwt_claims(body),
        prop_oneof![
            Just(None),
            Just(Some(b"sig_someoneelse".to_vec())),
            Just(Some(Vec::new())),
            vec(any::<u8>(), 1..40).prop_map(Some),
        ],
        prop_oneof![Just(String::new()), "[A-Za-z0-9_-]{1,60}"],
    )
        .prop_map(|(h, c, key, random_sig)| {
            let message = format!("{}.{}", b64url(h.as_bytes()), b64url(c.as_bytes()));
            let sig = match key {
                Some(k) if k != QS_CURRENT.as_bytes() && k != QS_NEXT.as_bytes() => {
                    b64url(&hmac_sha256(&k, message.as_bytes()))
                }
                _ => random_sig,
            };
            format!("{message}.{sig}")
        });
    prop_oneof![
        1 => hostile(10, true),
        1 => random_parts,
        4 => structured,
        1 => (hostile(1, false), 1usize..20_000).prop_map(|(s, n)| s.repeat(n)),
    ]
    .boxed()
}

fn qstash_verifier() -> qstash::Verifier {
    qstash::Verifier::new(QS_CURRENT, Some(QS_NEXT)).expect("valid keys")
}

proptest! {
    #![proptest_config(config(256))]

    /// Tokens not signed with either key never verify and never panic, at
    /// any clock and tolerance; their errors are short and name no key.
    #[test]
    fn qstash_rejects_forged_tokens(
        (body, token) in body_bytes().prop_flat_map(|b| (Just(b.clone()), forged_token(b))),
        now in prop_oneof![Just(NOW), any::<i64>()],
        tolerance in prop_oneof![Just(0u64), any::<u64>()],
    ) {
        let v = qstash_verifier().with_clock_tolerance(tolerance);
        let result = v.verify_at(Some(&token), &body, now);
        prop_assert!(result.is_err(), "forged token verified: {token:?}");
        let text = result.unwrap_err().to_string();
        prop_assert!(!text.contains(QS_CURRENT) && !text.contains(QS_NEXT), "{text}");
        prop_assert!(text.len() < 512, "error text is bounded: {text}");
    }

    /// `alg: none` (any spelling) with a claim set that would otherwise pass is refused.
    #[test]
    fn qstash_refuses_alg_none(
        alg in proptest::sample::select(vec!["none", "None", "NONE", "nOnE"]),
        body in body_bytes(),
        sig in prop_oneof![Just(String::new()), "[A-Za-z0-9_-]{1,43}"],
    ) {
        let header = serde_json::json!({"alg": alg, "typ": "JWT"}).to_string();
        let claims = serde_json::to_string(&qstash::Claims::new("https://x", &body, NOW, 300))
            .expect("claims serialize");
        let token = format!("{}.{}.{sig}", b64url(header.as_bytes()), b64url(claims.as_bytes()));
        prop_assert_eq!(
            qstash_verifier().verify_at(Some(&token), &body, NOW),
            Err(qstash::VerifyError::UnsupportedAlgorithm { alg: alg.to_owned() })
        );
    }

    /// Tokens signed with the right key but holding arbitrary claims never
    /// panic; when one verifies, its claims really are valid.
    #[test]
    fn qstash_checks_every_claim_of_signed_tokens(
        (body, claims) in body_bytes().prop_flat_map(|b| (Just(b.clone()), jwt_claims(b))),
        use_next in any::<bool>(),
    ) {
        let header = r#"{"alg":"HS256","typ":"JWT"}"#;
        let message = format!("{}.{}", b64url(header.as_bytes()), b64url(claims.as_bytes()));
        let key = if use_next { QS_NEXT } else { QS_CURRENT };
        let token = format!("{message}.{}", b64url(&hmac_sha256(key.as_bytes(), message.as_bytes())));
        if let Ok(c) = qstash_verifier().verify_at(Some(&token), &body, NOW) {
            prop_assert_eq!(c.iss.as_str(), "Upstash");
            prop_assert!(c.exp > NOW, "expired token accepted: {claims}");
            prop_assert!(c.nbf <= NOW, "premature token accepted: {claims}");
            let expected = qstash::body_hash(&body);
            prop_assert_eq!(c.body.trim_end_matches('='), expected.trim_end_matches('='));
        }
    }

    /// A token signed with either key for any URL and body verifies (also with
    /// enormous `exp` and odd `iat`); one byte changed in the body, the
    /// signature or the claims makes it fail.
    #[test]
    fn qstash_signed_round_trip_and_tamper(
        key in prop_oneof![Just(QS_CURRENT.to_owned()), Just(QS_NEXT.to_owned()), hostile(6, true).prop_filter("non-empty", |k| !k.is_empty())],
        url in hostile(10, true),
        body in body_bytes(),
        exp in prop_oneof![(NOW + 1)..=i64::MAX, Just(i64::MAX)],
        nbf in prop_oneof![i64::MIN..=NOW, Just(NOW)],
        iat in proptest::option::of(any::<i64>()),
        index in any::<proptest::sample::Index>(),
        flip in 1u8..=255,
    ) {
        let verifier = qstash::Verifier::new(&key, Some(QS_NEXT))
            .expect("non-empty key")
            .with_expected_url(url.clone());
        let mut claims = qstash::Claims::new(url.clone(), &body, NOW, 0);
        claims.exp = exp;
        claims.nbf = nbf;
        claims.iat = iat;
        let token = qstash::sign(&key, &claims).expect("signs");
        prop_assert_eq!(verifier.verify_at(Some(&token), &body, NOW), Ok(claims.clone()));

        // Wrong key.
        let stranger = qstash::Verifier::new("sig_someoneelse", None).expect("valid");
        prop_assert_eq!(
            stranger.verify_at(Some(&token), &body, NOW),
            Err(qstash::VerifyError::InvalidSignature)
        );

        // One byte of the body.
        if !body.is_empty() {
            let mut tampered = body.clone();
            tampered[index.index(body.len())] ^= flip;
            prop_assert_eq!(
                verifier.verify_at(Some(&token), &tampered, NOW),
                Err(qstash::VerifyError::BodyMismatch)
            );
        }

        // One byte of the signature.
        use base64::Engine as _;
        let engine = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let (message, sig) = token.rsplit_once('.').expect("three parts");
        let mut mac = engine.decode(sig).expect("base64url");
        let i = index.index(mac.len());
        mac[i] ^= flip;
        let forged = format!("{message}.{}", engine.encode(&mac));
        prop_assert_eq!(
            verifier.verify_at(Some(&forged), &body, NOW),
            Err(qstash::VerifyError::InvalidSignature)
        );

        // One byte of the claims (re-encoded, so the token stays well-formed).
        let (header, payload) = message.split_once('.').expect("header.payload");
        let mut raw = engine.decode(payload).expect("base64url");
        let i = index.index(raw.len());
        raw[i] ^= flip;
        let forged = format!("{header}.{}.{sig}", engine.encode(&raw));
        prop_assert!(verifier.verify_at(Some(&forged), &body, NOW).is_err());
    }
}

// ---------------------------------------------------------------------------
// The event builder (no database).

/// The reason `NewEvent` must refuse a name, if any.
fn name_problem(s: &str) -> Option<&'static str> {
    if s.is_empty() {
        Some("must not be empty")
    } else if s.len() > MAX_NAME_BYTES {
        Some("must be at most")
    } else if s.contains('\0') {
        Some("must not contain NUL")
    } else {
        None
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// Any payload text is valid JSON that jsonb can hold, or refused as such.
    #[test]
    fn from_json_accepts_exactly_storable_json(
        text in prop_oneof![
            hostile(12, true),
            json_value(true).prop_map(|v| v.to_string()),
            json_value(false).prop_map(|v| serde_json::to_string_pretty(&v).expect("serializes")),
        ]
    ) {
        match NewEvent::from_json("t", "a", "1", text.clone()) {
            Ok(e) => {
                let v: Value = serde_json::from_str(e.payload_json()).expect("valid JSON");
                prop_assert!(!json_has_nul(&v), "NUL accepted: {text:?}");
                prop_assert_eq!(e.payload_json(), text.as_str());
            }
            Err(Error::Payload(_)) => {
                prop_assert!(serde_json::from_str::<serde::de::IgnoredAny>(&text).is_err());
            }
            Err(Error::InvalidEvent { field, reason }) => {
                prop_assert_eq!(field, "payload");
                prop_assert!(reason.contains("NUL"), "{reason}");
                let v: Value = serde_json::from_str(&text).expect("valid JSON");
                prop_assert!(json_has_nul(&v), "refused without a NUL: {text:?}");
            }
            Err(other) => prop_assert!(false, "unexpected error {other}"),
        }
    }

    /// Names and headers: refused exactly when empty, over 255 bytes or
    /// holding NUL, with an error that names the field.
    #[test]
    fn names_and_headers_are_checked_by_field(
        event_type in name_arg(),
        aggregate_type in name_arg(),
        aggregate_id in name_arg(),
        headers in vec((hostile(4, true), hostile(6, true)), 0..4),
    ) {
        let built = NewEvent::new(&event_type, &aggregate_type, &aggregate_id, &1)
            .and_then(|e| e.headers(headers.clone()));
        let expected = [
            ("event_type", &event_type),
            ("aggregate_type", &aggregate_type),
            ("aggregate_id", &aggregate_id),
        ]
        .into_iter()
        .find_map(|(field, value)| name_problem(value).map(|why| (field, why)));
        let header_map: BTreeMap<String, String> = headers.into_iter().collect();
        let header_problem = header_map.keys().any(String::is_empty)
            || header_map.iter().any(|(k, v)| k.contains('\0') || v.contains('\0'));
        match (built, expected) {
            (Err(Error::InvalidEvent { field, reason }), Some((want, why))) => {
                prop_assert_eq!(field, want);
                prop_assert!(reason.contains(why), "{reason}");
            }
            (Err(Error::InvalidEvent { field, .. }), None) => {
                prop_assert_eq!(field, "headers");
                prop_assert!(header_problem);
            }
            (Ok(_), None) => prop_assert!(!header_problem),
            (other, want) => prop_assert!(false, "got {other:?}, expected {want:?}"),
        }
    }
}

// ---------------------------------------------------------------------------
// Enqueue round trips (database).

#[derive(Debug, Clone)]
struct Input {
    event_type: String,
    aggregate_type: String,
    aggregate_id: String,
    payload: Value,
    headers: Vec<(String, String)>,
}

fn input() -> impl Strategy<Value = Input> {
    (
        name_arg(),
        name_arg(),
        name_arg(),
        prop_oneof![4 => json_value(false), 1 => json_value(true)],
        prop_oneof![
            4 => vec((hostile(4, false), hostile(8, false)), 0..4),
            1 => vec((hostile(4, true), hostile(8, true)), 0..4),
        ],
    )
        .prop_map(
            |(event_type, aggregate_type, aggregate_id, payload, headers)| Input {
                event_type,
                aggregate_type,
                aggregate_id,
                payload,
                headers,
            },
        )
}

/// Rows in the outbox and the aggregate counters: a refused enqueue changes neither.
async fn row_counts(db: &TestDb) -> (i64, i64) {
    (
        db.count("SELECT count(*) FROM {schema}.outbox").await,
        db.count("SELECT count(*) FROM {schema}.aggregate_sequences")
            .await,
    )
}

/// Read back the row of `event_id` and compare every column with what went in.
async fn assert_stored(
    db: &TestDb,
    event_id: uuid::Uuid,
    input: &Input,
    headers: &BTreeMap<String, String>,
) -> Result<(), TestCaseError> {
    let row = sqlx::query(trusted(&db.sql(
        "SELECT event_type, aggregate_type, aggregate_id, payload::text, headers::text, \
                payload = $2::text::jsonb \
         FROM {schema}.outbox WHERE event_id = $1",
    )))
    .bind(event_id)
    .bind(input.payload.to_string())
    .fetch_one(&db.pool)
    .await
    .map_err(|e| TestCaseError::fail(format!("read back: {e}")))?;
    prop_assert_eq!(row.get::<String, _>(0), input.event_type.as_str());
    prop_assert_eq!(row.get::<String, _>(1), input.aggregate_type.as_str());
    prop_assert_eq!(row.get::<String, _>(2), input.aggregate_id.as_str());
    let payload: Value = serde_json::from_str(&row.get::<String, _>(3)).expect("jsonb is JSON");
    prop_assert!(
        json_eq(&payload, &input.payload),
        "payload changed: {payload} != {}",
        input.payload
    );
    prop_assert!(
        row.get::<bool, _>(5),
        "payload differs from {} by jsonb equality",
        input.payload
    );
    let stored: BTreeMap<String, String> =
        serde_json::from_str(&row.get::<String, _>(4)).expect("headers are a string map");
    prop_assert_eq!(&stored, headers);
    Ok(())
}

/// The library path: `NewEvent` + `postbox::sqlx::enqueue`. Whatever the
/// builder accepts is stored byte for byte; whatever it refuses is an
/// `InvalidEvent` naming the field, and nothing reaches the table.
#[test]
fn library_enqueue_round_trips_or_refuses_hostile_events() {
    db_property(64, input(), |db, input| async move {
        let outbox = Outbox::new(db.schema.clone());
        let before = row_counts(&db).await;
        let built = NewEvent::new(
            &input.event_type,
            &input.aggregate_type,
            &input.aggregate_id,
            &input.payload,
        )
        .and_then(|e| e.headers(input.headers.clone()));
        let header_map: BTreeMap<String, String> = input.headers.iter().cloned().collect();
        let storable = [
            &input.event_type,
            &input.aggregate_type,
            &input.aggregate_id,
        ]
        .iter()
        .all(|s| name_problem(s).is_none())
            && !json_has_nul(&input.payload)
            && !header_map.keys().any(|k| k.is_empty() || k.contains('\0'))
            && !header_map.values().any(|v| v.contains('\0'));
        let event = match built {
            Ok(event) => event,
            Err(e) => {
                prop_assert!(!storable, "refused a storable event: {e}");
                prop_assert!(matches!(e, Error::InvalidEvent { .. }), "{e:?}");
                return Ok(());
            }
        };
        prop_assert!(storable, "accepted an event Postgres cannot store");
        let mut tx = db.pool.begin().await.expect("begin");
        let id = postbox::sqlx::enqueue(&outbox, &mut tx, &event).await;
        let id = match id {
            Ok(id) => id,
            Err(e) => {
                drop(tx);
                prop_assert_eq!(row_counts(&db).await, before);
                return Err(TestCaseError::fail(format!("storable event refused: {e}")));
            }
        };
        tx.commit().await.expect("commit");
        prop_assert_eq!(id, event.event_id());
        let after = row_counts(&db).await;
        prop_assert_eq!(after.0, before.0 + 1);
        assert_stored(&db, id, &input, &header_map).await
    });
}

/// The SQL function, with every argument bound as text (as any language's
/// driver would): stored byte for byte, or refused with a clear SQLSTATE and
/// no row, no counter bump.
#[test]
fn sql_function_round_trips_or_refuses_hostile_arguments() {
    db_property(64, input(), |db, input| async move {
        let before = row_counts(&db).await;
        let header_map: BTreeMap<String, String> = input.headers.iter().cloned().collect();
        let payload = input.payload.to_string();
        let headers = serde_json::to_string(&header_map).expect("serializes");
        let sql = db.sql("SELECT {schema}.enqueue($1, $2, $3, $4::text::jsonb, $5::text::jsonb)");
        let mut tx = db.pool.begin().await.expect("begin");
        let result: Result<uuid::Uuid, sqlx::Error> = sqlx::query_scalar(trusted(&sql))
            .bind(&input.event_type)
            .bind(&input.aggregate_type)
            .bind(&input.aggregate_id)
            .bind(&payload)
            .bind(&headers)
            .fetch_one(&mut *tx)
            .await;
        let names = [
            &input.event_type,
            &input.aggregate_type,
            &input.aggregate_id,
        ];
        let nul_in_text = names.iter().any(|s| s.contains('\0'));
        let nul_in_json = json_has_nul(&input.payload)
            || header_map
                .iter()
                .any(|(k, v)| k.contains('\0') || v.contains('\0'));
        let bad_length = names
            .iter()
            .any(|s| s.is_empty() || s.len() > MAX_NAME_BYTES);
        let expected = if nul_in_text {
            Some("22021") // invalid byte sequence for encoding "UTF8": 0x00
        } else if nul_in_json {
            Some("22P05") // unsupported Unicode escape sequence
        } else if bad_length {
            Some("22023") // postbox.enqueue: … must be 1 to 255 bytes long
        } else {
            None
        };
        match (result, expected) {
            (Ok(id), None) => {
                tx.commit().await.expect("commit");
                prop_assert_eq!(row_counts(&db).await.0, before.0 + 1);
                assert_stored(&db, id, &input, &header_map).await?;
            }
            (Err(e), Some(code)) => {
                let db_err = e.as_database_error().expect("a database error");
                let got = db_err.code();
                prop_assert_eq!(got.as_deref(), Some(code), "{}", db_err.message());
                prop_assert!(!db_err.message().is_empty());
                drop(tx);
                prop_assert_eq!(row_counts(&db).await, before);
            }
            (Ok(_), Some(code)) => prop_assert!(false, "accepted, expected {code}"),
            (Err(e), None) => prop_assert!(false, "refused storable input: {e}"),
        }
        Ok(())
    });
}

/// Payloads around the size limit: at most the limit is stored faithfully,
/// one byte more is refused before the database, for single and batch enqueue.
#[test]
fn payloads_around_the_size_limit() {
    const LIMIT: usize = 8 * 1024;
    let strategy = (
        (LIMIT - 8)..=(LIMIT + 8),
        proptest::sample::select(vec!['x', 'é', '🦀', '"', '\\', '\u{1}', '\u{ffff}']),
        any::<bool>(),
    );
    db_property(32, strategy, |db, (target, filler, batch)| async move {
        let outbox = Outbox::new(db.schema.clone()).max_payload_bytes(LIMIT);
        // A JSON string of `filler`s padded with `a`s to exactly `target`
        // bytes once serialized.
        let width = serde_json::to_string(&filler.to_string())
            .expect("serializes")
            .len()
            - 2;
        let n = (target - 2) / width;
        let mut s = filler.to_string().repeat(n);
        s.push_str(&"a".repeat(target - 2 - n * width));
        let payload = Value::String(s);
        let event = NewEvent::new("big", "blob", "1", &payload).expect("valid event");
        let len = event.payload_json().len();
        prop_assert_eq!(len, target);
        let before = row_counts(&db).await;
        let mut tx = db.pool.begin().await.expect("begin");
        let result = if batch {
            let small = NewEvent::new("small", "blob", "2", &1).expect("valid");
            postbox::sqlx::enqueue_batch(&outbox, &mut tx, &[small, event.clone()])
                .await
                .map(|ids| ids[1])
        } else {
            postbox::sqlx::enqueue(&outbox, &mut tx, &event).await
        };
        match result {
            Ok(id) => {
                prop_assert!(len <= LIMIT, "{len} bytes accepted over {LIMIT}");
                tx.commit().await.expect("commit");
                let input = Input {
                    event_type: "big".into(),
                    aggregate_type: "blob".into(),
                    aggregate_id: "1".into(),
                    payload,
                    headers: Vec::new(),
                };
                assert_stored(&db, id, &input, &BTreeMap::new()).await?;
            }
            Err(e) => {
                prop_assert!(len > LIMIT, "{len} bytes refused: {e}");
                prop_assert!(
                    matches!(&e, Error::InvalidEvent { field: "payload", reason } if reason.contains("over the limit")),
                    "{e}"
                );
                drop(tx);
                prop_assert_eq!(row_counts(&db).await, before);
            }
        }
        Ok(())
    });
}

/// The default limit (1 MiB) with a real 1 MiB round trip.
#[tokio::test]
async fn a_payload_of_exactly_the_default_limit_round_trips() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let limit = postbox::DEFAULT_MAX_PAYLOAD_BYTES;
    let fits = Value::String("é".repeat((limit - 2) / 2));
    let over = Value::String(format!("{}a", "é".repeat((limit - 2) / 2)));
    let ok = NewEvent::new("big", "blob", "1", &fits).unwrap();
    assert_eq!(ok.payload_json().len(), limit);
    let too_big = NewEvent::new("big", "blob", "1", &over).unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let id = postbox::sqlx::enqueue(&outbox, &mut tx, &ok).await.unwrap();
    let err = postbox::sqlx::enqueue(&outbox, &mut tx, &too_big)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("over the limit"), "{err}");
    tx.commit().await.unwrap();
    let stored: String = sqlx::query_scalar(trusted(
        &db.sql("SELECT payload #>> '{}' FROM {schema}.outbox WHERE event_id = $1"),
    ))
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(Some(stored.as_str()), fits.as_str());
    assert_eq!(db.count("SELECT count(*) FROM {schema}.outbox").await, 1);
    db.drop_schema().await;
}

// ---------------------------------------------------------------------------
// Deeply nested JSON.

/// `depth` nested arrays, innermost holding `1`: `[[[1]]]`.
fn nested_arrays(depth: usize) -> String {
    format!("{}1{}", "[".repeat(depth), "]".repeat(depth))
}

/// `depth` nested objects in jsonb's own output form: `{"a": {"a": 1}}`.
fn nested_objects(depth: usize) -> String {
    format!("{}1{}", "{\"a\": ".repeat(depth), "}".repeat(depth))
}

/// The library checks payloads with serde_json's iterative validator, which
/// has no depth limit: deeply nested JSON is accepted and stored faithfully
/// through `enqueue`; beyond Postgres' own stack limit (`max_stack_depth`,
/// 2 MB by default: some ten thousands of levels) the cast fails with SQLSTATE
/// 54001 as `Error::Sqlx`, inside the caller's transaction, and nothing is written.
#[tokio::test]
async fn library_enqueue_stores_deep_json_faithfully_or_refuses_it_cleanly() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    let mut expected = 0;
    for depth in [127, 128, 129, 1_000, 10_000] {
        for (kind, text) in [
            ("arrays", nested_arrays(depth)),
            ("objects", nested_objects(depth)),
        ] {
            let event = NewEvent::from_json("deep", kind, depth.to_string(), text.clone())
                .unwrap_or_else(|e| panic!("depth {depth} {kind}: {e}"));
            let mut tx = db.pool.begin().await.unwrap();
            let id = postbox::sqlx::enqueue(&outbox, &mut tx, &event)
                .await
                .unwrap_or_else(|e| panic!("depth {depth} {kind}: {e}"));
            tx.commit().await.unwrap();
            expected += 1;
            let payload: String = sqlx::query_scalar(trusted(
                &db.sql("SELECT payload::text FROM {schema}.outbox WHERE event_id = $1"),
            ))
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            assert!(payload == text, "depth {depth} {kind}: payload altered");
        }
    }
    // A serializable value nested 1,000 deep goes the same way.
    let mut deep = Value::from(1);
    for _ in 0..1_000 {
        deep = Value::Array(vec![deep]);
    }
    let event = NewEvent::new("deep", "value", "1000", &deep).unwrap();
    assert_eq!(event.payload_json(), nested_arrays(1_000));

    let text = nested_arrays(200_000);
    let event = NewEvent::from_json("deep", "arrays", "200000", text).unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    match postbox::sqlx::enqueue(&outbox, &mut tx, &event).await {
        Err(e) => {
            assert_eq!(e.sqlstate().as_deref(), Some("54001"), "{e}");
            drop(tx);
        }
        Ok(_) => {
            // A server with a very large max_stack_depth stores it.
            tx.commit().await.unwrap();
            expected += 1;
        }
    }
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.outbox").await,
        expected
    );
    db.drop_schema().await;
}

/// The SQL function takes whatever jsonb takes: 10,000 levels are stored
/// faithfully; beyond Postgres' own stack limit (`max_stack_depth`) the cast
/// fails with SQLSTATE 54001 and nothing is written.
#[tokio::test]
async fn sql_function_stores_deep_json_faithfully_or_refuses_it_cleanly() {
    let db = TestDb::new().await;
    let sql =
        db.sql("SELECT {schema}.enqueue('deep', 'doc', $1, $2::text::jsonb, $3::text::jsonb)");
    for depth in [129, 1_000, 10_000] {
        for (kind, text) in [
            ("arrays", nested_arrays(depth)),
            ("objects", nested_objects(depth)),
        ] {
            // As payload and as a header value (headers must be an object).
            let headers = format!("{{\"h\": {text}}}");
            let id: uuid::Uuid = sqlx::query_scalar(trusted(&sql))
                .bind(format!("{kind}-{depth}"))
                .bind(&text)
                .bind(&headers)
                .fetch_one(&db.pool)
                .await
                .unwrap_or_else(|e| panic!("depth {depth} {kind}: {e}"));
            let (payload, stored_headers): (String, String) = sqlx::query_as(trusted(&db.sql(
                "SELECT payload::text, headers::text FROM {schema}.outbox WHERE event_id = $1",
            )))
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            assert!(payload == text, "depth {depth} {kind}: payload altered");
            assert!(
                stored_headers == headers,
                "depth {depth} {kind}: headers altered"
            );
        }
    }
    let stored = db.count("SELECT count(*) FROM {schema}.outbox").await;
    assert_eq!(stored, 6);
    // Far deeper than any stack: a clean error, or (with a large
    // max_stack_depth) a faithful row.
    let depth = 200_000;
    let text = nested_arrays(depth);
    let mut tx = db.pool.begin().await.unwrap();
    let result: Result<uuid::Uuid, sqlx::Error> = sqlx::query_scalar(trusted(&sql))
        .bind("very-deep")
        .bind(&text)
        .bind("{}")
        .fetch_one(&mut *tx)
        .await;
    match result {
        Err(e) => {
            let db_err = e.as_database_error().expect("a database error");
            assert_eq!(
                db_err.code().as_deref(),
                Some("54001"),
                "{}",
                db_err.message()
            );
            drop(tx);
            assert_eq!(
                db.count("SELECT count(*) FROM {schema}.outbox").await,
                stored
            );
        }
        Ok(id) => {
            tx.commit().await.unwrap();
            let payload: String = sqlx::query_scalar(trusted(
                &db.sql("SELECT payload::text FROM {schema}.outbox WHERE event_id = $1"),
            ))
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            assert!(payload == text, "depth {depth}: payload altered");
        }
    }
    db.drop_schema().await;
}

/// JSON that serde_json accepts but jsonb cannot hold (a lone surrogate, a
/// number beyond `numeric`): the library passes it on and the database refuses
/// it with a clear error, inside the caller's transaction, leaving no row.
#[tokio::test]
async fn json_that_only_postgres_refuses_is_a_clear_database_error() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.schema.clone());
    for (text, code) in [
        (r#""\ud800""#, "22P02"),
        (r#"{"k": "\udfff x"}"#, "22P02"),
        ("1e200000", "22003"),
        ("-1e-20000", "22003"),
    ] {
        let event = NewEvent::from_json("t", "a", "1", text).expect("serde_json accepts it");
        let mut tx = db.pool.begin().await.unwrap();
        let err = postbox::sqlx::enqueue(&outbox, &mut tx, &event)
            .await
            .unwrap_err();
        assert_eq!(err.sqlstate().as_deref(), Some(code), "{text}: {err}");
        // The message does not repeat its source: a chain printer shows it once.
        assert_eq!(err.to_string(), "database error");
        let source = std::error::Error::source(&err)
            .expect("the database's error")
            .to_string();
        assert!(!source.is_empty(), "{text}");
        drop(tx);
    }
    assert_eq!(db.count("SELECT count(*) FROM {schema}.outbox").await, 0);
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.aggregate_sequences")
            .await,
        0
    );
    db.drop_schema().await;
}

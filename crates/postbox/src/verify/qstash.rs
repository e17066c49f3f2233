//! [Upstash QStash](https://upstash.com/docs/qstash) request signatures.
//!
//! QStash sends an `Upstash-Signature` header holding a JWT signed with HS256. The HMAC
//! key is the signing key string itself (its UTF-8 bytes, *not* base64-decoded). QStash
//! has two keys, current and next, so that keys can be rolled; a request is accepted when
//! its token verifies with either.
//!
//! The token's claims are checked as follows:
//!
//! * `iss` must be `Upstash`;
//! * `exp` and `nbf` must be present and valid at the verification time, allowing the
//!   configured clock tolerance (default 0 seconds);
//! * `sub` must equal the expected URL, when one is configured;
//! * `body` must be the base64url SHA-256 of the exact raw body (trailing `=` padding is
//!   ignored on both sides, as QStash has sent both forms).
//!
//! ```
//! use postbox::verify::qstash::{sign, Claims, Verifier};
//!
//! let body = br#"{"hello":"world"}"#;
//! let now = 1_700_000_000;
//!
//! // A fake QStash (for example in a test server) signs the request.
//! let claims = Claims::new("https://example.com/hook", body, now, 300);
//! let token = sign("sig_current", &claims)?;
//!
//! // The receiver verifies it.
//! let verifier = Verifier::new("sig_current", Some("sig_next"))?
//!     .with_expected_url("https://example.com/hook");
//! let verified = verifier.verify_at(Some(&token), body, now)?;
//! assert_eq!(verified.sub.as_deref(), Some("https://example.com/hook"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;

use base64::engine::general_purpose::{URL_SAFE, URL_SAFE_NO_PAD};
use base64::Engine as _;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Validation};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Name of the header carrying the JWT.
pub const SIGNATURE_HEADER: &str = "Upstash-Signature";
/// Environment variable holding the current signing key.
pub const CURRENT_SIGNING_KEY_ENV: &str = "QSTASH_CURRENT_SIGNING_KEY";
/// Environment variable holding the next signing key.
pub const NEXT_SIGNING_KEY_ENV: &str = "QSTASH_NEXT_SIGNING_KEY";
/// The required value of the `iss` claim.
pub const ISSUER: &str = "Upstash";

/// The only accepted JWT algorithm, as it appears in the token header.
const ALGORITHM: &str = "HS256";
/// Longest `alg` value echoed back in [`VerifyError::UnsupportedAlgorithm`].
const MAX_ALG_IN_ERROR: usize = 32;

/// Error building a [`Verifier`] from signing keys.
///
/// Messages never include a key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The current signing key is empty.
    #[error("QStash current signing key is empty")]
    EmptyCurrentKey,
    /// The environment variable for the current key is not set.
    #[error("environment variable {name} is not set")]
    MissingEnv {
        /// Name of the variable.
        name: &'static str,
    },
    /// An environment variable is set but is not valid Unicode.
    #[error("environment variable {name} is not valid Unicode")]
    EnvNotUnicode {
        /// Name of the variable.
        name: &'static str,
    },
}

/// Error signing a token with [`sign`].
///
/// Messages never include the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SignError {
    /// The signing key is empty.
    #[error("QStash signing key is empty")]
    EmptyKey,
    /// The token could not be encoded.
    #[error("failed to encode the QStash token")]
    Encode,
}

/// Why a request failed verification.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerifyError {
    /// The `Upstash-Signature` header is absent.
    #[error("missing header Upstash-Signature")]
    MissingHeader,
    /// The `Upstash-Signature` header is empty (or only whitespace).
    #[error("header Upstash-Signature is empty")]
    EmptyHeader,
    /// The header is not a JWT (three base64url parts with a JSON header and claims,
    /// the claims having the expected types).
    #[error("header Upstash-Signature is not a well-formed JWT")]
    MalformedToken,
    /// The token's `alg` is anything but `HS256` (for example `none`, `RS256`, `HS512`).
    #[error("JWT algorithm {alg:?} is not accepted (only HS256)")]
    UnsupportedAlgorithm {
        /// The `alg` from the token header (truncated to 32 characters).
        alg: String,
    },
    /// The signature verifies with neither the current nor the next signing key.
    #[error("JWT signature does not match any signing key")]
    InvalidSignature,
    /// The `iss` claim is missing or not `Upstash`.
    #[error("JWT issuer is not Upstash")]
    InvalidIssuer,
    /// A required claim is absent.
    #[error("JWT claim {name} is missing")]
    MissingClaim {
        /// Name of the claim.
        name: &'static str,
    },
    /// The token expired (`exp`), even allowing for the clock tolerance.
    #[error("JWT expired at {exp} (now {now})")]
    Expired {
        /// The `exp` claim.
        exp: i64,
        /// The time used for the check.
        now: i64,
    },
    /// The token is not valid yet (`nbf`), even allowing for the clock tolerance.
    #[error("JWT not valid before {nbf} (now {now})")]
    NotYetValid {
        /// The `nbf` claim.
        nbf: i64,
        /// The time used for the check.
        now: i64,
    },
    /// The `sub` claim is missing or differs from the expected URL.
    #[error("JWT subject does not match the expected URL")]
    SubjectMismatch,
    /// The `body` claim does not match the SHA-256 of the body.
    #[error("JWT body hash does not match the request body")]
    BodyMismatch,
}

/// The claims of a QStash token.
///
/// [`Verifier::verify`] returns them once everything checked out; [`sign`] encodes them.
/// Optional claims are left out of the token when `None`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    /// Issuer; QStash uses [`ISSUER`].
    pub iss: String,
    /// Subject: the destination URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sub: Option<String>,
    /// Expiry, unix seconds.
    pub exp: i64,
    /// Not-before, unix seconds.
    pub nbf: i64,
    /// Issued-at, unix seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iat: Option<i64>,
    /// Unique token id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jti: Option<String>,
    /// base64url of the SHA-256 of the body (see [`body_hash`]).
    pub body: String,
}

impl Claims {
    /// Claims as QStash would issue them for delivering `body` to `url` at `now` (unix
    /// seconds): `iss` = `Upstash`, `nbf` = `iat` = `now`, `exp` = `now + ttl_seconds`,
    /// a random `jti` and the body hash.
    pub fn new(url: impl Into<String>, body: &[u8], now: i64, ttl_seconds: i64) -> Self {
        Self {
            iss: ISSUER.to_owned(),
            sub: Some(url.into()),
            exp: now.saturating_add(ttl_seconds),
            nbf: now,
            iat: Some(now),
            jti: Some(format!("jwt_{}", uuid::Uuid::new_v4().simple())),
            body: body_hash(body),
        }
    }
}

/// The `body` claim for `body`: base64url (with `=` padding) of its SHA-256.
pub fn body_hash(body: &[u8]) -> String {
    URL_SAFE.encode(Sha256::digest(body))
}

/// Signs `claims` as an HS256 JWT with `key` (its UTF-8 bytes are the HMAC key), the way
/// QStash does. Meant for tests and fake QStash servers.
pub fn sign(key: &str, claims: &Claims) -> Result<String, SignError> {
    if key.is_empty() {
        return Err(SignError::EmptyKey);
    }
    let header = jsonwebtoken::Header::new(Algorithm::HS256);
    let key = EncodingKey::from_secret(key.as_bytes()).map_err(|_| SignError::EmptyKey)?;
    jsonwebtoken::encode(&header, claims, &key).map_err(|_| SignError::Encode)
}

/// One signing key prepared for verification. `Debug` is redacted.
#[derive(Clone)]
struct Key(DecodingKey);

impl Key {
    /// `None` for an empty key (the only key jsonwebtoken refuses).
    fn new(key: &str) -> Option<Self> {
        DecodingKey::from_secret(key.as_bytes()).ok().map(Self)
    }
}

/// Verifies QStash requests against the current and (optionally) the next signing key.
#[derive(Clone)]
pub struct Verifier {
    current: Key,
    next: Option<Key>,
    expected_url: Option<String>,
    clock_tolerance: u64,
}

impl fmt::Debug for Verifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Verifier")
            .field("current", &"<redacted>")
            .field("next", &self.next.as_ref().map(|_| "<redacted>"))
            .field("expected_url", &self.expected_url)
            .field("clock_tolerance", &self.clock_tolerance)
            .finish()
    }
}

/// Decoded JWT header; only `alg` matters here.
#[derive(Deserialize)]
struct RawHeader {
    alg: Option<String>,
}

/// Claims as found in a token: everything optional so that absence gives a precise error.
#[derive(Deserialize)]
struct RawClaims {
    iss: Option<String>,
    sub: Option<String>,
    exp: Option<serde_json::Number>,
    nbf: Option<serde_json::Number>,
    iat: Option<serde_json::Number>,
    jti: Option<String>,
    body: Option<String>,
}

impl Verifier {
    /// A verifier for the given keys (the values of `QSTASH_CURRENT_SIGNING_KEY` and
    /// `QSTASH_NEXT_SIGNING_KEY`). An empty next key counts as absent.
    ///
    /// No expected URL is configured and the clock tolerance is 0 seconds.
    pub fn new(current_key: &str, next_key: Option<&str>) -> Result<Self, KeyError> {
        Ok(Self {
            current: Key::new(current_key).ok_or(KeyError::EmptyCurrentKey)?,
            next: next_key.and_then(Key::new),
            expected_url: None,
            clock_tolerance: 0,
        })
    }

    /// Same as [`Verifier::new`], named after the environment variables whose values are
    /// passed: [`CURRENT_SIGNING_KEY_ENV`] and [`NEXT_SIGNING_KEY_ENV`].
    pub fn from_env_values(current_key: &str, next_key: Option<&str>) -> Result<Self, KeyError> {
        Self::new(current_key, next_key)
    }

    /// A verifier reading `QSTASH_CURRENT_SIGNING_KEY` (required) and
    /// `QSTASH_NEXT_SIGNING_KEY` (optional) from the process environment.
    pub fn from_env() -> Result<Self, KeyError> {
        let current = match std::env::var(CURRENT_SIGNING_KEY_ENV) {
            Ok(v) => v,
            Err(std::env::VarError::NotPresent) => {
                return Err(KeyError::MissingEnv {
                    name: CURRENT_SIGNING_KEY_ENV,
                })
            }
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(KeyError::EnvNotUnicode {
                    name: CURRENT_SIGNING_KEY_ENV,
                })
            }
        };
        let next = match std::env::var(NEXT_SIGNING_KEY_ENV) {
            Ok(v) => Some(v),
            Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(KeyError::EnvNotUnicode {
                    name: NEXT_SIGNING_KEY_ENV,
                })
            }
        };
        Self::new(&current, next.as_deref())
    }

    /// Requires the `sub` claim to equal `url` (compared exactly, as a string).
    #[must_use]
    pub fn with_expected_url(mut self, url: impl Into<String>) -> Self {
        self.expected_url = Some(url.into());
        self
    }

    /// Allows `exp` and `nbf` to be off by up to `seconds` (default 0).
    #[must_use]
    pub fn with_clock_tolerance(mut self, seconds: u64) -> Self {
        self.clock_tolerance = seconds;
        self
    }

    /// Verifies a request against the system clock.
    ///
    /// `signature` is the value of the `Upstash-Signature` header (`None` if absent) and
    /// `body` the exact raw request body. Returns the verified claims.
    pub fn verify(&self, signature: Option<&str>, body: &[u8]) -> Result<Claims, VerifyError> {
        self.verify_at(signature, body, super::unix_now())
    }

    /// Verifies a request as if the current time were `now` (unix seconds).
    ///
    /// The token header's `alg` is checked first and must be exactly `HS256`; then the
    /// signature (current key, then next key); then `iss`, `exp`, `nbf`, `sub` and `body`.
    pub fn verify_at(
        &self,
        signature: Option<&str>,
        body: &[u8],
        now: i64,
    ) -> Result<Claims, VerifyError> {
        let token = match signature {
            None => return Err(VerifyError::MissingHeader),
            Some(t) if t.trim().is_empty() => return Err(VerifyError::EmptyHeader),
            Some(t) => t.trim(),
        };
        check_algorithm(token)?;
        let raw = self.decode_verified(token)?;
        self.check_claims(raw, body, now)
    }

    /// Checks the signature with the current key, then the next key, and returns the
    /// (not yet validated) claims of the first key that verifies.
    fn decode_verified(&self, token: &str) -> Result<RawClaims, VerifyError> {
        let mut validation = Validation::new(Algorithm::HS256);
        // Time, issuer and subject are checked by `check_claims` against the injected
        // clock with our own tolerance; keep jsonwebtoken away from the system clock and
        // its default 60 s leeway.
        validation.validate_exp = false;
        validation.validate_nbf = false;
        validation.leeway = 0;
        validation.validate_aud = false;
        validation.required_spec_claims.clear();

        for key in std::iter::once(&self.current).chain(self.next.as_ref()) {
            match jsonwebtoken::decode::<RawClaims>(token, &key.0, &validation) {
                Ok(data) => return Ok(data.claims),
                Err(e) => match e.kind() {
                    jsonwebtoken::errors::ErrorKind::InvalidSignature => continue,
                    jsonwebtoken::errors::ErrorKind::InvalidAlgorithm => {
                        return Err(VerifyError::UnsupportedAlgorithm {
                            alg: String::from("?"),
                        })
                    }
                    _ => return Err(VerifyError::MalformedToken),
                },
            }
        }
        Err(VerifyError::InvalidSignature)
    }

    fn check_claims(&self, raw: RawClaims, body: &[u8], now: i64) -> Result<Claims, VerifyError> {
        let iss = raw.iss.ok_or(VerifyError::InvalidIssuer)?;
        if iss != ISSUER {
            return Err(VerifyError::InvalidIssuer);
        }

        let exp = numeric_date(raw.exp.as_ref(), "exp")?;
        let nbf = numeric_date(raw.nbf.as_ref(), "nbf")?;
        let iat = match raw.iat.as_ref() {
            Some(n) => Some(to_seconds(n).ok_or(VerifyError::MalformedToken)?),
            None => None,
        };
        let tolerance = i64::try_from(self.clock_tolerance).unwrap_or(i64::MAX);
        // Valid while now < exp (RFC 7519 §4.1.4), extended by the tolerance.
        if now >= exp.saturating_add(tolerance) {
            return Err(VerifyError::Expired { exp, now });
        }
        // Valid from nbf on (RFC 7519 §4.1.5), brought forward by the tolerance.
        if now < nbf.saturating_sub(tolerance) {
            return Err(VerifyError::NotYetValid { nbf, now });
        }

        if let Some(expected) = &self.expected_url {
            if raw.sub.as_deref() != Some(expected.as_str()) {
                return Err(VerifyError::SubjectMismatch);
            }
        }

        let claimed = raw.body.ok_or(VerifyError::MissingClaim { name: "body" })?;
        let actual = body_hash(body);
        let matches = claimed
            .trim_end_matches('=')
            .as_bytes()
            .ct_eq(actual.trim_end_matches('=').as_bytes());
        if !bool::from(matches) {
            return Err(VerifyError::BodyMismatch);
        }

        Ok(Claims {
            iss,
            sub: raw.sub,
            exp,
            nbf,
            iat,
            jti: raw.jti,
            body: claimed,
        })
    }
}

/// Rejects any token whose header `alg` is not exactly `HS256`, before any key is used.
fn check_algorithm(token: &str) -> Result<(), VerifyError> {
    let mut parts = token.split('.');
    let (Some(header), Some(_), Some(_), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(VerifyError::MalformedToken);
    };
    let bytes = URL_SAFE_NO_PAD
        .decode(header)
        .map_err(|_| VerifyError::MalformedToken)?;
    let header: RawHeader =
        serde_json::from_slice(&bytes).map_err(|_| VerifyError::MalformedToken)?;
    match header.alg {
        Some(alg) if alg == ALGORITHM => Ok(()),
        Some(alg) => Err(VerifyError::UnsupportedAlgorithm {
            alg: alg.chars().take(MAX_ALG_IN_ERROR).collect(),
        }),
        None => Err(VerifyError::MalformedToken),
    }
}

/// A required NumericDate claim as whole seconds.
fn numeric_date(
    value: Option<&serde_json::Number>,
    name: &'static str,
) -> Result<i64, VerifyError> {
    let value = value.ok_or(VerifyError::MissingClaim { name })?;
    to_seconds(value).ok_or(VerifyError::MalformedToken)
}

/// Whole seconds of a JSON number (fractions are truncated towards negative infinity;
/// out-of-range values saturate).
fn to_seconds(n: &serde_json::Number) -> Option<i64> {
    if let Some(i) = n.as_i64() {
        return Some(i);
    }
    if n.as_u64().is_some() {
        return Some(i64::MAX);
    }
    let f = n.as_f64()?;
    if !f.is_finite() {
        return None;
    }
    // `as` saturates for out-of-range floats.
    Some(f.floor() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hmac::{Hmac, Mac};
    use proptest::prelude::*;

    const CURRENT: &str = "sig_7kYjw48mhY7kAjqNGcy6cr29RJ6r";
    const NEXT: &str = "sig_5ZB6DVzB1wjE8S6rZ7eenA8Pdnhs";
    const URL: &str = "https://example.com/api/hook";
    const NOW: i64 = 1_700_000_000;
    const BODY: &[u8] = br#"{"event":"order.created","id":42}"#;

    fn verifier() -> Verifier {
        Verifier::new(CURRENT, Some(NEXT)).expect("valid keys")
    }

    fn claims() -> Claims {
        Claims::new(URL, BODY, NOW, 300)
    }

    fn token(key: &str, claims: &Claims) -> String {
        sign(key, claims).expect("signs")
    }

    /// A token with an arbitrary header, HMAC-SHA256-signed regardless of its `alg`.
    fn forged(header: &serde_json::Value, claims: &serde_json::Value, key: &str) -> String {
        let h = URL_SAFE_NO_PAD.encode(header.to_string());
        let c = URL_SAFE_NO_PAD.encode(claims.to_string());
        let message = format!("{h}.{c}");
        let mut mac = Hmac::<Sha256>::new_from_slice(key.as_bytes()).expect("any length");
        mac.update(message.as_bytes());
        let sig = URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes());
        format!("{message}.{sig}")
    }

    fn claims_json() -> serde_json::Value {
        serde_json::to_value(claims()).expect("serialises")
    }

    #[test]
    fn valid_token_passes_and_returns_claims() {
        let c = claims();
        let t = token(CURRENT, &c);
        let v = verifier().with_expected_url(URL);
        assert_eq!(v.verify_at(Some(&t), BODY, NOW), Ok(c.clone()));
        // Also with surrounding whitespace in the header value.
        assert_eq!(v.verify_at(Some(&format!(" {t} ")), BODY, NOW), Ok(c));
    }

    #[test]
    fn module_doc_example() {
        let body = br#"{"hello":"world"}"#;
        let now = 1_700_000_000;
        let claims = Claims::new("https://example.com/hook", body, now, 300);
        let token = sign("sig_current", &claims).expect("signs");
        let verifier = Verifier::new("sig_current", Some("sig_next"))
            .expect("valid")
            .with_expected_url("https://example.com/hook");
        let verified = verifier.verify_at(Some(&token), body, now).expect("valid");
        assert_eq!(verified.sub.as_deref(), Some("https://example.com/hook"));
    }

    #[test]
    fn system_clock_verify_accepts_fresh_token() {
        let c = Claims::new(URL, BODY, crate::verify::unix_now(), 300);
        let t = token(CURRENT, &c);
        assert_eq!(verifier().verify(Some(&t), BODY), Ok(c));
    }

    #[test]
    fn token_has_all_claims_and_hs256_header() {
        let t = token(CURRENT, &claims());
        let header = jsonwebtoken::decode_header(&t).expect("header");
        assert_eq!(header.alg, Algorithm::HS256);
        let payload = t.split('.').nth(1).expect("payload");
        let json: serde_json::Value =
            serde_json::from_slice(&URL_SAFE_NO_PAD.decode(payload).expect("b64")).expect("json");
        for claim in ["iss", "sub", "exp", "nbf", "iat", "jti", "body"] {
            assert!(json.get(claim).is_some(), "claim {claim} missing");
        }
        assert_eq!(json["iss"], "Upstash");
        assert_eq!(json["exp"], NOW + 300);
    }

    #[test]
    fn body_hash_is_base64url_sha256() {
        // SHA-256 of the empty string.
        assert_eq!(
            body_hash(b""),
            "47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU="
        );
    }

    #[test]
    fn tampered_body_fails() {
        let t = token(CURRENT, &claims());
        assert_eq!(
            verifier().verify_at(Some(&t), br#"{"event":"order.created","id":43}"#, NOW),
            Err(VerifyError::BodyMismatch)
        );
    }

    #[test]
    fn tampered_payload_fails_signature() {
        let t = token(CURRENT, &claims());
        let mut parts: Vec<String> = t.split('.').map(str::to_owned).collect();
        let mut c = claims();
        c.sub = Some("https://evil.example/".into());
        parts[1] = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&c).expect("json"));
        let t = parts.join(".");
        assert_eq!(
            verifier().verify_at(Some(&t), BODY, NOW),
            Err(VerifyError::InvalidSignature)
        );
    }

    #[test]
    fn wrong_key_fails() {
        let t = token("sig_someoneelse", &claims());
        assert_eq!(
            verifier().verify_at(Some(&t), BODY, NOW),
            Err(VerifyError::InvalidSignature)
        );
    }

    #[test]
    fn next_key_rotation() {
        let t = token(NEXT, &claims());
        assert!(verifier().verify_at(Some(&t), BODY, NOW).is_ok());
        // Without a next key the same token fails.
        let only_current = Verifier::new(CURRENT, None).expect("valid");
        assert_eq!(
            only_current.verify_at(Some(&t), BODY, NOW),
            Err(VerifyError::InvalidSignature)
        );
        // An empty next key counts as absent.
        let empty_next = Verifier::from_env_values(CURRENT, Some("")).expect("valid");
        assert_eq!(
            empty_next.verify_at(Some(&t), BODY, NOW),
            Err(VerifyError::InvalidSignature)
        );
        // Signed with neither key.
        let t = token("sig_neither", &claims());
        assert_eq!(
            verifier().verify_at(Some(&t), BODY, NOW),
            Err(VerifyError::InvalidSignature)
        );
    }

    #[test]
    fn key_is_used_as_given_not_base64_decoded() {
        // "c2VjcmV0" is base64 of "secret": a token signed with the decoded bytes fails.
        let t = token("secret", &claims());
        let v = Verifier::new("c2VjcmV0", None).expect("valid");
        assert_eq!(
            v.verify_at(Some(&t), BODY, NOW),
            Err(VerifyError::InvalidSignature)
        );
        let t = token("c2VjcmV0", &claims());
        assert!(v.verify_at(Some(&t), BODY, NOW).is_ok());
    }

    #[test]
    fn expired_token_fails() {
        let t = token(CURRENT, &claims());
        let exp = NOW + 300;
        assert!(verifier().verify_at(Some(&t), BODY, exp - 1).is_ok());
        assert_eq!(
            verifier().verify_at(Some(&t), BODY, exp),
            Err(VerifyError::Expired { exp, now: exp })
        );
        assert_eq!(
            verifier().verify_at(Some(&t), BODY, exp + 3600),
            Err(VerifyError::Expired {
                exp,
                now: exp + 3600
            })
        );
    }

    #[test]
    fn tolerance_lets_just_expired_token_pass() {
        let t = token(CURRENT, &claims());
        let exp = NOW + 300;
        let now = exp + 5;
        // Default tolerance is 0 (not jsonwebtoken's 60 s).
        assert_eq!(
            verifier().verify_at(Some(&t), BODY, now),
            Err(VerifyError::Expired { exp, now })
        );
        let lax = verifier().with_clock_tolerance(10);
        assert!(lax.verify_at(Some(&t), BODY, now).is_ok());
        assert!(matches!(
            lax.verify_at(Some(&t), BODY, exp + 10),
            Err(VerifyError::Expired { .. })
        ));
        // A huge tolerance does not overflow.
        let huge = verifier().with_clock_tolerance(u64::MAX);
        assert!(huge.verify_at(Some(&t), BODY, i64::MAX - 1).is_ok());
    }

    #[test]
    fn future_nbf_fails() {
        let mut c = claims();
        c.nbf = NOW + 60;
        c.exp = NOW + 600;
        let t = token(CURRENT, &c);
        assert_eq!(
            verifier().verify_at(Some(&t), BODY, NOW),
            Err(VerifyError::NotYetValid {
                nbf: NOW + 60,
                now: NOW
            })
        );
        assert!(verifier().verify_at(Some(&t), BODY, NOW + 60).is_ok());
        assert!(verifier()
            .with_clock_tolerance(60)
            .verify_at(Some(&t), BODY, NOW)
            .is_ok());
    }

    #[test]
    fn missing_exp_or_nbf_fails() {
        for name in ["exp", "nbf"] {
            let mut c = claims_json();
            c.as_object_mut().expect("object").remove(name);
            let t = forged(
                &serde_json::json!({"alg": "HS256", "typ": "JWT"}),
                &c,
                CURRENT,
            );
            assert_eq!(
                verifier().verify_at(Some(&t), BODY, NOW),
                Err(VerifyError::MissingClaim { name }),
            );
        }
    }

    #[test]
    fn missing_body_claim_fails() {
        let mut c = claims_json();
        c.as_object_mut().expect("object").remove("body");
        let t = forged(&serde_json::json!({"alg": "HS256"}), &c, CURRENT);
        assert_eq!(
            verifier().verify_at(Some(&t), BODY, NOW),
            Err(VerifyError::MissingClaim { name: "body" })
        );
    }

    #[test]
    fn wrong_sub_fails() {
        let t = token(CURRENT, &claims());
        let v = verifier().with_expected_url("https://example.com/other");
        assert_eq!(
            v.verify_at(Some(&t), BODY, NOW),
            Err(VerifyError::SubjectMismatch)
        );
    }

    #[test]
    fn missing_sub_configured_vs_not() {
        let mut c = claims();
        c.sub = None;
        let t = token(CURRENT, &c);
        // No expected URL configured: no check.
        assert!(verifier().verify_at(Some(&t), BODY, NOW).is_ok());
        // Expected URL configured: a missing sub fails.
        assert_eq!(
            verifier()
                .with_expected_url(URL)
                .verify_at(Some(&t), BODY, NOW),
            Err(VerifyError::SubjectMismatch)
        );
    }

    #[test]
    fn wrong_or_missing_iss_fails() {
        let mut c = claims();
        c.iss = "NotUpstash".into();
        let t = token(CURRENT, &c);
        assert_eq!(
            verifier().verify_at(Some(&t), BODY, NOW),
            Err(VerifyError::InvalidIssuer)
        );
        let mut c = claims_json();
        c.as_object_mut().expect("object").remove("iss");
        let t = forged(&serde_json::json!({"alg": "HS256"}), &c, CURRENT);
        assert_eq!(
            verifier().verify_at(Some(&t), BODY, NOW),
            Err(VerifyError::InvalidIssuer)
        );
    }

    #[test]
    fn alg_none_is_rejected() {
        let h = URL_SAFE_NO_PAD.encode(r#"{"alg":"none","typ":"JWT"}"#);
        let c = URL_SAFE_NO_PAD.encode(claims_json().to_string());
        for t in [format!("{h}.{c}."), format!("{h}.{c}")] {
            let r = verifier().verify_at(Some(&t), BODY, NOW);
            assert!(
                matches!(
                    r,
                    Err(VerifyError::UnsupportedAlgorithm { .. } | VerifyError::MalformedToken)
                ),
                "{r:?}"
            );
        }
        let t = format!("{h}.{c}.");
        assert_eq!(
            verifier().verify_at(Some(&t), BODY, NOW),
            Err(VerifyError::UnsupportedAlgorithm { alg: "none".into() })
        );
    }

    #[test]
    fn hs384_and_hs512_are_rejected() {
        for (alg, name) in [(Algorithm::HS384, "HS384"), (Algorithm::HS512, "HS512")] {
            let t = jsonwebtoken::encode(
                &jsonwebtoken::Header::new(alg),
                &claims(),
                &EncodingKey::from_secret(CURRENT.as_bytes()).unwrap(),
            )
            .expect("encodes");
            assert_eq!(
                verifier().verify_at(Some(&t), BODY, NOW),
                Err(VerifyError::UnsupportedAlgorithm { alg: name.into() })
            );
        }
    }

    #[test]
    fn asymmetric_algorithms_are_rejected() {
        for alg in ["RS256", "ES256", "PS256", "EdDSA", "hs256", "HS256 "] {
            let t = forged(&serde_json::json!({"alg": alg}), &claims_json(), CURRENT);
            assert_eq!(
                verifier().verify_at(Some(&t), BODY, NOW),
                Err(VerifyError::UnsupportedAlgorithm { alg: alg.into() }),
            );
        }
    }

    #[test]
    fn long_alg_is_truncated_in_error() {
        let alg = "X".repeat(1000);
        let t = forged(&serde_json::json!({"alg": alg}), &claims_json(), CURRENT);
        match verifier().verify_at(Some(&t), BODY, NOW) {
            Err(VerifyError::UnsupportedAlgorithm { alg }) => assert_eq!(alg.len(), 32),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn missing_or_empty_header_fails() {
        assert_eq!(
            verifier().verify_at(None, BODY, NOW),
            Err(VerifyError::MissingHeader)
        );
        assert_eq!(
            verifier().verify_at(Some(""), BODY, NOW),
            Err(VerifyError::EmptyHeader)
        );
        assert_eq!(
            verifier().verify_at(Some("  "), BODY, NOW),
            Err(VerifyError::EmptyHeader)
        );
    }

    #[test]
    fn malformed_tokens_fail() {
        let good = token(CURRENT, &claims());
        let no_alg = forged(&serde_json::json!({"typ": "JWT"}), &claims_json(), CURRENT);
        let mut bad_types = claims_json();
        bad_types["exp"] = serde_json::json!("tomorrow");
        let bad_types = forged(&serde_json::json!({"alg": "HS256"}), &bad_types, CURRENT);
        for t in [
            "not a jwt".to_owned(),
            "a.b".to_owned(),
            format!("{good}.extra"),
            "!!!.e30.sig".to_owned(),
            format!("{}.e30.sig", URL_SAFE_NO_PAD.encode("[1,2]")),
            no_alg,
            bad_types,
        ] {
            assert_eq!(
                verifier().verify_at(Some(&t), BODY, NOW),
                Err(VerifyError::MalformedToken),
                "token {t:?}"
            );
        }
    }

    #[test]
    fn padded_and_unpadded_body_claims_are_accepted() {
        let padded = claims();
        assert!(padded.body.ends_with('='));
        let mut unpadded = claims();
        unpadded.body = unpadded.body.trim_end_matches('=').to_owned();
        for c in [padded, unpadded] {
            let t = token(CURRENT, &c);
            assert!(verifier().verify_at(Some(&t), BODY, NOW).is_ok());
        }
    }

    #[test]
    fn fractional_numeric_dates_are_accepted() {
        let mut c = claims_json();
        c["exp"] = serde_json::json!((NOW + 300) as f64 + 0.5);
        c["nbf"] = serde_json::json!(NOW as f64 - 0.5);
        let t = forged(&serde_json::json!({"alg": "HS256"}), &c, CURRENT);
        let verified = verifier().verify_at(Some(&t), BODY, NOW).expect("valid");
        assert_eq!((verified.exp, verified.nbf), (NOW + 300, NOW - 1));
    }

    #[test]
    fn key_errors_and_redaction() {
        assert_eq!(
            Verifier::new("", Some(NEXT)).err(),
            Some(KeyError::EmptyCurrentKey)
        );
        assert_eq!(sign("", &claims()).err(), Some(SignError::EmptyKey));
        let debug = format!("{:?}", verifier());
        assert!(!debug.contains(CURRENT) && !debug.contains(NEXT), "{debug}");
    }

    proptest! {
        #[test]
        fn any_single_byte_change_of_the_body_fails(
            body in proptest::collection::vec(any::<u8>(), 1..256),
            index in any::<proptest::sample::Index>(),
            flip in 1u8..=255,
        ) {
            let t = token(CURRENT, &Claims::new(URL, &body, NOW, 300));
            let v = verifier();
            prop_assert!(v.verify_at(Some(&t), &body, NOW).is_ok());
            let mut tampered = body.clone();
            let i = index.index(tampered.len());
            tampered[i] ^= flip;
            prop_assert_eq!(
                v.verify_at(Some(&t), &tampered, NOW),
                Err(VerifyError::BodyMismatch)
            );
        }
    }
}

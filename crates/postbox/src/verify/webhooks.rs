//! [Standard Webhooks](https://www.standardwebhooks.com/) signatures.
//!
//! A delivery carries three headers:
//!
//! * `webhook-id`: a unique message id,
//! * `webhook-timestamp`: the sending time in unix seconds,
//! * `webhook-signature`: one or more space-separated signatures `v1,<base64>`.
//!
//! The signed content is `{id}.{timestamp}.{body}` and each `v1` signature is the
//! standard base64 (with padding) of its HMAC-SHA256 under a secret. Secrets are written
//! `whsec_` followed by the base64 of the key bytes.
//!
//! ```
//! use postbox::verify::webhooks::{Headers, Signer, Verifier};
//!
//! let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
//! let body = br#"{"test": 2432232314}"#;
//!
//! // Sender side.
//! let signer = Signer::new(secret)?;
//! let signature = signer.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body);
//!
//! // Receiver side.
//! let verifier = Verifier::new(secret)?;
//! let headers = Headers::new("msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", &signature);
//! verifier.verify_at(&headers, body, 1614265330)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use base64::alphabet;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig, STANDARD};
use base64::engine::DecodePaddingMode;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

type HmacSha256 = Hmac<Sha256>;

/// Name of the header carrying the message id.
pub const ID_HEADER: &str = "webhook-id";
/// Name of the header carrying the sending time (unix seconds).
pub const TIMESTAMP_HEADER: &str = "webhook-timestamp";
/// Name of the header carrying the signature list.
pub const SIGNATURE_HEADER: &str = "webhook-signature";
/// Environment variable that holds postbox's webhook secret(s), space-separated.
pub const SECRET_ENV: &str = "POSTBOX_WEBHOOK_SECRET";
/// Prefix of the textual secret form (`whsec_<base64>`).
pub const SECRET_PREFIX: &str = "whsec_";
/// Default tolerance between the `webhook-timestamp` and the receiver's clock: 5 minutes.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(5 * 60);

/// The only signature version this module produces and accepts.
const VERSION: &str = "v1";

/// Decoder for standard base64 that accepts input with or without padding.
const LENIENT_STANDARD: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// Error building a [`Secret`], [`Verifier`] or [`Signer`].
///
/// Messages never include the secret or any part of it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SecretError {
    /// The secret (after removing an optional `whsec_` prefix) is empty.
    #[error("webhook secret is empty")]
    Empty,
    /// The secret is not valid base64 (expected `whsec_` followed by standard base64).
    #[error("webhook secret is not valid base64 (expected `whsec_` followed by standard base64 of the key)")]
    InvalidBase64,
    /// The secret decodes to zero key bytes.
    #[error("webhook secret decodes to an empty key")]
    EmptyKey,
    /// No secret at all was given (for example an empty or blank secret list).
    #[error("no webhook secret was given")]
    NoSecrets,
    /// The environment variable is not set.
    #[error("environment variable {name} is not set")]
    MissingEnv {
        /// Name of the variable.
        name: &'static str,
    },
    /// The environment variable is set but is not valid Unicode.
    #[error("environment variable {name} is not valid Unicode")]
    EnvNotUnicode {
        /// Name of the variable.
        name: &'static str,
    },
}

/// Why a delivery failed verification.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerifyError {
    /// A required header is absent.
    #[error("missing header {name}")]
    MissingHeader {
        /// Name of the header.
        name: &'static str,
    },
    /// A required header is present but empty (or only whitespace).
    #[error("header {name} is empty")]
    EmptyHeader {
        /// Name of the header.
        name: &'static str,
    },
    /// `webhook-timestamp` is not a non-negative integer number of seconds.
    #[error("header webhook-timestamp is not a unix timestamp in seconds")]
    InvalidTimestamp,
    /// The timestamp is further in the past than the tolerance allows.
    #[error("webhook timestamp {timestamp} is too old (now {now})")]
    TimestampTooOld {
        /// The timestamp from the header.
        timestamp: i64,
        /// The receiver's time used for the check.
        now: i64,
    },
    /// The timestamp is further in the future than the tolerance allows.
    #[error("webhook timestamp {timestamp} is too far in the future (now {now})")]
    TimestampTooNew {
        /// The timestamp from the header.
        timestamp: i64,
        /// The receiver's time used for the check.
        now: i64,
    },
    /// `webhook-signature` is not a space-separated list of `version,signature` entries.
    #[error(
        "header webhook-signature is malformed (expected space-separated `v1,<base64>` entries)"
    )]
    MalformedSignatureHeader,
    /// `webhook-signature` has no `v1` entry.
    #[error("header webhook-signature has no v1 signature")]
    NoSupportedSignature,
    /// No `v1` signature matched any configured secret.
    #[error("no webhook signature matches")]
    SignatureMismatch,
}

/// One Standard Webhooks signing secret (the key bytes).
///
/// Its `Debug` output is redacted.
#[derive(Clone)]
pub struct Secret {
    mac: HmacSha256,
}

impl Secret {
    /// Parses `whsec_<base64>` or the bare base64 of the key.
    ///
    /// Surrounding whitespace is ignored; base64 padding is optional.
    pub fn parse(secret: &str) -> Result<Self, SecretError> {
        let trimmed = secret.trim();
        let encoded = trimmed.strip_prefix(SECRET_PREFIX).unwrap_or(trimmed);
        if encoded.is_empty() {
            return Err(SecretError::Empty);
        }
        let key = LENIENT_STANDARD
            .decode(encoded)
            .map_err(|_| SecretError::InvalidBase64)?;
        Self::from_bytes(&key)
    }

    /// Parses a space-separated list of secrets, as held by [`SECRET_ENV`].
    ///
    /// Fails with [`SecretError::NoSecrets`] when the list is blank.
    pub fn parse_list(secrets: &str) -> Result<Vec<Self>, SecretError> {
        let parsed = secrets
            .split_whitespace()
            .map(Self::parse)
            .collect::<Result<Vec<_>, _>>()?;
        if parsed.is_empty() {
            return Err(SecretError::NoSecrets);
        }
        Ok(parsed)
    }

    /// Uses raw key bytes (not base64) as the secret.
    pub fn from_bytes(key: &[u8]) -> Result<Self, SecretError> {
        if key.is_empty() {
            return Err(SecretError::EmptyKey);
        }
        let mac = HmacSha256::new_from_slice(key).map_err(|_| SecretError::EmptyKey)?;
        Ok(Self { mac })
    }

    /// HMAC-SHA256 of `{id}.{timestamp}.{body}`.
    fn tag(&self, id: &str, timestamp: &str, body: &[u8]) -> [u8; 32] {
        let mut mac = self.mac.clone();
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.as_bytes());
        mac.update(b".");
        mac.update(body);
        mac.finalize().into_bytes().into()
    }
}

impl FromStr for Secret {
    type Err = SecretError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Reads and parses the secret list from [`SECRET_ENV`].
fn secrets_from_env() -> Result<Vec<Secret>, SecretError> {
    match std::env::var(SECRET_ENV) {
        Ok(value) => Secret::parse_list(&value),
        Err(std::env::VarError::NotPresent) => Err(SecretError::MissingEnv { name: SECRET_ENV }),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(SecretError::EnvNotUnicode { name: SECRET_ENV })
        }
    }
}

fn non_empty(secrets: Vec<Secret>) -> Result<Vec<Secret>, SecretError> {
    if secrets.is_empty() {
        Err(SecretError::NoSecrets)
    } else {
        Ok(secrets)
    }
}

/// The three Standard Webhooks header values of one delivery.
///
/// `None` means the header is absent. Build it with [`Headers::new`] when you already
/// have the values, or with [`Headers::from_lookup`] to read them from any header map.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Headers<'a> {
    /// Value of `webhook-id`.
    pub id: Option<&'a str>,
    /// Value of `webhook-timestamp`.
    pub timestamp: Option<&'a str>,
    /// Value of `webhook-signature`.
    pub signature: Option<&'a str>,
}

impl<'a> Headers<'a> {
    /// Headers with all three values present.
    pub fn new(id: &'a str, timestamp: &'a str, signature: &'a str) -> Self {
        Self {
            id: Some(id),
            timestamp: Some(timestamp),
            signature: Some(signature),
        }
    }

    /// Reads the three headers through `lookup`, which is called with the lower-case
    /// header names [`ID_HEADER`], [`TIMESTAMP_HEADER`] and [`SIGNATURE_HEADER`] and
    /// returns the value if present (header-name matching is up to `lookup`).
    pub fn from_lookup<F>(mut lookup: F) -> Self
    where
        F: FnMut(&str) -> Option<&'a str>,
    {
        Self {
            id: lookup(ID_HEADER),
            timestamp: lookup(TIMESTAMP_HEADER),
            signature: lookup(SIGNATURE_HEADER),
        }
    }
}

/// Verifies Standard Webhooks deliveries against one or more secrets.
///
/// Holding several secrets supports rotation: a delivery is accepted when any `v1`
/// signature in its header matches any of the secrets.
#[derive(Clone)]
pub struct Verifier {
    secrets: Vec<Secret>,
    tolerance: Duration,
}

impl fmt::Debug for Verifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Verifier")
            .field("secrets", &self.secrets.len())
            .field("tolerance", &self.tolerance)
            .finish()
    }
}

impl Verifier {
    /// A verifier with one secret in `whsec_<base64>` (or bare base64) form.
    pub fn new(secret: &str) -> Result<Self, SecretError> {
        Ok(Self::from_secret_list(vec![Secret::parse(secret)?]))
    }

    /// A verifier with several already-parsed secrets; fails if there are none.
    pub fn from_secrets(secrets: impl IntoIterator<Item = Secret>) -> Result<Self, SecretError> {
        Ok(Self::from_secret_list(non_empty(
            secrets.into_iter().collect(),
        )?))
    }

    /// A verifier from an environment-style value: secrets separated by whitespace,
    /// each `whsec_<base64>` or bare base64 (the form of [`SECRET_ENV`]).
    pub fn from_env_value(value: &str) -> Result<Self, SecretError> {
        Ok(Self::from_secret_list(Secret::parse_list(value)?))
    }

    /// A verifier from the environment variable [`SECRET_ENV`] (`POSTBOX_WEBHOOK_SECRET`).
    pub fn from_env() -> Result<Self, SecretError> {
        Ok(Self::from_secret_list(secrets_from_env()?))
    }

    fn from_secret_list(secrets: Vec<Secret>) -> Self {
        Self {
            secrets,
            tolerance: DEFAULT_TOLERANCE,
        }
    }

    /// Sets how far the timestamp may lie in the past or future (default
    /// [`DEFAULT_TOLERANCE`], 5 minutes). Sub-second parts are ignored.
    #[must_use]
    pub fn with_tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// The configured timestamp tolerance.
    pub fn tolerance(&self) -> Duration {
        self.tolerance
    }

    /// Verifies a delivery against the system clock.
    ///
    /// `body` must be the exact raw request body.
    pub fn verify(&self, headers: &Headers<'_>, body: &[u8]) -> Result<(), VerifyError> {
        self.verify_at(headers, body, super::unix_now())
    }

    /// Verifies a delivery as if the current time were `now` (unix seconds).
    ///
    /// Checks, in order: all three headers are present and non-empty, the timestamp is
    /// numeric, the signature list is well-formed, the timestamp is within the
    /// tolerance of `now`, and finally that some `v1` signature matches some secret
    /// (compared in constant time). Entries with other versions (such as `v1a`) are
    /// ignored.
    pub fn verify_at(
        &self,
        headers: &Headers<'_>,
        body: &[u8],
        now: i64,
    ) -> Result<(), VerifyError> {
        let id = required(headers.id, ID_HEADER)?;
        let timestamp_raw = required(headers.timestamp, TIMESTAMP_HEADER)?;
        let signature_header = required(headers.signature, SIGNATURE_HEADER)?;

        let timestamp = parse_timestamp(timestamp_raw)?;
        let candidates = parse_signatures(signature_header)?;
        if candidates.is_empty() {
            return Err(VerifyError::NoSupportedSignature);
        }
        self.check_timestamp(timestamp, now)?;

        let expected: Vec<[u8; 32]> = self
            .secrets
            .iter()
            .map(|secret| secret.tag(id, timestamp_raw, body))
            .collect();
        let mut matched = subtle::Choice::from(0u8);
        for candidate in &candidates {
            for tag in &expected {
                matched |= tag.as_slice().ct_eq(candidate.as_slice());
            }
        }
        if bool::from(matched) {
            Ok(())
        } else {
            Err(VerifyError::SignatureMismatch)
        }
    }

    fn check_timestamp(&self, timestamp: i64, now: i64) -> Result<(), VerifyError> {
        let tolerance = i128::from(self.tolerance.as_secs());
        let diff = i128::from(now) - i128::from(timestamp);
        if diff > tolerance {
            Err(VerifyError::TimestampTooOld { timestamp, now })
        } else if -diff > tolerance {
            Err(VerifyError::TimestampTooNew { timestamp, now })
        } else {
            Ok(())
        }
    }
}

fn required<'a>(value: Option<&'a str>, name: &'static str) -> Result<&'a str, VerifyError> {
    match value {
        None => Err(VerifyError::MissingHeader { name }),
        Some(v) if v.trim().is_empty() => Err(VerifyError::EmptyHeader { name }),
        Some(v) => Ok(v),
    }
}

/// Parses the timestamp: ASCII digits only (no sign, no spaces), fitting in an `i64`.
fn parse_timestamp(raw: &str) -> Result<i64, VerifyError> {
    if !raw.bytes().all(|b| b.is_ascii_digit()) {
        return Err(VerifyError::InvalidTimestamp);
    }
    raw.parse::<i64>()
        .map_err(|_| VerifyError::InvalidTimestamp)
}

/// Splits the signature list and returns the decoded `v1` signatures.
///
/// Every entry must be `version,signature` with both parts non-empty; entries of other
/// versions are skipped, and a `v1` entry whose signature is not base64 is kept as a
/// candidate that can never match (it is simply a bad signature).
fn parse_signatures(header: &str) -> Result<Vec<Vec<u8>>, VerifyError> {
    let mut candidates = Vec::new();
    for entry in header.split_ascii_whitespace() {
        let (version, signature) = entry
            .split_once(',')
            .ok_or(VerifyError::MalformedSignatureHeader)?;
        if version.is_empty() || signature.is_empty() {
            return Err(VerifyError::MalformedSignatureHeader);
        }
        if version != VERSION {
            continue;
        }
        candidates.push(LENIENT_STANDARD.decode(signature).unwrap_or_default());
    }
    Ok(candidates)
}

/// Signs deliveries in the Standard Webhooks format.
///
/// With several secrets it emits one `v1` signature per secret, so receivers that know
/// either the old or the new secret accept the delivery during a rotation.
#[derive(Clone)]
pub struct Signer {
    secrets: Vec<Secret>,
}

impl fmt::Debug for Signer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Signer")
            .field("secrets", &self.secrets.len())
            .finish()
    }
}

impl Signer {
    /// A signer with one secret in `whsec_<base64>` (or bare base64) form.
    pub fn new(secret: &str) -> Result<Self, SecretError> {
        Ok(Self {
            secrets: vec![Secret::parse(secret)?],
        })
    }

    /// A signer with several already-parsed secrets; fails if there are none.
    pub fn from_secrets(secrets: impl IntoIterator<Item = Secret>) -> Result<Self, SecretError> {
        Ok(Self {
            secrets: non_empty(secrets.into_iter().collect())?,
        })
    }

    /// A signer from an environment-style value: secrets separated by whitespace
    /// (the form of [`SECRET_ENV`]).
    pub fn from_env_value(value: &str) -> Result<Self, SecretError> {
        Ok(Self {
            secrets: Secret::parse_list(value)?,
        })
    }

    /// A signer from the environment variable [`SECRET_ENV`] (`POSTBOX_WEBHOOK_SECRET`).
    pub fn from_env() -> Result<Self, SecretError> {
        Ok(Self {
            secrets: secrets_from_env()?,
        })
    }

    /// The `webhook-signature` value for a message: `v1,<base64>` per secret, joined
    /// by single spaces.
    ///
    /// Send `timestamp` (unix seconds) unchanged as `webhook-timestamp` and `id` as
    /// `webhook-id`; `body` must be exactly the bytes sent.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        let timestamp = timestamp.to_string();
        self.secrets
            .iter()
            .map(|secret| {
                let tag = secret.tag(id, &timestamp, body);
                format!("{VERSION},{}", STANDARD.encode(tag))
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const TS: i64 = 1614265330;
    const TS_STR: &str = "1614265330";
    const BODY: &[u8] = br#"{"test": 2432232314}"#;
    const EXPECTED: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
    // base64 of 24 bytes, different from SECRET.
    const OTHER_SECRET: &str = "whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYX";

    fn verifier() -> Verifier {
        Verifier::new(SECRET).expect("valid secret")
    }

    #[test]
    fn published_vector_signs() {
        let signer = Signer::new(SECRET).expect("valid secret");
        assert_eq!(signer.sign(ID, TS, BODY), EXPECTED);
    }

    #[test]
    fn published_vector_verifies() {
        let headers = Headers::new(ID, TS_STR, EXPECTED);
        assert_eq!(verifier().verify_at(&headers, BODY, TS), Ok(()));
    }

    #[test]
    fn bare_base64_secret_is_accepted() {
        let signer = Signer::new("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").expect("valid secret");
        assert_eq!(signer.sign(ID, TS, BODY), EXPECTED);
    }

    #[test]
    fn module_doc_example() {
        let signer = Signer::new(SECRET).expect("valid");
        let signature = signer.sign(ID, TS, BODY);
        let verifier = Verifier::new(SECRET).expect("valid");
        let headers = Headers::new(ID, TS_STR, &signature);
        assert_eq!(verifier.verify_at(&headers, BODY, TS), Ok(()));
    }

    #[test]
    fn system_clock_verify_accepts_fresh_delivery() {
        let now = crate::verify::unix_now();
        let ts = now.to_string();
        let sig = Signer::new(SECRET).expect("valid").sign(ID, now, BODY);
        let headers = Headers::new(ID, &ts, &sig);
        assert_eq!(verifier().verify(&headers, BODY), Ok(()));
    }

    #[test]
    fn tampered_body_fails() {
        let headers = Headers::new(ID, TS_STR, EXPECTED);
        assert_eq!(
            verifier().verify_at(&headers, br#"{"test": 2432232315}"#, TS),
            Err(VerifyError::SignatureMismatch)
        );
    }

    #[test]
    fn tampered_id_or_timestamp_fails() {
        let v = verifier();
        let other_id = Headers::new("msg_other", TS_STR, EXPECTED);
        assert_eq!(
            v.verify_at(&other_id, BODY, TS),
            Err(VerifyError::SignatureMismatch)
        );
        let other_ts = Headers::new(ID, "1614265331", EXPECTED);
        assert_eq!(
            v.verify_at(&other_ts, BODY, TS),
            Err(VerifyError::SignatureMismatch)
        );
    }

    #[test]
    fn wrong_secret_fails() {
        let v = Verifier::new(OTHER_SECRET).expect("valid");
        let headers = Headers::new(ID, TS_STR, EXPECTED);
        assert_eq!(
            v.verify_at(&headers, BODY, TS),
            Err(VerifyError::SignatureMismatch)
        );
    }

    #[test]
    fn rotation_any_secret_matches() {
        let v = Verifier::from_env_value(&format!("{OTHER_SECRET}  {SECRET}\n")).expect("valid");
        let headers = Headers::new(ID, TS_STR, EXPECTED);
        assert_eq!(v.verify_at(&headers, BODY, TS), Ok(()));
    }

    #[test]
    fn signer_with_several_secrets_signs_with_each() {
        let signer = Signer::from_env_value(&format!("{SECRET} {OTHER_SECRET}")).expect("valid");
        let sig = signer.sign(ID, TS, BODY);
        let parts: Vec<&str> = sig.split(' ').collect();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0], EXPECTED);
        // Each single-secret verifier accepts the combined header.
        for secret in [SECRET, OTHER_SECRET] {
            let v = Verifier::new(secret).expect("valid");
            assert_eq!(
                v.verify_at(&Headers::new(ID, TS_STR, &sig), BODY, TS),
                Ok(())
            );
        }
    }

    #[test]
    fn one_good_signature_among_bad_ones_passes() {
        let header = format!(
            "v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA= v1,not-base64!! {EXPECTED} v1,Zm9v"
        );
        let headers = Headers::new(ID, TS_STR, &header);
        assert_eq!(verifier().verify_at(&headers, BODY, TS), Ok(()));
    }

    #[test]
    fn only_bad_signatures_fail() {
        let header = "v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA= v1,Zm9v v1,***";
        let headers = Headers::new(ID, TS_STR, header);
        assert_eq!(
            verifier().verify_at(&headers, BODY, TS),
            Err(VerifyError::SignatureMismatch)
        );
    }

    #[test]
    fn unknown_versions_are_ignored() {
        // A correct signature labelled with another version does not count ...
        let relabelled = EXPECTED.replacen("v1,", "v1a,", 1);
        let headers = Headers::new(ID, TS_STR, &relabelled);
        assert_eq!(
            verifier().verify_at(&headers, BODY, TS),
            Err(VerifyError::NoSupportedSignature)
        );
        // ... and other versions next to a good v1 do not disturb it.
        let mixed = format!("v1a,c29tZXRoaW5n v2,eA== {EXPECTED}");
        let headers = Headers::new(ID, TS_STR, &mixed);
        assert_eq!(verifier().verify_at(&headers, BODY, TS), Ok(()));
    }

    #[test]
    fn unpadded_signature_is_accepted() {
        let unpadded = EXPECTED.trim_end_matches('=');
        let headers = Headers::new(ID, TS_STR, unpadded);
        assert_eq!(verifier().verify_at(&headers, BODY, TS), Ok(()));
    }

    #[test]
    fn malformed_signature_list_fails() {
        let v = verifier();
        for header in [
            "g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
            &format!("{EXPECTED} garbage"),
            "v1,",
            ",abc",
        ] {
            let headers = Headers::new(ID, TS_STR, header);
            assert_eq!(
                v.verify_at(&headers, BODY, TS),
                Err(VerifyError::MalformedSignatureHeader),
                "header {header:?}"
            );
        }
    }

    #[test]
    fn missing_headers_fail() {
        let v = verifier();
        let mut h = Headers::new(ID, TS_STR, EXPECTED);
        h.id = None;
        assert_eq!(
            v.verify_at(&h, BODY, TS),
            Err(VerifyError::MissingHeader { name: ID_HEADER })
        );
        let mut h = Headers::new(ID, TS_STR, EXPECTED);
        h.timestamp = None;
        assert_eq!(
            v.verify_at(&h, BODY, TS),
            Err(VerifyError::MissingHeader {
                name: TIMESTAMP_HEADER
            })
        );
        let mut h = Headers::new(ID, TS_STR, EXPECTED);
        h.signature = None;
        assert_eq!(
            v.verify_at(&h, BODY, TS),
            Err(VerifyError::MissingHeader {
                name: SIGNATURE_HEADER
            })
        );
        assert_eq!(
            v.verify_at(&Headers::default(), BODY, TS),
            Err(VerifyError::MissingHeader { name: ID_HEADER })
        );
    }

    #[test]
    fn empty_headers_fail() {
        let v = verifier();
        assert_eq!(
            v.verify_at(&Headers::new("", TS_STR, EXPECTED), BODY, TS),
            Err(VerifyError::EmptyHeader { name: ID_HEADER })
        );
        assert_eq!(
            v.verify_at(&Headers::new(ID, " ", EXPECTED), BODY, TS),
            Err(VerifyError::EmptyHeader {
                name: TIMESTAMP_HEADER
            })
        );
        assert_eq!(
            v.verify_at(&Headers::new(ID, TS_STR, ""), BODY, TS),
            Err(VerifyError::EmptyHeader {
                name: SIGNATURE_HEADER
            })
        );
    }

    #[test]
    fn from_lookup_reads_headers() {
        let map = [
            ("webhook-id", ID),
            ("webhook-timestamp", TS_STR),
            ("webhook-signature", EXPECTED),
        ];
        let headers = Headers::from_lookup(|name| {
            map.iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| *v)
        });
        assert_eq!(headers, Headers::new(ID, TS_STR, EXPECTED));
        assert_eq!(verifier().verify_at(&headers, BODY, TS), Ok(()));
    }

    #[test]
    fn non_numeric_timestamp_fails() {
        let v = verifier();
        for ts in [
            "abc",
            "1614265330.5",
            "-1614265330",
            "+1614265330",
            "1e9",
            "99999999999999999999",
        ] {
            assert_eq!(
                v.verify_at(&Headers::new(ID, ts, EXPECTED), BODY, TS),
                Err(VerifyError::InvalidTimestamp),
                "timestamp {ts:?}"
            );
        }
    }

    #[test]
    fn stale_timestamps_fail() {
        let v = verifier();
        let headers = Headers::new(ID, TS_STR, EXPECTED);
        // Exactly at the edge of the 5-minute tolerance: still fine.
        assert_eq!(v.verify_at(&headers, BODY, TS + 300), Ok(()));
        assert_eq!(v.verify_at(&headers, BODY, TS - 300), Ok(()));
        // One second beyond, in the past and in the future.
        assert_eq!(
            v.verify_at(&headers, BODY, TS + 301),
            Err(VerifyError::TimestampTooOld {
                timestamp: TS,
                now: TS + 301
            })
        );
        assert_eq!(
            v.verify_at(&headers, BODY, TS - 301),
            Err(VerifyError::TimestampTooNew {
                timestamp: TS,
                now: TS - 301
            })
        );
        // Extreme clocks do not overflow.
        assert!(matches!(
            v.verify_at(&headers, BODY, i64::MAX),
            Err(VerifyError::TimestampTooOld { .. })
        ));
        assert!(matches!(
            v.verify_at(&headers, BODY, i64::MIN),
            Err(VerifyError::TimestampTooNew { .. })
        ));
    }

    #[test]
    fn tolerance_is_configurable() {
        let headers = Headers::new(ID, TS_STR, EXPECTED);
        let strict = verifier().with_tolerance(Duration::from_secs(10));
        assert!(matches!(
            strict.verify_at(&headers, BODY, TS + 11),
            Err(VerifyError::TimestampTooOld { .. })
        ));
        let lax = verifier().with_tolerance(Duration::from_secs(3600));
        assert_eq!(lax.verify_at(&headers, BODY, TS + 3600), Ok(()));
        assert_eq!(lax.verify_at(&headers, BODY, TS - 3600), Ok(()));
    }

    #[test]
    fn invalid_secrets_fail_at_construction() {
        assert_eq!(
            Verifier::new("whsec_not*base64").err(),
            Some(SecretError::InvalidBase64)
        );
        assert_eq!(Verifier::new("whsec_").err(), Some(SecretError::Empty));
        assert_eq!(Verifier::new("").err(), Some(SecretError::Empty));
        assert_eq!(Signer::new("%%%").err(), Some(SecretError::InvalidBase64));
        assert_eq!(
            Verifier::from_env_value("  ").err(),
            Some(SecretError::NoSecrets)
        );
        assert_eq!(
            Verifier::from_env_value(&format!("{SECRET} whsec_??")).err(),
            Some(SecretError::InvalidBase64)
        );
        assert_eq!(
            Verifier::from_secrets(Vec::new()).err(),
            Some(SecretError::NoSecrets)
        );
        assert_eq!(Secret::from_bytes(b"").err(), Some(SecretError::EmptyKey));
    }

    #[test]
    fn secrets_do_not_leak_through_debug_or_errors() {
        let v = verifier();
        let s = Signer::new(SECRET).expect("valid");
        let secret = Secret::parse(SECRET).expect("valid");
        for text in [format!("{v:?}"), format!("{s:?}"), format!("{secret:?}")] {
            assert!(!text.contains("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"), "{text}");
        }
        let err = Verifier::new("whsec_secret*value").expect_err("invalid");
        assert!(!err.to_string().contains("secret*value"));
    }

    proptest! {
        #[test]
        fn any_single_byte_change_of_the_body_fails(
            body in proptest::collection::vec(any::<u8>(), 1..256),
            index in any::<proptest::sample::Index>(),
            flip in 1u8..=255,
        ) {
            let signer = Signer::new(SECRET).expect("valid");
            let sig = signer.sign(ID, TS, &body);
            let v = verifier();
            prop_assert_eq!(v.verify_at(&Headers::new(ID, TS_STR, &sig), &body, TS), Ok(()));
            let mut tampered = body.clone();
            let i = index.index(tampered.len());
            tampered[i] ^= flip;
            prop_assert_eq!(
                v.verify_at(&Headers::new(ID, TS_STR, &sig), &tampered, TS),
                Err(VerifyError::SignatureMismatch)
            );
        }
    }
}

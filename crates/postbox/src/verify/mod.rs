//! Verification (and signing) of signed HTTP deliveries, without any web framework.
//!
//! Enabled with the cargo feature `verify`.
//!
//! Every verifier takes the values of the relevant HTTP headers as `&str` and the
//! **exact raw request body** as `&[u8]`. Verify before parsing the body: re-serialising
//! parsed JSON changes the bytes and breaks the signature.
//!
//! Two schemes are supported:
//!
//! * [`webhooks`]: [Standard Webhooks](https://www.standardwebhooks.com/)
//!   (`webhook-id`, `webhook-timestamp`, `webhook-signature`; HMAC-SHA256 with
//!   `whsec_…` secrets, several secrets for rotation).
//! * [`qstash`]: Upstash QStash (`Upstash-Signature`, an HS256 JWT signed with the
//!   current or the next signing key).
//!
//! Each module also has the matching signer, used by postbox's HTTP sink and by test
//! servers that need to produce valid deliveries.
//!
//! Errors are typed ([`webhooks::VerifyError`], [`qstash::VerifyError`], …) and their
//! messages never contain a secret or key. All comparisons of signatures are constant-time.
//!
//! Cryptography comes from maintained crates (`hmac`, `sha2`, `jsonwebtoken`, `subtle`,
//! `base64`); nothing here implements a cryptographic primitive itself.

pub mod qstash;
pub mod webhooks;

/// The current time as unix seconds, from the system clock.
pub(crate) fn unix_now() -> i64 {
    chrono::Utc::now().timestamp()
}

//! Users, passwords, sessions and CSRF tokens.

use crate::scope::OutboxPatterns;
use crate::{Console, ConsoleError};
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use axum::http::{header, HeaderMap};
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::{Digest, Sha256};
use std::sync::OnceLock;
use subtle::ConstantTimeEq;

/// The session cookie's name.
pub(crate) const SESSION_COOKIE: &str = "postbox_session";
/// The sign-in form's cookie (there is no session yet): a random nonce the
/// form's CSRF token is bound to ([`SignInTokens`]).
pub(crate) const SIGN_IN_COOKIE: &str = "postbox_sign_in";

/// Audit actions the console writes itself (replays and discards use `store::dlq`'s).
pub(crate) const ACTION_SIGN_IN: &str = "console.sign_in";
pub(crate) const ACTION_SIGN_IN_FAILED: &str = "console.sign_in_failed";
pub(crate) const ACTION_SIGN_OUT: &str = "console.sign_out";
/// What the console's own actions start with.
pub(crate) const CONSOLE_ACTIONS: &str = "console.";

/// What a console user may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Looks at everything; changes nothing.
    Viewer,
    /// Also replays and discards dead letters and cancels bulk actions.
    Operator,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
        }
    }

    /// Whether this role may do what `needed` may (an operator may do what a viewer may).
    pub(crate) fn includes(self, needed: Role) -> bool {
        match needed {
            Role::Viewer => true,
            Role::Operator => self == Role::Operator,
        }
    }

    pub fn parse(s: &str) -> Result<Self, ConsoleError> {
        match s {
            "viewer" => Ok(Role::Viewer),
            "operator" => Ok(Role::Operator),
            other => Err(ConsoleError::UnknownRole(other.to_owned())),
        }
    }
}

pub(crate) fn check_user_name(name: &str) -> Result<(), ConsoleError> {
    if name.is_empty() || name.len() > 64 {
        return Err(ConsoleError::InvalidUserName("must be 1 to 64 characters"));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '@'))
    {
        return Err(ConsoleError::InvalidUserName(
            "use letters, digits, '.', '_', '-' and '@' only",
        ));
    }
    Ok(())
}

pub(crate) fn check_password(password: &str) -> Result<(), ConsoleError> {
    if password.len() < 8 {
        return Err(ConsoleError::InvalidPassword("must be at least 8 bytes"));
    }
    if password.len() > 1024 {
        return Err(ConsoleError::InvalidPassword("must be at most 1024 bytes"));
    }
    Ok(())
}

/// An argon2id hash of `password` (PHC string, random salt). CPU-heavy: call
/// it off the async runtime.
pub fn hash_password(password: &str) -> Result<String, ConsoleError> {
    let mut salt = [0_u8; 16];
    rand::rng().fill_bytes(&mut salt);
    let salt = SaltString::encode_b64(&salt).map_err(|e| ConsoleError::Hash(e.to_string()))?;
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map(|h| h.to_string())
        .map_err(|e| ConsoleError::Hash(e.to_string()))
}

/// Whether `password` matches the PHC string `hash` (false for a malformed hash).
pub fn verify_password(password: &str, hash: &str) -> bool {
    let Ok(parsed) = PasswordHash::new(hash) else {
        return false;
    };
    Argon2::default()
        .verify_password(password.as_bytes(), &parsed)
        .is_ok()
}

/// A hash to verify against when the user does not exist, so that an unknown
/// name takes as long to refuse as a wrong password.
pub(crate) fn decoy_hash() -> &'static str {
    static DECOY: OnceLock<String> = OnceLock::new();
    DECOY.get_or_init(|| hash_password("decoy password, never valid").unwrap_or_default())
}

/// 32 random bytes, hex.
pub(crate) fn random_token() -> String {
    let mut bytes = [0_u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    hex(&bytes)
}

pub(crate) fn token_hash(token: &str) -> Vec<u8> {
    Sha256::digest(token.as_bytes()).to_vec()
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Compare secrets without an early exit.
pub(crate) fn same_secret(a: &str, b: &str) -> bool {
    if a.len() != b.len() || a.is_empty() {
        return false;
    }
    bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

/// The sign-in form's CSRF tokens, issued by this console process and
/// checked against its own key (random, made at start, never stored or
/// shown). A token is `EXPIRES.MAC`: an HMAC-SHA256 over the browser's
/// sign-in cookie (a random nonce) and the expiry (Unix seconds), so a token
/// made up, taken from another browser's form (another cookie), expired, or
/// issued before a restart (another key) is refused.
pub(crate) struct SignInTokens {
    key: [u8; 32],
}

impl SignInTokens {
    pub fn new() -> Self {
        let mut key = [0_u8; 32];
        rand::rng().fill_bytes(&mut key);
        Self { key }
    }

    fn mac(&self, nonce: &str, expires: u64) -> Option<Vec<u8>> {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.key).ok()?;
        mac.update(b"postbox console sign-in form\0");
        mac.update(nonce.as_bytes());
        mac.update(b"\0");
        mac.update(expires.to_string().as_bytes());
        Some(mac.finalize().into_bytes().to_vec())
    }

    /// The token of a form for the browser whose sign-in cookie is `nonce`,
    /// valid until `expires` (Unix seconds).
    pub fn issue(&self, nonce: &str, expires: u64) -> Option<String> {
        self.mac(nonce, expires)
            .map(|mac| format!("{expires}.{}", hex(&mac)))
    }

    /// Whether `token` is one this process issued for the sign-in cookie
    /// `nonce`, and not expired at `now` (Unix seconds).
    pub fn verify(&self, nonce: &str, token: &str, now: u64) -> bool {
        if nonce.is_empty() {
            return false;
        }
        let Some((expires, given)) = token.split_once('.') else {
            return false;
        };
        if expires.is_empty() || !expires.bytes().all(|b| b.is_ascii_digit()) {
            return false;
        }
        let Ok(expires) = expires.parse::<u64>() else {
            return false;
        };
        if expires <= now {
            return false;
        }
        match self.mac(nonce, expires) {
            Some(mac) => same_secret(given, &hex(&mac)),
            None => false,
        }
    }
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A cookie's value from the request's `Cookie` headers.
pub(crate) fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// Whether cookies set on this request's response should be `Secure`.
pub(crate) fn secure(console: &Console, headers: &HeaderMap) -> bool {
    console.inner.config.secure_cookies
        || headers
            .get("x-forwarded-proto")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("https"))
}

/// A `Set-Cookie` value; `max_age` 0 deletes the cookie.
pub(crate) fn set_cookie(name: &str, value: &str, max_age: u64, secure: bool) -> String {
    format!(
        "{name}={value}; Path=/; Max-Age={max_age}; HttpOnly; SameSite=Strict{}",
        if secure { "; Secure" } else { "" }
    )
}

/// The signed-in user of a request. As an extractor
/// ([`crate::http::session`]) it sends anyone without a live session to the
/// sign-in page, coming back to where they were going.
#[derive(Clone, Debug)]
pub(crate) struct Session {
    pub user: String,
    pub role: Role,
    /// The outboxes the role applies to (migration 23; checked on every
    /// request about an outbox: [`crate::http::access`]).
    pub outboxes: OutboxPatterns,
    pub csrf: String,
    pub token_hash: Vec<u8>,
}

impl Session {
    pub fn is_operator(&self) -> bool {
        self.role == Role::Operator
    }

    /// The audit log's actor for this user's actions.
    pub fn actor(&self) -> String {
        actor(&self.user)
    }
}

/// How the console names a user in the audit log.
pub(crate) fn actor(user: &str) -> String {
    format!("console:{user}")
}

/// Where to go after signing in: a local path only, never another site.
pub(crate) fn safe_next(next: Option<&str>) -> String {
    match next {
        Some(n)
            if n.starts_with('/')
                && !n.starts_with("//")
                && !n.contains('\\')
                && !n.chars().any(char::is_control) =>
        {
            n.to_owned()
        }
        _ => "/".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_verify_against_their_hash_only() {
        let h = hash_password("correct horse").unwrap();
        assert!(h.starts_with("$argon2id$"), "{h}");
        assert!(verify_password("correct horse", &h));
        assert!(!verify_password("wrong horse", &h));
        assert!(!verify_password("correct horse", "not a hash"));
    }

    #[test]
    fn names_passwords_and_roles_are_checked() {
        assert!(check_user_name("alice@ops").is_ok());
        assert!(check_user_name("").is_err());
        assert!(check_user_name("a b").is_err());
        assert!(check_user_name("<script>").is_err());
        assert!(check_password("short").is_err());
        assert!(Role::parse("admin").is_err());
        assert_eq!(Role::parse("operator").unwrap(), Role::Operator);
        assert!(Role::Operator.includes(Role::Viewer));
        assert!(Role::Operator.includes(Role::Operator));
        assert!(Role::Viewer.includes(Role::Viewer));
        assert!(!Role::Viewer.includes(Role::Operator));
    }

    #[test]
    fn only_local_paths_are_followed_after_sign_in() {
        assert_eq!(safe_next(Some("/events?type=a")), "/events?type=a");
        assert_eq!(safe_next(Some("//evil.example")), "/");
        assert_eq!(safe_next(Some("https://evil.example")), "/");
        assert_eq!(safe_next(Some("/\\evil")), "/");
        assert_eq!(safe_next(None), "/");
    }

    #[test]
    fn cookies_are_found_among_others() {
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            "a=1; postbox_session=abc; b=2".parse().unwrap(),
        );
        assert_eq!(cookie(&h, SESSION_COOKIE), Some("abc"));
        assert_eq!(cookie(&h, "c"), None);
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abc", "abd"));
        assert!(!same_secret("", ""));
    }

    #[test]
    fn sign_in_tokens_are_bound_to_their_cookie_their_expiry_and_their_key() {
        let tokens = SignInTokens::new();
        let now = 1_000_000;
        let token = tokens.issue("nonce-a", now + 60).unwrap();
        assert!(tokens.verify("nonce-a", &token, now));
        // Another browser's cookie, a token made up, the cookie as its own token.
        assert!(!tokens.verify("nonce-b", &token, now));
        assert!(!tokens.verify("", &token, now));
        assert!(!tokens.verify("nonce-a", "nonce-a", now));
        assert!(!tokens.verify("nonce-a", &format!("{}.00", now + 60), now));
        // Expired; an expiry moved later.
        assert!(!tokens.verify("nonce-a", &token, now + 60));
        let (_, mac) = token.split_once('.').unwrap();
        assert!(!tokens.verify("nonce-a", &format!("{}.{mac}", now + 3600), now));
        assert!(!tokens.verify("nonce-a", &format!("+{}.{mac}", now + 60), now));
        // Another process (a restart): another key.
        assert!(!SignInTokens::new().verify("nonce-a", &token, now));
    }
}

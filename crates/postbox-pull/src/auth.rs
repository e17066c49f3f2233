//! Bearer tokens: which group a request's token opens, remembered for a
//! short while, and a bound on the failed tokens one address may send.

use axum::http::{header, HeaderMap, StatusCode};
use postbox_store::Groups;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Why a request was refused before its call ran.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// No `Authorization: Bearer …` header.
    NoToken,
    /// A token no group has (or not shaped like one).
    UnknownToken,
    /// A token of another group.
    WrongGroup,
    /// Too many failed tokens from this address: try again after this.
    TooMany(Duration),
    /// The token could not be looked up.
    Unavailable,
}

impl Refusal {
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Refusal::NoToken | Refusal::UnknownToken => StatusCode::UNAUTHORIZED,
            Refusal::WrongGroup => StatusCode::FORBIDDEN,
            Refusal::TooMany(_) => StatusCode::TOO_MANY_REQUESTS,
            Refusal::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    pub(crate) fn phrase(&self) -> &'static str {
        match self {
            Refusal::NoToken => "a bearer token is required (Authorization: Bearer pbg_…)",
            Refusal::UnknownToken => "unknown bearer token",
            Refusal::WrongGroup => "this token does not open this consumer group",
            Refusal::TooMany(_) => "too many failed tokens from this address; try again later",
            Refusal::Unavailable => "the database is not reachable; try again",
        }
    }

    /// The `reason` label of the refusals metric.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Refusal::NoToken => "no_token",
            Refusal::UnknownToken => "unknown_token",
            Refusal::WrongGroup => "wrong_group",
            Refusal::TooMany(_) => "rate_limited",
            Refusal::Unavailable => "unavailable",
        }
    }
}

/// Entries beyond this many are swept (expired ones first, then all).
const MAX_ENTRIES: usize = 10_000;

/// The window failed tokens are counted in.
const FAILURE_WINDOW: Duration = Duration::from_secs(60);

pub(crate) struct TokenCache {
    ttl: Duration,
    failures_allowed: u32,
    /// A token's SHA-256 → its group, and when that was read.
    known: Mutex<HashMap<[u8; 32], (String, Instant)>>,
    /// Per address: the start of its window and its failures in it.
    failures: Mutex<HashMap<IpAddr, (Instant, u32)>>,
}

impl TokenCache {
    pub(crate) fn new(ttl: Duration, failures_allowed: u32) -> Self {
        Self {
            ttl,
            failures_allowed: failures_allowed.max(1),
            known: Mutex::new(HashMap::new()),
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Admit a request from `ip` for `group` if its bearer token opens it.
    pub(crate) async fn admit(
        &self,
        groups: &Groups,
        ip: IpAddr,
        headers: &HeaderMap,
        group: &str,
    ) -> Result<(), Refusal> {
        let Some(token) = bearer(headers) else {
            return Err(Refusal::NoToken);
        };
        let hash = postbox_store::token_hash(token);
        let now = Instant::now();
        if let Some(opens) = self.remembered(&hash, now) {
            return self.matches(ip, &opens, group, now);
        }
        // A look-up costs a query: not for an address out of failures.
        if let Some(wait) = self.blocked(ip, now) {
            return Err(Refusal::TooMany(wait));
        }
        match groups.group_of_token(token).await {
            Ok(Some(opens)) => {
                self.remember(hash, opens.clone(), now);
                self.matches(ip, &opens, group, now)
            }
            Ok(None) => {
                self.failed(ip, now);
                Err(Refusal::UnknownToken)
            }
            Err(e) => {
                tracing::warn!(
                    error = %postbox::redact::sanitize_error(&e.to_string()),
                    "cannot look a consumer group's token up"
                );
                Err(Refusal::Unavailable)
            }
        }
    }

    fn matches(&self, ip: IpAddr, opens: &str, group: &str, now: Instant) -> Result<(), Refusal> {
        if opens == group {
            Ok(())
        } else {
            self.failed(ip, now);
            Err(Refusal::WrongGroup)
        }
    }

    fn remembered(&self, hash: &[u8; 32], now: Instant) -> Option<String> {
        let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        known
            .get(hash)
            .filter(|(_, at)| now.duration_since(*at) < self.ttl)
            .map(|(group, _)| group.clone())
    }

    fn remember(&self, hash: [u8; 32], group: String, now: Instant) {
        if self.ttl.is_zero() {
            return;
        }
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        if known.len() >= MAX_ENTRIES {
            known.retain(|_, (_, at)| now.duration_since(*at) < self.ttl);
            if known.len() >= MAX_ENTRIES {
                known.clear();
            }
        }
        known.insert(hash, (group, now));
    }

    /// How long until `ip` may try an unknown token again, if it is out of
    /// failures.
    fn blocked(&self, ip: IpAddr, now: Instant) -> Option<Duration> {
        let failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let (since, n) = failures.get(&ip)?;
        let ends = *since + FAILURE_WINDOW;
        (*n >= self.failures_allowed && now < ends).then(|| ends - now)
    }

    fn failed(&self, ip: IpAddr, now: Instant) {
        let mut failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        if failures.len() >= MAX_ENTRIES {
            failures.retain(|_, (since, _)| now.duration_since(*since) < FAILURE_WINDOW);
            if failures.len() >= MAX_ENTRIES {
                failures.clear();
            }
        }
        let entry = failures.entry(ip).or_insert((now, 0));
        if now.duration_since(entry.0) >= FAILURE_WINDOW {
            *entry = (now, 0);
        }
        entry.1 = entry.1.saturating_add(1);
    }
}

/// The token of an `Authorization: Bearer <token>` header (the scheme in
/// any case).
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_bearer_token() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), None);
        h.insert(header::AUTHORIZATION, "Bearer pbg_x".parse().unwrap());
        assert_eq!(bearer(&h), Some("pbg_x"));
        h.insert(header::AUTHORIZATION, "bearer  pbg_y ".parse().unwrap());
        assert_eq!(bearer(&h), Some("pbg_y"));
        h.insert(header::AUTHORIZATION, "Basic dXNlcjpwdw==".parse().unwrap());
        assert_eq!(bearer(&h), None);
        h.insert(header::AUTHORIZATION, "Bearer ".parse().unwrap());
        assert_eq!(bearer(&h), None);
    }

    #[test]
    fn an_address_out_of_failures_waits_for_its_window() {
        let cache = TokenCache::new(Duration::from_secs(5), 3);
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let other: IpAddr = "192.0.2.2".parse().unwrap();
        let t0 = Instant::now();
        for _ in 0..3 {
            assert_eq!(cache.blocked(ip, t0), None);
            cache.failed(ip, t0);
        }
        assert!(cache.blocked(ip, t0).is_some());
        assert_eq!(cache.blocked(other, t0), None);
        assert_eq!(cache.blocked(ip, t0 + FAILURE_WINDOW), None);
        cache.failed(ip, t0 + FAILURE_WINDOW);
        assert_eq!(cache.blocked(ip, t0 + FAILURE_WINDOW), None);
    }

    #[test]
    fn a_known_token_is_forgotten_after_its_time() {
        let cache = TokenCache::new(Duration::from_secs(5), 3);
        let t0 = Instant::now();
        cache.remember([1; 32], "billing".into(), t0);
        assert_eq!(cache.remembered(&[1; 32], t0).as_deref(), Some("billing"));
        assert_eq!(
            cache.remembered(&[1; 32], t0 + Duration::from_secs(5)),
            None
        );
        let none = TokenCache::new(Duration::ZERO, 3);
        none.remember([1; 32], "billing".into(), t0);
        assert_eq!(none.remembered(&[1; 32], t0), None);
    }
}

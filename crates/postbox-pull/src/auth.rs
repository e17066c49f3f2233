//! Bearer tokens: which group a request's token opens (remembered for a
//! short while), and bounds on failed tokens — per client address and for
//! the whole server — that never lock a reader out whose token this server
//! has seen work lately.

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
    /// Too many failed tokens from this address (or from everyone): try
    /// again after this.
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
            Refusal::TooMany(_) => "too many failed tokens; try again later",
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

/// A request let in: the id of the token it showed (for the log; never
/// the token).
pub(crate) struct Admitted {
    pub token_id: i64,
}

/// Entries a map keeps at most (expired ones are swept first; past that,
/// new entries are not kept, and never are the old ones all dropped).
const MAX_ENTRIES: usize = 10_000;

/// The window failed tokens are counted in.
const FAILURE_WINDOW: Duration = Duration::from_secs(60);

/// How long a token that worked lets its holder past an address's or the
/// server's failure bound (so a stranger sharing the address — a proxy, a
/// NAT — cannot lock that reader out).
const TRUSTED_FOR: Duration = Duration::from_secs(600);

/// Failed tokens the whole server takes a minute, as a multiple of one
/// address's: past it, unknown tokens get 429 from everyone (addresses are
/// cheap to come by) and cost no look-up.
const GLOBAL_FACTOR: u32 = 10;

/// A failed look-up is said in the log at most this often.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// A window's count of failures.
#[derive(Clone, Copy)]
struct Window {
    since: Instant,
    failures: u32,
}

impl Window {
    fn new(now: Instant) -> Self {
        Self {
            since: now,
            failures: 0,
        }
    }

    fn current(&mut self, now: Instant) -> &mut Self {
        if now.duration_since(self.since) >= FAILURE_WINDOW {
            *self = Window::new(now);
        }
        self
    }

    /// How long until it may fail again, when it is out of `allowed`.
    fn blocked(&self, allowed: u32, now: Instant) -> Option<Duration> {
        let ends = self.since + FAILURE_WINDOW;
        (self.failures >= allowed && now < ends).then(|| ends - now)
    }
}

struct Failures {
    by_origin: HashMap<IpAddr, Window>,
    global: Window,
}

pub(crate) struct TokenCache {
    ttl: Duration,
    per_origin: u32,
    /// A token's SHA-256 → its group and id, and when that was read.
    known: Mutex<HashMap<[u8; 32], (String, i64, Instant)>>,
    /// Tokens that worked lately, and when.
    trusted: Mutex<HashMap<[u8; 32], Instant>>,
    failures: Mutex<Failures>,
    warned_at: Mutex<Option<Instant>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whom failures are counted against: an IPv4 address, or an IPv6 /64
/// (one host is usually given a whole /64).
fn origin(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

impl TokenCache {
    pub(crate) fn new(ttl: Duration, per_origin: u32) -> Self {
        let now = Instant::now();
        Self {
            ttl,
            per_origin: per_origin.max(1),
            known: Mutex::new(HashMap::new()),
            trusted: Mutex::new(HashMap::new()),
            failures: Mutex::new(Failures {
                by_origin: HashMap::new(),
                global: Window::new(now),
            }),
            warned_at: Mutex::new(None),
        }
    }

    /// Admit a request from `ip` for `group` if its bearer token opens it.
    pub(crate) async fn admit(
        &self,
        groups: &Groups,
        ip: IpAddr,
        headers: &HeaderMap,
        group: &str,
    ) -> Result<Admitted, Refusal> {
        let Some(token) = bearer(headers) else {
            return Err(Refusal::NoToken);
        };
        let hash = postbox_store::token_hash(token);
        let now = Instant::now();
        if let Some((opens, token_id)) = self.remembered(&hash, now) {
            return self.matches(ip, &opens, token_id, group, now);
        }
        // A look-up costs a query: not for a stranger out of failures.
        if !self.is_trusted(&hash, now) {
            if let Some(wait) = self.blocked(ip, now) {
                return Err(Refusal::TooMany(wait));
            }
        }
        match groups.token_of(token).await {
            Ok(Some((opens, token_id))) => {
                self.remember(hash, opens.clone(), token_id, now);
                self.matches(ip, &opens, token_id, group, now)
            }
            Ok(None) => {
                self.failed(ip, now);
                Err(Refusal::UnknownToken)
            }
            Err(e) => {
                // Counted too: a stranger's well-shaped tokens must not
                // make every call wait for a connection while the database
                // is away.
                self.failed(ip, now);
                self.warn(now, &e);
                Err(Refusal::Unavailable)
            }
        }
    }

    fn matches(
        &self,
        ip: IpAddr,
        opens: &str,
        token_id: i64,
        group: &str,
        now: Instant,
    ) -> Result<Admitted, Refusal> {
        if opens == group {
            Ok(Admitted { token_id })
        } else {
            self.failed(ip, now);
            Err(Refusal::WrongGroup)
        }
    }

    fn remembered(&self, hash: &[u8; 32], now: Instant) -> Option<(String, i64)> {
        lock(&self.known)
            .get(hash)
            .filter(|(_, _, at)| now.duration_since(*at) < self.ttl)
            .map(|(group, id, _)| (group.clone(), *id))
    }

    fn is_trusted(&self, hash: &[u8; 32], now: Instant) -> bool {
        lock(&self.trusted)
            .get(hash)
            .is_some_and(|at| now.duration_since(*at) < TRUSTED_FOR)
    }

    fn remember(&self, hash: [u8; 32], group: String, token_id: i64, now: Instant) {
        {
            let mut trusted = lock(&self.trusted);
            if trusted.len() >= MAX_ENTRIES {
                trusted.retain(|_, at| now.duration_since(*at) < TRUSTED_FOR);
            }
            if trusted.len() < MAX_ENTRIES || trusted.contains_key(&hash) {
                trusted.insert(hash, now);
            }
        }
        if self.ttl.is_zero() {
            return;
        }
        let mut known = lock(&self.known);
        if known.len() >= MAX_ENTRIES {
            known.retain(|_, (_, _, at)| now.duration_since(*at) < self.ttl);
        }
        if known.len() < MAX_ENTRIES {
            known.insert(hash, (group, token_id, now));
        }
    }

    /// How long until `ip` (or anyone, when the server is out of failures)
    /// may try an unknown token again.
    fn blocked(&self, ip: IpAddr, now: Instant) -> Option<Duration> {
        let mut failures = lock(&self.failures);
        let global = self.per_origin.saturating_mul(GLOBAL_FACTOR);
        if let Some(wait) = failures.global.current(now).blocked(global, now) {
            return Some(wait);
        }
        failures
            .by_origin
            .get(&origin(ip))
            .and_then(|w| w.blocked(self.per_origin, now))
    }

    fn failed(&self, ip: IpAddr, now: Instant) {
        let mut failures = lock(&self.failures);
        let global = failures.global.current(now);
        global.failures = global.failures.saturating_add(1);
        let key = origin(ip);
        if failures.by_origin.len() >= MAX_ENTRIES && !failures.by_origin.contains_key(&key) {
            failures
                .by_origin
                .retain(|_, w| now.duration_since(w.since) < FAILURE_WINDOW);
            if failures.by_origin.len() >= MAX_ENTRIES {
                // Counted by the global bound alone.
                return;
            }
        }
        let window = failures
            .by_origin
            .entry(key)
            .or_insert_with(|| Window::new(now))
            .current(now);
        window.failures = window.failures.saturating_add(1);
    }

    fn warn(&self, now: Instant, e: &sqlx::Error) {
        let mut warned = lock(&self.warned_at);
        if warned.is_some_and(|at| now.duration_since(at) < WARN_EVERY) {
            return;
        }
        *warned = Some(now);
        let denied = e
            .as_database_error()
            .and_then(|d| d.code())
            .is_some_and(|c| c == "42501");
        if denied {
            tracing::error!(
                "this login may not look tokens up (group_token_group): run `postbox migrate \
                 --create-roles` and grant the <schema>_consumer role to it"
            );
        } else {
            tracing::warn!(
                error = %postbox::redact::sanitize_error(&e.to_string()),
                "cannot look a consumer group's token up (said at most every 10 s)"
            );
        }
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
    fn an_ipv6_host_is_counted_by_its_64() {
        let cache = TokenCache::new(Duration::from_secs(5), 2);
        let t0 = Instant::now();
        cache.failed("2001:db8::1".parse().unwrap(), t0);
        cache.failed("2001:db8::ffff:2".parse().unwrap(), t0);
        assert!(cache.blocked("2001:db8::3".parse().unwrap(), t0).is_some());
        assert_eq!(cache.blocked("2001:db8:0:1::3".parse().unwrap(), t0), None);
        // An IPv4 address seen through an IPv6 socket is that address.
        cache.failed("::ffff:192.0.2.9".parse().unwrap(), t0);
        cache.failed("192.0.2.9".parse().unwrap(), t0);
        assert!(cache.blocked("192.0.2.9".parse().unwrap(), t0).is_some());
    }

    #[test]
    fn many_addresses_run_into_the_servers_bound() {
        let cache = TokenCache::new(Duration::from_secs(5), 2);
        let t0 = Instant::now();
        for i in 0..(2 * GLOBAL_FACTOR) {
            let ip = IpAddr::V4(std::net::Ipv4Addr::from(0x0a00_0000 + i));
            cache.failed(ip, t0);
        }
        assert!(cache.blocked("198.51.100.1".parse().unwrap(), t0).is_some());
        assert_eq!(
            cache.blocked("198.51.100.1".parse().unwrap(), t0 + FAILURE_WINDOW),
            None
        );
    }

    #[test]
    fn a_token_that_worked_is_trusted_past_its_cache() {
        let cache = TokenCache::new(Duration::from_secs(5), 3);
        let t0 = Instant::now();
        cache.remember([1; 32], "billing".into(), 7, t0);
        assert_eq!(cache.remembered(&[1; 32], t0), Some(("billing".into(), 7)));
        assert_eq!(
            cache.remembered(&[1; 32], t0 + Duration::from_secs(5)),
            None
        );
        assert!(cache.is_trusted(&[1; 32], t0 + Duration::from_secs(5)));
        assert!(!cache.is_trusted(&[1; 32], t0 + TRUSTED_FOR));
        assert!(!cache.is_trusted(&[2; 32], t0));
        let none = TokenCache::new(Duration::ZERO, 3);
        none.remember([1; 32], "billing".into(), 7, t0);
        assert_eq!(none.remembered(&[1; 32], t0), None);
        assert!(none.is_trusted(&[1; 32], t0));
    }
}

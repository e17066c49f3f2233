//! The in-process rate limits: keyed limiters (`governor`'s GCRA, a token
//! bucket that refills continuously), and the sign-in limits built on them
//! ([`SignInLimits`]), which keep guessing expensive without letting anyone
//! lock a user out.

use governor::clock::{Clock, MonotonicClock, Reference};
use governor::middleware::NoOpMiddleware;
use governor::state::keyed::HashMapStateStore;
use governor::{Quota, RateLimiter};
use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// At most `burst` requests at once, refilled at `burst` per `per`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateLimit {
    pub burst: u32,
    pub per: Duration,
}

impl RateLimit {
    /// `n` requests a minute, all of them usable at once.
    pub fn per_minute(n: u32) -> Self {
        Self {
            burst: n,
            per: Duration::from_secs(60),
        }
    }

    /// The quota: at least one request at once, refilled over at least a millisecond.
    fn quota(self) -> Quota {
        let burst = NonZeroU32::new(self.burst).unwrap_or(NonZeroU32::MIN);
        let one_per =
            (self.per.max(Duration::from_millis(1)) / burst.get()).max(Duration::from_nanos(1));
        Quota::with_period(one_per)
            .unwrap_or_else(|| Quota::per_second(burst))
            .allow_burst(burst)
    }
}

/// Keys beyond this many are swept of idle ones (full again for a refill
/// interval or longer) before a check.
const SWEEP_ABOVE: usize = 10_000;

pub(crate) struct Limiter<C: Clock = MonotonicClock> {
    limiter: RateLimiter<String, HashMapStateStore<String>, C, NoOpMiddleware<C::Instant>>,
}

impl Limiter {
    pub fn new(limit: RateLimit) -> Self {
        Self::with_clock(limit, MonotonicClock)
    }
}

impl<C: Clock> Limiter<C> {
    /// A limiter that reads the time from `clock`.
    fn with_clock(limit: RateLimit, clock: C) -> Self {
        Self {
            limiter: RateLimiter::hashmap_with_clock(limit.quota(), clock),
        }
    }

    /// Take one request for `key`: `Ok` if there was one, else how long until there is.
    pub fn check(&self, key: &str) -> Result<(), Duration> {
        if self.limiter.len() > SWEEP_ABOVE {
            self.limiter.retain_recent();
        }
        self.limiter
            .check_key(&key.to_owned())
            .map_err(|refused| refused.wait_time_from(self.limiter.clock().now()))
    }
}

/// A bound on the log lines about something that may repeat without end
/// (a refused request): at most the limit's lines, the others counted and
/// told in the next line logged.
pub(crate) struct LogLimit {
    lines: Limiter,
    left_out: AtomicU64,
}

impl LogLimit {
    pub fn new(limit: RateLimit) -> Self {
        Self {
            lines: Limiter::new(limit),
            left_out: AtomicU64::new(0),
        }
    }

    /// `Some(n)`: log this one, and say that `n` were left out since the
    /// last line; `None`: leave it out (it is counted).
    pub fn admit(&self) -> Option<u64> {
        match self.lines.check("") {
            Ok(()) => Some(self.left_out.swap(0, Ordering::Relaxed)),
            Err(_) => {
                self.left_out.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }
}

/// How long an address's failure for a name is remembered, in refill
/// periods of the sign-in limit (15 minutes at the default 5 a minute).
const PAIR_MEMORY_PERIODS: u32 = 15;
/// Remembered (name, address) failures beyond this many: the oldest half goes.
const PAIRS_AT_MOST: usize = 100_000;

/// The sign-in limits.
///
/// 1. **Per address**, every attempt takes a token (5 a minute): one address
///    cannot guess fast, whatever names it tries.
/// 2. **Per name**, only *failed* attempts take a token, from anywhere (5 a
///    minute). A failure that finds the bucket empty puts the name **under
///    protection** until a token is back. Under protection, an address that
///    already failed for this name in the last 15 minutes is refused, and any
///    other address is let through after a delay (`delay`): its attempt is
///    checked, so the right password still signs in. Nobody can lock a user
///    out by failing on purpose; a guesser gets one guess per address per 15
///    minutes for a protected name, each one slowed down.
///
/// A successful sign-in forgets that address's failures for the name.
pub(crate) struct SignInLimits<C: Clock = MonotonicClock> {
    by_client: Limiter<C>,
    failures_by_name: Limiter<C>,
    clock: C,
    pair_memory: Duration,
    delay: Duration,
    state: Mutex<SignInState<C::Instant>>,
}

struct SignInState<I> {
    /// Names under protection, and until when.
    protected_until: HashMap<String, I>,
    /// The last failure of each (name, address key).
    failed: HashMap<(String, String), I>,
}

/// What to do with a sign-in attempt.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Check the password now.
    Now,
    /// Check it after this delay (the name is under protection).
    After(Duration),
    /// Refuse it; another attempt may come after this long.
    Refuse(Duration),
}

impl SignInLimits {
    pub fn new(limit: RateLimit, delay: Duration) -> Self {
        Self::with_clock(limit, delay, MonotonicClock)
    }
}

impl<C: Clock + Clone> SignInLimits<C> {
    fn with_clock(limit: RateLimit, delay: Duration, clock: C) -> Self {
        Self {
            by_client: Limiter::with_clock(limit, clock.clone()),
            failures_by_name: Limiter::with_clock(limit, clock.clone()),
            pair_memory: limit.per.max(Duration::from_millis(1)) * PAIR_MEMORY_PERIODS,
            delay,
            clock,
            state: Mutex::new(SignInState {
                protected_until: HashMap::new(),
                failed: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SignInState<C::Instant>> {
        match self.state.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    fn key(name: &str, client: &str) -> (String, String) {
        (name.to_ascii_lowercase(), client.to_owned())
    }

    /// Whether (and when) to check an attempt for `name` from the address key `client`.
    pub fn admit(&self, name: &str, client: &str) -> Admit {
        if let Err(wait) = self.by_client.check(client) {
            return Admit::Refuse(wait);
        }
        let now = self.clock.now();
        let state = self.lock();
        let (name, client) = Self::key(name, client);
        let protected = state
            .protected_until
            .get(&name)
            .is_some_and(|until| *until > now);
        if !protected {
            return Admit::Now;
        }
        match state.failed.get(&(name, client)) {
            Some(at) => {
                let since = Duration::from(now.duration_since(*at));
                if since < self.pair_memory {
                    Admit::Refuse(self.pair_memory - since)
                } else {
                    Admit::After(self.delay)
                }
            }
            None => Admit::After(self.delay),
        }
    }

    /// Record a failed attempt for `name` from `client`.
    pub fn failed(&self, name: &str, client: &str) {
        let (name, client) = Self::key(name, client);
        let refused = self.failures_by_name.check(&name);
        let now = self.clock.now();
        let mut state = self.lock();
        if let Err(wait) = refused {
            let until = now + governor::nanos::Nanos::from(wait);
            let entry = state.protected_until.entry(name.clone()).or_insert(until);
            *entry = (*entry).max(until);
        }
        if state.protected_until.len() > SWEEP_ABOVE {
            state.protected_until.retain(|_, until| *until > now);
        }
        state.failed.insert((name, client), now);
        if state.failed.len() > SWEEP_ABOVE {
            let memory = self.pair_memory;
            state
                .failed
                .retain(|_, at| Duration::from(now.duration_since(*at)) < memory);
            if state.failed.len() > PAIRS_AT_MOST {
                let mut times: Vec<C::Instant> = state.failed.values().copied().collect();
                times.sort_unstable();
                let median = times[times.len() / 2];
                state.failed.retain(|_, at| *at >= median);
            }
        }
    }

    /// Record a successful sign-in: `client`'s failures for `name` are forgotten.
    pub fn succeeded(&self, name: &str, client: &str) {
        self.lock().failed.remove(&Self::key(name, client));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use governor::clock::FakeRelativeClock;

    fn limiter(limit: RateLimit) -> (Limiter<FakeRelativeClock>, FakeRelativeClock) {
        let clock = FakeRelativeClock::default();
        (Limiter::with_clock(limit, clock.clone()), clock)
    }

    #[test]
    fn a_burst_is_allowed_then_refused_with_a_wait() {
        let (l, _) = limiter(RateLimit::per_minute(3));
        for _ in 0..3 {
            assert!(l.check("a").is_ok());
        }
        assert_eq!(l.check("a").unwrap_err(), Duration::from_secs(20));
        assert!(l.check("b").is_ok(), "keys are independent");
    }

    #[test]
    fn tokens_come_back_over_time() {
        let (l, clock) = limiter(RateLimit::per_minute(2));
        assert!(l.check("a").is_ok());
        assert!(l.check("a").is_ok());
        assert_eq!(l.check("a").unwrap_err(), Duration::from_secs(30));
        clock.advance(Duration::from_secs(29));
        assert_eq!(l.check("a").unwrap_err(), Duration::from_secs(1));
        clock.advance(Duration::from_secs(2));
        assert!(l.check("a").is_ok());
        assert!(l.check("a").is_err(), "one came back, not two");
    }

    #[test]
    fn idle_keys_are_forgotten_once_there_are_many() {
        let (l, clock) = limiter(RateLimit::per_minute(2));
        for i in 0..=SWEEP_ABOVE {
            assert!(l.check(&format!("client-{i}")).is_ok());
        }
        assert!(l.check("client-0").is_ok(), "a used key is remembered");
        assert!(l.check("client-0").is_err());
        clock.advance(Duration::from_secs(120)); // every bucket full again, long since
        assert!(l.check("someone new").is_ok());
        assert_eq!(l.limiter.len(), 1, "only the new key is left");
    }

    fn sign_in(limit: RateLimit) -> (SignInLimits<FakeRelativeClock>, FakeRelativeClock) {
        let clock = FakeRelativeClock::default();
        let delay = Duration::from_secs(2);
        (SignInLimits::with_clock(limit, delay, clock.clone()), clock)
    }

    #[test]
    fn an_attacker_cannot_lock_a_user_out() {
        let (l, clock) = sign_in(RateLimit::per_minute(3));
        // One address guesses until its own limit stops it.
        for _ in 0..3 {
            assert_eq!(l.admit("alice", "6.6.6.6"), Admit::Now);
            l.failed("alice", "6.6.6.6");
        }
        assert!(matches!(l.admit("alice", "6.6.6.6"), Admit::Refuse(_)));
        // Many addresses keep failing for the same name: it is protected,
        // each of them gets one (slowed) guess, then is refused.
        for i in 0..20 {
            let addr = format!("7.7.7.{i}");
            let first = l.admit("Alice", &addr);
            assert!(
                first == Admit::Now || first == Admit::After(Duration::from_secs(2)),
                "{first:?}"
            );
            l.failed("Alice", &addr);
            clock.advance(Duration::from_millis(100));
            assert!(
                matches!(l.admit("alice", &addr), Admit::Refuse(w) if w > Duration::from_secs(60)),
                "{addr} already failed for a protected name"
            );
        }
        // Alice, from an address of her own: checked (after the delay), not refused.
        assert_eq!(
            l.admit("alice", "192.0.2.10"),
            Admit::After(Duration::from_secs(2))
        );
        l.succeeded("alice", "192.0.2.10");
        // Other names are not affected.
        assert_eq!(l.admit("bob", "192.0.2.11"), Admit::Now);
    }

    #[test]
    fn protection_ends_when_failures_stop_and_success_forgets_failures() {
        let (l, clock) = sign_in(RateLimit::per_minute(2));
        for addr in ["1.0.0.1", "1.0.0.2", "1.0.0.3"] {
            assert_eq!(l.admit("alice", addr), Admit::Now);
            l.failed("alice", addr);
        }
        assert!(matches!(l.admit("alice", "1.0.0.3"), Admit::Refuse(_)));
        clock.advance(Duration::from_secs(31));
        assert_eq!(l.admit("alice", "1.0.0.3"), Admit::Now, "a token is back");
        // Protected again; a success from 1.0.0.4 clears its own failure only.
        l.failed("alice", "1.0.0.4");
        l.failed("alice", "1.0.0.4");
        clock.advance(Duration::from_secs(1));
        assert!(matches!(l.admit("alice", "1.0.0.4"), Admit::Refuse(_)));
        l.succeeded("alice", "1.0.0.4");
        assert_eq!(
            l.admit("alice", "1.0.0.4"),
            Admit::After(Duration::from_secs(2))
        );
        assert!(matches!(l.admit("alice", "1.0.0.1"), Admit::Refuse(_)));
    }

    #[test]
    fn a_zero_limit_still_allows_one_request() {
        let (l, _) = limiter(RateLimit {
            burst: 0,
            per: Duration::ZERO,
        });
        assert!(l.check("a").is_ok());
        assert_eq!(l.check("a").unwrap_err(), Duration::from_millis(1));
    }

    #[test]
    fn log_lines_beyond_the_limit_are_counted_for_the_next_one() {
        let l = LogLimit::new(RateLimit {
            burst: 2,
            per: Duration::from_secs(3600),
        });
        assert_eq!(l.admit(), Some(0));
        assert_eq!(l.admit(), Some(0));
        assert_eq!(l.admit(), None);
        assert_eq!(l.admit(), None);
        assert_eq!(l.left_out.load(Ordering::Relaxed), 2);
    }
}

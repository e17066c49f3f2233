//! The in-process rate limits: one keyed limiter (`governor`'s GCRA, a
//! token bucket that refills continuously) per kind of request.

use governor::clock::{Clock, MonotonicClock};
use governor::middleware::NoOpMiddleware;
use governor::state::keyed::HashMapStateStore;
use governor::{Quota, RateLimiter};
use std::num::NonZeroU32;
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

    #[test]
    fn a_zero_limit_still_allows_one_request() {
        let (l, _) = limiter(RateLimit {
            burst: 0,
            per: Duration::ZERO,
        });
        assert!(l.check("a").is_ok());
        assert_eq!(l.check("a").unwrap_err(), Duration::from_millis(1));
    }
}

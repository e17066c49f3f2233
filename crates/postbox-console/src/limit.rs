//! A small in-process rate limiter: one token bucket per key.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

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
}

/// Buckets beyond this many are swept of full ones before a new key is added.
const SWEEP_ABOVE: usize = 10_000;

pub(crate) struct Limiter {
    limit: RateLimit,
    buckets: Mutex<HashMap<String, (f64, Instant)>>,
}

impl Limiter {
    pub fn new(limit: RateLimit) -> Self {
        Self {
            limit,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Take one token for `key`: `Ok` if there was one, else how long until there is.
    pub fn check(&self, key: &str) -> Result<(), Duration> {
        self.check_at(key, Instant::now())
    }

    /// [`Limiter::check`] at the instant `now`.
    fn check_at(&self, key: &str, now: Instant) -> Result<(), Duration> {
        let burst = f64::from(self.limit.burst.max(1));
        let rate = burst / self.limit.per.as_secs_f64().max(0.001); // tokens per second
        let mut buckets = match self.buckets.lock() {
            Ok(b) => b,
            Err(poisoned) => poisoned.into_inner(),
        };
        if buckets.len() > SWEEP_ABOVE && !buckets.contains_key(key) {
            buckets.retain(|_, (tokens, at)| {
                *tokens + now.duration_since(*at).as_secs_f64() * rate < burst
            });
        }
        let (tokens, at) = buckets.entry(key.to_owned()).or_insert((burst, now));
        let refilled = (*tokens + now.duration_since(*at).as_secs_f64() * rate).min(burst);
        *at = now;
        if refilled >= 1.0 {
            *tokens = refilled - 1.0;
            Ok(())
        } else {
            *tokens = refilled;
            Err(Duration::from_secs_f64((1.0 - refilled) / rate))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_allowed_then_refused_with_a_wait() {
        let l = Limiter::new(RateLimit::per_minute(3));
        for _ in 0..3 {
            assert!(l.check("a").is_ok());
        }
        let wait = l.check("a").unwrap_err();
        assert!(
            wait > Duration::from_secs(10) && wait <= Duration::from_secs(20),
            "{wait:?}"
        );
        assert!(l.check("b").is_ok(), "keys are independent");
    }

    #[test]
    fn tokens_come_back_over_time() {
        let l = Limiter::new(RateLimit::per_minute(2));
        let start = Instant::now();
        assert!(l.check_at("a", start).is_ok());
        assert!(l.check_at("a", start).is_ok());
        let wait = l.check_at("a", start).unwrap_err();
        assert_eq!(wait, Duration::from_secs(30));
        assert!(l.check_at("a", start + Duration::from_secs(29)).is_err());
        assert!(l.check_at("a", start + Duration::from_secs(31)).is_ok());
    }
}

//! A request rate limit shared by every request of one sink, on `governor`
//! (GCRA): at most `rate` starts per second on average, and after a quiet
//! spell a burst of one second's worth (the rate rounded down, at least one).
//!
//! A request that would have to wait past its deadline is not made to wait:
//! [`RateLimit::start_by`] answers how long until a start is free, and the
//! sink defers the message instead.

use governor::clock::{Clock, MonotonicClock};
use governor::middleware::NoOpMiddleware;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use std::num::NonZeroU32;
use std::time::Duration;

/// What the limit says to one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Start now (a start is taken).
    Start,
    /// The next free start is this far away, within the time left: wait, then ask again.
    Wait(Duration),
    /// The next free start is this far away, past the time left: do not send.
    Defer(Duration),
}

/// At most `rate` request starts per second, across the whole sink.
pub(crate) struct RateLimit<C: Clock = MonotonicClock> {
    limiter: RateLimiter<NotKeyed, InMemoryState, C, NoOpMiddleware<C::Instant>>,
}

impl RateLimit {
    /// `rate` starts per second (a validated, finite, positive number).
    pub(crate) fn per_second(rate: f64) -> Self {
        Self::with_clock(rate, MonotonicClock)
    }

    /// Wait for a start until `deadline`: `Ok` once one is taken, or
    /// `Err(wait)` — without taking one — when the next free start is
    /// `wait` away and that is past the deadline.
    pub(crate) async fn start_by(&self, deadline: tokio::time::Instant) -> Result<(), Duration> {
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.admit(left) {
                Admission::Start => return Ok(()),
                Admission::Wait(wait) => tokio::time::sleep(wait).await,
                Admission::Defer(wait) => return Err(wait),
            }
        }
    }
}

impl<C: Clock> RateLimit<C> {
    fn with_clock(rate: f64, clock: C) -> Self {
        // The burst: one second's worth, as the token bucket this replaced held.
        let burst = NonZeroU32::new(rate.floor().clamp(1.0, f64::from(u32::MAX)) as u32)
            .unwrap_or(NonZeroU32::MIN);
        let period = Duration::try_from_secs_f64(1.0 / rate)
            .ok()
            .filter(|p| !p.is_zero())
            .unwrap_or(Duration::from_nanos(1));
        let quota = Quota::with_period(period)
            .unwrap_or_else(|| Quota::per_second(burst))
            .allow_burst(burst);
        Self {
            limiter: RateLimiter::direct_with_clock(quota, clock),
        }
    }

    /// Take a start if one is free now; otherwise say how long until the
    /// next one, and whether that is within `left`.
    pub(crate) fn admit(&self, left: Duration) -> Admission {
        match self.limiter.check() {
            Ok(()) => Admission::Start,
            Err(not_until) => {
                let wait = not_until.wait_time_from(self.limiter.clock().now());
                if wait > left {
                    Admission::Defer(wait)
                } else {
                    Admission::Wait(wait)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use governor::clock::FakeRelativeClock;

    #[test]
    fn a_burst_of_one_seconds_worth_then_one_start_per_period() {
        let clock = FakeRelativeClock::default();
        let limit = RateLimit::with_clock(2.0, clock.clone());
        let second = Duration::from_secs(1);
        assert_eq!(limit.admit(second), Admission::Start);
        assert_eq!(limit.admit(second), Admission::Start);
        assert_eq!(
            limit.admit(second),
            Admission::Wait(Duration::from_millis(500))
        );
        // Nothing was taken by asking: past the time left, the same wait defers.
        assert_eq!(
            limit.admit(Duration::from_millis(499)),
            Admission::Defer(Duration::from_millis(500))
        );
        clock.advance(Duration::from_millis(500));
        assert_eq!(limit.admit(second), Admission::Start);
        assert_eq!(
            limit.admit(second),
            Admission::Wait(Duration::from_millis(500))
        );
        // A quiet spell refills the burst, and no more.
        clock.advance(Duration::from_secs(10));
        assert_eq!(limit.admit(second), Admission::Start);
        assert_eq!(limit.admit(second), Admission::Start);
        assert!(matches!(limit.admit(second), Admission::Wait(_)));
    }

    #[test]
    fn slow_and_fractional_rates() {
        let clock = FakeRelativeClock::default();
        // Below one per second: a burst of one, then one per 1/rate seconds.
        let slow = RateLimit::with_clock(0.5, clock.clone());
        assert_eq!(slow.admit(Duration::ZERO), Admission::Start);
        assert_eq!(
            slow.admit(Duration::from_secs(5)),
            Admission::Wait(Duration::from_secs(2))
        );
        // 2.5 per second: a burst of two, one start every 400 ms.
        let fractional = RateLimit::with_clock(2.5, clock.clone());
        assert_eq!(fractional.admit(Duration::ZERO), Admission::Start);
        assert_eq!(fractional.admit(Duration::ZERO), Admission::Start);
        assert_eq!(
            fractional.admit(Duration::ZERO),
            Admission::Defer(Duration::from_millis(400))
        );
        // The largest rate the options allow.
        let fast = RateLimit::with_clock(1_000_000.0, clock);
        for _ in 0..1_000 {
            assert_eq!(fast.admit(Duration::ZERO), Admission::Start);
        }
    }
}

//! Retry delays: capped exponential backoff with full jitter.

use rand::Rng;
use std::time::Duration;

/// Delay before attempt `attempt + 1`, after `attempt` (1-based) failed:
/// uniformly random in `[0, min(max, base × 2^(attempt-1))]`.
pub fn full_jitter(attempt: i32, base: Duration, max: Duration) -> Duration {
    let ceiling = exponential(attempt, base, max);
    let nanos = ceiling.as_nanos().min(u64::MAX as u128) as u64;
    if nanos == 0 {
        return Duration::ZERO;
    }
    Duration::from_nanos(rand::rng().random_range(0..=nanos))
}

/// `min(max, base × 2^(attempt-1))`, without overflow.
pub fn exponential(attempt: i32, base: Duration, max: Duration) -> Duration {
    let shift = attempt.saturating_sub(1).clamp(0, 30) as u32;
    base.checked_mul(1u32 << shift).map_or(max, |d| d.min(max))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_then_caps() {
        let b = Duration::from_secs(1);
        let m = Duration::from_secs(60);
        assert_eq!(exponential(1, b, m), Duration::from_secs(1));
        assert_eq!(exponential(4, b, m), Duration::from_secs(8));
        assert_eq!(exponential(7, b, m), Duration::from_secs(60));
        assert_eq!(exponential(i32::MAX, b, m), m);
        assert_eq!(exponential(0, b, m), b);
        for attempt in 1..40 {
            assert!(full_jitter(attempt, b, m) <= exponential(attempt, b, m));
        }
    }
}

//! The one retry delay troupe uses: capped exponential backoff with ±20 % jitter, so clients
//! and retried tasks that failed together do not come back in step.

use std::time::Duration;

use rand::Rng;

/// A delay policy: `first · 2^n` before retry `n` (0-based), at most `cap`, each delay jittered
/// by ±20 % and never above `cap`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    first: Duration,
    cap: Duration,
}

impl Backoff {
    /// A policy starting at `first` and doubling up to `cap`.
    pub const fn new(first: Duration, cap: Duration) -> Self {
        Self { first, cap }
    }

    /// The longest delay.
    pub const fn cap(&self) -> Duration {
        self.cap
    }

    /// The delay before retry `retry` (0 for the first), jittered with `rng`.
    pub fn delay_with(&self, retry: u32, rng: &mut impl Rng) -> Duration {
        let base = self.first.saturating_mul(1 << retry.min(20)).min(self.cap);
        base.mul_f64(rng.random_range(0.8..=1.2)).min(self.cap)
    }

    /// The delay before retry `retry` (0 for the first).
    pub fn delay(&self, retry: u32) -> Duration {
        self.delay_with(retry, &mut rand::rng())
    }

    /// A sequence of delays under this policy, for a loop that retries until it succeeds.
    pub fn retries(self) -> Retries {
        Retries {
            policy: self,
            retry: 0,
        }
    }
}

/// Successive delays of a [`Backoff`]; [`Retries::reset`] starts again after a success.
#[derive(Debug, Clone)]
pub struct Retries {
    policy: Backoff,
    retry: u32,
}

impl Retries {
    /// The next delay.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.policy.delay(self.retry);
        self.retry = self.retry.saturating_add(1);
        delay
    }

    /// Starts again from the first delay.
    pub fn reset(&mut self) {
        self.retry = 0;
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn delays_double_with_jitter_up_to_the_cap() {
        let policy = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let within = |d: Duration, low: u64, high: u64| {
            d >= Duration::from_millis(low) && d <= Duration::from_millis(high)
        };
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..100 {
            let first = policy.delay_with(0, &mut rng);
            assert!(within(first, 800, 1200), "{first:?}");
            seen.insert(first);
            let third = policy.delay_with(2, &mut rng);
            assert!(within(third, 3200, 4800), "{third:?}");
            assert!(policy.delay_with(30, &mut rng) <= policy.cap());
            assert!(policy.delay_with(u32::MAX, &mut rng) <= policy.cap());
        }
        assert!(seen.len() > 50, "jittered: {} distinct delays", seen.len());
    }

    #[test]
    fn retries_grow_and_reset() {
        let mut retries =
            Backoff::new(Duration::from_millis(200), Duration::from_secs(5)).retries();
        let first = retries.next_delay();
        assert!(first >= Duration::from_millis(160) && first <= Duration::from_millis(240));
        for _ in 0..10 {
            retries.next_delay();
        }
        let late = retries.next_delay();
        assert!(
            late >= Duration::from_secs(4) && late <= Duration::from_secs(5),
            "{late:?}"
        );
        retries.reset();
        assert!(retries.next_delay() <= Duration::from_millis(240));
    }
}

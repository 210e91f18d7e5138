//! Retry timing and the shared retry budget. The ledger scheduler is the only retry layer;
//! this module only computes when the next attempt may run and whether the tool's budget
//! allows it.
//!
//! `backoff` (RUSTSEC-2025-0012: unmaintained) is used only inside [`retry_delay`], so it can
//! be swapped without touching callers.

use std::time::Duration;

use backoff::backoff::Backoff;

use crate::config::RetryPolicy;

/// Delay before attempt `attempt + 1`, given that `attempt` attempts (>= 1) have been made:
/// exponential from `initial_delay_ms` by `multiplier`, capped at `max_delay_ms`, randomised
/// within ±`jitter`, never above `max_delay_ms`. Pure apart from the random draw.
pub fn retry_delay(policy: &RetryPolicy, attempt: u32) -> Duration {
    let max = Duration::from_millis(policy.max_delay_ms);
    let nominal = nominal_delay(policy, attempt);
    let mut schedule = backoff::ExponentialBackoffBuilder::new()
        .with_initial_interval(nominal)
        .with_randomization_factor(policy.jitter)
        .with_multiplier(policy.multiplier)
        .with_max_interval(max)
        .with_max_elapsed_time(None)
        .build();
    schedule.next_backoff().unwrap_or(nominal).min(max)
}

/// The un-jittered delay after `attempt` attempts.
pub fn nominal_delay(policy: &RetryPolicy, attempt: u32) -> Duration {
    let exp = policy
        .multiplier
        .powi(attempt.saturating_sub(1).min(64) as i32);
    let ms = (policy.initial_delay_ms as f64 * exp).min(policy.max_delay_ms as f64);
    Duration::from_millis(ms as u64)
}

/// The delay to use when the downstream asked for one: `Retry-After` wins when it asks for
/// longer than the computed delay, but never beyond the policy's maximum.
pub fn with_retry_after(
    policy: &RetryPolicy,
    computed: Duration,
    retry_after: Option<Duration>,
) -> Duration {
    let max = Duration::from_millis(policy.max_delay_ms);
    match retry_after {
        Some(ra) if ra > computed => ra.min(max).max(computed),
        _ => computed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_exponentially_within_jitter_and_cap() {
        let p = RetryPolicy {
            initial_delay_ms: 100,
            multiplier: 2.0,
            max_delay_ms: 1000,
            jitter: 0.2,
            ..RetryPolicy::default()
        };
        for attempt in 1..=8u32 {
            let nominal = nominal_delay(&p, attempt).as_secs_f64();
            assert_eq!(nominal, (0.1 * 2f64.powi(attempt as i32 - 1)).min(1.0));
            for _ in 0..200 {
                let d = retry_delay(&p, attempt).as_secs_f64();
                assert!(
                    d >= nominal * 0.8 - 1e-9,
                    "attempt {attempt}: {d} < {nominal}*0.8"
                );
                assert!(
                    d <= (nominal * 1.2).min(1.0) + 1e-9,
                    "attempt {attempt}: {d} > bound"
                );
            }
        }
    }

    #[test]
    fn jitter_actually_spreads_delays() {
        let p = RetryPolicy::default();
        let draws: std::collections::BTreeSet<u128> =
            (0..50).map(|_| retry_delay(&p, 3).as_micros()).collect();
        assert!(
            draws.len() > 10,
            "jitter produced too few distinct delays: {draws:?}"
        );
    }

    #[test]
    fn retry_after_wins_only_when_longer_and_is_capped() {
        let p = RetryPolicy {
            max_delay_ms: 5000,
            ..RetryPolicy::default()
        };
        let c = Duration::from_millis(300);
        assert_eq!(
            with_retry_after(&p, c, Some(Duration::from_secs(2))),
            Duration::from_secs(2)
        );
        assert_eq!(with_retry_after(&p, c, Some(Duration::from_millis(100))), c);
        assert_eq!(
            with_retry_after(&p, c, Some(Duration::from_secs(60))),
            Duration::from_secs(5)
        );
        assert_eq!(with_retry_after(&p, c, None), c);
    }
}

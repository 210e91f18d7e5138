//! The one back-off function. Every wait-and-try-again loop of the worker and the publisher
//! (tool retries, reconnects to the broker and to Postgres, a batch the ledger could not record)
//! takes its delay from [`delay`]. The `backoff` crate (RUSTSEC-2025-0012: unmaintained) is used
//! only here, so it can be swapped without touching a caller.

use std::time::Duration;

use backoff::backoff::Backoff as _;

/// An exponential schedule: `initial`, times `multiplier` per attempt, capped at `max`, each
/// delay randomised within ±`jitter` (0 to 1) of its nominal value and never above `max`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    pub initial: Duration,
    pub multiplier: f64,
    pub max: Duration,
    pub jitter: f64,
}

impl Backoff {
    /// The un-jittered delay after `attempt` attempts (>= 1).
    pub fn nominal(&self, attempt: u32) -> Duration {
        let exp = self
            .multiplier
            .powi(attempt.saturating_sub(1).min(64) as i32);
        let secs = (self.initial.as_secs_f64() * exp).min(self.max.as_secs_f64());
        Duration::from_secs_f64(secs.max(0.0))
    }
}

/// Delay before attempt `attempt + 1`, given that `attempt` attempts (>= 1) were made. Pure apart
/// from the random draw.
pub fn delay(schedule: &Backoff, attempt: u32) -> Duration {
    let nominal = schedule.nominal(attempt);
    let mut drawn = backoff::ExponentialBackoffBuilder::new()
        .with_initial_interval(nominal)
        .with_randomization_factor(schedule.jitter)
        .with_multiplier(schedule.multiplier)
        .with_max_interval(schedule.max)
        .with_max_elapsed_time(None)
        .build();
    drawn.next_backoff().unwrap_or(nominal).min(schedule.max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_by_the_multiplier_within_the_jitter_and_the_cap() {
        let s = Backoff {
            initial: Duration::from_millis(100),
            multiplier: 2.0,
            max: Duration::from_millis(1000),
            jitter: 0.5,
        };
        for (attempt, nominal) in [
            (1, 100),
            (2, 200),
            (3, 400),
            (4, 800),
            (5, 1000),
            (40, 1000),
        ] {
            assert_eq!(s.nominal(attempt), Duration::from_millis(nominal));
            for _ in 0..50 {
                let d = delay(&s, attempt).as_millis() as u64;
                assert!(
                    d >= nominal / 2 && d <= (nominal * 3 / 2).min(1000),
                    "{attempt}: {d}"
                );
            }
        }
    }
}

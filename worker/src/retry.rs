//! Retry policies, retry timing and the shared retry budget. [`RetryPolicy`] and
//! [`BudgetPolicy`] are declared per tool in the tools file (`retry = {...}`, `budget = {...}`).
//! The ledger scheduler is the only retry layer; this module computes when the next attempt may
//! run and what each write's outcome is worth to the tool's token bucket (kept in Postgres, see
//! `ledger::guard`).
//!
//! The delays come from the one back-off function, [`kit::backoff::delay`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use crate::outcome::Outcome;
use serde::Deserialize;

/// Retry policy of one tool: the ledger scheduler is the only retry layer (docs/design.md section 6).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryPolicy {
    /// Write requests allowed for proven-not-applied failures, the first included.
    pub max_attempts: u32,
    pub initial_delay_ms: u64,
    pub multiplier: f64,
    pub max_delay_ms: u64,
    /// Randomisation factor: each delay lies within ±jitter of the nominal one.
    pub jitter: f64,
    /// No retry is scheduled past this long after the operation was recorded.
    pub max_elapsed_secs: u64,
    /// HTTP statuses the downstream documents as "not applied, try again".
    pub not_applied_statuses: Vec<u16>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            initial_delay_ms: 200,
            multiplier: 2.0,
            max_delay_ms: 30_000,
            jitter: 0.2,
            max_elapsed_secs: 3600,
            not_applied_statuses: vec![429],
        }
    }
}

/// Shared retry budget of one tool, kept in Postgres for all workers.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BudgetPolicy {
    /// Retries may not exceed this share of first attempts over the window.
    pub ratio: f64,
    /// Retries always allowed per minute, so a quiet tool can still retry.
    pub floor_per_minute: u32,
    /// Sliding window length.
    pub window_secs: u64,
}

impl Default for BudgetPolicy {
    fn default() -> Self {
        BudgetPolicy {
            ratio: 0.1,
            floor_per_minute: 10,
            window_secs: 60,
        }
    }
}

/// Delay before attempt `attempt + 1`, given that `attempt` attempts (>= 1) have been made:
/// exponential from `initial_delay_ms` by `multiplier`, capped at `max_delay_ms`, randomised
/// within ±`jitter`, never above `max_delay_ms`. Pure apart from the random draw.
pub fn retry_delay(policy: &RetryPolicy, attempt: u32) -> Duration {
    kit::backoff::delay(&schedule(policy), attempt)
}

/// The un-jittered delay after `attempt` attempts.
pub fn nominal_delay(policy: &RetryPolicy, attempt: u32) -> Duration {
    schedule(policy).nominal(attempt)
}

fn schedule(policy: &RetryPolicy) -> kit::backoff::Backoff {
    kit::backoff::Backoff {
        initial: Duration::from_millis(policy.initial_delay_ms),
        multiplier: policy.multiplier,
        max: Duration::from_millis(policy.max_delay_ms),
        jitter: policy.jitter,
    }
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

/// Which write an outcome answers, for the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteKind {
    /// The first request of an operation (not budgeted; its outcome still moves the bucket).
    First,
    /// A retry or replay, which spent one token when it was sent.
    Retry,
}

/// Tokens an outcome moves in the tool's bucket (gRPC retry throttling): a failure of a first
/// attempt (not sent, not applied, unknown) costs one; a retry already paid when sent, so its
/// failure costs nothing more; any success earns `ratio`, and a retry's success also earns back
/// the token it spent; a definitive rejection is no sign of overload and earns back a retry's
/// token.
pub fn budget_delta(kind: WriteKind, outcome: &Outcome, ratio: f64) -> f64 {
    let refund = if kind == WriteKind::Retry { 1.0 } else { 0.0 };
    match outcome {
        // An accepted write was taken by the downstream: a success for the budget (whatever the
        // operation's end, which is no sign of overload either).
        Outcome::Succeeded { .. } | Outcome::Accepted { .. } => refund + ratio,
        Outcome::Rejected { .. } | Outcome::Failed { .. } => refund,
        // Nothing left this worker (its own exhaustion): a retry or replay gets its token back,
        // and a first write is credited the token its resend will spend, so the shared budget
        // is as if the attempt had never been made.
        Outcome::LocalExhaustion { .. } => 1.0,
        Outcome::NotSent { .. }
        | Outcome::NotApplied { .. }
        | Outcome::Unknown { .. }
        | Outcome::LookupMiss { .. } => {
            if kind == WriteKind::First {
                -1.0
            } else {
                0.0
            }
        }
    }
}

/// Bucket movements (credits and debits) of this worker's outcomes not yet written to the ledger.
/// Writing each outcome on its own would make every completion wait on the tool's row lock (and
/// hold a pool connection meanwhile); instead the net movement is written with this worker's
/// next spend for the tool (so its own failures always count before it retries) and on every
/// scheduler pass. Another worker's failures reach the bucket within one of its passes; a crash
/// loses at most one pass of movements.
#[derive(Debug, Default)]
pub struct BudgetTally {
    pending: Mutex<HashMap<String, f64>>,
}

impl BudgetTally {
    /// Adds a movement (credit > 0, debit < 0) for `tool`.
    pub fn add(&self, tool: &str, tokens: f64) {
        if tokens != 0.0 {
            *self.lock().entry(tool.to_string()).or_default() += tokens;
        }
    }

    /// Takes `tool`'s pending movement (to write it with a statement).
    pub fn take(&self, tool: &str) -> f64 {
        self.lock().remove(tool).unwrap_or(0.0)
    }

    /// Takes every pending movement.
    pub fn take_all(&self) -> Vec<(String, f64)> {
        self.lock().drain().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, f64>> {
        crate::lock(&self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_spend_successes_refill_by_the_ratio() {
        let ok = Outcome::Succeeded {
            receipt: crate::document::Document::from_value(serde_json::json!({})),
            receipt_id: "r".into(),
        };
        let shed = Outcome::NotApplied {
            evidence: "429".into(),
            retry_after: None,
        };
        assert_eq!(budget_delta(WriteKind::First, &ok, 0.1), 0.1);
        assert_eq!(budget_delta(WriteKind::First, &shed, 0.1), -1.0);
        assert_eq!(budget_delta(WriteKind::Retry, &ok, 0.1), 1.1);
        assert_eq!(budget_delta(WriteKind::Retry, &shed, 0.1), 0.0);
    }

    #[test]
    fn the_tally_hands_out_each_movement_once() {
        let t = BudgetTally::default();
        t.add("a", 0.5);
        t.add("a", 0.25);
        t.add("b", -1.0);
        t.add("c", 0.0);
        assert_eq!(t.take("a"), 0.75);
        assert_eq!(t.take("a"), 0.0);
        assert_eq!(t.take_all(), vec![("b".to_string(), -1.0)]);
    }

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

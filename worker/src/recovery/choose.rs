//! The recovery decision for an operation whose outcome is unknown, as a pure function of
//! facts (docs/design.md section 5). Order: a stored receipt, then lookup, then replay, then hold.
//! It never authorises a fresh write; the caller makes the network call.

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::Capability;
use crate::ledger::Operation;

/// What the scheduler knows about an unknown operation.
#[derive(Debug, Clone, PartialEq)]
pub struct Facts {
    /// A receipt is already stored (only possible after an interrupted resolution).
    pub has_stored_receipt: bool,
    /// The tool offers an authoritative lookup by the stable key.
    pub has_lookup: bool,
    /// The tool replays with receipt, and its protection (window minus margin since the first
    /// dispatch) still covers a request sent now.
    pub can_replay_safely: bool,
    /// Why replay is not safe, for the hold evidence.
    pub replay_closed_reason: Option<String>,
    /// Recovery rounds left (this one included).
    pub rounds_left: bool,
}

/// The one thing to do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    ReturnStoredReceipt,
    LookupOriginalReceipt,
    ReplayOriginalRequest,
    Hold { reason: String },
}

impl Action {
    pub fn label(&self) -> &'static str {
        match self {
            Action::ReturnStoredReceipt => "stored_receipt",
            Action::LookupOriginalReceipt => "lookup",
            Action::ReplayOriginalRequest => "replay",
            Action::Hold { .. } => "hold",
        }
    }
}

/// Chooses the recovery action. Pure and total.
pub fn choose(facts: &Facts) -> Action {
    if facts.has_stored_receipt {
        return Action::ReturnStoredReceipt;
    }
    if !facts.rounds_left {
        return Action::Hold {
            reason: "recovery attempts exhausted without a matching receipt".into(),
        };
    }
    if facts.has_lookup {
        return Action::LookupOriginalReceipt;
    }
    if facts.can_replay_safely {
        return Action::ReplayOriginalRequest;
    }
    Action::Hold {
        reason: facts.replay_closed_reason.clone().unwrap_or_else(|| {
            "the downstream offers no replay or lookup; a person must reconcile".into()
        }),
    }
}

/// Gathers the facts for `op` under `capability` at `now`. `round` is the recovery round being
/// attempted (1-based) and `max_rounds` the tool's limit.
pub fn facts(
    op: &Operation,
    capability: &Capability,
    round: i32,
    max_rounds: u32,
    now: DateTime<Utc>,
) -> Facts {
    let (can_replay_safely, replay_closed_reason) = match capability {
        Capability::Replay { window, margin } => replay_open(op, *window, *margin, now),
        _ => (false, None),
    };
    Facts {
        has_stored_receipt: op.receipt.is_some(),
        has_lookup: matches!(capability, Capability::Lookup { .. }),
        can_replay_safely,
        replay_closed_reason,
        rounds_left: round >= 1 && (round as u32) <= max_rounds,
    }
}

/// Replay is safe only while `first_dispatch_at + window - margin > now`: a request sent now
/// must reach the downstream before it forgets the key.
fn replay_open(
    op: &Operation,
    window: Duration,
    margin: Duration,
    now: DateTime<Utc>,
) -> (bool, Option<String>) {
    let deadline = op.replay_deadline.or_else(|| {
        op.first_dispatch_at
            .map(|t| t + chrono::Duration::from_std(window).unwrap_or(chrono::Duration::MAX))
    });
    let Some(deadline) = deadline else {
        return (
            false,
            Some("no first dispatch time recorded; replay protection cannot be established".into()),
        );
    };
    let last_safe =
        deadline - chrono::Duration::from_std(margin).unwrap_or(chrono::Duration::zero());
    if last_safe > now {
        (true, None)
    } else {
        (
            false,
            Some(format!(
                "replay window closed: protection ends {deadline} and the safety margin is {}s; the original key may no longer be remembered",
                margin.as_secs()
            )),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(receipt: bool, lookup: bool, replay: bool, rounds: bool) -> Facts {
        Facts {
            has_stored_receipt: receipt,
            has_lookup: lookup,
            can_replay_safely: replay,
            replay_closed_reason: None,
            rounds_left: rounds,
        }
    }

    #[test]
    fn order_is_receipt_lookup_replay_hold() {
        assert_eq!(
            choose(&f(true, true, true, true)),
            Action::ReturnStoredReceipt
        );
        assert_eq!(
            choose(&f(true, false, false, false)),
            Action::ReturnStoredReceipt
        );
        assert_eq!(
            choose(&f(false, true, true, true)),
            Action::LookupOriginalReceipt
        );
        assert_eq!(
            choose(&f(false, false, true, true)),
            Action::ReplayOriginalRequest
        );
        assert!(matches!(
            choose(&f(false, false, false, true)),
            Action::Hold { .. }
        ));
    }

    #[test]
    fn exhausted_rounds_hold_and_never_replay() {
        for (lookup, replay) in [(true, false), (false, true), (true, true), (false, false)] {
            assert!(matches!(
                choose(&f(false, lookup, replay, false)),
                Action::Hold { .. }
            ));
        }
    }

    #[test]
    fn every_combination_is_one_of_the_four_and_never_fresh() {
        for bits in 0..16u8 {
            let facts = f(bits & 1 != 0, bits & 2 != 0, bits & 4 != 0, bits & 8 != 0);
            let action = choose(&facts);
            if action == Action::ReplayOriginalRequest {
                assert!(facts.can_replay_safely && facts.rounds_left && !facts.has_lookup);
            }
        }
    }
}

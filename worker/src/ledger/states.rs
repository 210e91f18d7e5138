//! Operation states (docs/design.md section 4) and the moves between them that the ledger allows.

use std::fmt;

/// Where an operation stands. The database CHECK constraint holds the same list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum State {
    /// Recorded; no dispatch authorised yet.
    Prepared,
    /// One owner (fence, lease) may send; the request may have left.
    Dispatching,
    /// The adapter proved nothing happened; the next attempt is due at `next_attempt_at`.
    RetryWait,
    /// The request may have been applied; only capability-based recovery may proceed.
    Unknown,
    /// Recovery cannot proceed automatically; a person must reconcile.
    Held,
    /// The downstream acknowledged the write with an operation id (a long-running operation):
    /// its status URL is polled, read only, until it is done, failed, or past its deadline.
    Accepted,
    /// The tool asks a person to approve this exact intent (its fingerprint) first: recorded,
    /// never sent from here. The last approval needed makes it `prepared` and due; a rejection,
    /// or the end of the wait (`next_attempt_at`), makes it `failed`.
    AwaitingApproval,
    /// Receipt stored; final.
    Succeeded,
    /// The downstream proved it did not and will not apply; final.
    Failed,
}

impl State {
    pub const ALL: [State; 9] = [
        State::Prepared,
        State::Dispatching,
        State::RetryWait,
        State::Unknown,
        State::Held,
        State::Accepted,
        State::AwaitingApproval,
        State::Succeeded,
        State::Failed,
    ];

    /// States whose age the hold-age gauge reports.
    pub const UNRESOLVED: [State; 6] = [
        State::Dispatching,
        State::RetryWait,
        State::Unknown,
        State::Held,
        State::Accepted,
        State::AwaitingApproval,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Prepared => "prepared",
            State::Dispatching => "dispatching",
            State::RetryWait => "retry_wait",
            State::Unknown => "unknown",
            State::Held => "held",
            State::Accepted => "accepted",
            State::AwaitingApproval => "awaiting_approval",
            State::Succeeded => "succeeded",
            State::Failed => "failed",
        }
    }

    /// The state's position in [`State::ALL`], which lists the states in declaration order.
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn parse(s: &str) -> Option<State> {
        State::ALL.into_iter().find(|st| st.as_str() == s)
    }

    pub fn is_final(self) -> bool {
        matches!(self, State::Succeeded | State::Failed)
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for s in State::ALL {
            assert_eq!(State::parse(s.as_str()), Some(s));
        }
        assert_eq!(State::parse("done"), None);
        assert!(State::Succeeded.is_final() && !State::Held.is_final());
    }

    #[test]
    fn index_is_the_position_in_all() {
        for (i, s) in State::ALL.into_iter().enumerate() {
            assert_eq!(s.index(), i, "{s:?}");
        }
    }
}

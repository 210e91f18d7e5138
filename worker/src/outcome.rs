//! The outcome vocabulary: what one downstream call established ([`Outcome`]), with its metric
//! labels, its evidence text and the `Retry-After` it carried.
//!
//! Below everything that speaks it: the adapters classify every answer into an outcome
//! ([`crate::adapter`]), the retry policy prices it ([`crate::retry::budget_delta`]), dispatch
//! maps it to the next ledger state ([`crate::dispatch::next_state`]). Only
//! [`Outcome::NotSent`], [`Outcome::LocalExhaustion`] and [`Outcome::NotApplied`] may lead to
//! another write; anything that may have been applied is [`Outcome::Unknown`].

use std::time::Duration;

use crate::document::Document;

/// What one downstream call established.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// A 2xx (or lookup hit) whose receipt matches this operation.
    Succeeded {
        receipt: Document,
        receipt_id: String,
    },
    /// The request was never written (e.g. connection refused): safe to send again.
    NotSent { evidence: String },
    /// The request never left because this worker ran out of a local resource before it could
    /// connect (no file descriptor, no socket buffer, no memory, no local port: EMFILE, ENFILE,
    /// ENOBUFS, ENOMEM, EADDRNOTAVAIL). Not sent, like [`Outcome::NotSent`], but says nothing
    /// about the downstream: retried without spending the operation's attempts.
    LocalExhaustion { evidence: String },
    /// The downstream answered with a status it documents as "not applied" (default 429).
    NotApplied {
        evidence: String,
        retry_after: Option<Duration>,
    },
    /// A definitive rejection (4xx other than 408/409/429): it did not and will not apply.
    /// Answered to a replay it proves nothing about the original write; recovery keeps the row
    /// unknown unless the tool lists the status in `replay_final_statuses`.
    Rejected { status: u16, evidence: String },
    /// It may have been applied: timeout, reset after writing, 5xx, 408, 409, a receipt that
    /// does not match, an unreadable 2xx.
    Unknown {
        evidence: String,
        retry_after: Option<Duration>,
    },
    /// A lookup found nothing. Not proof of absence: the row stays unknown.
    LookupMiss { evidence: String },
    /// A long-running write was accepted (an `async` tool's accepted status, or a lookup
    /// finding it in progress): the downstream names its operation, whose outcome is read later
    /// from its status, never by writing again.
    Accepted {
        operation_id: String,
        acceptance: Document,
    },
    /// The downstream's documented terminal failure of a long-running operation (its
    /// `failed_match`): it did not and will not complete.
    Failed { evidence: String },
}

/// What one read of a long-running operation's status established. Only `Done` and `Failed`
/// end the operation; the others leave it accepted until the next poll or its deadline.
#[derive(Debug, Clone, PartialEq)]
pub enum Polled {
    /// `done_match` observed, and the document passes the receipt check: the receipt.
    Done {
        receipt: Document,
        receipt_id: String,
    },
    /// `failed_match` observed: the document is the evidence.
    Failed { evidence: String },
    /// Read, and neither done nor failed: still running.
    Running { evidence: String },
    /// Nothing proven: no answer, a 404 or 5xx, a document that is not JSON, or a done one
    /// that does not pass the receipt check.
    Unproven { evidence: String },
    /// The read never left this worker (it ran out of a local resource).
    LocalExhaustion { evidence: String },
}

impl Polled {
    /// Every poll outcome's metric label, in [`Polled::index`] order.
    pub const LABELS: [&'static str; 5] =
        ["done", "failed", "running", "unproven", "local_exhaustion"];

    pub fn index(&self) -> usize {
        match self {
            Polled::Done { .. } => 0,
            Polled::Failed { .. } => 1,
            Polled::Running { .. } => 2,
            Polled::Unproven { .. } => 3,
            Polled::LocalExhaustion { .. } => 4,
        }
    }

    pub fn label(&self) -> &'static str {
        Polled::LABELS[self.index()]
    }

    pub fn evidence(&self) -> String {
        match self {
            Polled::Done { receipt_id, .. } => format!("done: receipt {receipt_id}"),
            Polled::Failed { evidence }
            | Polled::Running { evidence }
            | Polled::Unproven { evidence }
            | Polled::LocalExhaustion { evidence } => evidence.clone(),
        }
    }
}

impl Outcome {
    /// Every outcome's metric label, in [`Outcome::index`] order.
    pub const LABELS: [&'static str; 9] = [
        "succeeded",
        "not_sent",
        "local_exhaustion",
        "not_applied",
        "rejected",
        "unknown",
        "miss",
        "accepted",
        "failed",
    ];

    /// This outcome's place in [`Outcome::LABELS`].
    pub fn index(&self) -> usize {
        match self {
            Outcome::Succeeded { .. } => 0,
            Outcome::NotSent { .. } => 1,
            Outcome::LocalExhaustion { .. } => 2,
            Outcome::NotApplied { .. } => 3,
            Outcome::Rejected { .. } => 4,
            Outcome::Unknown { .. } => 5,
            Outcome::LookupMiss { .. } => 6,
            Outcome::Accepted { .. } => 7,
            Outcome::Failed { .. } => 8,
        }
    }

    /// Low-cardinality label for metrics.
    pub fn label(&self) -> &'static str {
        Outcome::LABELS[self.index()]
    }

    pub fn evidence(&self) -> String {
        match self {
            Outcome::Succeeded { receipt_id, .. } => format!("receipt {receipt_id}"),
            Outcome::NotSent { evidence }
            | Outcome::LocalExhaustion { evidence }
            | Outcome::NotApplied { evidence, .. }
            | Outcome::Rejected { evidence, .. }
            | Outcome::Unknown { evidence, .. }
            | Outcome::LookupMiss { evidence }
            | Outcome::Failed { evidence } => evidence.clone(),
            Outcome::Accepted { operation_id, .. } => {
                format!("accepted as operation {operation_id}")
            }
        }
    }

    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Outcome::NotApplied { retry_after, .. } | Outcome::Unknown { retry_after, .. } => {
                *retry_after
            }
            _ => None,
        }
    }
}

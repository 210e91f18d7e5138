//! Agent-facing answers, built in one place: the shape of every result event the worker
//! publishes ([`operation_event`] for an operation's progress, [`rejected_event`] for a message
//! refused), every text an agent reads in one (succeeded, pending, failed, refused, conflict,
//! expired), and the reason codes of dead-lettered deliveries ([`DeadLetterReason`], whose
//! metric labels are derived from it).
//!
//! Pure: values in, events out. The ledger writes them in the commit of the state change that
//! owes them ([`crate::ledger::outbox`]); intake decides which answer a refused delivery gets.

use chrono::{DateTime, SecondsFormat, Utc};
use protocol::{RejectReason, ResultEvent, Status, Uncertainty, VerifiedBy};

use crate::ledger::outbox::NewEvent;
use crate::ledger::{NewOperation, Operation, State};

/// Why a delivery was dead-lettered (the `x-intent-worker-reason` header and the
/// `reason` label of the dead-letter metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLetterReason {
    /// The worker started this message's delivery `WORKER_DELIVERY_LIMIT` times already.
    DeliveryLimit,
    /// The body broke the contract (or was too large to read).
    InvalidMessage,
    /// The transport did not prove the tenant the message names.
    TenantMismatch,
    /// A well-formed intent for a tool this pool does not have.
    UnknownTool,
}

impl DeadLetterReason {
    /// Every reason, for the metric series that exist from start-up.
    pub const ALL: [DeadLetterReason; 4] = [
        DeadLetterReason::DeliveryLimit,
        DeadLetterReason::InvalidMessage,
        DeadLetterReason::TenantMismatch,
        DeadLetterReason::UnknownTool,
    ];

    /// The stable code: header value and metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterReason::DeliveryLimit => "delivery_limit",
            DeadLetterReason::InvalidMessage => "invalid_message",
            DeadLetterReason::TenantMismatch => "tenant_mismatch",
            DeadLetterReason::UnknownTool => "unknown_tool",
        }
    }
}

impl std::fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for DeadLetterReason {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

fn now_rfc3339() -> String {
    Utc::now().to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// The completion report an event about `op` carries (docs/contract.md, "Result event"): how
/// the answer is known and by whom, the downstream's identifier, what remains uncertain, and
/// when the worker looks again.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    pub verified_by: Option<VerifiedBy>,
    pub operator: Option<String>,
    pub remote_id: Option<String>,
    pub uncertainty: Option<Uncertainty>,
    pub retry_after_ms: Option<u64>,
}

/// What `verified_by` column text says: the source, and the operator's name for `operator:`.
pub fn verified_by(stored: &str) -> (VerifiedBy, Option<String>) {
    if let Some(name) = stored.strip_prefix("operator:") {
        return (VerifiedBy::Operator, Some(name.to_string()));
    }
    let by = match stored {
        "dispatch" => VerifiedBy::Dispatch,
        "replay" => VerifiedBy::Replay,
        "lookup" => VerifiedBy::Lookup,
        "poll" => VerifiedBy::Poll,
        "callback" => VerifiedBy::Callback,
        "late_receipt" => VerifiedBy::LateReceipt,
        "expiry" => VerifiedBy::Expiry,
        _ => VerifiedBy::Other,
    };
    (by, None)
}

/// The report of an event with `status` about `op` at `now`. Pure.
pub fn report(op: &Operation, status: Status, now: DateTime<Utc>) -> Report {
    match status {
        Status::Succeeded | Status::Failed => {
            let (by, operator) = op
                .verified_by
                .as_deref()
                .map(verified_by)
                .map_or((None, None), |(b, o)| (Some(b), o));
            Report {
                verified_by: by,
                operator,
                remote_id: if status == Status::Succeeded {
                    op.receipt_id.clone()
                } else {
                    op.remote_id.clone()
                },
                ..Report::default()
            }
        }
        Status::Pending => {
            let uncertainty = match op.state() {
                State::Unknown => Uncertainty::UnknownOutcome,
                State::Held => Uncertainty::Held,
                State::AwaitingApproval => Uncertainty::AwaitingApproval,
                _ => Uncertainty::InProgress,
            };
            let scheduled = matches!(
                op.state(),
                State::RetryWait | State::Unknown | State::Accepted
            );
            Report {
                remote_id: op.remote_id.clone(),
                uncertainty: Some(uncertainty),
                retry_after_ms: op
                    .next_attempt_at
                    .filter(|_| scheduled)
                    .map(|at| (at - now).num_milliseconds().max(0) as u64),
                ..Report::default()
            }
        }
        Status::Rejected => Report::default(),
    }
}

/// Builds the event the agent must see about `op`.
pub fn operation_event(op: &Operation, status: Status, message: String) -> NewEvent {
    let report = report(op, status, Utc::now());
    NewEvent {
        operation_id: Some(op.id),
        event: ResultEvent {
            tenant: op.tenant.clone(),
            action_id: op.action_id.clone(),
            tool: op.tool.clone(),
            status,
            receipt: if status == Status::Succeeded {
                op.receipt.as_ref().map(|r| r.value().clone())
            } else {
                None
            },
            next_action: (status == Status::Pending).then(|| "check_status".to_string()),
            attempts: op.attempts.max(0) as u32,
            message,
            fingerprint: Some(op.fingerprint.clone()),
            reason: None,
            detail: None,
            verified_by: report.verified_by,
            operator: report.operator,
            remote_id: report.remote_id,
            uncertainty: report.uncertainty,
            retry_after_ms: report.retry_after_ms,
            compensates: op.compensates.clone(),
            compensated_by: None,
            event_id: uuid::Uuid::new_v4().to_string(),
            occurred_at: now_rfc3339(),
        },
        reply_to: op.reply_to.clone(),
        trace: op.trace(),
    }
}

/// Builds a `rejected` event for a message that did not become (or could not touch) an
/// operation, routed to the tenant-wide key until [`NewEvent::answering`] addresses it.
pub fn rejected_event(
    tenant: &str,
    action_id: &str,
    tool: &str,
    reason: RejectReason,
    detail: Option<String>,
    message: String,
    fingerprint: Option<String>,
) -> NewEvent {
    NewEvent {
        operation_id: None,
        event: ResultEvent {
            tenant: tenant.to_string(),
            action_id: action_id.to_string(),
            tool: tool.to_string(),
            status: Status::Rejected,
            receipt: None,
            next_action: None,
            attempts: 0,
            message,
            fingerprint,
            reason: Some(reason),
            detail,
            verified_by: None,
            operator: None,
            remote_id: None,
            uncertainty: None,
            retry_after_ms: None,
            compensates: None,
            compensated_by: None,
            event_id: uuid::Uuid::new_v4().to_string(),
            occurred_at: now_rfc3339(),
        },
        reply_to: None,
        trace: None,
    }
}

/// The agent-facing words for an operation whose outcome is not known yet.
pub fn pending_message(op: &Operation) -> String {
    match op.state() {
        State::RetryWait | State::Prepared => format!(
            "The {} has not been applied yet; it will be retried automatically with the same key. Do not submit it again.",
            op.tool
        ),
        State::Held => format!(
            "The {} outcome is unknown and is held for reconciliation by a person. Do not submit it again.",
            op.tool
        ),
        State::AwaitingApproval => format!(
            "The {} waits for a person to approve these exact arguments; nothing has been sent. It runs once approved, or fails if it is rejected or not approved in time. Do not submit it again.",
            op.tool
        ),
        State::Accepted => format!(
            "The {} was accepted by the downstream (operation {}) and is in progress; the worker checks its status until it is done. Do not submit it again.",
            op.tool,
            op.remote_id.as_deref().unwrap_or("?")
        ),
        _ => format!("The {} outcome is unknown. Do not submit it again.", op.tool),
    }
}

/// The event an existing operation answers with when its intent arrives again.
///
/// A row swept by retention keeps only its tombstone (key, fingerprint, final state): it never
/// answers `succeeded` without the receipt, but `rejected` with reason `expired` and the final
/// state in `detail`, so the agent learns it finished and must not resubmit.
pub fn stored_result(op: &Operation) -> NewEvent {
    if op.swept_at.is_some() {
        let state = op.state();
        let mut event = rejected_event(
            &op.tenant,
            &op.action_id,
            &op.tool,
            RejectReason::Expired,
            Some(state.as_str().to_string()),
            format!(
                "This action already finished ({state}); its details were removed by retention, and it will not run again."
            ),
            Some(op.fingerprint.clone()),
        );
        event.operation_id = Some(op.id);
        event.reply_to = op.reply_to.clone();
        event.event.attempts = op.attempts.max(0) as u32;
        event.event.compensates = op.compensates.clone();
        return event;
    }
    match op.state() {
        State::Succeeded => succeeded(op),
        // No attempt: only an intent whose approval did not come fails without one.
        State::Failed if op.attempts == 0 => not_approved(
            op,
            if op.verified_by.as_deref() == Some("expiry") {
                NotApproved::Expired
            } else {
                NotApproved::Rejected
            },
        ),
        State::Failed => failed(op),
        _ => pending(op),
    }
}

/// The words of a `failed` answer: the evidence, or a refusal.
pub fn failed_message(op: &Operation) -> String {
    format!(
        "The {} failed: {}",
        op.tool,
        op.evidence
            .as_deref()
            .unwrap_or("the downstream refused it")
    )
}

/// `succeeded` with the receipt the worker recorded.
pub fn succeeded(op: &Operation) -> NewEvent {
    let id = op.receipt_id.clone().unwrap_or_default();
    operation_event(
        op,
        Status::Succeeded,
        format!("The {} succeeded (receipt {id}).", op.tool),
    )
}

/// `succeeded` with a receipt an operator confirmed.
pub fn succeeded_by_operator(op: &Operation, receipt_id: &str) -> NewEvent {
    operation_event(
        op,
        Status::Succeeded,
        format!(
            "The {} succeeded (receipt {receipt_id}, confirmed by an operator).",
            op.tool
        ),
    )
}

/// `failed`, with the evidence.
pub fn failed(op: &Operation) -> NewEvent {
    operation_event(op, Status::Failed, failed_message(op))
}

/// Why a compensation was not admitted (nothing was recorded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotAdmitted {
    /// No action of this tenant has that action_id.
    OriginalNotFound,
    /// The original failed: nothing was applied.
    OriginalNotApplied,
    /// The original is not settled; its state.
    OriginalUnresolved(State),
    /// The compensating tool does not list the original's tool.
    ToolNotAllowed { original_tool: String },
    /// This live compensation of the original came first.
    AlreadyCompensated { by: String },
}

/// `rejected` for a compensation that was not admitted (nothing recorded), with the reason
/// and, where one helps, a `detail`: the original's state, or the compensation that came
/// first.
pub fn compensation_refused(new: &NewOperation, why: &NotAdmitted) -> NewEvent {
    let original = new.compensates.as_deref().unwrap_or_default();
    let (reason, detail, message) = match why {
        NotAdmitted::OriginalNotFound => (
            RejectReason::OriginalNotFound,
            None,
            format!("There is no action {original:?} of this tenant to compensate; nothing was sent."),
        ),
        NotAdmitted::OriginalNotApplied => (
            RejectReason::OriginalNotApplied,
            Some(State::Failed.as_str().to_string()),
            format!("Action {original:?} failed: it was not applied, so there is nothing to undo; nothing was sent."),
        ),
        NotAdmitted::OriginalUnresolved(state) => (
            RejectReason::OriginalUnresolved,
            Some(state.as_str().to_string()),
            format!(
                "Action {original:?} is {state}, not known to have succeeded: undoing it now could cause a second unintended effect. Reconcile it first (check its status), then send the compensation again; nothing was sent."
            ),
        ),
        NotAdmitted::ToolNotAllowed { original_tool } if original == new.action_id => (
            RejectReason::CompensationNotAllowed,
            Some(original_tool.clone()),
            "An action cannot compensate itself; nothing was sent.".to_string(),
        ),
        NotAdmitted::ToolNotAllowed { original_tool } => (
            RejectReason::CompensationNotAllowed,
            Some(original_tool.clone()),
            format!(
                "Tool {:?} may not compensate a {original_tool:?} action (its compensation_for does not list it); nothing was sent.",
                new.tool
            ),
        ),
        NotAdmitted::AlreadyCompensated { by } => (
            RejectReason::AlreadyCompensated,
            Some(by.clone()),
            format!(
                "Action {original:?} already has compensation {by:?}, which succeeded or may still apply; nothing was sent."
            ),
        ),
    };
    let mut event = rejected_event(
        &new.tenant,
        &new.action_id,
        &new.tool,
        reason,
        detail,
        message,
        Some(new.fingerprint.clone()),
    );
    event.event.compensates = new.compensates.clone();
    event
}

/// `succeeded` again about an original whose compensation `by` succeeded: its state and
/// receipt are unchanged; `compensated_by` names the compensation.
pub fn compensated(original: &Operation, by: &str) -> NewEvent {
    let mut event = succeeded(original);
    event.event.compensated_by = Some(by.to_string());
    event.event.message = format!(
        "The {} succeeded (receipt {}) and was undone by its compensation {by:?}, which succeeded.",
        original.tool,
        original.receipt_id.as_deref().unwrap_or_default()
    );
    event
}

/// Why an intent that waited for approval failed without being sent: `detail` of its `failed`
/// event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotApproved {
    /// An approver rejected it.
    Rejected,
    /// Its wait (`approval_ttl_secs`) ended before enough people approved it.
    Expired,
}

impl NotApproved {
    /// The `detail` code.
    pub fn as_str(self) -> &'static str {
        match self {
            NotApproved::Rejected => "not_approved",
            NotApproved::Expired => "approval_expired",
        }
    }
}

/// `failed` for an intent that was never sent because its approval did not come: the evidence
/// says who rejected it and why, or that its wait ended; `detail` carries the code.
pub fn not_approved(op: &Operation, why: NotApproved) -> NewEvent {
    let mut event = operation_event(
        op,
        Status::Failed,
        format!(
            "The {} was not sent and will not be: {}",
            op.tool,
            op.evidence.as_deref().unwrap_or(why.as_str())
        ),
    );
    event.event.detail = Some(why.as_str().to_string());
    event
}

/// `pending`, saying why the outcome is not known yet.
pub fn pending(op: &Operation) -> NewEvent {
    operation_event(op, Status::Pending, pending_message(op))
}

/// `rejected` / `invalid_message` for a body that broke the contract, whose key has no row.
pub fn invalid_message(tenant: &str, action_id: &str, code: &str, error: &str) -> NewEvent {
    rejected_event(
        tenant,
        action_id,
        "",
        RejectReason::InvalidMessage,
        Some(code.to_string()),
        format!("The intent was rejected before any action: {error}; nothing was done."),
        None,
    )
}

/// `rejected` / `unknown_tool` for an intent naming a tool this pool does not have, whose key
/// has no row.
pub fn unknown_tool(tenant: &str, action_id: &str, tool: &str, fingerprint: &str) -> NewEvent {
    rejected_event(
        tenant,
        action_id,
        tool,
        RejectReason::UnknownTool,
        None,
        format!("The tool {tool:?} is not configured on this worker pool; nothing was done."),
        Some(fingerprint.to_string()),
    )
}

/// `rejected` / `intent_conflict` for an undecodable body whose salvaged key already has an
/// operation (its fingerprint is unknowable, so it never matches).
pub fn key_taken_by_undecodable(
    tenant: &str,
    action_id: &str,
    code: &str,
    op: &Operation,
) -> NewEvent {
    let why = format!("could not be decoded ({code})");
    key_taken(tenant, action_id, "", None, op, &why)
}

/// `rejected` / `intent_conflict` for an intent naming a tool this pool does not have, whose
/// key already has a different operation.
pub fn key_taken_by_unknown_tool(
    tenant: &str,
    action_id: &str,
    tool: &str,
    fingerprint: &str,
    op: &Operation,
) -> NewEvent {
    let why = format!("names the tool {tool:?}, which is not configured on this worker pool");
    key_taken(
        tenant,
        action_id,
        tool,
        Some(fingerprint.to_string()),
        op,
        &why,
    )
}

/// `intent_conflict` for a refused message that reuses a key that already has an operation;
/// `why` says what was wrong with the message.
fn key_taken(
    tenant: &str,
    action_id: &str,
    tool: &str,
    fingerprint: Option<String>,
    op: &Operation,
    why: &str,
) -> NewEvent {
    rejected_event(
        tenant,
        action_id,
        tool,
        RejectReason::IntentConflict,
        None,
        format!(
            "action_id {action_id:?} already has an operation ({} {}); this message {why} and was not run, and the stored operation is unchanged. The key must not be reused for a new action: a new action needs a new action_id chosen by the application.",
            op.tool,
            op.state()
        ),
        fingerprint,
    )
}

/// `rejected` / `intent_conflict` for an intent whose key was already used for a different
/// intent (tool or arguments differ), routed to the delivery that reused the key.
pub fn conflict(new: &NewOperation) -> NewEvent {
    let mut event = rejected_event(
        &new.tenant,
        &new.action_id,
        &new.tool,
        RejectReason::IntentConflict,
        None,
        format!(
            "action_id {:?} was already used for a different intent (tool or arguments differ); the stored operation is unchanged. A new action needs a new action_id chosen by the application.",
            new.action_id
        ),
        Some(new.fingerprint.clone()),
    );
    event.event.compensates = new.compensates.clone();
    event.answering(new.reply_to.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dead_letter_reason_has_its_own_code() {
        let codes: std::collections::BTreeSet<_> =
            DeadLetterReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(codes.len(), DeadLetterReason::ALL.len());
        assert_eq!(DeadLetterReason::InvalidMessage, "invalid_message");
    }
}

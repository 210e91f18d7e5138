//! What a model reads: a result event (or no answer yet) turned into an MCP tool result or a
//! task state.
//!
//! `succeeded` is a result whose `structuredContent` is the whole result event (receipt
//! included); `failed` and `rejected` are `isError: true` with the evidence (a `failed` never sent
//! because its approval did not come says so); `pending`, and no answer at all after the intent
//! was sent, are a plain text that says the outcome is unknown (or, for an operation the
//! downstream accepted and named, that it is in progress; for an intent waiting for a person's
//! approval, that nothing was sent), that the model must not retry or call again under another
//! id, and how to check.

use protocol::{ResultEvent, Status, Uncertainty};

/// `detail` of a `failed` that a person rejected before it was sent.
pub const NOT_APPROVED: &str = "not_approved";
/// `detail` of a `failed` whose wait for approval ended before it was approved; never sent.
pub const APPROVAL_EXPIRED: &str = "approval_expired";
use rmcp::model::{CallToolResult, ContentBlock, DetailedTask, Task, TaskPayload};
use serde_json::Value;

/// How a client can learn the outcome later, named in the `pending` text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// The `get_action_status` tool (a status API is configured).
    StatusTool,
    /// Only by calling the same tool again with the same action id.
    SameCall,
}

/// The result of a call whose answer is `event`.
pub fn from_event(event: &ResultEvent, check: Check) -> CallToolResult {
    let value = serde_json::to_value(event).unwrap_or(Value::Null);
    match event.status {
        Status::Succeeded => {
            let mut result = CallToolResult::structured(value);
            result.content = vec![ContentBlock::text(format!(
                "Succeeded: action {:?} ({}) was carried out. {} Receipt: {}{}",
                event.action_id,
                event.tool,
                event.message,
                event.receipt.as_ref().unwrap_or(&Value::Null),
                compensation_note(event)
            ))];
            result
        }
        Status::Failed if not_approved(event).is_some() => {
            let mut result = CallToolResult::structured_error(value);
            result.content = vec![ContentBlock::text(not_approved_text(event))];
            result
        }
        Status::Failed | Status::Rejected => {
            let word = if event.status == Status::Failed {
                "Failed: the action was not carried out"
            } else {
                "Rejected: the action was refused and not carried out"
            };
            let reason = event
                .reason
                .map(|r| format!(" Reason: {}.", serde_json::to_value(r).unwrap_or_default()))
                .unwrap_or_default();
            let detail = event
                .detail
                .as_deref()
                .map(|d| format!(" Detail: {d}."))
                .unwrap_or_default();
            let compensates = event
                .compensates
                .as_deref()
                .map(|original| format!(" It was to undo action {original:?}."))
                .unwrap_or_default();
            let mut result = CallToolResult::structured_error(value);
            result.content = vec![ContentBlock::text(format!(
                "{word} (action {:?}, tool {}). {}{reason}{detail}{compensates}",
                event.action_id, event.tool, event.message
            ))];
            result
        }
        Status::Pending => {
            CallToolResult::success(vec![ContentBlock::text(pending_text(event, check))])
        }
    }
}

/// What a `succeeded` answer adds about compensation: the action it undid (an event about a
/// compensation), or the compensation that has since undone it (an event about the original).
fn compensation_note(event: &ResultEvent) -> String {
    let mut note = String::new();
    if let Some(original) = &event.compensates {
        note.push_str(&format!(" It undid action {original:?}."));
    }
    if let Some(by) = &event.compensated_by {
        note.push_str(&format!(
            " It has since been undone by action {by:?}; the receipt above is the original's."
        ));
    }
    note
}

/// Which approval a `failed` answer lacked: `Some(NOT_APPROVED)` when a person rejected it,
/// `Some(APPROVAL_EXPIRED)` when its wait ended; either way nothing was ever sent.
fn not_approved(event: &ResultEvent) -> Option<&'static str> {
    if event.status != Status::Failed {
        return None;
    }
    match event.detail.as_deref() {
        Some(NOT_APPROVED) => Some(NOT_APPROVED),
        Some(APPROVAL_EXPIRED) => Some(APPROVAL_EXPIRED),
        _ => None,
    }
}

/// The text of a `failed` answer that was never sent because its approval did not come.
fn not_approved_text(event: &ResultEvent) -> String {
    let what = match not_approved(event) {
        Some(APPROVAL_EXPIRED) => "NOT APPROVED IN TIME: nobody approved the request",
        _ => "NOT APPROVED: a person rejected the request",
    };
    let by = event
        .operator
        .as_deref()
        .map(|name| format!(" (by {name})"))
        .unwrap_or_default();
    format!(
        "{what} for action {:?} (tool {}){by}, so it was not carried out: nothing was sent, and nothing will be under this action id. Worker: {} Tell the user; do not call again under another action id to get around the decision.",
        event.action_id, event.tool, event.message
    )
}

/// The text of a `pending` answer: waiting for approval (nothing sent) for an intent a person
/// must approve first, in progress for an operation the downstream accepted and named, else
/// outcome unknown.
pub fn pending_text(event: &ResultEvent, check: Check) -> String {
    if event.uncertainty == Some(Uncertainty::AwaitingApproval) {
        return awaiting_approval_text(event, check);
    }
    match accepted_operation(event) {
        Some(operation) => in_progress_text(event, operation, check),
        None => unknown_text(&event.action_id, Some(&event.message), check),
    }
}

/// The text of a `pending` answer about an intent that waits for a person's approval: recorded,
/// nothing sent.
pub fn awaiting_approval_text(event: &ResultEvent, check: Check) -> String {
    format!(
        "AWAITING APPROVAL: the request for action {:?} was recorded and waits for a person to approve these exact arguments; nothing has been sent. It is carried out once approved, and fails if it is rejected or not approved in time. Worker: {} Do not retry it and do not call again under another action id: tell the user it waits for approval. {}",
        event.action_id,
        event.message,
        how_to_check(&event.action_id, check)
    )
}

/// The downstream's operation id of a `pending` answer that says the write was accepted:
/// `in_progress` with a `remote_id`. An `in_progress` answer without one is a write on its way
/// or waiting for a retry proven safe (docs/contract.md): nothing was accepted, and the model
/// is told the outcome is unknown, as the Python client does.
fn accepted_operation(event: &ResultEvent) -> Option<&str> {
    (event.uncertainty == Some(Uncertainty::InProgress))
        .then_some(event.remote_id.as_deref())
        .flatten()
        .filter(|id| !id.is_empty())
}

/// The text of a `pending` answer about an operation the downstream accepted as `operation`
/// and the worker polls until done.
pub fn in_progress_text(event: &ResultEvent, operation: &str, check: Check) -> String {
    format!(
        "ACCEPTED, IN PROGRESS: the request for action {:?} was accepted as operation {operation:?} and is still being carried out; the worker checks it until it is done. Worker: {} Do not resubmit it and do not call again under another action id: that could do it twice. {}",
        event.action_id,
        event.message,
        how_to_check(&event.action_id, check)
    )
}

fn how_to_check(action_id: &str, check: Check) -> String {
    match check {
        Check::StatusTool => format!(
            "Check it later with the get_action_status tool (action_id {action_id:?}); calling this same tool again with the same action id is also safe and returns the answer once it is known."
        ),
        Check::SameCall => format!(
            "To check, call this same tool again later with the same arguments and the same action id ({action_id:?}): that never repeats the action and returns the answer once it is known."
        ),
    }
}

/// The result of a call that was sent but has no answer within its budget.
pub fn no_answer(action_id: &str, check: Check) -> CallToolResult {
    CallToolResult::success(vec![ContentBlock::text(unknown_text(
        action_id, None, check,
    ))])
}

/// The plain "outcome unknown" text.
pub fn unknown_text(action_id: &str, message: Option<&str>, check: Check) -> String {
    let how = how_to_check(action_id, check);
    let worker = message.map(|m| format!(" Worker: {m}")).unwrap_or_default();
    format!(
        "OUTCOME UNKNOWN: the request for action {action_id:?} was sent, and it is not known yet whether it was carried out.{worker} Do not retry it and do not call again under another action id: that could do it twice. {how}"
    )
}

/// A tool error: nothing was sent (a bad call).
pub fn refused(text: impl Into<String>) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(text.into())])
}

/// The task id of an action: its action key `<tenant>:<action_id>` (a tenant never contains
/// `:`), so any gateway process can answer `tasks/get` from the ledger alone.
pub fn task_id(tenant: &str, action_id: &str) -> String {
    crate::action_key(tenant, action_id)
}

/// `(tenant, action_id)` of a task id.
pub fn parse_task_id(task_id: &str) -> Option<(&str, &str)> {
    task_id
        .split_once(':')
        .filter(|(tenant, action)| !tenant.is_empty() && !action.is_empty())
}

/// Polling interval suggested to task clients.
pub const TASK_POLL_MS: u64 = 500;

/// Why a task shows `working`, including that a cancel cannot undo a dispatched write.
const WORKING_NOTE: &str = "tasks/cancel cannot undo a write that was dispatched; this task always reports the ledger's state.";

/// The task for an action in its current state: `None` (not recorded yet) and `pending` are
/// `working`; a final event is `completed` with the same result a synchronous call returns.
pub fn task(tenant: &str, action_id: &str, event: Option<&ResultEvent>, now: &str) -> DetailedTask {
    let stamp = event.map(|e| e.occurred_at.as_str()).unwrap_or(now);
    let base = Task::new(
        task_id(tenant, action_id),
        rmcp::model::TaskStatus::Working,
        stamp,
        stamp,
    )
    .with_poll_interval_ms(TASK_POLL_MS);
    match event {
        None => DetailedTask::new(
            base.with_status_message(format!(
                "Sent; the worker has not recorded it yet. {WORKING_NOTE}"
            )),
            TaskPayload::Working,
        ),
        Some(event) if event.status == Status::Pending => DetailedTask::new(
            base.with_status_message(format!(
                "{} {WORKING_NOTE}",
                pending_text(event, Check::StatusTool)
            )),
            TaskPayload::Working,
        ),
        Some(event) => {
            let result = from_event(event, Check::StatusTool);
            let result = match serde_json::to_value(&result) {
                Ok(Value::Object(object)) => object,
                _ => Default::default(),
            };
            DetailedTask::new(base, TaskPayload::Completed { result })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(uncertainty: Option<Uncertainty>) -> ResultEvent {
        pending_as(uncertainty, Some("op-41"))
    }

    fn pending_as(uncertainty: Option<Uncertainty>, remote_id: Option<&str>) -> ResultEvent {
        let message = match remote_id {
            Some(_) => "accepted by the downstream",
            None => "The deploy has not been applied yet; it will be retried automatically.",
        };
        serde_json::from_value(serde_json::json!({
            "tenant": "north-shop", "action_id": "deploy-9", "tool": "deploy",
            "status": "pending", "receipt": null, "next_action": "check_status",
            "attempts": 1, "message": message, "fingerprint": null,
            "remote_id": remote_id, "uncertainty": uncertainty,
            "event_id": "e-1", "occurred_at": "2026-01-01T00:00:00.000Z"
        }))
        .unwrap()
    }

    fn task_message(event: &ResultEvent) -> String {
        let task = task(
            "north-shop",
            "deploy-9",
            Some(event),
            "2026-01-01T00:00:00.000Z",
        );
        serde_json::to_value(&task).unwrap()["statusMessage"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    fn text(result: &CallToolResult) -> String {
        serde_json::to_value(&result.content).unwrap().to_string()
    }

    /// The result's text blocks as the model reads them (no JSON escaping).
    fn plain(result: &CallToolResult) -> String {
        let content = serde_json::to_value(&result.content).unwrap();
        let blocks = content.as_array().unwrap().iter();
        blocks.filter_map(|b| b["text"].as_str()).collect()
    }

    #[test]
    fn an_accepted_operation_reads_in_progress_and_an_unknown_one_outcome_unknown() {
        let accepted = from_event(&pending(Some(Uncertainty::InProgress)), Check::StatusTool);
        let said = text(&accepted);
        assert!(
            said.contains("ACCEPTED, IN PROGRESS") && said.contains("op-41"),
            "{said}"
        );
        assert!(said.contains("Do not resubmit"), "{said}");
        for uncertainty in [
            Some(Uncertainty::UnknownOutcome),
            Some(Uncertainty::Held),
            None,
        ] {
            let said = text(&from_event(&pending(uncertainty), Check::SameCall));
            assert!(said.contains("OUTCOME UNKNOWN"), "{uncertainty:?}: {said}");
        }
    }

    /// `in_progress` without an operation id is a write on its way or waiting for a retry
    /// proven safe: nothing was accepted, so nothing says so.
    #[test]
    fn only_an_operation_the_downstream_named_is_said_to_be_accepted() {
        let waiting = pending_as(Some(Uncertainty::InProgress), None);
        for said in [
            text(&from_event(&waiting, Check::StatusTool)),
            task_message(&waiting),
        ] {
            assert!(!said.to_lowercase().contains("accepted"), "{said}");
            assert!(said.contains("Do not"), "{said}");
        }
        let blank = pending_as(Some(Uncertainty::InProgress), Some(""));
        let said = text(&from_event(&blank, Check::StatusTool));
        assert!(!said.contains("ACCEPTED"), "{said}");
    }

    /// `tasks/get` of an accepted operation says what a call answers: accepted, in progress,
    /// with its operation id; an unknown one says the outcome is unknown.
    #[test]
    fn a_task_in_progress_reads_in_progress() {
        let said = task_message(&pending(Some(Uncertainty::InProgress)));
        assert!(
            said.contains("ACCEPTED, IN PROGRESS") && said.contains("op-41"),
            "{said}"
        );
        assert!(said.contains("tasks/cancel cannot undo"), "{said}");
        let said = task_message(&pending(Some(Uncertainty::UnknownOutcome)));
        assert!(said.contains("OUTCOME UNKNOWN"), "{said}");
    }

    /// An event of `status` about `deploy-9` with `fields` added (or replaced).
    fn event(status: &str, fields: serde_json::Value) -> ResultEvent {
        let mut event = serde_json::json!({
            "tenant": "north-shop", "action_id": "deploy-9", "tool": "deploy",
            "status": status, "receipt": null, "next_action": null,
            "attempts": 0, "message": "The deploy waits for a person.", "fingerprint": null,
            "event_id": "e-1", "occurred_at": "2026-01-01T00:00:00.000Z"
        });
        for (key, value) in fields.as_object().unwrap() {
            event[key] = value.clone();
        }
        serde_json::from_value(event).unwrap()
    }

    /// A `pending` waiting for approval says nothing was sent, never "outcome unknown", with
    /// the same warnings against a retry or another action id, and how to check; a task says
    /// the same.
    #[test]
    fn awaiting_approval_reads_nothing_sent_and_not_outcome_unknown() {
        let waiting = event(
            "pending",
            serde_json::json!({"uncertainty": "awaiting_approval", "next_action": "check_status"}),
        );
        for check in [Check::StatusTool, Check::SameCall] {
            let result = from_event(&waiting, check);
            assert_ne!(result.is_error, Some(true));
            let said = text(&result);
            assert!(said.contains("AWAITING APPROVAL"), "{said}");
            assert!(said.contains("nothing has been sent"), "{said}");
            assert!(said.contains("deploy-9"), "{said}");
            assert!(said.contains("Do not retry"), "{said}");
            assert!(said.contains("another action id"), "{said}");
            assert!(!said.contains("OUTCOME UNKNOWN"), "{said}");
            assert!(!said.to_lowercase().contains("accepted"), "{said}");
        }
        assert!(text(&from_event(&waiting, Check::StatusTool)).contains("get_action_status"));
        assert!(text(&from_event(&waiting, Check::SameCall)).contains("same action id"));
        let said = task_message(&waiting);
        assert!(
            said.contains("AWAITING APPROVAL") && said.contains("nothing has been sent"),
            "{said}"
        );
    }

    /// A `failed` never sent for want of approval says so (rejected by a person, or the wait
    /// ended), as a tool error with the event; an ordinary failure keeps its wording.
    #[test]
    fn a_request_not_approved_reads_never_sent() {
        let rejected = event(
            "failed",
            serde_json::json!({
                "detail": "not_approved", "verified_by": "operator", "operator": "alice",
                "message": "alice rejected it: not this week."
            }),
        );
        let result = from_event(&rejected, Check::StatusTool);
        assert_eq!(result.is_error, Some(true));
        assert_eq!(
            result.structured_content.as_ref().unwrap()["detail"],
            "not_approved"
        );
        let said = text(&result);
        assert!(said.contains("NOT APPROVED: a person rejected"), "{said}");
        assert!(
            said.contains("(by alice)") && said.contains("not this week"),
            "{said}"
        );
        assert!(said.contains("nothing was sent"), "{said}");

        let expired = event(
            "failed",
            serde_json::json!({"detail": "approval_expired", "verified_by": "expiry"}),
        );
        let said = text(&from_event(&expired, Check::SameCall));
        assert!(said.contains("NOT APPROVED IN TIME"), "{said}");
        assert!(said.contains("nothing was sent"), "{said}");

        let failed = event("failed", serde_json::json!({"verified_by": "dispatch"}));
        let said = text(&from_event(&failed, Check::SameCall));
        assert!(
            said.contains("Failed: the action was not carried out"),
            "{said}"
        );
        assert!(!said.contains("APPROVED"), "{said}");
    }

    /// Answers about a compensation name the original; the original's later `succeeded` names
    /// the compensation that undid it.
    #[test]
    fn compensation_answers_name_both_actions() {
        let undo = event(
            "succeeded",
            serde_json::json!({"action_id": "undo-9", "compensates": "deploy-9"}),
        );
        let said = plain(&from_event(&undo, Check::SameCall));
        assert!(said.contains("It undid action \"deploy-9\"."), "{said}");
        let original = event("succeeded", serde_json::json!({"compensated_by": "undo-9"}));
        let said = plain(&from_event(&original, Check::SameCall));
        assert!(said.contains("undone by action \"undo-9\""), "{said}");
        let refused = event(
            "rejected",
            serde_json::json!({
                "action_id": "undo-10", "reason": "already_compensated", "detail": "undo-9",
                "compensates": "deploy-9"
            }),
        );
        let said = plain(&from_event(&refused, Check::SameCall));
        assert!(said.contains("already_compensated"), "{said}");
        assert!(said.contains("Detail: undo-9."), "{said}");
        assert!(
            said.contains("It was to undo action \"deploy-9\"."),
            "{said}"
        );
    }
}

//! What a model reads: a result event (or no answer yet) turned into an MCP tool result or a
//! task state.
//!
//! `succeeded` is a result whose `structuredContent` is the whole result event (receipt
//! included); `failed` and `rejected` are `isError: true` with the evidence; `pending`, and no
//! answer at all after the intent was sent, are a plain text that says the outcome is unknown,
//! that the model must not retry or call again under another id, and how to check.

use protocol::{ResultEvent, Status};
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
                "Succeeded: action {:?} ({}) was carried out. {} Receipt: {}",
                event.action_id,
                event.tool,
                event.message,
                event.receipt.as_ref().unwrap_or(&Value::Null)
            ))];
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
            let mut result = CallToolResult::structured_error(value);
            result.content = vec![ContentBlock::text(format!(
                "{word} (action {:?}, tool {}). {}{reason}{detail}",
                event.action_id, event.tool, event.message
            ))];
            result
        }
        Status::Pending => CallToolResult::success(vec![ContentBlock::text(unknown_text(
            &event.action_id,
            Some(&event.message),
            check,
        ))]),
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
    let how = match check {
        Check::StatusTool => format!(
            "Check it later with the get_action_status tool (action_id {action_id:?}); calling this same tool again with the same action id is also safe and returns the answer once it is known."
        ),
        Check::SameCall => format!(
            "To check, call this same tool again later with the same arguments and the same action id ({action_id:?}): that never repeats the action and returns the answer once it is known."
        ),
    };
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
                unknown_text(action_id, Some(&event.message), Check::StatusTool)
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

//! The operator actions and the agent status query, shared by the HTTP API and the CLI: list,
//! show, status, resolve, fail, recheck. Input is validated here; every state change goes
//! through the ledger's one conditional statement per action, idempotent by request id.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::adapter::Request;
use crate::answers::stored_result;
use crate::context::Context;
use crate::document::Document;
use crate::ledger::queries::HistoryEntry;
use crate::ledger::{
    Ledger, LedgerError, Operation, OperatorChange, OperatorOutcome, OperatorRequest, State,
    UnresolvedFilter,
};
use crate::recovery::scheduler;
use crate::telemetry::spans;
use tracing::Instrument as _;

/// Default page size of the listing.
pub const DEFAULT_LIMIT: i64 = 50;
/// Largest page size of the listing.
pub const MAX_LIMIT: i64 = 500;
/// The largest `older_than_secs` a listing accepts (100 years).
pub const MAX_OLDER_THAN_SECS: u64 = 3_153_600_000;
/// Shortest evidence accepted for marking an operation failed.
pub const MIN_EVIDENCE_CHARS: usize = 10;
pub(super) const MAX_NAME_CHARS: usize = 100;
/// Longest operator name (the console's sign-in form allows the same).
pub const MAX_OPERATOR_CHARS: usize = MAX_NAME_CHARS;
pub(super) const MAX_REQUEST_ID_CHARS: usize = 200;
const MAX_TEXT_CHARS: usize = 4000;

/// Why an operator action or query did not happen.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// The input is incomplete or malformed; nothing was read or written.
    #[error("{0}")]
    BadRequest(String),
    /// No such operation (or not visible to the caller).
    #[error("operation {tenant}/{action_id} not found")]
    NotFound { tenant: String, action_id: String },
    /// The operation is not in a state the action may change, or the request id was used for
    /// something else. Nothing was written.
    #[error("{message}")]
    Conflict {
        message: String,
        state: Option<State>,
    },
    /// The receipt does not belong to the operation (the tool's receipt match failed); nothing
    /// was stored.
    #[error("receipt refused: {0}")]
    ReceiptMismatch(String),
    /// The operation's tool is not configured here, so its receipt check or recovery cannot run.
    #[error("tool {0:?} is not configured on this worker (WORKER_TOOLS)")]
    ToolNotConfigured(String),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

/// The detail view of one operation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OperationView {
    pub id: i64,
    pub tenant: String,
    pub action_id: String,
    /// The downstream idempotency key, `<tenant>:<action_id>`.
    pub idempotency_key: String,
    pub tool: String,
    pub state: String,
    pub fingerprint: String,
    /// The saved arguments; null once retention removed them.
    pub arguments: Option<serde_json::Value>,
    pub fence: i64,
    pub attempts: i32,
    pub recovery_attempts: i32,
    pub first_dispatch_at: Option<DateTime<Utc>>,
    pub replay_deadline: Option<DateTime<Utc>>,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub lease_owner: Option<String>,
    pub lease_until: Option<DateTime<Utc>>,
    pub evidence: Option<String>,
    /// The receipt exactly as the downstream sent it (its bytes, a U+0000 included).
    pub receipt: Option<Document>,
    pub receipt_id: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub state_since: DateTime<Utc>,
    pub swept_at: Option<DateTime<Utc>>,
    /// The trace id of the intent that created the operation (32 hex characters), if it
    /// carried a trace context.
    pub trace_id: Option<String>,
    /// `trace_id` in the trace viewer (`WORKER_TRACE_URL`), when that is configured.
    pub trace_url: Option<String>,
    /// The downstream's operation id, once it accepted a long-running write.
    pub remote_id: Option<String>,
    /// The acceptance answer it sent.
    pub acceptance: Option<Document>,
    /// When an accepted operation is held if still not done.
    pub poll_deadline: Option<DateTime<Utc>>,
    /// The deadline the last write request carried (a tool with `absence_proof`).
    pub send_deadline: Option<DateTime<Utc>>,
    /// How the final answer (or the acceptance) is known: `dispatch`, `replay`, `lookup`,
    /// `poll`, `late_receipt` or `operator:<name>`.
    pub verified_by: Option<String>,
    /// On a compensation: the action_id of the original it undoes.
    pub compensates: Option<String>,
    /// The compensations of this action, oldest first (a failed one does not count as live).
    pub compensations: Vec<CompensationLink>,
    pub history: Vec<HistoryView>,
}

/// A compensation of an operation, as its detail view links it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CompensationLink {
    pub action_id: String,
    pub state: String,
}

/// `WORKER_TRACE_URL`: the trace viewer's address for one trace, with `{trace_id}`.
static TRACE_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Sets the trace viewer template (`WORKER_TRACE_URL`) once, at start-up.
pub fn set_trace_url_template(template: &str) {
    let _ = TRACE_URL.set(template.to_string());
}

/// The trace viewer's link for `trace_id`, when a template is configured.
pub fn trace_url(trace_id: &str) -> Option<String> {
    TRACE_URL.get().map(|t| t.replace("{trace_id}", trace_id))
}

/// One history entry: who (`actor`), when (`at`), why (`evidence`), and the schedule.
pub type HistoryView = HistoryEntry;

impl OperationView {
    pub fn new(op: &Operation, history: Vec<HistoryEntry>) -> OperationView {
        OperationView {
            id: op.id,
            tenant: op.tenant.clone(),
            action_id: op.action_id.clone(),
            idempotency_key: op.idempotency_key(),
            tool: op.tool.clone(),
            state: op.state().as_str().to_string(),
            fingerprint: op.fingerprint.clone(),
            arguments: op.arguments.as_deref().map(|a| {
                serde_json::from_str(a).unwrap_or_else(|_| serde_json::Value::String(a.into()))
            }),
            fence: op.fence,
            attempts: op.attempts,
            recovery_attempts: op.recovery_attempts,
            first_dispatch_at: op.first_dispatch_at,
            replay_deadline: op.replay_deadline,
            next_attempt_at: op.next_attempt_at,
            lease_owner: op.lease_owner.clone(),
            lease_until: op.lease_until,
            evidence: op.evidence.clone(),
            receipt: op.receipt.clone(),
            receipt_id: op.receipt_id.clone(),
            created_at: op.created_at,
            updated_at: op.updated_at,
            state_since: op.state_since,
            swept_at: op.swept_at,
            trace_id: op.trace().map(|t| t.parent.trace_id_hex()),
            trace_url: op.trace().and_then(|t| trace_url(&t.parent.trace_id_hex())),
            remote_id: op.remote_id.clone(),
            acceptance: op.acceptance.clone(),
            poll_deadline: op.poll_deadline,
            send_deadline: op.send_deadline,
            compensates: op.compensates.clone(),
            compensations: Vec::new(),
            verified_by: op.verified_by.clone(),
            history,
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("views serialize")
    }
}

/// Listing parameters as the API query string and the CLI give them.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListParams {
    /// One unresolved state or several separated by commas; default all unresolved states.
    pub state: Option<String>,
    pub tool: Option<String>,
    pub older_than_secs: Option<u64>,
    pub limit: Option<i64>,
    /// Cursor: the `next_after` of the previous page.
    pub after: Option<i64>,
}

/// One operation in a listing: the facts of [`OperationView`] without its arguments, receipt
/// and history, so a page stays small whatever the operations carry (one operation's route
/// returns the whole row).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OperationSummary {
    pub id: i64,
    pub tenant: String,
    pub action_id: String,
    /// The downstream idempotency key, `<tenant>:<action_id>`.
    pub idempotency_key: String,
    pub tool: String,
    pub state: String,
    pub fingerprint: String,
    pub fence: i64,
    pub attempts: i32,
    pub recovery_attempts: i32,
    pub first_dispatch_at: Option<DateTime<Utc>>,
    pub replay_deadline: Option<DateTime<Utc>>,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub lease_owner: Option<String>,
    pub lease_until: Option<DateTime<Utc>>,
    /// At most [`SUMMARY_EVIDENCE_CHARS`] characters, with `…` when cut.
    pub evidence: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub state_since: DateTime<Utc>,
    pub trace_id: Option<String>,
    pub trace_url: Option<String>,
    /// The downstream's operation id, once it accepted a long-running write.
    pub remote_id: Option<String>,
    /// When an accepted operation is held if still not done.
    pub poll_deadline: Option<DateTime<Utc>>,
}

/// The longest evidence a listing shows per operation.
pub const SUMMARY_EVIDENCE_CHARS: usize = 1000;

impl OperationSummary {
    pub fn new(op: &Operation) -> OperationSummary {
        OperationSummary {
            id: op.id,
            tenant: op.tenant.clone(),
            action_id: op.action_id.clone(),
            idempotency_key: op.idempotency_key(),
            tool: op.tool.clone(),
            state: op.state().as_str().to_string(),
            fingerprint: op.fingerprint.clone(),
            fence: op.fence,
            attempts: op.attempts,
            recovery_attempts: op.recovery_attempts,
            first_dispatch_at: op.first_dispatch_at,
            replay_deadline: op.replay_deadline,
            next_attempt_at: op.next_attempt_at,
            lease_owner: op.lease_owner.clone(),
            lease_until: op.lease_until,
            evidence: op.evidence.as_deref().map(|e| {
                if e.chars().count() <= SUMMARY_EVIDENCE_CHARS {
                    e.to_string()
                } else {
                    let mut cut: String = e.chars().take(SUMMARY_EVIDENCE_CHARS).collect();
                    cut.push('…');
                    cut
                }
            }),
            created_at: op.created_at,
            updated_at: op.updated_at,
            state_since: op.state_since,
            trace_id: op.trace().map(|t| t.parent.trace_id_hex()),
            trace_url: op.trace().and_then(|t| trace_url(&t.parent.trace_id_hex())),
            remote_id: op.remote_id.clone(),
            poll_deadline: op.poll_deadline,
        }
    }
}

/// One page of the listing.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ListPage {
    pub operations: Vec<OperationSummary>,
    /// Pass as `after` for the next page; null when this page was the last.
    pub next_after: Option<i64>,
}

/// Body of a resolve request.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResolveInput {
    /// Kept exactly as the operator sent it, like a downstream's receipt.
    pub receipt: Option<Document>,
    pub operator: Option<String>,
    pub reason: Option<String>,
    pub request_id: Option<String>,
}

/// Body of a fail request.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailInput {
    pub evidence: Option<String>,
    pub operator: Option<String>,
    pub request_id: Option<String>,
}

/// Body of a recheck request.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecheckInput {
    pub operator: Option<String>,
    pub reason: Option<String>,
    pub request_id: Option<String>,
}

/// The answer to an operator action: the operation's detail view after it.
#[derive(Debug, Clone)]
pub struct ActionResponse {
    pub body: serde_json::Value,
    /// True when the request id had been seen: nothing changed, `body` is the stored response.
    pub repeated: bool,
}

pub(super) fn bad(msg: impl Into<String>) -> OpsError {
    OpsError::BadRequest(msg.into())
}

fn required_text(field: &str, value: Option<String>, max: usize) -> Result<String, OpsError> {
    let value = value.unwrap_or_default();
    // The spec's maxLength counts every character sent, surrounding whitespace included.
    if value.chars().count() > max {
        return Err(bad(format!("{field} is longer than {max} characters")));
    }
    let value = value.trim();
    if value.is_empty() {
        return Err(bad(format!("{field} is required")));
    }
    // Postgres text cannot store NUL.
    if value.contains('\0') {
        return Err(bad(format!("{field} must not contain NUL characters")));
    }
    Ok(value.to_string())
}

pub(super) fn name(field: &str, value: Option<String>, max: usize) -> Result<String, OpsError> {
    let value = required_text(field, value, max)?;
    unseen_characters(field, &value).map_err(bad)?;
    Ok(value)
}

/// The evidence an operator gives for `failed` (one operation or a bulk job): not blank, at
/// least [`MIN_EVIDENCE_CHARS`] and at most 4,000 characters, no NUL.
pub fn evidence_text(value: Option<String>) -> Result<String, OpsError> {
    let evidence = required_text("evidence", value, MAX_TEXT_CHARS)?;
    if evidence.chars().count() < MIN_EVIDENCE_CHARS {
        return Err(bad(format!(
            "evidence must describe the downstream's proof in at least {MIN_EVIDENCE_CHARS} characters"
        )));
    }
    Ok(evidence)
}

/// The reason an operator gives for a recheck or a resolve (one operation or a bulk job): not
/// blank, at most 4,000 characters, no NUL.
pub fn reason_text(value: Option<String>) -> Result<String, OpsError> {
    required_text("reason", value, MAX_TEXT_CHARS)
}

/// Refuses a name holding a character that is not seen as itself (controls, bidirectional
/// controls, zero-width and other default-ignorable characters, line separators:
/// [`kit::text::is_unseen`]): it is recorded in the history, where it could pass for another.
fn unseen_characters(field: &str, value: &str) -> Result<(), String> {
    match value.chars().find(|c| kit::text::is_unseen(*c)) {
        None => Ok(()),
        Some(c) if c.is_control() => Err(format!("{field} must not contain control characters")),
        Some(c) => Err(format!(
            "{field} must not contain invisible or direction-changing characters (found U+{:04X})",
            c as u32
        )),
    }
}

/// The rules of an operator's name, as every operator action applies them: not blank, at most
/// [`MAX_OPERATOR_CHARS`] characters, no control, invisible or direction-changing character.
pub fn check_operator_name(operator: &str) -> Result<(), String> {
    let operator = operator.trim();
    if operator.is_empty() {
        return Err("The name is required.".into());
    }
    if operator.chars().count() > MAX_OPERATOR_CHARS {
        return Err(format!(
            "The name is longer than {MAX_OPERATOR_CHARS} characters."
        ));
    }
    unseen_characters("The name", operator).map_err(|e| format!("{e}."))
}

fn parse_states(raw: Option<&str>) -> Result<Vec<State>, OpsError> {
    let mut states = Vec::new();
    let Some(raw) = raw else {
        return Ok(states);
    };
    // Exactly the spec's pattern: state names joined by commas, no blanks or empty parts.
    for part in raw.split(',') {
        match State::parse(part).filter(|s| State::UNRESOLVED.contains(s)) {
            Some(s) if !states.contains(&s) => states.push(s),
            Some(_) => {}
            None => {
                return Err(bad(format!(
                    "state {part:?} is not an unresolved state: expected dispatching, retry_wait, unknown, held, accepted or awaiting_approval"
                )))
            }
        }
    }
    Ok(states)
}

/// Unresolved operations (dispatching, retry_wait, unknown, held, accepted, awaiting_approval),
/// oldest id first, one page.
pub async fn list(ledger: &Ledger, params: ListParams) -> Result<ListPage, OpsError> {
    let states = parse_states(params.state.as_deref())?;
    let limit = params.limit.unwrap_or(DEFAULT_LIMIT);
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(bad(format!("limit must be between 1 and {MAX_LIMIT}")));
    }
    // Postgres cannot subtract more than about 290,000 years from now(): bound it well before.
    if params
        .older_than_secs
        .is_some_and(|s| s > MAX_OLDER_THAN_SECS)
    {
        return Err(bad(format!(
            "older_than_secs must be at most {MAX_OLDER_THAN_SECS} (100 years)"
        )));
    }
    if params.after.is_some_and(|a| a < 0) {
        return Err(bad("after must be an operation id (0 or more)"));
    }
    let filter = UnresolvedFilter {
        states,
        tool: match params.tool.filter(|t| !t.trim().is_empty()) {
            Some(t) if t.contains('\0') => return Err(bad("tool must not contain NUL characters")),
            t => t,
        },
        older_than_secs: params.older_than_secs.map(|s| s as f64),
        after: params.after,
        limit,
    };
    let ops = ledger.list_unresolved(&filter).await?;
    let next_after = (ops.len() as i64 == limit)
        .then(|| ops.last().map(|o| o.id))
        .flatten();
    let operations = ops.iter().map(OperationSummary::new).collect();
    Ok(ListPage {
        operations,
        next_after,
    })
}

pub(super) async fn find(
    ledger: &Ledger,
    tenant: &str,
    action_id: &str,
) -> Result<Operation, OpsError> {
    // Postgres text cannot hold NUL, so no such operation exists (and asking would fail).
    if tenant.contains('\0') || action_id.contains('\0') {
        return Err(OpsError::NotFound {
            tenant: tenant.to_string(),
            action_id: action_id.to_string(),
        });
    }
    ledger
        .find(tenant, action_id)
        .await?
        .ok_or_else(|| OpsError::NotFound {
            tenant: tenant.to_string(),
            action_id: action_id.to_string(),
        })
}

/// One operation with its history.
pub async fn show(
    ledger: &Ledger,
    tenant: &str,
    action_id: &str,
) -> Result<OperationView, OpsError> {
    let op = find(ledger, tenant, action_id).await?;
    let history = ledger.history(op.id).await?;
    with_links(ledger, OperationView::new(&op, history)).await
}

/// The view with its compensations linked (read beside the row: most actions have none).
pub async fn with_links(
    ledger: &Ledger,
    mut view: OperationView,
) -> Result<OperationView, OpsError> {
    view.compensations = ledger
        .compensations_of(&view.tenant, &view.action_id)
        .await?
        .into_iter()
        .map(|(_, action_id, state)| CompensationLink { action_id, state })
        .collect();
    Ok(view)
}

/// The status query's answer: the result event the operation answers with now (the same shape
/// the agent receives) with its trace, and the detail view under `"operation"` for admin
/// callers. The receipt, in both, is the exact text the downstream sent.
#[derive(Debug, Serialize)]
pub struct StatusAnswer {
    /// The event's members but its receipt, and `trace_id` (with `trace_url` when configured).
    #[serde(flatten)]
    pub event: serde_json::Map<String, serde_json::Value>,
    /// The receipt on `succeeded`, else null (as in the event).
    pub receipt: Option<Document>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub operation: Option<OperationView>,
}

/// The status query (see [`StatusAnswer`]); `with_operation` for admin callers.
pub async fn status(
    ledger: &Ledger,
    tenant: &str,
    action_id: &str,
    with_operation: bool,
) -> Result<StatusAnswer, OpsError> {
    let op = find(ledger, tenant, action_id).await?;
    let mut event = stored_result(&op).event;
    // An original whose compensation succeeded says so, as its agent was told.
    if event.status == protocol::Status::Succeeded {
        event.compensated_by = ledger
            .compensations_of(tenant, action_id)
            .await?
            .into_iter()
            .find(|(_, _, state)| state == "succeeded")
            .map(|(_, by, _)| by);
    }
    let serde_json::Value::Object(mut fields) =
        serde_json::to_value(&event).expect("result events serialize")
    else {
        unreachable!("a result event is a JSON object")
    };
    fields.remove("receipt");
    let receipt = event
        .receipt
        .is_some()
        .then(|| op.receipt.clone())
        .flatten();
    let trace_id = op.trace().map(|t| t.parent.trace_id_hex());
    if let Some(url) = trace_id.as_deref().and_then(trace_url) {
        fields.insert("trace_url".into(), url.into());
    }
    fields.insert("trace_id".into(), trace_id.into());
    let operation = match with_operation {
        true => Some(
            with_links(
                ledger,
                OperationView::new(&op, ledger.history(op.id).await?),
            )
            .await?,
        ),
        false => None,
    };
    Ok(StatusAnswer {
        event: fields,
        receipt,
        operation,
    })
}

/// What the receipt check needs: the stable key and identity (the body is not consulted).
fn receipt_request(op: &Operation) -> Request {
    Request {
        tenant: op.tenant.clone(),
        action_id: op.action_id.clone(),
        tool: op.tool.clone(),
        idempotency_key: op.idempotency_key(),
        body: op.arguments.clone().unwrap_or_default(),
        trace: op.trace(),
        deadline: None,
    }
}

pub(super) fn respond(op: &Operation, history: Vec<HistoryEntry>) -> serde_json::Value {
    OperationView::new(op, history).to_json()
}

/// Maps what the ledger did to the caller's answer.
pub(super) fn answer(
    outcome: OperatorOutcome,
    action: &str,
    allowed: &str,
) -> Result<(ActionResponse, Option<Operation>), OpsError> {
    match outcome {
        OperatorOutcome::Applied {
            operation,
            response,
        } => Ok((
            ActionResponse {
                body: response,
                repeated: false,
            },
            Some(operation),
        )),
        OperatorOutcome::Repeated { response } => Ok((
            ActionResponse {
                body: response,
                repeated: true,
            },
            None,
        )),
        OperatorOutcome::RequestIdReused {
            action: prev,
            operation_id,
        } => Err(OpsError::Conflict {
            message: format!(
                "request_id was already used for {prev} on operation {operation_id}; use a new request_id for a new request"
            ),
            state: None,
        }),
        OperatorOutcome::Refused { current } => Err(OpsError::Conflict {
            message: format!(
                "operation {}/{} is {}; {action} is allowed from {allowed}; nothing was changed",
                current.tenant,
                current.action_id,
                current.state()
            ),
            state: Some(current.state()),
        }),
    }
}

pub(super) fn log_applied(op: &Operation, action: &str, request: &OperatorRequest) {
    crate::telemetry::metrics::transitions(op.state()).increment(1);
    tracing::info!(
        tenant = %op.tenant, action_id = %op.action_id, tool = %op.tool, state = %op.state(),
        operator = %request.operator, request_id = %request.request_id, action,
        "operator action applied"
    );
}

/// Resolves an unresolved operation as `succeeded` with a receipt that passes the tool's
/// receipt match; emits the `succeeded` result event in the same commit.
pub async fn resolve(
    ctx: &Arc<Context>,
    tenant: &str,
    action_id: &str,
    input: ResolveInput,
) -> Result<ActionResponse, OpsError> {
    let operator = name("operator", input.operator, MAX_NAME_CHARS)?;
    let request_id = name("request_id", input.request_id, MAX_REQUEST_ID_CHARS)?;
    let reason = reason_text(input.reason)?;
    let receipt = match input.receipt {
        None => return Err(bad("receipt is required")),
        Some(r) if r.value().is_null() => return Err(bad("receipt is required")),
        Some(r) if r.value().is_object() => r,
        Some(_) => return Err(bad("receipt must be a JSON object")),
    };
    let op = find(&ctx.ledger, tenant, action_id).await?;
    let tool = ctx
        .tools
        .get(&op.tool)
        .ok_or_else(|| OpsError::ToolNotConfigured(op.tool.clone()))?;
    let receipt_id = tool
        .adapter
        .check_receipt(&receipt_request(&op), receipt.value())
        .map_err(OpsError::ReceiptMismatch)?;
    let request = OperatorRequest {
        request_id,
        operator,
        reason,
    };
    let change = OperatorChange::Resolve {
        receipt,
        receipt_id,
    };
    let span = spans::operator(&op, "resolve", &request.operator);
    apply_final(
        ctx,
        op.id,
        &request,
        &change,
        "held, unknown, retry_wait, dispatching or accepted",
    )
    .instrument(span)
    .await
}

/// Marks an unresolved operation `failed` with the operator's written evidence; emits the
/// `failed` result event in the same commit.
pub async fn fail(
    ctx: &Arc<Context>,
    tenant: &str,
    action_id: &str,
    input: FailInput,
) -> Result<ActionResponse, OpsError> {
    let operator = name("operator", input.operator, MAX_NAME_CHARS)?;
    let request_id = name("request_id", input.request_id, MAX_REQUEST_ID_CHARS)?;
    let evidence = evidence_text(input.evidence)?;
    let op = find(&ctx.ledger, tenant, action_id).await?;
    let request = OperatorRequest {
        request_id,
        operator,
        reason: evidence.clone(),
    };
    let change = OperatorChange::Fail { evidence };
    let span = spans::operator(&op, "fail", &request.operator);
    apply_final(
        ctx,
        op.id,
        &request,
        &change,
        "held, retry_wait, or unknown or accepted while no recovery round or poll is running",
    )
    .instrument(span)
    .await
}

/// Applies a resolution that makes the operation final (resolve, fail) and, when it moved,
/// logs it and wakes the relay for its result event.
async fn apply_final(
    ctx: &Arc<Context>,
    operation_id: i64,
    request: &OperatorRequest,
    change: &OperatorChange,
    allowed_states: &str,
) -> Result<ActionResponse, OpsError> {
    let action = change.action();
    let outcome = ctx
        .ledger
        .operator_apply(operation_id, request, change, respond)
        .await?;
    let (response, applied) = answer(outcome, action, allowed_states)?;
    if let Some(op) = applied {
        log_applied(&op, action, request);
        ctx.relay_wake.notify_one();
    }
    Ok(response)
}

/// Asks for a recovery round now: `held` gets exactly one more round (`unknown`, due now),
/// `unknown` becomes due now; then the round runs here through the scheduler's own rules and
/// fences, and the response shows the row after it.
pub async fn recheck(
    ctx: &Arc<Context>,
    tenant: &str,
    action_id: &str,
    input: RecheckInput,
) -> Result<ActionResponse, OpsError> {
    let operator = name("operator", input.operator, MAX_NAME_CHARS)?;
    let request_id = name("request_id", input.request_id, MAX_REQUEST_ID_CHARS)?;
    let reason = reason_text(input.reason)?;
    let op = find(&ctx.ledger, tenant, action_id).await?;
    let tool = ctx
        .tools
        .get(&op.tool)
        .ok_or_else(|| OpsError::ToolNotConfigured(op.tool.clone()))?;
    let held_recovery_attempts = (tool.config.recovery_attempts as i32 - 1).max(0);
    let request = OperatorRequest {
        request_id,
        operator,
        reason,
    };
    let outcome = ctx
        .ledger
        .operator_apply(
            op.id,
            &request,
            &OperatorChange::Recheck {
                held_recovery_attempts,
                poll_deadline_secs: tool
                    .config
                    .completion
                    .contract()
                    .map(|c| c.poll.deadline().as_secs_f64()),
            },
            respond,
        )
        .instrument(spans::operator(&op, "recheck", &request.operator))
        .await?;
    let (response, applied) = answer(
        outcome,
        "recheck",
        "held, or unknown or accepted while no recovery round or poll is running",
    )?;
    let Some(op) = applied else {
        return Ok(response);
    };
    log_applied(&op, "recheck", &request);
    let after = scheduler::recover_now(ctx, op.id)
        .await?
        .ok_or_else(|| OpsError::NotFound {
            tenant: tenant.to_string(),
            action_id: action_id.to_string(),
        })?;
    let history = ctx.ledger.history(after.id).await?;
    let body = OperationView::new(&after, history).to_json();
    ctx.ledger
        .update_operator_response(&request.request_id, &body)
        .await?;
    ctx.relay_wake.notify_one();
    Ok(ActionResponse {
        body,
        repeated: false,
    })
}

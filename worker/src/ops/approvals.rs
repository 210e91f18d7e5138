//! Approving and rejecting an intent that waits for a person (`awaiting_approval`), shared by
//! the HTTP API (approver tokens), the CLI and the console, and the listing of what waits.
//!
//! An approval names the fingerprint of the arguments the approver was shown: the ledger
//! refuses it for any other, so an approval can never cover different arguments. Each is one
//! conditional statement, idempotent by request id, recorded as `operator:<name>`; the same
//! person cannot approve one intent twice. The last approval needed makes the row `prepared`
//! and due: the recovery scheduler (woken here) claims it under a fence and dispatches it once.

use std::sync::Arc;

use metrics::counter;
use serde::{Deserialize, Serialize};

use super::actions::{
    answer, bad, find, log_applied, name, reason_text, respond, ActionResponse, OpsError,
    MAX_NAME_CHARS, MAX_REQUEST_ID_CHARS,
};
use crate::context::Context;
use crate::ledger::{OperatorChange, OperatorOutcome, OperatorRequest, State};
use crate::telemetry::metrics as m;
use crate::telemetry::spans;
use tracing::Instrument as _;

/// Body of an approve or reject request.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionInput {
    /// The fingerprint of the arguments the approver was shown (the operation's `fingerprint`).
    /// Required through the API; the CLI uses the stored one when it is left out.
    pub fingerprint: Option<String>,
    /// Who decides. Through the API it comes from the approver token, never from the body.
    pub operator: Option<String>,
    pub reason: Option<String>,
    pub request_id: Option<String>,
}

/// The longest fingerprint a decision may name.
const MAX_FINGERPRINT_CHARS: usize = 128;

/// Approve or reject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Approve,
    Reject,
}

impl Decision {
    fn as_str(self) -> &'static str {
        match self {
            Decision::Approve => "approve",
            Decision::Reject => "reject",
        }
    }
}

/// Where a fingerprint may come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fingerprint {
    /// The request must carry it (the API, the console).
    Required,
    /// Left out, it is the stored one (the CLI, whose user holds the database's keys anyway).
    StoredWhenAbsent,
}

/// Applies one approval decision on `tenant`/`action_id` (see the module docs).
pub async fn decide(
    ctx: &Arc<Context>,
    tenant: &str,
    action_id: &str,
    decision: Decision,
    input: DecisionInput,
    fingerprint: Fingerprint,
) -> Result<ActionResponse, OpsError> {
    let operator = name("operator", input.operator, MAX_NAME_CHARS)?;
    let request_id = name("request_id", input.request_id, MAX_REQUEST_ID_CHARS)?;
    let reason = reason_text(input.reason)?;
    let op = find(&ctx.ledger, tenant, action_id).await?;
    // A fingerprint is 64 hex characters; anything far from that (or holding a NUL, which
    // Postgres text cannot carry) is refused before the ledger is asked.
    if let Some(f) = &input.fingerprint {
        if f.chars().count() > MAX_FINGERPRINT_CHARS || f.contains('\0') {
            return Err(bad(format!(
                "fingerprint must be at most {MAX_FINGERPRINT_CHARS} characters, without NUL"
            )));
        }
    }
    let fingerprint = match (input.fingerprint.map(|f| f.trim().to_string()), fingerprint) {
        (Some(f), _) if !f.is_empty() => f,
        (_, Fingerprint::StoredWhenAbsent) => op.fingerprint.clone(),
        (_, Fingerprint::Required) => {
            return Err(bad(
                "fingerprint is required: the fingerprint of the arguments you were shown (the operation's `fingerprint`)",
            ))
        }
    };
    let request = OperatorRequest {
        request_id,
        operator,
        reason,
    };
    let change = match decision {
        Decision::Approve => OperatorChange::Approve {
            fingerprint: fingerprint.clone(),
        },
        Decision::Reject => OperatorChange::Reject {
            fingerprint: fingerprint.clone(),
        },
    };
    let action = decision.as_str();
    let outcome = ctx
        .ledger
        .operator_apply(op.id, &request, &change, respond)
        .instrument(spans::operator(&op, action, &request.operator))
        .await?;
    if let OperatorOutcome::Refused { current } = &outcome {
        return Err(refusal(ctx, current, decision, &fingerprint, &request.operator).await?);
    }
    let (response, applied) = answer(outcome, action, "awaiting_approval")?;
    if let Some(op) = applied {
        if op.state() == State::Prepared {
            crate::fault::point("after_approval", &op.action_id);
        }
        log_applied(&op, action, &request);
        let outcome = match op.state() {
            State::Prepared => Some("approved"),
            State::Failed => Some("rejected"),
            _ => None,
        };
        if let Some(outcome) = outcome {
            counter!(m::APPROVALS, "tool" => op.tool.clone(), "outcome" => outcome).increment(1);
        }
        ctx.scheduler_wake.notify_one();
        ctx.relay_wake.notify_one();
    }
    Ok(response)
}

/// Why the ledger refused a decision, in words the approver can act on.
async fn refusal(
    ctx: &Context,
    current: &crate::ledger::Operation,
    decision: Decision,
    fingerprint: &str,
    operator: &str,
) -> Result<OpsError, OpsError> {
    let key = format!("{}/{}", current.tenant, current.action_id);
    let conflict = |message: String| OpsError::Conflict {
        message,
        state: Some(current.state()),
    };
    if current.state() != State::AwaitingApproval {
        return Ok(conflict(format!(
            "operation {key} is {}; {} is allowed only while it is awaiting_approval; nothing was changed",
            current.state(),
            decision.as_str()
        )));
    }
    if current.fingerprint != fingerprint {
        return Ok(conflict(format!(
            "the fingerprint {fingerprint:?} is not that of operation {key}'s arguments ({}): what you were shown is not what would run; nothing was changed",
            current.fingerprint
        )));
    }
    let status = ctx.ledger.approval_status(current.id).await?;
    if let Some(s) = status.filter(|s| s.approved_by.iter().any(|a| a == operator)) {
        return Ok(conflict(format!(
            "{operator} already approved operation {key}; it needs {} approvals from different people ({} so far); nothing was changed",
            s.needed,
            s.approved_by.len()
        )));
    }
    Ok(conflict(format!(
        "the wait for approval of operation {key} has ended; it fails without being sent; nothing was changed"
    )))
}

/// One intent waiting for approval, as approvers and its tenant see it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AwaitingView {
    pub tenant: String,
    pub action_id: String,
    pub tool: String,
    /// What an approval must name.
    pub fingerprint: String,
    /// The exact arguments that run once approved.
    pub arguments: Option<serde_json::Value>,
    pub approvals_needed: i16,
    pub approved_by: Vec<String>,
    /// The agent's call id, when it gave one (who asked).
    pub call_id: Option<String>,
    pub created_at: chrono::DateTime<chrono::Utc>,
    /// When the wait ends (the intent then fails, never sent).
    pub expires_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// Default and largest page of [`awaiting`].
pub const AWAITING_LIMIT: i64 = 100;
pub const MAX_AWAITING_LIMIT: i64 = 500;

/// The intents waiting for approval (of `tenant`, or all), the wait ending soonest first.
pub async fn awaiting(
    ctx: &Context,
    tenant: Option<&str>,
    limit: Option<i64>,
) -> Result<Vec<AwaitingView>, OpsError> {
    let limit = limit.unwrap_or(AWAITING_LIMIT);
    if !(1..=MAX_AWAITING_LIMIT).contains(&limit) {
        return Err(bad(format!(
            "limit must be between 1 and {MAX_AWAITING_LIMIT}"
        )));
    }
    if tenant.is_some_and(|t| t.contains('\0')) {
        return Err(bad("tenant must not contain NUL characters"));
    }
    let rows = ctx.ledger.awaiting(tenant, limit).await?;
    Ok(rows
        .into_iter()
        .map(|r| AwaitingView {
            arguments: r.arguments.as_deref().map(|a| {
                serde_json::from_str(a).unwrap_or_else(|_| serde_json::Value::String(a.into()))
            }),
            tenant: r.tenant,
            action_id: r.action_id,
            tool: r.tool,
            fingerprint: r.fingerprint,
            approvals_needed: r.needed,
            approved_by: r.approved_by,
            call_id: r.call_id,
            created_at: r.created_at,
            expires_at: r.expires_at,
        })
        .collect())
}

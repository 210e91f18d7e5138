//! The result event the worker sends back to the agent (docs/design.md section 7): one per
//! state the agent must know, re-emitted when a later resolution changes it. Decoding is
//! lenient (unknown fields are ignored) so the contract can grow without breaking
//! agents that read older events.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What the agent should believe about the action.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Done; the receipt is the downstream's original proof.
    Succeeded,
    /// Outcome unknown; the agent must not resubmit and should check status later.
    Pending,
    /// The downstream proved it did not and will not apply it; evidence in `message`.
    Failed,
    /// Refused before any dispatch; see `reason` and `detail`.
    Rejected,
}

impl Status {
    /// The wire spelling, e.g. `"pending"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Status::Succeeded => "succeeded",
            Status::Pending => "pending",
            Status::Failed => "failed",
            Status::Rejected => "rejected",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an intent was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectReason {
    /// The key is already recorded with a different fingerprint.
    IntentConflict,
    /// The body broke the wire contract; `detail` holds the [`crate::DecodeError`] code.
    InvalidMessage,
    /// No adapter is configured for the tool.
    UnknownTool,
    /// The tenant in the body is not the one the transport proved.
    TenantMismatch,
    /// The action already finished and its details were removed by retention; only a
    /// tombstone (key, fingerprint, final state in `detail`) remains. It will not run again.
    Expired,
    /// A compensation whose original is not settled (`unknown`, `held`, `accepted`, ...; its
    /// state in `detail`): undoing it now could make a second unintended effect. Reconcile it
    /// first.
    OriginalUnresolved,
    /// A compensation whose original `failed`: nothing was applied, nothing to undo.
    OriginalNotApplied,
    /// A compensation naming an action this tenant does not have.
    OriginalNotFound,
    /// The original already has a compensation that may have been or will be applied (its
    /// action_id in `detail`).
    AlreadyCompensated,
    /// The tool may not compensate that action: it does not list the original's tool in
    /// `compensation_for`, or the intent names itself.
    CompensationNotAllowed,
}

impl RejectReason {
    /// The wire spelling, e.g. `"intent_conflict"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            RejectReason::IntentConflict => "intent_conflict",
            RejectReason::InvalidMessage => "invalid_message",
            RejectReason::UnknownTool => "unknown_tool",
            RejectReason::TenantMismatch => "tenant_mismatch",
            RejectReason::Expired => "expired",
            RejectReason::OriginalUnresolved => "original_unresolved",
            RejectReason::OriginalNotApplied => "original_not_applied",
            RejectReason::OriginalNotFound => "original_not_found",
            RejectReason::AlreadyCompensated => "already_compensated",
            RejectReason::CompensationNotAllowed => "compensation_not_allowed",
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How an answer is known: which call or person established it (a result event's
/// `verified_by`, on `succeeded` and `failed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VerifiedBy {
    /// The downstream's answer to the first write (or a retry proven needed).
    Dispatch,
    /// The answer to a replay of the original request under the same key.
    Replay,
    /// A lookup of the operation by its key.
    Lookup,
    /// A poll of a long-running operation's status URL.
    Poll,
    /// A signed completion callback the downstream sent.
    Callback,
    /// The answer to a write whose lease had run out, arriving after the row moved on.
    LateReceipt,
    /// A person, through the operator actions (`operator` names them).
    Operator,
    /// The worker's own record: the intent waited for approval past its time and was never
    /// sent.
    Expiry,
    /// A source this version does not know (a newer worker's).
    #[serde(other)]
    Other,
}

impl VerifiedBy {
    /// The wire spelling, e.g. `"poll"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            VerifiedBy::Dispatch => "dispatch",
            VerifiedBy::Replay => "replay",
            VerifiedBy::Lookup => "lookup",
            VerifiedBy::Poll => "poll",
            VerifiedBy::Callback => "callback",
            VerifiedBy::LateReceipt => "late_receipt",
            VerifiedBy::Operator => "operator",
            VerifiedBy::Expiry => "expiry",
            VerifiedBy::Other => "other",
        }
    }
}

/// What remains uncertain about a `pending` action, and so what the agent may expect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Uncertainty {
    /// The write may or may not have happened; the worker recovers it as the tool allows.
    UnknownOutcome,
    /// Nothing is in doubt yet: the write is on its way, waits for a retry proven safe, or
    /// was accepted by the downstream and is being polled until it is done.
    InProgress,
    /// Recovery cannot proceed automatically: a person must decide.
    Held,
    /// The tool asks a person to approve this exact intent first: nothing was sent, and
    /// nothing will be unless it is approved before its wait ends.
    AwaitingApproval,
    /// A kind this version does not know (a newer worker's).
    #[serde(other)]
    Other,
}

impl Uncertainty {
    /// The wire spelling, e.g. `"in_progress"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Uncertainty::UnknownOutcome => "unknown_outcome",
            Uncertainty::InProgress => "in_progress",
            Uncertainty::Held => "held",
            Uncertainty::AwaitingApproval => "awaiting_approval",
            Uncertainty::Other => "other",
        }
    }
}

/// One result event, routed to the agent by tenant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultEvent {
    /// The tenant of the action (also the routing key).
    pub tenant: String,
    /// The action key within the tenant.
    pub action_id: String,
    /// The tool of the action.
    pub tool: String,
    /// What the agent should believe.
    pub status: Status,
    /// The downstream's receipt; always written, as `null` when there is none, so
    /// agents can rely on the field being present.
    pub receipt: Option<Value>,
    /// What the agent should do next: `"check_status"` for `pending`, otherwise `null`.
    pub next_action: Option<String>,
    /// Dispatch attempts so far.
    pub attempts: u32,
    /// A sentence for the agent (and the model) to read.
    pub message: String,
    /// The intent fingerprint; `null` when the message could not be fingerprinted.
    pub fingerprint: Option<String>,
    /// Why it was rejected; only present on `rejected`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<RejectReason>,
    /// Machine detail: for `rejected`, e.g. a [`crate::DecodeError::code`]; for a `failed` that
    /// was never sent because its approval did not come, `not_approved` or `approval_expired`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// How the answer is known; on `succeeded` and `failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verified_by: Option<VerifiedBy>,
    /// The operator who settled the action, when `verified_by` is `operator`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator: Option<String>,
    /// The downstream's identifier: the receipt id on `succeeded`, the downstream's operation
    /// id once it accepted a long-running write.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_id: Option<String>,
    /// What remains uncertain; on `pending`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uncertainty: Option<Uncertainty>,
    /// On `pending`: when the worker looks again (its next poll or recovery round), in
    /// milliseconds from `occurred_at`; absent while nothing is scheduled (a person decides).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// On every event about a compensation: the action_id of the original it undoes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensates: Option<String>,
    /// On the `succeeded` event about an original sent when its compensation succeeded: the
    /// compensation's action_id. The original keeps its state and receipt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensated_by: Option<String>,
    /// Unique per event, so agents can drop redelivered copies.
    pub event_id: String,
    /// When the state was reached, RFC 3339.
    pub occurred_at: String,
}

/// The word that separates a tenant from a `reply_to` in a result routing key. It can never
/// be a word of a tenant (tenants allow only letters, digits, `-`, `_` and `.`), so a binding
/// for tenant `a` can never match a key of tenant `a.b`.
pub const REPLY_WORD: &str = "@";

/// The routing key of a result event on the results topic exchange: `<tenant>` for an intent
/// without `reply_to`, `<tenant>.@.<reply_to>` for one with it. One agent binds
/// `<tenant>.@.<its reply_to>`; a tenant-wide observer binds `<tenant>` and `<tenant>.@.#`.
///
/// An AMQP routing key is at most [`MAX_ROUTING_KEY_BYTES`] bytes, while `tenant` and
/// `reply_to` may each be 200 characters: when the combined key would not fit, the event is
/// routed `<tenant>` (tenant-wide), and an agent binding with this same function binds that.
pub fn result_routing_key(tenant: &str, reply_to: Option<&str>) -> String {
    match reply_to {
        Some(reply_to)
            if tenant.len() + REPLY_WORD.len() + reply_to.len() + 2 <= MAX_ROUTING_KEY_BYTES =>
        {
            format!("{tenant}.{REPLY_WORD}.{reply_to}")
        }
        _ => tenant.to_string(),
    }
}

/// The longest AMQP routing key (a short string), in bytes.
pub const MAX_ROUTING_KEY_BYTES: usize = 255;

/// The binding keys that receive every result event of `tenant`, whatever its `reply_to`.
pub fn tenant_binding_keys(tenant: &str) -> [String; 2] {
    [tenant.to_string(), format!("{tenant}.{REPLY_WORD}.#")]
}

#[cfg(test)]
mod routing_tests {
    use super::*;

    #[test]
    fn routing_keys_keep_tenants_apart() {
        assert_eq!(result_routing_key("north.shop", None), "north.shop");
        assert_eq!(
            result_routing_key("north.shop", Some("agent-7")),
            "north.shop.@.agent-7"
        );
        // Tenant "a"'s wide binding "a.@.#" needs "@" as the second word; tenant "a.b" has "b".
        assert_eq!(result_routing_key("a.b", Some("c")), "a.b.@.c");
        assert_eq!(tenant_binding_keys("a")[1], "a.@.#");
    }

    #[test]
    fn a_key_that_would_not_fit_an_amqp_short_string_falls_back_to_the_tenant() {
        let tenant = "t".repeat(200);
        let fits = "r".repeat(52);
        assert_eq!(result_routing_key(&tenant, Some(&fits)).len(), 255);
        let too_long = "r".repeat(53);
        assert_eq!(result_routing_key(&tenant, Some(&too_long)), tenant);
    }
}

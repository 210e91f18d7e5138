//! Completion callbacks: a long-running tool's downstream telling the worker that an operation
//! ended (`POST /v1/callbacks/{tool}` on the admin listener), as well as being polled.
//!
//! A callback is the downstream's own word, so it is believed only when signed with the tool's
//! secret ([`crate::config::Callback`]): `t=<unix seconds>,v1=<hex HMAC-SHA256 of
//! "<t>.<raw body>">` in the tool's signature header, the time within the tolerance of this
//! worker's clock (so a captured callback cannot be replayed later), compared in constant
//! time. Wrong signatures draw on the listener's failure budget like wrong tokens. The body is
//! a status document like a poll's answer: the operation is found by the operation id in it
//! (the contract's `operation_id`) or by its idempotency key (the callback's `key`), and the
//! document goes to the same decision as a poll's answer
//! ([`crate::adapter::ToolAdapter::judge_status`]):
//! done with this operation's receipt, the downstream's documented failure, or nothing proven.
//! A verdict takes the receipt path ([`crate::ledger::Phase::Proof`]): it settles an accepted,
//! unknown or held row, whoever holds it, once; for a final row it is answered as a late
//! receipt is (the same document: nothing to do; another: a conflict, nothing stored).
//! Replaying a signed callback within its window changes nothing a first delivery did not.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::HeaderMap;
use metrics::counter;
use serde::Serialize;

use crate::adapter::status;
use crate::config::Callback;
use crate::context::Context;
use crate::dispatch;
use crate::document::Document;
use crate::ledger::{Applied, LedgerError, Operation, Phase, Source, State, Transition};
use crate::outcome::Polled;
use crate::telemetry::metrics as m;

/// Why a callback was refused (nothing changed), each with its HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum CallbackError {
    #[error("tool {0} takes no completion callbacks")]
    NoCallback(String),
    #[error("a callback body of tool {tool} is at most {max} bytes")]
    TooLarge { tool: String, max: usize },
    #[error("the signature header {0} is missing")]
    MissingSignature(String),
    #[error("the signature header {header} is malformed: {why} (expected t=<unix seconds>,v1=<hex HMAC-SHA256>)")]
    MalformedSignature { header: String, why: &'static str },
    #[error("the signed time {signed_at} is {off_secs} s from this worker's clock; callbacks are taken within {tolerance_secs} s")]
    OutsideWindow {
        signed_at: i64,
        off_secs: u64,
        tolerance_secs: u64,
    },
    #[error("the signature does not match the body with tool {0}'s secret")]
    BadSignature(String),
    #[error("the body is not JSON: {0}")]
    NotJson(String),
    #[error("the document names no operation: no operation id at {operation_id}{key}")]
    NamesNothing { operation_id: String, key: String },
    #[error("no operation of tool {tool} with {what}")]
    NotFound { tool: String, what: String },
    #[error("the document names two operations: {0}")]
    TwoOperations(String),
    #[error("the document does not prove this operation's outcome: {0}")]
    Unproven(String),
    #[error(
        "the operation is already {state}{detail}; this document says otherwise, nothing changed"
    )]
    Conflict { state: String, detail: String },
    #[error("the operation is {0}, which a callback does not settle (it was not sent yet); nothing changed")]
    NotSettleable(String),
    #[error("the operation is final and its details were removed by retention")]
    Swept,
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

impl CallbackError {
    /// The HTTP status the listener answers with.
    pub fn status(&self) -> u16 {
        match self {
            CallbackError::NoCallback(_) | CallbackError::NotFound { .. } => 404,
            CallbackError::MissingSignature(_)
            | CallbackError::MalformedSignature { .. }
            | CallbackError::OutsideWindow { .. }
            | CallbackError::BadSignature(_) => 401,
            CallbackError::NotJson(_) => 400,
            CallbackError::TooLarge { .. } => 413,
            CallbackError::NamesNothing { .. } | CallbackError::Unproven(_) => 422,
            CallbackError::TwoOperations(_) | CallbackError::Conflict { .. } => 409,
            CallbackError::Swept | CallbackError::NotSettleable(_) => 409,
            CallbackError::Ledger(_) => 503,
        }
    }

    /// The error code of the JSON answer.
    pub fn code(&self) -> &'static str {
        match self {
            CallbackError::NoCallback(_) | CallbackError::NotFound { .. } => "not_found",
            CallbackError::MissingSignature(_)
            | CallbackError::MalformedSignature { .. }
            | CallbackError::OutsideWindow { .. }
            | CallbackError::BadSignature(_) => "bad_signature",
            CallbackError::NotJson(_) => "bad_request",
            CallbackError::TooLarge { .. } => "payload_too_large",
            CallbackError::NamesNothing { .. } => "no_operation",
            CallbackError::Unproven(_) => "unproven",
            CallbackError::TwoOperations(_) | CallbackError::Conflict { .. } => "conflict",
            CallbackError::Swept | CallbackError::NotSettleable(_) => "conflict",
            CallbackError::Ledger(_) => "unavailable",
        }
    }

    /// The `outcome` label of `intent_worker_callbacks_total`.
    fn label(&self) -> &'static str {
        match self.status() {
            401 => "refused",
            404 => "not_found",
            409 => "conflict",
            413 => "too_large",
            422 => "unproven",
            503 => "ledger_error",
            _ => "bad_request",
        }
    }
}

/// What a callback that was taken did.
#[derive(Debug, Serialize)]
pub struct CallbackAnswer {
    /// `settled` (the row moved), `already_final` (it had, with this outcome), or
    /// `in_progress` (the document says the operation runs on: nothing changed).
    pub outcome: &'static str,
    pub tenant: String,
    pub action_id: String,
    /// The operation's state after the callback.
    pub state: String,
}

/// The tool's callback settings, or why there are none.
pub fn settings<'a>(ctx: &'a Context, tool: &str) -> Result<&'a Callback, CallbackError> {
    ctx.tools
        .get(tool)
        .and_then(|t| t.config.completion.contract())
        .and_then(|c| c.callback.as_ref())
        .ok_or_else(|| CallbackError::NoCallback(tool.to_string()))
}

/// Checks the signature of `body` in `headers` with `callback`'s secret at `now`.
pub fn verify(
    tool: &str,
    callback: &Callback,
    headers: &HeaderMap,
    body: &[u8],
    now: SystemTime,
) -> Result<(), CallbackError> {
    let header = &callback.signature_header;
    let malformed = |why| CallbackError::MalformedSignature {
        header: header.clone(),
        why,
    };
    let value = headers
        .get(header.as_str())
        .ok_or_else(|| CallbackError::MissingSignature(header.clone()))?
        .to_str()
        .map_err(|_| malformed("not visible ASCII"))?;
    let mut signed_at = None;
    let mut macs = Vec::new();
    for part in value.split(',').map(str::trim) {
        if let Some(t) = part.strip_prefix("t=") {
            let t: i64 = t
                .parse()
                .map_err(|_| malformed("t is not a whole number"))?;
            signed_at = Some(t);
        } else if let Some(v1) = part.strip_prefix("v1=") {
            macs.push(unhex32(v1).ok_or_else(|| malformed("v1 is not 64 hex digits"))?);
        }
    }
    let signed_at = signed_at.ok_or_else(|| malformed("no t="))?;
    if macs.is_empty() {
        return Err(malformed("no v1="));
    }
    let now = now
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs() as i64;
    let off_secs = now.abs_diff(signed_at);
    if off_secs > callback.tolerance.as_secs() {
        return Err(CallbackError::OutsideWindow {
            signed_at,
            off_secs,
            tolerance_secs: callback.tolerance.as_secs(),
        });
    }
    let mut signed = format!("{signed_at}.").into_bytes();
    signed.extend_from_slice(body);
    let want = kit::secret::hmac_sha256(callback.secret.as_bytes(), &signed);
    // Every candidate compared in full: no early exit tells which one was close.
    let matched = macs
        .iter()
        .fold(false, |any, mac| kit::secret::digests_eq(mac, &want) | any);
    if matched {
        Ok(())
    } else {
        Err(CallbackError::BadSignature(tool.to_string()))
    }
}

fn unhex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Takes a callback whose signature was verified: finds its operation, decides what the
/// document proves and records it. Counted by outcome.
pub async fn receive(
    ctx: &Context,
    tool: &str,
    body: &[u8],
) -> Result<CallbackAnswer, CallbackError> {
    let answer = take(ctx, tool, body).await;
    let outcome = match &answer {
        Ok(a) => a.outcome,
        Err(e) => e.label(),
    };
    counter!(m::CALLBACKS, "tool" => tool.to_string(), "outcome" => outcome).increment(1);
    answer
}

/// Counts a callback refused before it was read (its signature, its size).
pub fn refused(tool: &str, error: &CallbackError) {
    if settings_known(error) {
        counter!(m::CALLBACKS, "tool" => tool.to_string(), "outcome" => error.label()).increment(1);
    }
}

/// Counts a callback not compared because the failure budget is spent.
pub fn throttled(tool: &str) {
    counter!(m::CALLBACKS, "tool" => tool.to_string(), "outcome" => "throttled").increment(1);
}

/// Whether the refusal concerns a tool that takes callbacks (an unknown tool's name is not
/// made a metric label).
fn settings_known(error: &CallbackError) -> bool {
    !matches!(error, CallbackError::NoCallback(_))
}

async fn take(ctx: &Context, tool: &str, body: &[u8]) -> Result<CallbackAnswer, CallbackError> {
    let callback = settings(ctx, tool)?;
    let contract = ctx
        .tools
        .get(tool)
        .and_then(|t| t.config.completion.contract())
        .ok_or_else(|| CallbackError::NoCallback(tool.to_string()))?;
    let document = Document::parse(body).map_err(|e| CallbackError::NotJson(e.to_string()))?;
    let judge = status::Contract::new(contract);
    let op = find(ctx, tool, callback, &judge, &document).await?;
    let Some(request) = dispatch::request_for(&op) else {
        return Err(CallbackError::Swept);
    };
    let adapter = &ctx.tools.get(tool).expect("found above").adapter;
    let transition = match adapter.judge_status(&request, op.remote_id.as_deref(), document) {
        Polled::Done {
            receipt,
            receipt_id,
        } => Transition::Succeeded {
            evidence: format!("receipt {receipt_id} from a completion callback"),
            receipt,
            receipt_id,
        },
        Polled::Failed { evidence } => Transition::Failed {
            evidence: format!("the downstream's completion callback says failed: {evidence}"),
        },
        Polled::Running { .. } => {
            return Ok(answer(&op, "in_progress"));
        }
        Polled::Unproven { evidence } | Polled::LocalExhaustion { evidence } => {
            return Err(CallbackError::Unproven(evidence))
        }
    };
    let failing = matches!(transition, Transition::Failed { .. });
    match dispatch::settle(ctx, &op, Phase::Proof, transition, Source::Callback).await? {
        Applied::Done(new) => Ok(answer(&new, "settled")),
        Applied::LateReceiptMatches(current) => Ok(answer(&current, "already_final")),
        Applied::LateReceiptConflict(current) => Err(conflict(&current)),
        Applied::Stale(Some(current)) if failing && current.state() == State::Failed => {
            Ok(answer(&current, "already_final"))
        }
        Applied::Stale(current) => Err(conflict(current.as_ref().unwrap_or(&op))),
    }
}

fn answer(op: &Operation, outcome: &'static str) -> CallbackAnswer {
    CallbackAnswer {
        outcome,
        tenant: op.tenant.clone(),
        action_id: op.action_id.clone(),
        state: op.state().as_str().to_string(),
    }
}

fn conflict(op: &Operation) -> CallbackError {
    let state = op.state();
    if !state.is_final() {
        return CallbackError::NotSettleable(state.as_str().to_string());
    }
    CallbackError::Conflict {
        state: state.as_str().to_string(),
        detail: op
            .receipt_id
            .as_deref()
            .map(|id| format!(" with receipt {id}"))
            .unwrap_or_default(),
    }
}

/// The operation the document names: by its operation id among the tool's accepted ones, or
/// by its idempotency key; both must name the same one when both are given.
async fn find(
    ctx: &Context,
    tool: &str,
    callback: &Callback,
    judge: &status::Contract,
    document: &Document,
) -> Result<Operation, CallbackError> {
    let remote_id = judge.operation_id(document.value());
    let key = callback
        .key
        .as_deref()
        .and_then(|p| document.value().pointer(p))
        .and_then(|v| v.as_str())
        .map(str::to_string);
    if remote_id.is_none() && key.is_none() {
        return Err(CallbackError::NamesNothing {
            operation_id: judge.operation_id.to_string(),
            key: callback
                .key
                .as_deref()
                .map(|k| format!(", no key at {k}"))
                .unwrap_or_default(),
        });
    }
    let by_id = match &remote_id {
        Some(id) => {
            let mut found = ctx.ledger.find_remote(tool, id).await?;
            if found.len() > 1 {
                return Err(CallbackError::TwoOperations(format!(
                    "operation id {id} was accepted for two actions"
                )));
            }
            found.pop()
        }
        None => None,
    };
    let by_key = match key.as_deref().and_then(|k| k.split_once(':')) {
        Some((tenant, action_id)) => ctx
            .ledger
            .find(tenant, action_id)
            .await?
            // Another tool's operation is indistinguishable from a missing one.
            .filter(|op| op.tool == tool),
        None => None,
    };
    match (by_id, by_key) {
        (Some(a), Some(b)) if a.id != b.id => Err(CallbackError::TwoOperations(format!(
            "operation id {} is {}/{}, key {} is another action",
            remote_id.unwrap_or_default(),
            kit::text::visible(&a.tenant),
            kit::text::visible(&a.action_id),
            kit::text::visible(key.as_deref().unwrap_or_default()),
        ))),
        (Some(a), _) => Ok(a),
        (None, Some(b)) => match (&b.remote_id, &remote_id) {
            // The key's action was accepted as another operation than the document's.
            (Some(recorded), Some(named)) if recorded != named => {
                Err(CallbackError::TwoOperations(format!(
                    "key {} was accepted as operation {recorded}, the document names {named}",
                    kit::text::visible(key.as_deref().unwrap_or_default()),
                )))
            }
            _ => Ok(b),
        },
        (None, None) => Err(CallbackError::NotFound {
            tool: tool.to_string(),
            what: match (&remote_id, &key) {
                (Some(id), Some(k)) => format!(
                    "operation id {} or key {}",
                    kit::text::visible(id),
                    kit::text::visible(k)
                ),
                (Some(id), None) => format!("operation id {}", kit::text::visible(id)),
                (None, Some(k)) => format!("key {}", kit::text::visible(k)),
                (None, None) => unreachable!("refused above"),
            },
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn callback() -> Callback {
        Callback {
            secret: "0123456789abcdef-secret".into(),
            signature_header: "x-signature".into(),
            tolerance: Duration::from_secs(300),
            max_body_bytes: 1024,
            key: None,
        }
    }

    fn signed(secret: &str, t: i64, body: &[u8]) -> String {
        let mut m = format!("{t}.").into_bytes();
        m.extend_from_slice(body);
        let mac = kit::secret::hmac_sha256(secret.as_bytes(), &m);
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        format!("t={t},v1={hex}")
    }

    fn headers(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("x-signature", value.parse().unwrap());
        h
    }

    #[test]
    fn a_signature_is_checked_against_the_body_the_secret_and_the_clock() {
        let cb = callback();
        let body = br#"{"operation_id":"op-1","state":"succeeded"}"#;
        let now = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let t = 1_800_000_000;
        let ok = signed("0123456789abcdef-secret", t, body);
        assert!(verify("deploy", &cb, &headers(&ok), body, now).is_ok());
        // Another candidate beside it (a secret being rotated) does not hurt.
        let two = format!("{ok},v1={}", "0".repeat(64));
        assert!(verify("deploy", &cb, &headers(&two), body, now).is_ok());
        let refused = |h: HeaderMap, body: &[u8], now| {
            let e = verify("deploy", &cb, &h, body, now).unwrap_err();
            assert_eq!(e.status(), 401, "{e}");
            e.to_string()
        };
        // Another body, another secret, an old or future time, a mangled header, none.
        assert!(refused(headers(&ok), br#"{"state":"failed"}"#, now).contains("does not match"));
        let other = signed("another-tool-secret-0123", t, body);
        assert!(refused(headers(&other), body, now).contains("does not match"));
        let old = signed("0123456789abcdef-secret", t - 301, body);
        assert!(refused(headers(&old), body, now).contains("301 s from"));
        let future = signed("0123456789abcdef-secret", t + 301, body);
        assert!(refused(headers(&future), body, now).contains("within 300 s"));
        assert!(refused(headers("v1=00"), body, now).contains("64 hex"));
        assert!(refused(headers(&format!("t={t}")), body, now).contains("no v1="));
        assert!(refused(headers("t=x,v1=00"), body, now).contains("whole number"));
        assert!(refused(HeaderMap::new(), body, now).contains("missing"));
    }
}

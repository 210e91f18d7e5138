//! The consumer step for one batch of deliveries, independent of the broker: decode and
//! validate, admit into the ledger (the inbox), claim new operations for dispatch, and answer
//! duplicates, conflicts and bad messages through the result outbox. The AMQP layer dead-letters
//! what this step says, acks only after it returns, and starts the dispatches.

use std::collections::HashMap;
use std::time::Duration;

use metrics::counter;
use protocol::{RejectReason, Status};

use crate::config::TenantAuth;
use crate::context::Context;
use crate::fault;
use crate::ledger::outbox::{self, NewEvent};
use crate::ledger::{LedgerError, NewOperation, Operation, State};
use crate::telemetry::metrics as m;

/// One delivery as the intake step needs it.
#[derive(Debug, Clone)]
pub struct Incoming {
    pub body: Vec<u8>,
    /// The broker says it delivered this message before (a consumer died without acking).
    pub redelivered: bool,
    /// The broker-validated AMQP `user_id` property, if the publisher set one.
    pub user_id: Option<String>,
}

/// A delivery to copy to the dead-letter exchange before acking.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetter {
    /// Index into the batch.
    pub index: usize,
    /// Stable reason code (e.g. `invalid_message`, `unknown_tool`, `tenant_mismatch`).
    pub reason: &'static str,
    /// Human-readable detail.
    pub detail: String,
}

/// What the AMQP layer must do after the step: dead-letter these, then ack the whole batch,
/// then dispatch the claimed operations.
#[derive(Debug, Default)]
pub struct StepOutcome {
    pub dead_letters: Vec<DeadLetter>,
    pub claimed: Vec<Operation>,
    /// Result events committed (rejections and answers to duplicates).
    pub answered: usize,
}

/// An intent that passed validation, with where it came from.
struct Valid {
    redelivered: bool,
    new: NewOperation,
}

/// Processes one batch. On a ledger error nothing was acked and the caller retries the same
/// batch later; every write here is idempotent under retry (the inbox dedupes).
pub async fn step(
    ctx: &Context,
    auth: &TenantAuth,
    prepared_grace: Duration,
    batch: &[Incoming],
) -> Result<StepOutcome, LedgerError> {
    let mut out = StepOutcome::default();
    let mut events: Vec<NewEvent> = Vec::new();
    let mut valid: Vec<Valid> = Vec::new();

    for (index, incoming) in batch.iter().enumerate() {
        let intent = match protocol::decode_intent(&incoming.body) {
            Ok(intent) => intent,
            Err(e) => {
                if let Some((tenant, action_id)) = protocol::salvage_key(&incoming.body) {
                    events.push(outbox::rejected_event(
                        &tenant,
                        &action_id,
                        "",
                        RejectReason::InvalidMessage,
                        Some(e.code().to_string()),
                        format!("The intent was rejected before any action: {e}."),
                        None,
                    ));
                    counter!(m::REJECTED, "reason" => "invalid_message").increment(1);
                }
                out.dead_letters.push(DeadLetter {
                    index,
                    reason: "invalid_message",
                    detail: format!("{}: {e}", e.code()),
                });
                continue;
            }
        };
        fault::point("crash_on_intake", &intent.action_id);
        if !auth.allows(incoming.user_id.as_deref(), &intent.tenant) {
            // The claimed tenant is not proven: no result goes to it (that would let one tenant
            // address another); the message is kept in the dead-letter queue.
            out.dead_letters.push(DeadLetter {
                index,
                reason: "tenant_mismatch",
                detail: format!(
                    "publisher user {:?} may not act for tenant {:?}",
                    incoming.user_id.as_deref().unwrap_or(""),
                    intent.tenant
                ),
            });
            continue;
        }
        let fingerprint = intent.fingerprint();
        if ctx.tools.get(&intent.tool).is_none() {
            let mut event = outbox::rejected_event(
                &intent.tenant,
                &intent.action_id,
                &intent.tool,
                RejectReason::UnknownTool,
                None,
                format!(
                    "The tool {:?} is not configured on this worker pool; nothing was done.",
                    intent.tool
                ),
                Some(fingerprint),
            );
            event.reply_to = intent.reply_to.clone();
            events.push(event);
            counter!(m::REJECTED, "reason" => "unknown_tool").increment(1);
            out.dead_letters.push(DeadLetter {
                index,
                reason: "unknown_tool",
                detail: format!("unknown tool {:?}", intent.tool),
            });
            continue;
        }
        valid.push(Valid {
            redelivered: incoming.redelivered,
            new: NewOperation {
                arguments: intent.canonical_arguments(),
                tenant: intent.tenant,
                action_id: intent.action_id,
                tool: intent.tool,
                fingerprint,
                call_id: intent.call_id,
                reply_to: intent.reply_to,
            },
        });
    }

    // Fold duplicates inside the batch: the first of a key is admitted, the rest answer after.
    let mut first_of: HashMap<(String, String), usize> = HashMap::new();
    let mut unique: Vec<&Valid> = Vec::new();
    let mut later: Vec<(&Valid, usize)> = Vec::new();
    for v in &valid {
        let key = (v.new.tenant.clone(), v.new.action_id.clone());
        match first_of.get(&key) {
            Some(&u) => later.push((v, u)),
            None => {
                first_of.insert(key, unique.len());
                unique.push(v);
            }
        }
    }
    let admitted = ctx
        .ledger
        .admit(
            &unique.iter().map(|v| v.new.clone()).collect::<Vec<_>>(),
            &ctx.worker_id,
            prepared_grace,
        )
        .await?;
    if let Some(a) = admitted.iter().find(|a| a.inserted) {
        fault::point("after_prepared", &a.operation.action_id);
    }

    let mut to_claim = Vec::new();
    // Per unique intent: Some(op) when it must be answered from the stored row.
    let mut answer_from: Vec<Option<&Operation>> = vec![None; unique.len()];
    for (u, (v, a)) in unique.iter().zip(&admitted).enumerate() {
        let op = &a.operation;
        if op.fingerprint != v.new.fingerprint {
            events.push(conflict_event(&v.new, op));
            duplicate("conflict");
        } else if op.state() == State::Prepared {
            to_claim.push(op.id);
        } else {
            duplicate(reason(v.redelivered, op));
            answer_from[u] = Some(op);
        }
    }
    let (claimed, answered) = ctx
        .ledger
        .claim_and_answer(
            &to_claim,
            &ctx.worker_id,
            ctx.lease,
            &ctx.windows,
            |claimed| {
                let claimed_ids: Vec<i64> = claimed.iter().map(|o| o.id).collect();
                for (u, a) in admitted.iter().enumerate() {
                    let op = &a.operation;
                    if to_claim.contains(&op.id) && !claimed_ids.contains(&op.id) {
                        // A prepared row someone else claimed first: it is in flight.
                        duplicate(reason(unique[u].redelivered, op));
                        events.push(answer_to(
                            outbox::operation_event(
                                op,
                                Status::Pending,
                                outbox::pending_message(op),
                            ),
                            &unique[u].new,
                        ));
                    } else if let Some(op) = answer_from[u] {
                        events.push(answer_to(outbox::stored_result(op), &unique[u].new));
                    }
                }
                for (v, u) in later {
                    let first = &admitted[u].operation;
                    if first.fingerprint != v.new.fingerprint {
                        events.push(conflict_event(&v.new, first));
                        duplicate("conflict");
                    } else {
                        let current = claimed.iter().find(|c| c.id == first.id).unwrap_or(first);
                        duplicate(reason(v.redelivered, current));
                        events.push(answer_to(outbox::stored_result(current), &v.new));
                    }
                }
                events
            },
        )
        .await?;
    out.answered = answered;
    if let Some(op) = claimed.first() {
        fault::point("after_dispatching", &op.action_id);
    }
    out.claimed = claimed;
    Ok(out)
}

fn duplicate(reason: &'static str) {
    counter!(m::DUPLICATES, "reason" => reason).increment(1);
}

/// Why a known key was not dispatched again.
fn reason(redelivered: bool, op: &Operation) -> &'static str {
    if redelivered {
        "redelivery"
    } else if op.state().is_final() {
        "completed"
    } else {
        "in_flight"
    }
}

/// A duplicate's answer goes to the `reply_to` of the delivery that caused it, not the stored one.
fn answer_to(mut event: NewEvent, delivery: &NewOperation) -> NewEvent {
    event.reply_to = delivery.reply_to.clone();
    event
}

/// Same key, other intent: rejected before any network activity; the stored result is never
/// returned for it.
fn conflict_event(new: &NewOperation, _stored: &Operation) -> NewEvent {
    counter!(m::REJECTED, "reason" => "intent_conflict").increment(1);
    let mut event = outbox::rejected_event(
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
    // The answer goes to the agent that sent the conflicting intent.
    event.reply_to = new.reply_to.clone();
    event
}

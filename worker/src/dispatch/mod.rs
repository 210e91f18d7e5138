//! Dispatch: sending a claimed operation to its downstream and recording what happened, and
//! the policy that maps an adapter outcome to the next ledger state ([`next_state`]: the rule
//! tables, pure).
//!
//! Only outcomes proven not applied lead to another write (`retry_wait`); anything that may have
//! been applied becomes `unknown` and is left to capability-based recovery. Exhausted retries of
//! proven-not-applied attempts end `failed`; exhausted recovery ends `held`, never `failed`. A
//! write or lookup this worker could not even start because it ran out of a local resource
//! (descriptors, buffers, memory: [`Outcome::LocalExhaustion`]) spends nothing: the write goes
//! back to `retry_wait` with its attempt given back, a recovery round is deferred.

pub mod kept;
pub mod next_state;

pub use next_state::{after_dispatch, after_lookup, after_recovery, local_exhaustion_delay};

use std::sync::Arc;

use chrono::Utc;
use metrics::counter;
use tracing::{Instrument as _, Span};

use crate::adapter::meters::timed;
use crate::adapter::Request;
use crate::batch::OnItsWay;
use crate::config::ToolConfig;
use crate::context::Context;
use crate::fault;
use crate::ledger::{
    Applied, Completion, LedgerError, Operation, Passed, Phase, SendFence, Source, State,
    Transition, LEDGER_ERRORS,
};
use crate::outcome::Outcome;
use crate::retry::RetryPolicy;
use crate::retry::{budget_delta, retry_delay, WriteKind};
use crate::telemetry::metrics as m;
use crate::telemetry::spans;

/// The adapter request for an operation: its stable key and its stored canonical body.
pub fn request_for(op: &Operation) -> Option<Request> {
    Some(Request {
        tenant: op.tenant.clone(),
        action_id: op.action_id.clone(),
        tool: op.tool.clone(),
        idempotency_key: op.idempotency_key(),
        body: op.arguments.clone()?,
        trace: op.trace(),
        deadline: None,
    })
}

/// Keeps the in-flight gauge honest however a task ends.
pub struct InFlight;

impl InFlight {
    pub fn enter() -> InFlight {
        m::in_flight().increment(1.0);
        InFlight
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        m::in_flight().decrement(1.0);
    }
}

/// A claimed row this worker cannot send: its committed `dispatching` may have been sent by an
/// earlier owner, so it is recorded `unknown` for recovery, never retried blind.
async fn unsendable(ctx: &Context, op: &Operation, evidence: String) {
    let unknown = Transition::Unknown {
        delay: Default::default(),
        evidence,
    };
    finish(ctx, op, Phase::Dispatch, unknown).await;
}

/// Sends an operation this worker holds in `dispatching` (at `op.fence`) and records the
/// outcome, in its dispatch span ([`spans::send`]): the child of `parent` (the span of the
/// delivery that brought it), or without one (the scheduler's sends) a root in the action's
/// trace. `expected`: the send's registration with the fence batcher, when the intake made one
/// ([`crate::batch::fence::FenceBatcher::expect`]).
pub async fn run(
    ctx: Arc<Context>,
    op: Operation,
    parent: Option<Span>,
    expected: Option<OnItsWay>,
) {
    let span = match ctx.tools.get(&op.tool) {
        Some(tool) => spans::send(&op, &tool.config, parent.as_ref()),
        None => Span::none(),
    };
    send(ctx, op, expected).instrument(span).await
}

async fn send(ctx: Arc<Context>, op: Operation, expected: Option<OnItsWay>) {
    let _in_flight = InFlight::enter();
    let Some(tool) = ctx.tools.get(&op.tool) else {
        // Committed `dispatching` counts as possibly sent (docs/design.md section 4).
        let evidence = format!(
            "tool {} is not configured on worker {}; outcome unknown",
            op.tool, ctx.worker_id
        );
        return unsendable(&ctx, &op, evidence).await;
    };
    let Some(request) = request_for(&op) else {
        let evidence = "arguments were removed by retention; cannot send".to_string();
        return unsendable(&ctx, &op, evidence).await;
    };
    fault::point("before_send", &op.action_id);
    let kind = if op.attempts <= 1 {
        WriteKind::First
    } else {
        WriteKind::Retry
    };
    let Some(passed) = send_fence(&ctx, &op, &tool.config, kind, expected).await else {
        return;
    };
    fault::point("after_send_fence", &op.action_id);
    let request = Request {
        deadline: passed.deadline,
        ..request
    };
    let outcome = timed(tool, "write", tool.adapter.execute(&request)).await;
    Span::current().record("intent_worker.outcome", outcome.label());
    account(&ctx, &tool.config, kind, &outcome);
    fault::point("after_response", &op.action_id);
    let transition = after_dispatch(&op, &tool.config, outcome, Utc::now());
    let transition = match passed.deadline {
        Some(deadline) => transition.noting(&deadline_note(deadline)),
        None => transition,
    };
    finish(&ctx, &op, Phase::Dispatch, transition).await;
}

/// What the outcome of a write with a deadline records beside its evidence, so the history
/// keeps every send's deadline.
pub fn deadline_note(deadline: chrono::DateTime<Utc>) -> String {
    format!(
        "request deadline {}",
        deadline.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
    )
}

/// The send fence of a first dispatch or retry (see [`crate::ledger::Ledger::fence_send`],
/// batched by [`crate::batch::fence`]): when the write may leave now, what it carries (its
/// deadline, for a tool with `absence_proof`). Time may have passed since the claim (waiting
/// for a permit, a slow completion, a paused process), so ownership is confirmed on the
/// database clock right before the request leaves; otherwise nothing is sent and the row is
/// left to whoever owns it now.
async fn send_fence(
    ctx: &Context,
    op: &Operation,
    tool: &ToolConfig,
    kind: WriteKind,
    expected: Option<OnItsWay>,
) -> Option<Passed> {
    let send = SendFence {
        id: op.id,
        fence: op.fence,
        timeout: tool.timeout,
        deadline: tool.absence_proof.as_ref().map(|p| p.deadline),
    };
    match ctx
        .fences
        .fence_send(send, kit::otel::context_of(&Span::current()), expected)
        .await
    {
        Ok(Some(passed)) => Some(passed),
        Ok(None) => {
            abandoned(ctx, op, kind, "the lease was lost before the request left");
            None
        }
        Err(e) => {
            // Unconfirmed ownership is no ownership: the lease lapses and recovery decides.
            counter!(LEDGER_ERRORS, "operation" => "send_fence").increment(1);
            abandoned(
                ctx,
                op,
                kind,
                &format!("the send fence could not be checked: {e}"),
            );
            None
        }
    }
}

/// Counts and logs a write that was abandoned before it left; a retry or replay gets back the
/// budget token it spent.
pub fn abandoned(ctx: &Context, op: &Operation, kind: WriteKind, why: &str) {
    if kind == WriteKind::Retry {
        ctx.budget.add(&op.tool, 1.0);
    }
    let kind = match kind {
        WriteKind::First => "first",
        WriteKind::Retry if op.state() == State::Unknown => "replay",
        WriteKind::Retry => "retry",
    };
    counter!(m::STALE_SENDS_ABANDONED, "tool" => op.tool.clone(), "kind" => kind).increment(1);
    tracing::warn!(
        tenant = %op.tenant, action_id = %op.action_id, tool = %op.tool, fence = op.fence, kind,
        "send abandoned, nothing was sent: {why}"
    );
}

/// Moves the tool's retry budget by what a write's outcome is worth
/// ([`crate::retry::budget_delta`]), through this worker's tally (see
/// [`crate::retry::BudgetTally`]).
pub fn account(ctx: &Context, tool: &ToolConfig, kind: WriteKind, outcome: &Outcome) {
    ctx.budget
        .add(&tool.name, budget_delta(kind, outcome, tool.budget.ratio));
}

/// Records a completion, trying again while the ledger cannot be reached (a cut link, a
/// failover) for up to one lease, so an answer that arrived during a short outage is kept
/// rather than turned into a needless unknown. A receipt is tried for longer ([`kept`]): the
/// receipt path may settle the row whoever owns it by then. Safe to repeat: every completion is
/// fenced and conditional, so a late try lands only where it still applies (or as a late
/// receipt).
async fn record(ctx: &Context, key: &str, completion: Completion) -> Result<Applied, LedgerError> {
    let started = tokio::time::Instant::now();
    let lease_end = started + ctx.lease;
    let receipt_id = match &completion.transition {
        Transition::Succeeded { receipt_id, .. } => Some(receipt_id.clone()),
        _ => None,
    };
    let operation_id = completion.operation_id;
    let mut give_up = lease_end;
    let mut keeping = false;
    let mut attempt = 0;
    let mut pending = Some(completion);
    let result = loop {
        let Some(completion) = pending.take() else {
            break Err(LedgerError::Refused("completion batcher stopped".into()));
        };
        let (answer, back) = ctx.completions.complete(completion).await;
        pending = back;
        match answer {
            // Unreachable, gone, or read-only (the connection is retired and the next try takes
            // a fresh one): worth another try; a statement the database refused is not.
            Err(LedgerError::Db(e)) if crate::ledger::primary::unreachable(&e) => {
                let now = tokio::time::Instant::now();
                if now >= lease_end && !keeping {
                    if let Some(receipt_id) = &receipt_id {
                        keeping = ctx.receipts.hold(operation_id, key, receipt_id);
                        if keeping {
                            give_up = started + ctx.receipts.keep();
                            tracing::warn!(
                                idempotency_key = %key, receipt_id = %receipt_id,
                                keep_secs = ctx.receipts.keep().as_secs(),
                                "the ledger has not taken this receipt for a whole lease; keeping \
                                 it and trying on (the receipt path settles the row whoever owns it)"
                            );
                        }
                    }
                }
                if now >= give_up {
                    if keeping {
                        ctx.receipts.release(operation_id, Some(kept::Dropped::Age));
                        keeping = false;
                    }
                    break Err(LedgerError::Db(e));
                }
                attempt += 1;
                counter!(LEDGER_ERRORS, "operation" => "complete").increment(1);
                ctx.ledger.hosts().observe(&e);
                let delay = retry_delay(&record_retry(), attempt)
                    .min(give_up.saturating_duration_since(now));
                tracing::warn!(
                    operation_id, attempt, error = %e,
                    retry_in_ms = delay.as_millis() as u64,
                    "cannot record the outcome yet; trying again"
                );
                tokio::time::sleep(delay).await;
            }
            other => break other,
        }
    };
    if keeping {
        ctx.receipts.release(operation_id, None);
    }
    result
}

/// Back-off between tries of [`record`]: 100 ms doubling to 2 s, ±50 %.
fn record_retry() -> RetryPolicy {
    RetryPolicy {
        initial_delay_ms: 100,
        multiplier: 2.0,
        max_delay_ms: 2_000,
        jitter: 0.5,
        ..RetryPolicy::default()
    }
}

/// After a late receipt that matches: often this worker's own commit, whose reply was lost, so
/// its result events are held for a hand-over that never came. Releasing them may at worst
/// publish an event twice (same event_id), which agents already tolerate.
async fn release_held_events(ctx: &Context, operation_id: i64) {
    // Boxed: a rare path whose statement future would otherwise size every dispatch task.
    match Box::pin(ctx.ledger.release_held(operation_id, &ctx.worker_id)).await {
        Ok(0) => {}
        Ok(_) => ctx.relay_wake.notify_one(),
        Err(error) => {
            tracing::warn!(%error, "cannot release held result events; they wait for the relay hold")
        }
    }
}

/// After the ledger applied a transition (now `new`): counted (a retry it scheduled too), logged
/// (a success at debug, a deferral not at all), and the scheduler woken for an unknown outcome.
fn done(ctx: &Context, new: &Operation, schedules_retry: bool, deferred: bool) {
    m::transitions(new.state()).increment(1);
    if schedules_retry {
        counter!(m::RETRIES_SCHEDULED, "tool" => new.tool.clone()).increment(1);
    }
    // A success is the common case, kept in the ledger and counted: logged at debug. Every
    // other outcome is what an operator looks for in the log.
    if new.state() == State::Succeeded {
        tracing::debug!(
            tenant = %new.tenant, action_id = %new.action_id, tool = %new.tool,
            fence = new.fence, attempts = new.attempts, "operation succeeded"
        );
    } else if !deferred {
        tracing::info!(
            tenant = %new.tenant, action_id = %new.action_id, tool = %new.tool,
            state = %new.state(), fence = new.fence, attempts = new.attempts,
            evidence = new.evidence.as_deref().unwrap_or(""), "operation updated"
        );
    }
    if new.state() == State::Succeeded {
        fault::point("after_succeeded", &new.action_id);
    }
    if new.state() == State::Accepted {
        fault::point("after_accepted", &new.action_id);
    }
    if new.state() == State::Unknown {
        ctx.scheduler_wake.notify_one();
    }
}

/// Records a transition and reacts to what the ledger did. The result event it causes carries
/// the context of the current span (the send, recovery or operator span that decided it), or
/// the intent's own when spans are not recorded. Its source ([`Source`]) follows from the
/// phase: a dispatch's or a retry's answer, a poll's; a recovery round names its own
/// ([`finish_by`]).
pub async fn finish(
    ctx: &Context,
    op: &Operation,
    phase: Phase,
    transition: Transition,
) -> Option<Operation> {
    let by = match phase {
        Phase::Leased(State::Accepted) => Source::Poll,
        Phase::Leased(State::Unknown) => Source::Lookup,
        _ => Source::Dispatch,
    };
    finish_by(ctx, op, phase, transition, by).await
}

/// [`finish`] with the call that established the outcome named.
pub async fn finish_by(
    ctx: &Context,
    op: &Operation,
    phase: Phase,
    transition: Transition,
    by: Source,
) -> Option<Operation> {
    let was_receipt = matches!(transition, Transition::Succeeded { .. });
    match settle(ctx, op, phase, transition, by).await {
        Ok(Applied::Done(new)) | Ok(Applied::LateReceiptMatches(new)) => Some(new),
        Ok(Applied::Stale(_)) | Ok(Applied::LateReceiptConflict(_)) => None,
        Err(e) => {
            if was_receipt && phase == Phase::Dispatch {
                // The downstream answered but the receipt could not be saved: the outcome is
                // unknown here; recovery will fetch the original receipt.
                let evidence = format!(
                    "a receipt arrived but could not be saved ({e}); recovery will fetch it"
                );
                let retry = Box::pin(finish(
                    ctx,
                    op,
                    phase,
                    Transition::Unknown {
                        delay: Default::default(),
                        evidence,
                    },
                ))
                .await;
                return retry;
            }
            None
        }
    }
}

/// Records a transition and reacts to what the ledger did (logs, metrics, wake-ups, held
/// events released), answering what it did: for a caller that tells someone (a callback's
/// answer), where [`finish_by`] only goes on.
pub async fn settle(
    ctx: &Context,
    op: &Operation,
    phase: Phase,
    transition: Transition,
    by: Source,
) -> Result<Applied, LedgerError> {
    let schedules_retry = matches!(
        transition,
        Transition::RetryWait { .. } | Transition::Resend { .. }
    );
    let deferred = matches!(transition, Transition::Defer { .. });
    // A receipt for the request this dispatch sent may be recorded in one statement with its
    // event, built from the row as held here.
    let dispatched = (phase == Phase::Dispatch
        && matches!(transition, Transition::Succeeded { .. }))
    .then(|| Box::new(op.clone()));
    let applied = record(
        ctx,
        &op.idempotency_key(),
        Completion {
            operation_id: op.id,
            fence: op.fence,
            phase,
            transition,
            by,
            trace: kit::otel::context_of(&Span::current()),
            dispatched,
        },
    )
    .await;
    match &applied {
        Ok(Applied::Done(new)) => {
            done(ctx, new, schedules_retry, deferred);
            // The relay was woken by the completion batcher (Context::complete), which knows
            // whether the commit left events to publish.
        }
        Ok(Applied::Stale(current)) => {
            counter!(m::STALE_WRITES).increment(1);
            tracing::info!(
                tenant = %op.tenant, action_id = %op.action_id, fence = op.fence,
                current_state = current.as_ref().map(|c| c.state().as_str()).unwrap_or("missing"),
                current_fence = current.as_ref().map(|c| c.fence),
                "outcome discarded: the operation moved on (stale owner or late answer)"
            );
        }
        Ok(Applied::LateReceiptMatches(_)) => {
            counter!(m::LATE_RECEIPTS, "outcome" => "matches").increment(1);
            tracing::info!(tenant = %op.tenant, action_id = %op.action_id, "late receipt equals the stored one");
            // A callback repeats the downstream's word; no commit of this worker was lost.
            if by != Source::Callback {
                release_held_events(ctx, op.id).await;
            }
        }
        Ok(Applied::LateReceiptConflict(current)) => {
            counter!(m::LATE_RECEIPTS, "outcome" => "conflict").increment(1);
            tracing::error!(
                tenant = %op.tenant, action_id = %op.action_id, state = %current.state(),
                stored_receipt = current.receipt_id.as_deref().unwrap_or(""),
                "late receipt differs from the final state; rejected, nothing stored"
            );
        }
        Err(e) => {
            ctx.ledger.failed("complete", e);
            tracing::error!(tenant = %op.tenant, action_id = %op.action_id, error = %e, "cannot record outcome");
        }
    }
    applied
}

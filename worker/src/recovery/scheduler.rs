//! The recovery scheduler, run by every worker: it expires the leases of crashed owners into
//! `unknown`, leases due rows (`prepared` left by a crash, `retry_wait`, `unknown`) with
//! `SKIP LOCKED`, and runs each one: a first dispatch, a retry within the shared budget, or a
//! recovery round chosen by [`super::choose`]. Many schedulers may run at once; fences make
//! every write single-winner.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use metrics::{counter, gauge};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, Span};

use super::choose::{choose, facts, Action};
use super::Capability;
use crate::adapter::meters::timed;
use crate::context::Context;
use crate::dispatch::next_state::after_poll;
use crate::dispatch::{
    self, after_lookup, after_recovery, finish, finish_by, request_for, InFlight,
};
use crate::fault;
use crate::ledger::{ClaimKind, Claimed, Phase, Source, State, Transition, LEDGER_ERRORS};
use crate::retry::WriteKind;
use crate::telemetry::metrics as m;
use crate::telemetry::spans;

/// Rows leased per scheduler pass.
const LEASE_BATCH: i64 = 128;
/// Late polls rescheduled per tool and pass (the rest in the next passes).
const SPREAD_BATCH: i64 = 1_000;

/// One scheduler pass: expire leases, lease due rows and start their work. Returns how many
/// rows it leased (tests drive the scheduler one step at a time with this).
pub async fn step(ctx: &Arc<Context>, tick: Duration) -> Result<usize, crate::ledger::LedgerError> {
    let expired = ctx
        .ledger
        .expire_leases(&ctx.worker_id, LEASE_BATCH)
        .await?;
    for op in &expired {
        let state = op.state();
        m::transitions(state).increment(1);
        if state == State::Unknown {
            tracing::warn!(
                tenant = %op.tenant, action_id = %op.action_id, tool = %op.tool,
                "dispatch lease expired; outcome unknown"
            );
        } else {
            tracing::warn!(
                tenant = %op.tenant, action_id = %op.action_id, tool = %op.tool, %state,
                "dispatch lease expired before the send fence passed; nothing was sent, dispatching again"
            );
        }
    }
    // Intents whose wait for approval ended fail, never sent (their events in the same commit).
    let unapproved = ctx
        .ledger
        .expire_approvals(&ctx.worker_id, LEASE_BATCH)
        .await?;
    for op in &unapproved {
        m::transitions(op.state()).increment(1);
        counter!(m::APPROVALS, "tool" => op.tool.clone(), "outcome" => "expired").increment(1);
        tracing::warn!(
            tenant = %op.tenant, action_id = %op.action_id, tool = %op.tool,
            "approval wait ended before enough approvals came; failed, nothing was sent"
        );
    }
    // Originals whose compensation succeeded: their agents are told (`compensated_by`).
    let told = ctx.ledger.tell_compensations(LEASE_BATCH).await?;
    for c in &told {
        tracing::info!(
            tenant = %c.original.tenant, action_id = %c.original.action_id,
            compensated_by = %c.by, "compensation succeeded; the original's agent is told"
        );
    }
    if !expired.is_empty() || !unapproved.is_empty() || !told.is_empty() {
        ctx.relay_wake.notify_one();
    }
    spread_late_polls(ctx, late_after(tick)).await?;
    let available = ctx.in_flight.available_permits().min(LEASE_BATCH as usize) as i64;
    if available == 0 {
        return Ok(0);
    }
    let claimed = ctx
        .ledger
        .lease_due(available, &ctx.worker_id, ctx.lease)
        .await?;
    let n = claimed.len();
    for claim in claimed {
        ctx.spawn_bounded(|ctx| run_claim(ctx, claim)).await;
    }
    Ok(n)
}

/// How late a poll may be before it is rescheduled within its gap rather than run now
/// ([`crate::ledger::Ledger::spread_late_polls`]): a few scheduler ticks (a poll is normally
/// at most one late), at least a second.
fn late_after(tick: Duration) -> Duration {
    (tick * 3).max(Duration::from_secs(1))
}

/// Reschedules the polls no worker could run on time, tool by tool, before leasing: after an
/// outage (or a restart of the only worker) the overdue polls resume spread over their gaps.
async fn spread_late_polls(
    ctx: &Arc<Context>,
    late: Duration,
) -> Result<(), crate::ledger::LedgerError> {
    for (name, tool) in ctx.tools.iter() {
        let Some(contract) = tool.config.completion.contract() else {
            continue;
        };
        let poll = contract.poll;
        let spread = ctx
            .ledger
            .spread_late_polls(
                name,
                Duration::from_millis(poll.first_ms),
                Duration::from_millis(poll.max_ms),
                late,
                SPREAD_BATCH,
            )
            .await?;
        if spread > 0 {
            counter!(m::POLLS_SPREAD, "tool" => name.clone()).increment(spread);
            tracing::info!(
                tool = %name, operations = spread,
                "polls overdue (workers down or saturated) rescheduled within their gaps"
            );
        }
    }
    Ok(())
}

/// Runs the scheduler until `stop` fires.
pub async fn run(ctx: Arc<Context>, interval: Duration, stop: CancellationToken) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
            _ = ctx.scheduler_wake.notified() => {}
        }
        match step(&ctx, interval).await {
            Ok(n) if n as i64 == LEASE_BATCH => ctx.scheduler_wake.notify_one(),
            Ok(_) => {}
            Err(e) => {
                ctx.ledger.failed("schedule", &e);
                tracing::warn!(error = %e, "recovery scheduler pass failed; retrying next tick");
            }
        }
        refresh_budget_gauges(&ctx).await;
    }
}

/// Writes this worker's pending budget movements and refreshes the budget gauges.
async fn refresh_budget_gauges(ctx: &Context) {
    for (name, credit) in ctx.budget.take_all() {
        let Some(tool) = ctx.tools.get(&name) else {
            continue;
        };
        if let Err(e) = ctx
            .ledger
            .adjust_retry_tokens(&name, &tool.config.budget, credit)
            .await
        {
            ctx.budget.add(&name, credit);
            ctx.ledger.failed("budget", &e);
            tracing::warn!(tool = %name, error = %e, "cannot record retry budget movements");
        }
    }
    for (name, tool) in ctx.tools.iter() {
        if let Ok(v) = ctx
            .ledger
            .retry_budget_available(name, &tool.config.budget)
            .await
        {
            gauge!(m::BUDGET_AVAILABLE, "tool" => name.clone()).set(v.max(0.0));
        }
    }
}

async fn run_claim(ctx: Arc<Context>, claim: Claimed) {
    let op = claim.operation;
    match claim.kind {
        ClaimKind::FirstDispatch => {
            match ctx
                .ledger
                .start_dispatch(
                    op.id,
                    op.fence,
                    State::Prepared,
                    &ctx.worker_id,
                    ctx.lease,
                    &ctx.windows,
                )
                .await
            {
                Ok(Some(op)) => {
                    fault::point("after_dispatching", &op.action_id);
                    dispatch::run(ctx, op, None, None).await;
                }
                Ok(None) => {
                    tracing::debug!(action_id = %op.action_id, "prepared row taken by another worker")
                }
                Err(e) => {
                    tracing::warn!(action_id = %op.action_id, error = %e, "cannot start dispatch")
                }
            }
        }
        ClaimKind::Retry => {
            let Some(tool) = ctx.tools.get(&op.tool) else {
                let evidence = format!("tool {} is not configured; retry deferred", op.tool);
                tracing::warn!(action_id = %op.action_id, "{evidence}");
                finish(
                    &ctx,
                    &op,
                    Phase::Leased(State::RetryWait),
                    Transition::Defer { delay: ctx.lease },
                )
                .await;
                return;
            };
            if !spend_retry(&ctx, &op, &tool.config.budget).await {
                defer_for_budget(&ctx, &op, Phase::Leased(State::RetryWait), &tool.config).await;
                return;
            }
            match ctx
                .ledger
                .start_dispatch(
                    op.id,
                    op.fence,
                    State::RetryWait,
                    &ctx.worker_id,
                    ctx.lease,
                    &ctx.windows,
                )
                .await
            {
                Ok(Some(op)) => dispatch::run(ctx, op, None, None).await,
                Ok(None) => {
                    ctx.budget.add(&op.tool, 1.0);
                    tracing::debug!(action_id = %op.action_id, "retry taken by another worker")
                }
                Err(e) => {
                    ctx.budget.add(&op.tool, 1.0);
                    tracing::warn!(action_id = %op.action_id, error = %e, "cannot start retry")
                }
            }
        }
        ClaimKind::Recover => recover(ctx, op).await,
        ClaimKind::Poll => poll(ctx, op).await,
    }
}

/// One poll of a leased `accepted` row: its status read (never the write), judged by the
/// tool's async contract, and the next state recorded ([`after_poll`]), in a `poll <tool>`
/// span (a root in the action's trace, linked to its intent).
async fn poll(ctx: Arc<Context>, op: crate::ledger::Operation) {
    let span = spans::poll(&op);
    poll_round(ctx, op).instrument(span).await
}

async fn poll_round(ctx: Arc<Context>, op: crate::ledger::Operation) {
    let _in_flight = InFlight::enter();
    let phase = Phase::Leased(State::Accepted);
    let held = |evidence: String| Transition::Held { evidence };
    let Some(tool) = ctx.tools.get(&op.tool) else {
        let why = format!(
            "tool {} is not configured on this worker; held for a person",
            op.tool
        );
        finish_by(&ctx, &op, phase, held(why), Source::Poll).await;
        return;
    };
    let Some(operation_id) = op.remote_id.clone() else {
        let why = "accepted without an operation id to poll; held for a person".to_string();
        finish_by(&ctx, &op, phase, held(why), Source::Poll).await;
        return;
    };
    // The status read needs the key (its URL may name it) and the identity (the receipt
    // check), never the body: a row whose arguments were swept is polled all the same.
    let request = crate::adapter::Request {
        tenant: op.tenant.clone(),
        action_id: op.action_id.clone(),
        tool: op.tool.clone(),
        idempotency_key: op.idempotency_key(),
        body: String::new(),
        trace: op.trace(),
        deadline: None,
    };
    fault::point("before_poll", &op.action_id);
    let polled = tool.adapter.poll(&request, &operation_id).await;
    counter!(m::POLLS, "tool" => op.tool.clone(), "outcome" => polled.label()).increment(1);
    Span::current().record("intent_worker.outcome", polled.label());
    tracing::info!(
        tenant = %op.tenant, action_id = %op.action_id, tool = %op.tool,
        operation = %operation_id, outcome = polled.label(), "polled a long-running operation"
    );
    fault::point("after_poll", &op.action_id);
    let transition = after_poll(&op, &tool.config, polled, Utc::now());
    let deadline = matches!(&transition, Transition::Held { evidence }
        if evidence.starts_with(crate::dispatch::next_state::ASYNC_DEADLINE));
    if finish_by(&ctx, &op, phase, transition, Source::Poll)
        .await
        .is_some()
        && deadline
    {
        counter!(m::ASYNC_DEADLINES, "tool" => op.tool.clone()).increment(1);
        tracing::warn!(
            tenant = %op.tenant, action_id = %op.action_id, tool = %op.tool,
            operation = %operation_id,
            "a long-running operation was not done by its poll deadline; held for a person"
        );
    }
}

/// Runs one recovery round now on one `unknown` or `accepted` operation that is due (an
/// operator recheck): leases it exactly as the scheduler would (fence + 1, lease, one recovery
/// round counted) and runs the same round ([`choose`], then lookup / replay / hold, or a poll),
/// so the same rules and fences apply. Returns the row as it is afterwards. When another
/// worker's scheduler leased the row first (the recheck made it due for every worker), that
/// round is the one asked for: the answer waits until it has released the row, or until its
/// lease has run out.
pub async fn recover_now(
    ctx: &Arc<Context>,
    operation_id: i64,
) -> Result<Option<crate::ledger::Operation>, crate::ledger::LedgerError> {
    let permit = ctx.in_flight_slot().await;
    let leased = ctx
        .ledger
        .lease_for_recovery(operation_id, &ctx.worker_id, ctx.lease)
        .await?;
    match leased {
        Some(op) if op.state() == State::Accepted => poll(ctx.clone(), op).await,
        Some(op) => recover(ctx.clone(), op).await,
        None => {
            drop(permit);
            return after_round_elsewhere(ctx, operation_id).await;
        }
    }
    drop(permit);
    ctx.ledger.get(operation_id).await
}

/// How often [`after_round_elsewhere`] reads the row again: an operator's request, not a hot
/// path.
const ROUND_ELSEWHERE_CHECK: Duration = Duration::from_millis(50);

/// The row once no round holds it: read until its lease is released (the round ended) or has
/// run out (its worker stopped; the scheduler expires it), and at most one lease plus a second
/// by this worker's clock, so a clock skewed against the database cannot keep the request.
async fn after_round_elsewhere(
    ctx: &Arc<Context>,
    operation_id: i64,
) -> Result<Option<crate::ledger::Operation>, crate::ledger::LedgerError> {
    let give_up = tokio::time::Instant::now() + ctx.lease + Duration::from_secs(1);
    loop {
        let row = ctx.ledger.get(operation_id).await?;
        let leased = row.as_ref().is_some_and(|op| op.leased(Utc::now()));
        if !leased || tokio::time::Instant::now() >= give_up {
            return Ok(row);
        }
        tokio::time::sleep(ROUND_ELSEWHERE_CHECK).await;
    }
}

/// One recovery round on a leased `unknown` row, in a `recover <tool>` span (a root in the
/// action's trace, linked to its intent).
async fn recover(ctx: Arc<Context>, op: crate::ledger::Operation) {
    let span = spans::recover(&op);
    recover_round(ctx, op).instrument(span).await
}

async fn recover_round(ctx: Arc<Context>, op: crate::ledger::Operation) {
    let _in_flight = InFlight::enter();
    let phase = Phase::Leased(State::Unknown);
    let Some(tool) = ctx.tools.get(&op.tool) else {
        let evidence = format!(
            "tool {} is not configured on this worker; held for a person",
            op.tool
        );
        finish(&ctx, &op, phase, Transition::Held { evidence }).await;
        return;
    };
    let config = &tool.config;
    let action = choose(&facts(
        &op,
        &config.capability,
        op.recovery_attempts,
        config.recovery_attempts,
        Utc::now(),
    ));
    counter!(m::RECOVERIES, "tool" => op.tool.clone(), "action" => action.label()).increment(1);
    Span::current().record("intent_worker.recovery", action.label());
    tracing::info!(
        tenant = %op.tenant, action_id = %op.action_id, tool = %op.tool,
        round = op.recovery_attempts, action = action.label(), "recovering unknown outcome"
    );
    let Some(request) = request_for(&op) else {
        let evidence = "arguments were removed by retention; recovery needs a person".to_string();
        finish(&ctx, &op, phase, Transition::Held { evidence }).await;
        return;
    };
    let by = match action {
        Action::ReplayOriginalRequest => Source::Replay,
        Action::LookupOriginalReceipt => Source::Lookup,
        // A receipt stored before (an interrupted resolution): an earlier answer's.
        Action::ReturnStoredReceipt | Action::Hold { .. } => Source::Dispatch,
    };
    let transition = match action {
        Action::ReturnStoredReceipt => {
            let receipt = op.receipt.clone().expect("facts said a receipt is stored");
            match tool.adapter.check_receipt(&request, receipt.value()) {
                Ok(receipt_id) => Transition::Succeeded {
                    receipt,
                    receipt_id,
                    evidence: "stored receipt".into(),
                },
                Err(why) => Transition::Held {
                    evidence: format!("stored receipt does not match the operation: {why}"),
                },
            }
        }
        Action::Hold { reason } => Transition::Held { evidence: reason },
        Action::LookupOriginalReceipt => {
            let outcome = timed(tool, "lookup", tool.adapter.lookup(&request)).await;
            Span::current().record("intent_worker.outcome", outcome.label());
            let transition = after_lookup(&op, config, outcome, leased_at(&ctx, &op), Utc::now());
            if let Transition::RetryWait { evidence, .. } | Transition::Failed { evidence } =
                &transition
            {
                if evidence.contains(crate::dispatch::next_state::PROOF_OF_ABSENCE) {
                    counter!(m::ABSENCE_PROOFS, "tool" => op.tool.clone()).increment(1);
                    tracing::info!(
                        tenant = %op.tenant, action_id = %op.action_id, tool = %op.tool,
                        "a lookup miss after the last request's deadline proved the write absent"
                    );
                }
            }
            transition
        }
        Action::ReplayOriginalRequest => match replay(&ctx, &op, tool, &request, phase).await {
            Some(transition) => transition,
            None => return,
        },
    };
    finish_by(&ctx, &op, phase, transition, by).await;
}

/// When this worker leased `op`, on the database clock (the lease statement set `lease_until`
/// to its `now()` plus this worker's lease), less a millisecond for the rounding of the
/// interval: the lookup of this round left after it.
fn leased_at(ctx: &Context, op: &crate::ledger::Operation) -> Option<chrono::DateTime<Utc>> {
    let lease = chrono::Duration::from_std(ctx.lease).ok()?;
    Some(op.lease_until? - lease - chrono::Duration::milliseconds(1))
}

/// A replay of the original request, within the shared retry budget and behind its fence
/// ([`crate::ledger::Ledger::begin_replay`]); None when it did not leave (deferred for the
/// budget, or abandoned: nothing was sent).
async fn replay(
    ctx: &Context,
    op: &crate::ledger::Operation,
    tool: &crate::adapter::Tool,
    request: &crate::adapter::Request,
    phase: Phase,
) -> Option<Transition> {
    let config = &tool.config;
    if !spend_retry(ctx, op, &config.budget).await {
        defer_for_budget(ctx, op, phase, config).await;
        return None;
    }
    fault::point("before_send", &op.action_id);
    let Capability::Replay { window, margin } = config.capability else {
        unreachable!("choose replays only tools with recovery = \"replay\"")
    };
    match ctx
        .ledger
        .begin_replay(
            op.id,
            op.fence,
            &ctx.worker_id,
            ctx.lease,
            config.timeout,
            window,
            margin,
        )
        .await
    {
        Ok(true) => {}
        Ok(false) => {
            dispatch::abandoned(
                ctx,
                op,
                WriteKind::Retry,
                "the lease was lost or the replay window ends before the request could be answered",
            );
            return None;
        }
        Err(e) => {
            counter!(LEDGER_ERRORS, "operation" => "send_fence").increment(1);
            dispatch::abandoned(
                ctx,
                op,
                WriteKind::Retry,
                &format!("the send fence could not be checked: {e}"),
            );
            return None;
        }
    }
    let outcome = timed(tool, "write", tool.adapter.execute(request)).await;
    Span::current().record("intent_worker.outcome", outcome.label());
    dispatch::account(ctx, config, WriteKind::Retry, &outcome);
    Some(after_recovery(op, config, outcome))
}

async fn spend_retry(
    ctx: &Context,
    op: &crate::ledger::Operation,
    budget: &crate::retry::BudgetPolicy,
) -> bool {
    let pending = ctx.budget.take(&op.tool);
    match ctx.ledger.try_spend_retry(&op.tool, budget, pending).await {
        Ok(ok) => ok,
        Err(e) => {
            ctx.budget.add(&op.tool, pending);
            tracing::warn!(tool = %op.tool, error = %e, "cannot read the retry budget; deferring");
            false
        }
    }
}

/// How long a budget-deferred retry waits before it looks again: a thirtieth of the window,
/// between 1 and 5 seconds, so refilled tokens (time, successes) are used
/// soon without hammering the ledger.
pub fn budget_deferral(window_secs: u64) -> Duration {
    Duration::from_secs(window_secs / 30).clamp(Duration::from_secs(1), Duration::from_secs(5))
}

async fn defer_for_budget(
    ctx: &Context,
    op: &crate::ledger::Operation,
    phase: Phase,
    tool: &crate::config::ToolConfig,
) {
    counter!(m::BUDGET_DEFERRALS, "tool" => op.tool.clone()).increment(1);
    let delay = budget_deferral(tool.budget.window_secs);
    tracing::info!(action_id = %op.action_id, tool = %op.tool, "retry budget empty; deferred");
    finish(ctx, op, phase, Transition::Defer { delay }).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_deferral_is_a_thirtieth_of_the_window_within_1_to_5_seconds() {
        assert_eq!(budget_deferral(2), Duration::from_secs(1));
        assert_eq!(budget_deferral(60), Duration::from_secs(2));
        assert_eq!(budget_deferral(3600), Duration::from_secs(5));
    }
}

//! Prometheus metrics: names, descriptions, the exporter and the `/metrics` endpoint.
//!
//! The names of the layers above live here; a layer below records names of its own, kept with
//! it and described and pre-registered here: the ledger's errors and failovers
//! ([`crate::ledger::LEDGER_ERRORS`], [`crate::ledger::LEDGER_FAILOVERS`]) and readiness
//! ([`super::health::READY`]).
//!
//! Labels stay low-cardinality (tool, state, reason, outcome, kind, status) — never a tenant or
//! a key. Gauges computed from the ledger (operations by state, oldest unresolved age, held,
//! relay backlog) are refreshed on every scrape, so each worker reports the same global figure:
//! alert rules aggregate them with `max()`.

use std::sync::OnceLock;

use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, Counter, Gauge, Unit,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use super::health::READY;
use crate::ledger::{Ledger, State, LEDGER_ERRORS, LEDGER_FAILOVERS};

pub const INTENTS_RECEIVED: &str = "intent_worker_intents_received_total";
pub const DUPLICATES: &str = "intent_worker_duplicates_suppressed_total";
pub const REJECTED: &str = "intent_worker_rejected_total";
pub const DEAD_LETTERED: &str = "intent_worker_dead_lettered_total";
pub const DEAD_LETTER_REFUSED: &str = "intent_worker_dead_letter_refused_total";
pub const BROKER_RECONNECTS: &str = "intent_worker_broker_reconnects_total";
pub const OPERATIONS: &str = "intent_worker_operations";
pub const OLDEST_UNRESOLVED: &str = "intent_worker_oldest_unresolved_age_seconds";
pub const UNRESOLVED: &str = "intent_worker_unresolved_operations";
pub const HELD: &str = "intent_worker_held_operations";
pub const DOWNSTREAM_DURATION: &str = "intent_worker_downstream_request_duration_seconds";
pub const DOWNSTREAM_REQUESTS: &str = "intent_worker_downstream_requests_total";
pub const DISPATCH_ATTEMPTS: &str = "intent_worker_dispatch_attempts_total";
pub const RESULTS_PUBLISHED: &str = "intent_worker_results_published_total";
pub const RESULTS_UNROUTABLE: &str = "intent_worker_results_unroutable_total";
pub const RELAY_BACKLOG: &str = "intent_worker_relay_backlog";
pub const IN_FLIGHT: &str = "intent_worker_in_flight";
pub const TRANSITIONS: &str = "intent_worker_transitions_total";
pub const RECOVERIES: &str = "intent_worker_recovery_actions_total";
/// Status reads of accepted long-running operations, by tool and what each established.
pub const POLLS: &str = "intent_worker_polls_total";
/// Accepted long-running operations held because they were not done by their poll deadline.
pub const ASYNC_DEADLINES: &str = "intent_worker_async_deadlines_total";
/// Lookup misses after the last request's deadline that proved a write absent (`absence_proof`).
pub const ABSENCE_PROOFS: &str = "intent_worker_absence_proofs_total";
/// Intents that wait for a person's approval, by tool and outcome: `requested` (recorded
/// awaiting), `approved` (the last approval needed came; dispatched next), `rejected`, `expired`.
pub const APPROVALS: &str = "intent_worker_approvals_total";
/// The outcomes of [`APPROVALS`].
pub const APPROVAL_OUTCOMES: [&str; 4] = ["requested", "approved", "rejected", "expired"];
/// Overdue polls rescheduled within their gaps rather than run at once, by tool.
pub const POLLS_SPREAD: &str = "intent_worker_polls_spread_total";
/// Signed completion callbacks, by tool and what each did.
pub const CALLBACKS: &str = "intent_worker_callbacks_total";
pub const LATE_RECEIPTS: &str = "intent_worker_late_receipts_total";
pub const STALE_WRITES: &str = "intent_worker_stale_writes_total";
pub const STALE_SENDS_ABANDONED: &str = "intent_worker_stale_sends_abandoned_total";
pub const RETRIES_SCHEDULED: &str = "intent_worker_retries_scheduled_total";
pub const BUDGET_DEFERRALS: &str = "intent_worker_retry_budget_deferrals_total";
pub const BUDGET_AVAILABLE: &str = "intent_worker_retry_budget_available";
pub const SWEPT: &str = "intent_worker_retention_swept_total";
pub const LOCAL_RESOURCE_ERRORS: &str = "intent_worker_local_resource_errors_total";
pub const RECEIPTS_KEPT: &str = "intent_worker_receipts_kept";
pub const RECEIPTS_DROPPED: &str = "intent_worker_receipts_dropped_total";
pub const TRACE_CONTEXT_INVALID: &str = "intent_worker_trace_context_invalid_total";

/// Label values the worker emits, so every series an alert reads exists at 0 from start-up.
/// A counter born at 1 has no `increase()` over its first sample: the first late-receipt
/// conflict after a start would never page. Keep these lists in step with the call sites; the
/// dead-letter reasons are derived from [`crate::answers::DeadLetterReason`] instead.
pub const LEDGER_OPERATIONS: &[&str] = &[
    "intake",
    "send_fence",
    "complete",
    "schedule",
    "budget",
    "retention",
];
pub const SEND_KINDS: &[&str] = &["first", "retry", "replay"];
pub const RECOVERY_ACTIONS: &[&str] = &["lookup", "replay", "hold", "stored_receipt"];
pub const LATE_RECEIPT_OUTCOMES: &[&str] = &["matches", "conflict"];

/// The in-flight gauge, moved twice per dispatch.
///
/// The handles below are of series recorded for every intent whose labels are known in
/// advance. A `counter!` or `gauge!` call builds its key (a label set is an allocation), hashes
/// it and looks it up in the exporter's registry on every call; these are looked up once, on
/// first use, which comes after [`install`] at start, and recorded through.
pub fn in_flight() -> &'static Gauge {
    static HANDLE: OnceLock<Gauge> = OnceLock::new();
    HANDLE.get_or_init(|| gauge!(IN_FLIGHT))
}

/// `intent_worker_transitions_total` of `state`.
pub fn transitions(state: State) -> &'static Counter {
    static HANDLES: [OnceLock<Counter>; State::ALL.len()] =
        [const { OnceLock::new() }; State::ALL.len()];
    HANDLES[state.index()].get_or_init(|| counter!(TRANSITIONS, "state" => state.as_str()))
}

/// Counts one result event published with `status` (the outbox row's text: one of the four
/// wire statuses, or whatever a row written by hand holds).
pub fn result_published(status: &str) {
    use protocol::result::Status;
    const STATUSES: [Status; 4] = [
        Status::Succeeded,
        Status::Pending,
        Status::Failed,
        Status::Rejected,
    ];
    static HANDLES: [OnceLock<Counter>; STATUSES.len()] =
        [const { OnceLock::new() }; STATUSES.len()];
    match STATUSES.iter().position(|s| s.as_str() == status) {
        Some(i) => HANDLES[i]
            .get_or_init(|| counter!(RESULTS_PUBLISHED, "status" => STATUSES[i].as_str()))
            .increment(1),
        None => counter!(RESULTS_PUBLISHED, "status" => status.to_owned()).increment(1),
    }
}

/// Explicit histogram buckets (seconds) for downstream latency.
const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

fn describe() {
    describe_intake();
    describe_work();
}

/// Intake, the broker links and the ledger's states.
fn describe_intake() {
    describe_counter!(
        INTENTS_RECEIVED,
        "Intent deliveries taken from the intents queue."
    );
    describe_counter!(DUPLICATES, "Intents not dispatched because their key already had an operation, by reason (redelivery, completed, in_flight, conflict).");
    describe_counter!(REJECTED, "Rejected result events emitted, by reason.");
    describe_counter!(
        DEAD_LETTERED,
        "Deliveries copied to the dead-letter exchange, by reason."
    );
    describe_counter!(
        DEAD_LETTER_REFUSED,
        "Dead-letter copies the broker kept refusing, by reason; each delivery was rejected without requeue so the queue's own dead-letter exchange took it."
    );
    describe_counter!(
        BROKER_RECONNECTS,
        "Broker links lost and reopened, by link (consumer, relay)."
    );
    describe_counter!(
        TRACE_CONTEXT_INVALID,
        "Intents whose trace context header broke the W3C format and was ignored (the intent was processed as if it had none), by header (traceparent, tracestate)."
    );
    describe_gauge!(OPERATIONS, "Operations in the ledger by state.");
    describe_gauge!(OLDEST_UNRESOLVED, Unit::Seconds, "Age since recording of the oldest unresolved operation per tool and state (dispatching counts only when its lease expired); 0 when none.");
    describe_gauge!(UNRESOLVED, "Unresolved operations per tool and state.");
    describe_gauge!(
        HELD,
        "Operations held for reconciliation by a person, per tool."
    );
}

/// Sends, recoveries, results, retries, receipts and the ledger's own health.
fn describe_work() {
    describe_histogram!(
        DOWNSTREAM_DURATION,
        Unit::Seconds,
        "Downstream request latency by tool, kind (write, lookup) and outcome."
    );
    describe_counter!(
        DOWNSTREAM_REQUESTS,
        "Downstream requests by tool, kind (write, lookup) and outcome."
    );
    describe_counter!(
        DISPATCH_ATTEMPTS,
        "Write attempts by tool and outcome (succeeded, not_sent, not_applied, rejected, unknown)."
    );
    describe_counter!(
        RESULTS_PUBLISHED,
        "Result events confirmed by the broker, by status."
    );
    describe_counter!(RESULTS_UNROUTABLE, "Result events no queue was bound for (kept in the outbox table, readable via the status API).");
    describe_gauge!(
        RELAY_BACKLOG,
        "Result events committed but not yet published."
    );
    describe_gauge!(
        IN_FLIGHT,
        "Dispatches and recoveries running in this worker."
    );
    describe_counter!(
        TRANSITIONS,
        "Ledger transitions made by this worker, by target state."
    );
    describe_counter!(
        RECOVERIES,
        "Recovery decisions by tool and action (lookup, replay, hold, stored_receipt)."
    );
    describe_counter!(
        POLLS,
        "Status reads of accepted long-running operations, by tool and outcome (done, failed, running, unproven, local_exhaustion)."
    );
    describe_counter!(
        APPROVALS,
        "Intents that wait for a person's approval, by tool and outcome: requested (recorded awaiting_approval), approved (the last approval needed came: dispatched next), rejected, expired (the wait ended first)."
    );
    describe_counter!(
        ABSENCE_PROOFS,
        "Lookup misses after the last request's deadline plus clock skew and settle time that proved a write absent (absence_proof): sent again under the same key, or failed when its attempts were spent; by tool."
    );
    describe_counter!(
        ASYNC_DEADLINES,
        "Accepted long-running operations held for a person because they were not done by their poll deadline, by tool."
    );
    describe_counter!(
        POLLS_SPREAD,
        "Polls of accepted long-running operations that no worker could run on time (all down or saturated), rescheduled at random within their gaps so they do not all run at once, by tool."
    );
    describe_counter!(
        CALLBACKS,
        "Completion callbacks of long-running tools, by tool and outcome (settled, already_final, in_progress, refused, not_found, conflict, unproven, ledger_error, bad_request)."
    );
    describe_counter!(
        LATE_RECEIPTS,
        "Receipts that arrived for an operation already final, by outcome (matches, conflict)."
    );
    describe_counter!(
        STALE_WRITES,
        "Outcomes discarded because the row had moved on (stale fence or state)."
    );
    describe_counter!(
        STALE_SENDS_ABANDONED,
        "Writes abandoned before leaving because the send fence failed (lease lost, or a replay too close to its window's end), by tool and kind (first, retry, replay)."
    );
    describe_counter!(
        LEDGER_ERRORS,
        "Ledger statements that failed, by operation."
    );
    describe_counter!(RETRIES_SCHEDULED, "Retries scheduled (retry_wait) by tool.");
    describe_counter!(
        BUDGET_DEFERRALS,
        "Retries deferred because the tool's shared retry budget was empty."
    );
    describe_gauge!(
        BUDGET_AVAILABLE,
        "Retries the tool's shared token bucket allows right now (whole tokens above half its capacity)."
    );
    describe_gauge!(
        READY,
        "1 while this worker is ready (both broker links up and the ledger answers, as GET /readyz), else 0; refreshed on every scrape."
    );
    describe_counter!(
        LOCAL_RESOURCE_ERRORS,
        "Downstream requests that could not leave because this worker ran out of a local resource (open files, socket buffers, memory, local ports), by tool and kind (write, lookup); never counted as the downstream's failure."
    );
    describe_gauge!(
        RECEIPTS_KEPT,
        "Receipts the downstream returned that this worker holds in memory while the ledger cannot record them yet."
    );
    describe_counter!(
        RECEIPTS_DROPPED,
        "Receipts the downstream returned that were never recorded, by reason (age: WORKER_RECEIPT_KEEP_SECS passed, budget: too many kept, shutdown); each is logged with its key and receipt id."
    );
    describe_counter!(
        LEDGER_FAILOVERS,
        "Failovers this worker followed: its ledger host turned read-only, or the primary moved to another host of DATABASE_URL."
    );
    describe_counter!(
        SWEPT,
        "Rows touched by the retention sweeper, by kind (private_data, tombstone, outbox, redelivery, retry_spend, console_id)."
    );
}

/// Installs the global recorder and exports every counter an alert or dashboard reads at 0 for
/// its known label values (`tools`: the tool names of the tools file). Returns the handle that
/// renders the exposition text.
pub fn install(tools: &[String]) -> Result<PrometheusHandle, String> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(DOWNSTREAM_DURATION.to_string()),
            LATENCY_BUCKETS,
        )
        .map_err(|e| e.to_string())?
        .install_recorder()
        .map_err(|e| e.to_string())?;
    describe();
    // Counters that alerts and dashboards read start at 0 rather than being absent.
    counter!(INTENTS_RECEIVED).absolute(0);
    for header in ["traceparent", "tracestate"] {
        counter!(TRACE_CONTEXT_INVALID, "header" => header).absolute(0);
    }
    for reason in ["redelivery", "completed", "in_flight", "conflict"] {
        counter!(DUPLICATES, "reason" => reason).absolute(0);
    }
    gauge!(IN_FLIGHT).set(0.0);
    for link in ["consumer", "relay"] {
        counter!(BROKER_RECONNECTS, "link" => link).absolute(0);
    }
    for outcome in LATE_RECEIPT_OUTCOMES {
        counter!(LATE_RECEIPTS, "outcome" => *outcome).absolute(0);
    }
    for operation in LEDGER_OPERATIONS {
        counter!(LEDGER_ERRORS, "operation" => *operation).absolute(0);
    }
    for reason in crate::answers::DeadLetterReason::ALL {
        counter!(DEAD_LETTERED, "reason" => reason.as_str()).absolute(0);
        counter!(DEAD_LETTER_REFUSED, "reason" => reason.as_str()).absolute(0);
    }
    counter!(STALE_WRITES).absolute(0);
    gauge!(RECEIPTS_KEPT).set(0.0);
    counter!(LEDGER_FAILOVERS).absolute(0);
    for reason in ["age", "budget", "shutdown"] {
        counter!(RECEIPTS_DROPPED, "reason" => reason).absolute(0);
    }
    counter!(RESULTS_UNROUTABLE).absolute(0);
    for tool in tools {
        counter!(BUDGET_DEFERRALS, "tool" => tool.clone()).absolute(0);
        counter!(RETRIES_SCHEDULED, "tool" => tool.clone()).absolute(0);
        for kind in SEND_KINDS {
            counter!(STALE_SENDS_ABANDONED, "tool" => tool.clone(), "kind" => *kind).absolute(0);
        }
        for action in RECOVERY_ACTIONS {
            counter!(RECOVERIES, "tool" => tool.clone(), "action" => *action).absolute(0);
        }
        for outcome in crate::outcome::Polled::LABELS {
            counter!(POLLS, "tool" => tool.clone(), "outcome" => outcome).absolute(0);
        }
        counter!(ASYNC_DEADLINES, "tool" => tool.clone()).absolute(0);
        counter!(ABSENCE_PROOFS, "tool" => tool.clone()).absolute(0);
        for outcome in APPROVAL_OUTCOMES {
            counter!(APPROVALS, "tool" => tool.clone(), "outcome" => outcome).absolute(0);
        }
        for kind in ["write", "lookup"] {
            counter!(LOCAL_RESOURCE_ERRORS, "tool" => tool.clone(), "kind" => kind).absolute(0);
        }
    }
    // Not ready until the first scrape or probe proves otherwise.
    gauge!(READY).set(0.0);
    Ok(handle)
}

/// Refreshes the gauges that come from the ledger.
pub async fn refresh_ledger_gauges(ledger: &Ledger, tools: impl Iterator<Item = String>) {
    match ledger.count_by_state().await {
        Ok(rows) => {
            for state in State::ALL {
                let n = rows
                    .iter()
                    .find(|(s, _)| s == state.as_str())
                    .map_or(0, |(_, n)| *n);
                gauge!(OPERATIONS, "state" => state.as_str()).set(n as f64);
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot count operations by state"),
    }
    match ledger.unresolved_ages().await {
        Ok(rows) => {
            for tool in tools {
                for state in State::UNRESOLVED {
                    let row = rows
                        .iter()
                        .find(|r| r.tool == tool && r.state == state.as_str());
                    let labels = [
                        ("tool", tool.clone()),
                        ("state", state.as_str().to_string()),
                    ];
                    gauge!(OLDEST_UNRESOLVED, &labels)
                        .set(row.map_or(0.0, |r| r.oldest_age_secs.max(0.0)));
                    gauge!(UNRESOLVED, &labels).set(row.map_or(0.0, |r| r.count as f64));
                    if state == State::Held {
                        gauge!(HELD, "tool" => tool.clone())
                            .set(row.map_or(0.0, |r| r.count as f64));
                    }
                }
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot compute unresolved ages"),
    }
    match ledger.relay_backlog().await {
        Ok(n) => gauge!(RELAY_BACKLOG).set(n as f64),
        Err(e) => tracing::warn!(error = %e, "cannot count relay backlog"),
    }
}

/// Serves `GET /metrics`, `GET /livez` and `GET /readyz` (see [`super::health`]) with the
/// listener `limits` (header and idle timeouts, connection cap: [`kit::http`]) until `shutdown`
/// resolves.
#[allow(clippy::too_many_arguments)]
pub async fn serve(
    listener: std::net::TcpListener,
    limits: kit::http::Limits,
    handle: PrometheusHandle,
    ledger: Ledger,
    tools: Vec<String>,
    links: crate::amqp::LinkState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::routing::get;
    let exporter = handle.clone();
    let ready_ledger = ledger.clone();
    let links_for_metrics = links.clone();
    let app = axum::Router::new()
        .route("/livez", get(super::health::livez))
        .route(
            "/readyz",
            get(move || {
                let (links, ledger) = (links.clone(), ready_ledger.clone());
                async move { super::health::readyz(&links, &ledger).await }
            }),
        )
        .route(
            "/metrics",
            get(move || {
                let handle = handle.clone();
                let ledger = ledger.clone();
                let tools = tools.clone();
                let links = links_for_metrics.clone();
                async move {
                    // Sets the `intent_worker_ready` gauge.
                    let _ = super::health::readyz(&links, &ledger).await;
                    refresh_ledger_gauges(&ledger, tools.into_iter()).await;
                    kit::metrics::exposition(&handle)
                }
            }),
        );
    kit::metrics::serve(listener, limits, exporter, app, shutdown).await
}

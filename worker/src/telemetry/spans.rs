//! The worker's trace vocabulary: every span it records, named and attributed in one place
//! (OpenTelemetry messaging and HTTP client conventions, and our own attributes under
//! `intent_worker.*`). Spans exist only while an exporter records them
//! ([`kit::otel::recording`]); otherwise each function returns [`Span::none`] and costs nothing.
//!
//! | span | kind | parent | links |
//! | --- | --- | --- | --- |
//! | `process intents` ([`crate::amqp::trace::process_span`]) | consumer | the intent's context | |
//! | `send <tool>`: one per first dispatch or retry | internal | the delivery's span, or a root in the action's trace (sent by the scheduler) | the intent |
//! | `POST`, `GET`: the downstream request ([`http_client`]) | client | the send or recovery span | |
//! | `recover <tool>`: one per recovery round | internal | root in the action's trace | the intent |
//! | `operator <action>` | internal | root in the action's trace | the intent |
//! | `ledger admit`, `ledger fence`, `ledger complete`: one per commit batch | internal | none | every intent or send it carried |
//! | `publish results`: one per relay round | producer | none | every event it carried |
//!
//! "Root in the action's trace": a span started hours after the action's first spans ended is
//! not made their child; it is a new root with the action's trace id, linked to the intent's
//! context ([`kit::otel::root_in_trace`]).

use protocol::trace::TraceContext;
use tracing::field::Empty;
use tracing::Span;

use crate::ledger::Operation;

/// The span of one write attempt (first dispatch or retry) of `op`. With `parent` (the
/// delivery's span) it is its child; without, a root in the action's trace.
pub fn send(op: &Operation, parent: Option<&Span>) -> Span {
    if !kit::otel::recording() {
        return Span::none();
    }
    let span = tracing::info_span!(
        parent: parent.and_then(Span::id),
        "send",
        otel.name = format!("send {}", op.tool),
        otel.kind = "internal",
        intent_worker.tenant = op.tenant.as_str(),
        intent_worker.action_id = op.action_id.as_str(),
        intent_worker.tool = op.tool.as_str(),
        intent_worker.attempt = op.attempts as i64,
        intent_worker.fence = op.fence,
        intent_worker.outcome = Empty,
    );
    if parent.is_none() {
        in_actions_trace(&span, op);
    }
    span
}

/// The span of one recovery round on `op` (lookup, replay, hold, stored receipt): a root in the
/// action's trace.
pub fn recover(op: &Operation) -> Span {
    if !kit::otel::recording() {
        return Span::none();
    }
    let span = tracing::info_span!(
        parent: None,
        "recover",
        otel.name = format!("recover {}", op.tool),
        otel.kind = "internal",
        intent_worker.tenant = op.tenant.as_str(),
        intent_worker.action_id = op.action_id.as_str(),
        intent_worker.tool = op.tool.as_str(),
        intent_worker.attempt = op.attempts as i64,
        intent_worker.recovery_round = op.recovery_attempts as i64,
        intent_worker.fence = op.fence,
        intent_worker.recovery = Empty,
        intent_worker.outcome = Empty,
    );
    in_actions_trace(&span, op);
    span
}

/// The span of an operator action (`resolve`, `fail`, `recheck`) on `op`, by `operator`: a root
/// in the action's trace.
pub fn operator(op: &Operation, action: &'static str, operator: &str) -> Span {
    if !kit::otel::recording() {
        return Span::none();
    }
    let span = tracing::info_span!(
        parent: None,
        "operator",
        otel.name = format!("operator {action}"),
        otel.kind = "internal",
        intent_worker.tenant = op.tenant.as_str(),
        intent_worker.action_id = op.action_id.as_str(),
        intent_worker.tool = op.tool.as_str(),
        intent_worker.operator = operator,
        intent_worker.operator_action = action,
        intent_worker.outcome = Empty,
    );
    in_actions_trace(&span, op);
    span
}

/// The span of one ledger commit batch (`what`: admit, fence, complete), linked to the context
/// of every intent or send it carried.
pub fn ledger_batch<'a>(
    what: &'static str,
    size: usize,
    links: impl IntoIterator<Item = &'a TraceContext>,
) -> Span {
    if !kit::otel::recording() {
        return Span::none();
    }
    let span = tracing::info_span!(
        parent: None,
        "ledger",
        otel.name = format!("ledger {what}"),
        otel.kind = "internal",
        db.system.name = "postgresql",
        db.operation.batch.size = size as i64,
        intent_worker.batch = what,
    );
    for cx in links {
        kit::otel::link(&span, cx, "carried");
    }
    span
}

/// The span of one relay round publishing `size` result events, linked to each event's
/// context.
pub fn publish_results<'a>(
    exchange: &str,
    size: usize,
    links: impl IntoIterator<Item = &'a TraceContext>,
) -> Span {
    if !kit::otel::recording() {
        return Span::none();
    }
    let span = tracing::info_span!(
        parent: None,
        "publish results",
        otel.kind = "producer",
        messaging.system = "rabbitmq",
        messaging.operation.type = "send",
        messaging.operation.name = "publish",
        messaging.destination.name = exchange,
        messaging.batch.message_count = size as i64,
    );
    for cx in links {
        kit::otel::link(&span, cx, "event");
    }
    span
}

/// The span of one downstream request (HTTP client conventions), a child of the current span.
/// `url` must already be free of credentials and query.
pub fn http_client(method: &str, url: &reqwest::Url) -> Span {
    if !kit::otel::recording() {
        return Span::none();
    }
    tracing::info_span!(
        "http",
        otel.name = method,
        otel.kind = "client",
        otel.status_code = Empty,
        http.request.method = method,
        server.address = url.host_str().unwrap_or(""),
        server.port = url.port_or_known_default().map_or(0, i64::from),
        url.full = url.as_str(),
        http.response.status_code = Empty,
        error.type = Empty,
    )
}

/// Makes `span` (created without a parent) a root in `op`'s trace, linked to its intent; with
/// no stored context it is the root of a trace of its own.
fn in_actions_trace(span: &Span, op: &Operation) {
    if let Some(origin) = op.trace() {
        kit::otel::root_in_trace(span, &origin, "intent");
    }
}

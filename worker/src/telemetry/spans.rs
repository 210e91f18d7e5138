//! The worker's trace vocabulary: every span it records, named and attributed in one place
//! (OpenTelemetry messaging and HTTP client conventions, and our own attributes under
//! `intent_worker.*`). A span is made only when it will be recorded: an exporter runs
//! ([`kit::otel::recording`]) and the sampler keeps its trace (decided before the span exists,
//! [`kit::otel::child_span`]); otherwise each function returns [`Span::none`] and costs next
//! to nothing, and the context that arrived is passed on instead.
//!
//! | span | kind | parent | links |
//! | --- | --- | --- | --- |
//! | `process intents` ([`crate::amqp::trace::process_span`]) | consumer | the intent's context | |
//! | `POST` (the tool's method): the dispatch span, one per first dispatch or retry ([`send`]) | client | the delivery's span, or a root in the action's trace (sent by the scheduler) | the intent |
//! | `GET`, `POST`: a recovery round's lookup or replay ([`http_client`]) | client | the recovery span | |
//! | `recover <tool>`: one per recovery round | internal | root in the action's trace | the intent |
//! | `poll <tool>`: one per status read of an accepted operation, with its `GET` client span | internal | root in the action's trace | the intent |
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

use crate::config::ToolConfig;
use crate::ledger::Operation;

/// The dispatch span of one write attempt (first dispatch or retry) of `op` to `tool`: an HTTP
/// client span (named by the method, with the conventions' request attributes; the adapter
/// records the answer's) that also carries the action's attributes. With `parent` (the
/// delivery's span) it is its child, and none when the delivery's span is none (not recorded);
/// without, a root in the action's trace.
pub fn send(op: &Operation, tool: &ToolConfig, parent: Option<&Span>) -> Span {
    let make = |parent: Option<tracing::Id>| {
        let (url, host, port) = split_url(&tool.url);
        tracing::info_span!(
            parent: parent,
            "send",
            otel.name = tool.method.as_str(),
            otel.kind = "client",
            otel.status_code = Empty,
            http.request.method = tool.method.as_str(),
            server.address = host,
            server.port = port,
            url.full = url,
            http.response.status_code = Empty,
            error.type = Empty,
            intent_worker.tenant = op.tenant.as_str(),
            intent_worker.action_id = op.action_id.as_str(),
            intent_worker.tool = op.tool.as_str(),
            intent_worker.attempt = op.attempts as i64,
            intent_worker.fence = op.fence,
            intent_worker.outcome = Empty,
        )
    };
    match parent {
        Some(p) if p.is_none() => Span::none(),
        Some(p) => make(p.id()),
        None => kit::otel::action_span(op.trace().as_ref(), || make(None)),
    }
}

/// The span of one recovery round on `op` (lookup, replay, hold, stored receipt): a root in the
/// action's trace.
pub fn recover(op: &Operation) -> Span {
    kit::otel::action_span(op.trace().as_ref(), || {
        tracing::info_span!(
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
        )
    })
}

/// The span of one poll of an accepted long-running operation `op`: a root in the action's
/// trace.
pub fn poll(op: &Operation) -> Span {
    kit::otel::action_span(op.trace().as_ref(), || {
        tracing::info_span!(
            parent: None,
            "poll",
            otel.name = format!("poll {}", op.tool),
            otel.kind = "internal",
            intent_worker.tenant = op.tenant.as_str(),
            intent_worker.action_id = op.action_id.as_str(),
            intent_worker.tool = op.tool.as_str(),
            intent_worker.remote_id = op.remote_id.as_deref().unwrap_or(""),
            intent_worker.fence = op.fence,
            intent_worker.outcome = Empty,
        )
    })
}

/// The span of an operator action (`resolve`, `fail`, `recheck`) on `op`, by `operator`: a root
/// in the action's trace.
pub fn operator(op: &Operation, action: &'static str, operator: &str) -> Span {
    kit::otel::action_span(op.trace().as_ref(), || {
        tracing::info_span!(
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
        )
    })
}

/// The span of one ledger commit batch (`what`: admit, fence, complete), linked to the span of
/// every delivery or send it carried that is recorded; none when it carried none.
pub fn ledger_batch(what: &'static str, size: usize, links: &[TraceContext]) -> Span {
    kit::otel::linked_span(links, "carried", || {
        tracing::info_span!(
            parent: None,
            "ledger",
            otel.name = format!("ledger {what}"),
            otel.kind = "internal",
            db.system.name = "postgresql",
            db.operation.batch.size = size as i64,
            intent_worker.batch = what,
        )
    })
}

/// The span of one relay round publishing `size` result events, linked to each event's
/// context; none when none of them is recorded.
pub fn publish_results(exchange: &str, size: usize, links: &[TraceContext]) -> Span {
    kit::otel::linked_span(links, "event", || {
        tracing::info_span!(
            parent: None,
            "publish results",
            otel.kind = "producer",
            messaging.system = "rabbitmq",
            messaging.operation.type = "send",
            messaging.operation.name = "publish",
            messaging.destination.name = exchange,
            messaging.batch.message_count = size as i64,
        )
    })
}

/// The span of one downstream request: the current span when it is a dispatch span
/// ([`send`], which declares the HTTP attributes), else a new client span, its child (a
/// recovery round's lookup or replay), only when the current span is recorded.
pub fn http_client(method: &str, url: &str) -> Span {
    let current = Span::current();
    if current.is_none() || !kit::otel::recording() {
        return Span::none();
    }
    if current.has_field("http.request.method") {
        return current;
    }
    let (url, host, port) = split_url(url);
    tracing::info_span!(
        "http",
        otel.name = method,
        otel.kind = "client",
        otel.status_code = Empty,
        http.request.method = method,
        server.address = host,
        server.port = port,
        url.full = url,
        http.response.status_code = Empty,
        error.type = Empty,
    )
}

/// `url` for a span: without query, fragment or credentials (a tools file may put a token
/// there), with its host and port (the scheme's default when absent). A plain split of an URL
/// the tools file already validated, without a full parse for every span.
fn split_url(url: &str) -> (String, &str, i64) {
    let url = url.split(['?', '#']).next().unwrap_or("");
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    let (host, port) = match host_port.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => match p.parse::<i64>() {
            Ok(p) => (h, Some(p)),
            Err(_) => (host_port, None),
        },
        _ => (host_port, None),
    };
    let port = port.unwrap_or(match scheme {
        "https" => 443,
        _ => 80,
    });
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (format!("{scheme}://{host_port}{path}"), host, port)
}

#[cfg(test)]
mod tests {
    use super::split_url;

    #[test]
    fn span_urls_keep_no_query_or_credentials() {
        assert_eq!(
            split_url("https://user:secret@pay.example:8443/refunds?token=abc#x"),
            (
                "https://pay.example:8443/refunds".to_string(),
                "pay.example",
                8443
            )
        );
        assert_eq!(
            split_url("http://127.0.0.1/replay/refunds"),
            (
                "http://127.0.0.1/replay/refunds".to_string(),
                "127.0.0.1",
                80
            )
        );
        assert_eq!(
            split_url("https://[::1]:9443/x"),
            ("https://[::1]:9443/x".to_string(), "::1", 9443)
        );
        assert_eq!(
            split_url("https://api.example"),
            ("https://api.example".to_string(), "api.example", 443)
        );
    }
}

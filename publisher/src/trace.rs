//! The W3C trace context an intent carries from the agent (the AMQP headers `traceparent` and
//! `tracestate`, [`protocol::trace`]): which context a publish sends, the producer span around
//! it, the headers themselves, and how a context received by the agent side (an outbox row, an
//! MCP `_meta`, an HTTP header at the MCP gateway) is read and, when malformed, counted.
//!
//! Which context a publish sends, in order:
//! 1. the one the caller passed ([`PublishOptions::with_trace`]);
//! 2. with the feature `otel`, the current one ([`kit::otel::current`]: the current `tracing`
//!    span when an OpenTelemetry layer records it, else OpenTelemetry's current context);
//! 3. none: the message has no trace headers.
//!
//! With `otel`, every publish runs in a producer span named as the OpenTelemetry messaging
//! conventions ask (`publish intents`); the context above is its remote parent, and what goes on
//! the wire is [`kit::otel::outgoing`]: that span's own context when an OpenTelemetry layer
//! records it, else the context above unchanged (a publisher that exports nothing passes the
//! agent's context through, so the worker's spans still join the agent's trace).
//!
//! A context is advisory: a malformed one is never a reason to refuse an intent. The agent side
//! ignores a malformed `traceparent` (and drops a malformed `tracestate` alone), and counts each
//! in [`TRACE_CONTEXT_INVALID`].

use lapin::types::{AMQPValue, FieldTable, ShortString};
use protocol::trace::{Incoming, TraceContext, TRACEPARENT, TRACESTATE};

/// Malformed trace context received on the agent side, by `source` (`outbox`, `mcp_meta`,
/// `http_header`) and `header` (`traceparent`: ignored, `tracestate`: dropped alone).
pub const TRACE_CONTEXT_INVALID: &str = "intent_publisher_trace_context_invalid_total";

/// What a publish (or an outbox row) carries besides the intent: for now, its trace context.
///
/// The default sends the current context (feature `otel`), or none without it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublishOptions {
    trace: Trace,
}

/// Where a publish's trace context comes from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
enum Trace {
    /// The current context (feature `otel`); none without the feature.
    #[default]
    Current,
    /// No parent at all, whatever is current: an outbox row stored without a context is
    /// published as it was enqueued, not under the relay's own span.
    Detached,
    /// The caller's context.
    Context(TraceContext),
    /// Header values sent exactly as given (no parent for the publish span).
    Verbatim {
        traceparent: String,
        tracestate: Option<String>,
    },
}

impl PublishOptions {
    /// The defaults: the current context (feature `otel`), else none.
    pub fn new() -> PublishOptions {
        PublishOptions::default()
    }

    /// Sends `trace` as the intent's context (the parent of the publish span); `None` goes back
    /// to the default, the current context.
    pub fn with_trace(mut self, trace: Option<TraceContext>) -> PublishOptions {
        self.trace = match trace {
            Some(cx) => Trace::Context(cx),
            None => Trace::Current,
        };
        self
    }

    /// Sends these header values exactly as given, valid or not, instead of any context. For
    /// tools and tests that must deliver a malformed header on purpose (`publisher send
    /// --traceparent`); receivers ignore a malformed one. A `tracestate` goes only with a
    /// `traceparent`.
    pub fn with_verbatim_trace(
        mut self,
        traceparent: impl Into<String>,
        tracestate: Option<String>,
    ) -> PublishOptions {
        self.trace = Trace::Verbatim {
            traceparent: traceparent.into(),
            tracestate,
        };
        self
    }

    /// No parent and no context but the publish span's own (when recorded): the current one
    /// is not looked at.
    pub(crate) fn detached() -> PublishOptions {
        PublishOptions {
            trace: Trace::Detached,
        }
    }

    /// The context passed with [`PublishOptions::with_trace`], if any.
    pub fn trace(&self) -> Option<&TraceContext> {
        match &self.trace {
            Trace::Context(cx) => Some(cx),
            _ => None,
        }
    }

    /// The context these options name before any publish span exists: the explicit one, else
    /// (feature `otel`) the current one. `None` for verbatim values and detached options.
    fn parent(&self) -> Option<TraceContext> {
        match &self.trace {
            Trace::Context(cx) => Some(cx.clone()),
            #[cfg(feature = "otel")]
            Trace::Current => kit::otel::current(),
            #[cfg(not(feature = "otel"))]
            Trace::Current => None,
            Trace::Detached | Trace::Verbatim { .. } => None,
        }
    }

    /// The `traceparent` and `tracestate` values to store with an outbox row: the explicit or
    /// current context as it is now (the relay's publish span, later, is its child), or the
    /// verbatim values.
    pub(crate) fn stored(&self) -> (Option<String>, Option<String>) {
        match &self.trace {
            Trace::Verbatim {
                traceparent,
                tracestate,
            } => (Some(traceparent.clone()), tracestate.clone()),
            _ => match self.parent() {
                Some(cx) => (Some(cx.traceparent()), cx.state),
                None => (None, None),
            },
        }
    }
}

/// The names a publish is known by: the producer span's attributes (no span without `otel`).
#[cfg_attr(not(feature = "otel"), allow(dead_code))]
pub(crate) struct Names<'a> {
    pub exchange: &'a str,
    pub tenant: &'a str,
    pub action_id: &'a str,
    pub message_id: &'a str,
    /// Known for a decoded intent, not for an encoded body.
    pub tool: Option<&'a str>,
}

/// One publish's span (disabled without the feature `otel`) and the headers it sends.
pub(crate) struct Outgoing {
    pub span: tracing::Span,
    pub headers: Option<FieldTable>,
}

/// The span and headers of a publish named `names` with `options`. Call it once per message,
/// right before it is sent: the span starts here.
pub(crate) fn outgoing(names: &Names<'_>, options: &PublishOptions) -> Outgoing {
    let span = producer_span(names, options.trace == Trace::Detached);
    if let Trace::Verbatim {
        traceparent,
        tracestate,
    } = &options.trace
    {
        return Outgoing {
            span,
            headers: Some(headers(traceparent, tracestate.as_deref())),
        };
    }
    let parent = options.parent();
    let wire = on_the_wire(&span, parent);
    Outgoing {
        span,
        headers: wire.map(|cx| headers(&cx.traceparent(), cx.state.as_deref())),
    }
}

/// The `publish intents` span (the messaging conventions' name, kind and attributes). A
/// detached one has no `tracing` parent either, so no span around the call adopts it.
#[cfg(feature = "otel")]
fn producer_span(names: &Names<'_>, detached: bool) -> tracing::Span {
    macro_rules! span {
        ($($parent:tt)*) => {
            tracing::info_span!(
                $($parent)*
                "publish intents",
                otel.kind = "producer",
                messaging.system = "rabbitmq",
                messaging.operation.type = "send",
                messaging.operation.name = "publish",
                messaging.destination.name = %names.exchange,
                messaging.rabbitmq.destination.routing_key = %names.tenant,
                messaging.message.id = %names.message_id,
                intent_worker.tenant = %names.tenant,
                intent_worker.action_id = %names.action_id,
                intent_worker.tool = names.tool,
                otel.status_code = tracing::field::Empty,
                error.type = tracing::field::Empty,
            )
        };
    }
    if detached {
        span!(parent: None,)
    } else {
        span!()
    }
}

#[cfg(not(feature = "otel"))]
fn producer_span(_: &Names<'_>, _: bool) -> tracing::Span {
    tracing::Span::none()
}

/// What to send: the span's own context when recorded, else `parent` unchanged.
#[cfg(feature = "otel")]
fn on_the_wire(span: &tracing::Span, parent: Option<TraceContext>) -> Option<TraceContext> {
    if let Some(parent) = &parent {
        // Before anything reads the span's context, which starts it.
        kit::otel::set_remote_parent(span, parent);
    }
    kit::otel::outgoing(span, parent.as_ref())
}

#[cfg(not(feature = "otel"))]
fn on_the_wire(_: &tracing::Span, parent: Option<TraceContext>) -> Option<TraceContext> {
    parent
}

/// Marks a publish span failed, with the error's kind as `error.type`.
pub(crate) fn failed(span: &tracing::Span, error: &crate::PublishError) {
    span.record("otel.status_code", "ERROR");
    span.record("error.type", error.kind());
}

/// The AMQP headers of a context: long strings, under the names HTTP uses.
fn headers(traceparent: &str, tracestate: Option<&str>) -> FieldTable {
    let mut table = FieldTable::default();
    table.insert(
        ShortString::from(TRACEPARENT),
        AMQPValue::LongString(traceparent.into()),
    );
    if let Some(state) = tracestate.filter(|s| !s.is_empty()) {
        table.insert(
            ShortString::from(TRACESTATE),
            AMQPValue::LongString(state.into()),
        );
    }
    table
}

/// Reads a context the agent side received from `source` (a metrics label: `outbox`,
/// `mcp_meta`, `http_header`): a malformed `traceparent` is ignored, a malformed `tracestate`
/// dropped and the `traceparent` kept; each is counted and logged at debug level (the values
/// are the sender's, never logged).
pub fn receive(
    source: &'static str,
    traceparent: Option<&str>,
    tracestate: Option<&str>,
) -> Option<TraceContext> {
    match TraceContext::read(traceparent, tracestate) {
        Incoming::Absent => None,
        Incoming::Context {
            context,
            state_dropped,
        } => {
            if state_dropped {
                invalid(source, TRACESTATE);
            }
            Some(context)
        }
        Incoming::Malformed(reason) => {
            tracing::debug!(source, %reason, "ignored a malformed traceparent");
            invalid(source, TRACEPARENT);
            None
        }
    }
}

/// Counts one malformed `header` (`traceparent` or `tracestate`) received from `source`.
pub fn invalid(source: &'static str, header: &'static str) {
    metrics::counter!(
        TRACE_CONTEXT_INVALID,
        "source" => source,
        "header" => header
    )
    .increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn names() -> Names<'static> {
        Names {
            exchange: "intents",
            tenant: "t",
            action_id: "a",
            message_id: "t:a",
            tool: None,
        }
    }

    fn header(table: &FieldTable, name: &str) -> Option<String> {
        match table.inner().get(name)? {
            AMQPValue::LongString(s) => Some(String::from_utf8(s.as_bytes().to_vec()).unwrap()),
            other => panic!("{name} is {other:?}"),
        }
    }

    #[test]
    fn an_explicit_context_is_sent_as_is_without_a_recording_layer() {
        let cx = TraceContext {
            parent: protocol::trace::TraceParent::parse(GOOD).unwrap(),
            state: Some("rojo=1".into()),
        };
        let out = outgoing(&names(), &PublishOptions::new().with_trace(Some(cx)));
        let headers = out.headers.expect("headers");
        assert_eq!(header(&headers, TRACEPARENT).as_deref(), Some(GOOD));
        assert_eq!(header(&headers, TRACESTATE).as_deref(), Some("rojo=1"));
    }

    #[test]
    fn no_context_no_headers_and_verbatim_values_unchanged() {
        assert!(outgoing(&names(), &PublishOptions::new()).headers.is_none());
        assert!(outgoing(&names(), &PublishOptions::detached())
            .headers
            .is_none());
        let out = outgoing(
            &names(),
            &PublishOptions::new().with_verbatim_trace("garbage", None),
        );
        let headers = out.headers.unwrap();
        assert_eq!(header(&headers, TRACEPARENT).as_deref(), Some("garbage"));
        assert_eq!(header(&headers, TRACESTATE), None);
    }

    #[test]
    fn a_received_context_is_ignored_or_trimmed_when_malformed() {
        assert_eq!(receive("test", None, Some("a=b")), None);
        assert_eq!(receive("test", Some("garbage"), None), None);
        let cx = receive("test", Some(GOOD), Some("Not Valid")).unwrap();
        assert_eq!(cx.traceparent(), GOOD);
        assert_eq!(cx.state, None);
        let stored = PublishOptions::new().with_trace(Some(cx)).stored();
        assert_eq!(stored, (Some(GOOD.to_string()), None));
    }
}

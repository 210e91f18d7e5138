//! The bridge between our `tracing` spans and W3C trace context (feature `otel`): reading the
//! context of a span, giving a span a remote parent or a link, and choosing what context to send
//! onward. With the submodule [`export`] (feature `otel-export`, binaries only) spans become
//! OpenTelemetry spans exported over OTLP/HTTP.
//!
//! Two regimes, one rule for each:
//! - **Export on** (an OpenTelemetry layer records our spans): every span has a context of its
//!   own, and what goes onward (a downstream request, a result event) is the context of the
//!   span that sent or decided it.
//! - **Export off** (no layer): nothing of ours is recorded, so a context of our own would point
//!   at spans no backend has. The context that arrived is passed on unchanged instead (what the
//!   W3C recommendation asks of a hop that does not participate), so the agent's trace still
//!   joins the downstream's.
//!
//! Span kind, name and status use `tracing-opentelemetry`'s special fields (`otel.kind`,
//! `otel.name`, `otel.status_code`); attributes are ordinary span fields.

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use opentelemetry::KeyValue;
use protocol::trace::{TraceContext, TraceParent};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

#[cfg(feature = "otel-export")]
pub mod export;

static RECORDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether an OpenTelemetry layer records this process's spans (set when the log subscriber
/// installs one). Hot paths create their spans only then: with export off a span would cost
/// its allocation and record nothing.
pub fn recording() -> bool {
    RECORDING.load(std::sync::atomic::Ordering::Relaxed)
}

/// Marks spans as recorded from now on (the subscriber with the span layer is installed).
pub fn set_recording() {
    RECORDING.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// The OpenTelemetry span context for a received W3C context (remote).
pub fn span_context(cx: &TraceContext) -> SpanContext {
    let state = cx
        .state
        .as_deref()
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    SpanContext::new(
        TraceId::from_bytes(cx.parent.trace_id),
        SpanId::from_bytes(cx.parent.parent_id),
        TraceFlags::new(cx.parent.flags),
        true,
        state,
    )
}

/// The W3C context naming `sc` as the parent, when `sc` is valid.
pub fn from_span_context(sc: &SpanContext) -> Option<TraceContext> {
    if !sc.is_valid() {
        return None;
    }
    let state = sc.trace_state().header();
    Some(TraceContext {
        parent: TraceParent {
            trace_id: sc.trace_id().to_bytes(),
            parent_id: sc.span_id().to_bytes(),
            flags: sc.trace_flags().to_u8(),
        },
        state: (!state.is_empty()).then_some(state),
    })
}

/// The context of `span` as an OpenTelemetry layer records it; `None` without such a layer
/// (export off) or for a disabled span.
pub fn context_of(span: &Span) -> Option<TraceContext> {
    let cx = span.context();
    from_span_context(cx.span().span_context())
}

/// The context an application's code is in: its current `tracing` span when an OpenTelemetry
/// layer records it, else OpenTelemetry's own current context (an application that uses the
/// OpenTelemetry API directly). Both need the same `opentelemetry` (0.33) and
/// `tracing-opentelemetry` (0.34) versions as this crate; with others, pass the context
/// explicitly.
pub fn current() -> Option<TraceContext> {
    context_of(&Span::current()).or_else(|| {
        let cx = opentelemetry::Context::current();
        from_span_context(cx.span().span_context())
    })
}

/// Makes `parent` (a context that arrived from elsewhere) the parent of `span`. Call it before
/// the span is first entered; later it changes nothing.
pub fn set_remote_parent(span: &Span, parent: &TraceContext) {
    let cx = opentelemetry::Context::new().with_remote_span_context(span_context(parent));
    let _ = span.set_parent(cx);
}

/// Links `span` to the span `to` names, with `intent_worker.link` saying what the link is (the
/// intent a batch carried, the action a recovery round works on).
pub fn link(span: &Span, to: &TraceContext, kind: &'static str) {
    span.add_link_with_attributes(
        span_context(to),
        vec![KeyValue::new("intent_worker.link", kind)],
    );
}

/// What to send onward from `span`: its own context when it is recorded (export on), otherwise
/// `received` unchanged (export off: pass-through).
pub fn outgoing(span: &Span, received: Option<&TraceContext>) -> Option<TraceContext> {
    context_of(span).or_else(|| received.cloned())
}

/// A span for work on a message that carried `parent` (None: it carried no context), made by
/// `make` only if it will be recorded: nothing when spans are not recorded or the sampler drops
/// this trace (see [`export::decide`]); else the span, as the child of `parent` or as a root.
/// Without span export in this build every span is made (an application's own layer decides).
pub fn child_span(parent: Option<&TraceContext>, make: impl FnOnce() -> Span) -> Span {
    if !recording() {
        return Span::none();
    }
    #[cfg(feature = "otel-export")]
    {
        match export::decide(parent) {
            export::Decision::Drop => Span::none(),
            export::Decision::Child => {
                let span = make();
                if let Some(p) = parent {
                    set_remote_parent(&span, p);
                }
                span
            }
            export::Decision::Root(trace_id) => {
                let span = make();
                export::with_trace_id(trace_id, || {
                    let _ = span.context();
                });
                span
            }
        }
    }
    #[cfg(not(feature = "otel-export"))]
    {
        let span = make();
        if let Some(p) = parent {
            set_remote_parent(&span, p);
        }
        span
    }
}

/// A root span (made by `make` with `parent: None`) that links to `links`, made only if it will
/// be recorded: when one of them is sampled (a commit batch or a relay round carrying a
/// recorded action).
pub fn linked_span<'a>(
    links: impl IntoIterator<Item = &'a TraceContext> + Clone,
    kind: &'static str,
    make: impl FnOnce() -> Span,
) -> Span {
    if !recording() {
        return Span::none();
    }
    #[cfg(feature = "otel-export")]
    if !export::any_sampled(links.clone()) {
        return Span::none();
    }
    let span = make();
    for cx in links {
        link(&span, cx, kind);
    }
    span
}

/// A span (made by `make` with `parent: None`) for later work on an action whose intent
/// carried `origin`: a new root in the action's trace, linked to the intent
/// ([`root_in_trace`]), made only if the action's trace is recorded. Without `origin`, a root of
/// its own, made as [`child_span`] decides.
pub fn action_span(origin: Option<&TraceContext>, make: impl FnOnce() -> Span) -> Span {
    let Some(origin) = origin else {
        return child_span(None, make);
    };
    if !recording() {
        return Span::none();
    }
    #[cfg(feature = "otel-export")]
    if !export::any_sampled([origin]) {
        return Span::none();
    }
    let span = make();
    root_in_trace(&span, origin, "intent");
    span
}

/// Starts `span` (created with `parent: None`) as a new root in the trace of `origin`, linked
/// to it: a recovery round, an operator action or a lease expiry, hours after the span that
/// started the action ended, stays in the action's trace without becoming the child of a
/// finished span. Without export it only adds the link (which then records nothing).
pub fn root_in_trace(span: &Span, origin: &TraceContext, kind: &'static str) {
    link(span, origin, kind);
    #[cfg(feature = "otel-export")]
    export::with_trace_id(origin.parent.trace_id, || {
        // Starts the span now, while the id generator hands out `origin`'s trace id.
        let _ = span.context();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_context_survives_the_trip_through_opentelemetry() {
        let tp =
            TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        let cx = TraceContext {
            parent: tp,
            state: Some("rojo=00f067aa0ba902b7".into()),
        };
        let sc = span_context(&cx);
        assert!(sc.is_valid() && sc.is_remote() && sc.is_sampled());
        assert_eq!(from_span_context(&sc), Some(cx));
        assert_eq!(from_span_context(&SpanContext::empty_context()), None);
    }

    #[test]
    fn without_a_layer_the_received_context_is_passed_on() {
        let tp =
            TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap();
        let received = TraceContext::new(tp);
        let span = tracing::info_span!("no subscriber");
        assert_eq!(context_of(&span), None);
        assert_eq!(outgoing(&span, Some(&received)), Some(received));
        assert_eq!(outgoing(&span, None), None);
    }
}

//! Trace context on AMQP messages: reading the `traceparent` / `tracestate` headers of an
//! intent (a malformed value is ignored and counted, never a reason to refuse the intent), the
//! `process intents` span of a delivery, and writing the headers of a result event.

use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use metrics::counter;
use protocol::trace::{self, TraceContext};
use tracing::Span;

use crate::telemetry::metrics as m;

/// A header's value as text; `Some(Err)` when it is there but not a string.
fn text(headers: &FieldTable, name: &str) -> Option<Result<String, ()>> {
    let value = headers.inner().get(name)?;
    Some(match value {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes())
            .map(str::to_owned)
            .map_err(|_| ()),
        AMQPValue::ShortString(s) => Ok(s.as_str().to_owned()),
        _ => Err(()),
    })
}

/// The trace context an intent carried. A `traceparent` that is not a string or breaks the
/// W3C format is ignored (the intent is processed as if it had none) and counted; so is a
/// malformed `tracestate`, while its `traceparent` is kept.
pub fn received(headers: Option<&FieldTable>) -> Option<TraceContext> {
    let headers = headers?;
    let parent = match text(headers, trace::TRACEPARENT)? {
        Ok(v) => v,
        Err(()) => {
            invalid(trace::TRACEPARENT, "not a string");
            return None;
        }
    };
    let state = text(headers, trace::TRACESTATE);
    let state_text = match &state {
        Some(Ok(s)) => Some(s.as_str()),
        Some(Err(())) => {
            invalid(trace::TRACESTATE, "not a string");
            None
        }
        None => None,
    };
    match TraceContext::read(Some(&parent), state_text) {
        trace::Incoming::Absent => None,
        trace::Incoming::Malformed(e) => {
            invalid(trace::TRACEPARENT, &e.to_string());
            None
        }
        trace::Incoming::Context {
            context,
            state_dropped,
        } => {
            if state_dropped {
                invalid(trace::TRACESTATE, "not a W3C tracestate list");
            }
            Some(context)
        }
    }
}

fn invalid(header: &'static str, why: &str) {
    counter!(m::TRACE_CONTEXT_INVALID, "header" => header).increment(1);
    tracing::debug!(header, why, "ignored a malformed trace context header");
}

/// The `process intents` span of one delivery (OpenTelemetry messaging conventions, consumer
/// side), a child of the context the intent carried; [`Span::none`] when it will not be
/// recorded ([`kit::otel::child_span`]). The intake step fills in the `intent_worker.*` fields
/// once the body is decoded.
pub fn process_span(d: &Delivery, parent: Option<&TraceContext>) -> Span {
    kit::otel::child_span(parent, || {
        let message_id = d
            .properties
            .message_id()
            .as_ref()
            .map(ShortString::as_str)
            .unwrap_or("");
        tracing::info_span!(
            "process intents",
            otel.kind = "consumer",
            messaging.system = "rabbitmq",
            messaging.operation.type = "process",
            messaging.operation.name = "process",
            messaging.destination.name = d.exchange.as_str(),
            messaging.rabbitmq.destination.routing_key = d.routing_key.as_str(),
            messaging.rabbitmq.message.delivery_tag = d.delivery_tag as i64,
            messaging.message.id = message_id,
            messaging.message.body.size = d.data.len() as i64,
            intent_worker.redelivered = d.redelivered,
            intent_worker.tenant = tracing::field::Empty,
            intent_worker.action_id = tracing::field::Empty,
            intent_worker.tool = tracing::field::Empty,
            intent_worker.outcome = tracing::field::Empty,
        )
    })
}

/// Adds the `traceparent` (and `tracestate`) headers of `cx` to `headers`.
pub fn write(headers: &mut FieldTable, cx: &TraceContext) {
    headers.insert(
        trace::TRACEPARENT.into(),
        AMQPValue::LongString(LongString::from(cx.traceparent())),
    );
    if let Some(state) = &cx.state {
        headers.insert(
            trace::TRACESTATE.into(),
            AMQPValue::LongString(LongString::from(state.as_str())),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), v.clone());
        }
        t
    }

    fn long(s: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(s))
    }

    #[test]
    fn headers_are_read_as_a_receiver_must() {
        assert_eq!(received(None), None);
        assert_eq!(received(Some(&table(&[]))), None);
        let cx = received(Some(&table(&[
            ("traceparent", long(TP)),
            ("tracestate", long("congo=t61rcWkgMzE")),
        ])))
        .unwrap();
        assert_eq!(cx.traceparent(), TP);
        assert_eq!(cx.state.as_deref(), Some("congo=t61rcWkgMzE"));
        // Garbage, wrong types and a bad tracestate: ignored, never an error.
        for bad in [
            long("{\"}"),
            AMQPValue::LongLongInt(7),
            long(&TP.to_uppercase()),
        ] {
            assert_eq!(
                received(Some(&table(&[("traceparent", bad.clone())]))),
                None
            );
        }
        let kept = received(Some(&table(&[
            ("traceparent", long(TP)),
            ("tracestate", AMQPValue::Boolean(true)),
        ])))
        .unwrap();
        assert_eq!(kept.state, None);
    }

    #[test]
    fn written_headers_read_back() {
        let cx = TraceContext {
            parent: trace::TraceParent::parse(TP).unwrap(),
            state: Some("a=b".into()),
        };
        let mut t = FieldTable::default();
        write(&mut t, &cx);
        assert_eq!(received(Some(&t)), Some(cx));
    }
}

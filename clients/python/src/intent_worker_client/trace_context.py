"""W3C trace context on the intents this client sends (the optional ``otel`` extra,
``opentelemetry-api``): the ``traceparent`` and ``tracestate`` message headers the worker reads,
so its spans join the agent's trace.

- With ``opentelemetry`` importable, every publish runs in a producer span ``publish intents``
  (the OpenTelemetry messaging conventions' name, kind and attributes) and the context is
  written with :func:`opentelemetry.propagate.inject` (the application's propagator; the
  default one writes ``traceparent``/``tracestate``, and only those two are sent). With the API
  alone the span does not record and the current context passes through unchanged; with an SDK
  it is recorded and its own context is sent.
- An explicit ``traceparent=``/``tracestate=`` wins over the current context: it is the
  span's parent, and when the span does not record (or the value does not parse) it is sent
  exactly as given. The worker ignores a malformed one; it never refuses the intent.
- Without the package: no span, no headers but explicit ones, and no import error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.trace import SpanKind

    AVAILABLE = True
except ImportError:  # the `otel` extra is not installed
    AVAILABLE = False

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
SPAN_NAME = "publish intents"
TRACER_NAME = "intent_worker_client"


def explicit_headers(traceparent: str | None, tracestate: str | None) -> dict[str, str]:
    """The headers of an explicit context, as given. ``tracestate`` only goes with a
    ``traceparent`` (raises :class:`ValueError` otherwise)."""
    if traceparent is None:
        if tracestate is not None:
            raise ValueError("tracestate is only sent with a traceparent")
        return {}
    headers = {TRACEPARENT: traceparent}
    if tracestate:
        headers[TRACESTATE] = tracestate
    return headers


@contextmanager
def publish_span(
    *,
    exchange: str,
    tenant: str,
    action_id: str,
    tool: str | None,
    traceparent: str | None = None,
    tracestate: str | None = None,
) -> Iterator[dict[str, str]]:
    """Runs a publish in its producer span (when ``opentelemetry`` is importable) and yields the
    message headers that carry the context: the span's own when it records, else the explicit
    or current one unchanged, else none. An exception raised inside marks the span failed."""
    explicit = explicit_headers(traceparent, tracestate)
    if not AVAILABLE:
        yield explicit
        return
    parent = propagate.extract(explicit) if explicit else None
    valid_parent = parent is None or trace.get_current_span(parent).get_span_context().is_valid
    if not valid_parent:
        # A value that does not parse: no parent (a fresh context, not the current one), and
        # the value is sent as given.
        parent = otel_context.Context()
    attributes: dict[str, str] = {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
        "messaging.destination.name": exchange,
        "messaging.rabbitmq.destination.routing_key": tenant,
        "messaging.message.id": f"{tenant}:{action_id}",
        "intent_worker.tenant": tenant,
        "intent_worker.action_id": action_id,
    }
    if tool is not None:
        attributes["intent_worker.tool"] = tool
    tracer = trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(
        SPAN_NAME, context=parent, kind=SpanKind.PRODUCER, attributes=attributes
    ) as span:
        if explicit and (not valid_parent or not span.is_recording()):
            yield explicit
            return
        yield _injected()


def _injected() -> dict[str, str]:
    """The current context as the propagator writes it, W3C headers only (a ``baggage`` header
    may carry application data, which is not the broker's to keep)."""
    headers: dict[str, str] = {}
    propagate.inject(headers)
    return {k: v for k, v in headers.items() if k in (TRACEPARENT, TRACESTATE)}


def current_headers(traceparent: str | None, tracestate: str | None) -> dict[str, str]:
    """The context to keep with an outbox row: the explicit one as given, else the current one
    (when ``opentelemetry`` is importable), else none. The relay's publish span, later, is its
    child."""
    explicit = explicit_headers(traceparent, tracestate)
    if explicit or not AVAILABLE:
        return explicit
    return _injected()


__all__ = [
    "AVAILABLE",
    "SPAN_NAME",
    "TRACEPARENT",
    "TRACESTATE",
    "current_headers",
    "explicit_headers",
    "publish_span",
]

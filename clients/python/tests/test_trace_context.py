"""W3C trace context on the client's publishes (``intent_worker_client.trace_context``), against
the real RabbitMQ (exchanges of the test's own, no worker) and Postgres for the outbox: a
publish inside a span carries its trace and runs in an exported ``publish intents`` producer
span; explicit ``traceparent=``/``tracestate=`` arguments win; with the OpenTelemetry API alone
the current context passes through; without ``opentelemetry`` installed nothing breaks and only
explicit headers are sent; outbox rows keep the context."""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aio_pika
import pytest
from conftest import AMQP_URL, _create_database, _drop_database, pg_connect
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from intent_worker_client import Intent, IntentClient, create_outbox, enqueue, trace_context

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
GOOD_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def ids(traceparent: str | None) -> list[str]:
    """The trace id and parent id of a ``traceparent`` (the flags vary: an SDK may set the
    random-trace-id bit)."""
    assert traceparent is not None
    return traceparent.split("-")[1:3]


@dataclass
class Broker:
    intents_exchange: str
    results_exchange: str
    queue: aio_pika.abc.AbstractQueue

    async def next(self) -> aio_pika.abc.AbstractIncomingMessage:
        for _ in range(200):
            message = await self.queue.get(no_ack=True, fail=False)
            if message is not None:
                return message
            await asyncio.sleep(0.02)
        raise AssertionError("no message reached the test exchange")


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    """Intents and results exchanges of the test's own and a queue catching every intent."""
    prefix = f"pytrace{uuid.uuid4().hex[:10]}"
    connection = await aio_pika.connect(AMQP_URL)
    channel = await connection.channel()
    intents = await channel.declare_exchange(
        f"{prefix}.intents", aio_pika.ExchangeType.TOPIC, durable=True
    )
    await channel.declare_exchange(f"{prefix}.results", aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(exclusive=True, auto_delete=True)
    await queue.bind(intents, routing_key="#")
    try:
        yield Broker(f"{prefix}.intents", f"{prefix}.results", queue)
    finally:
        for name in (f"{prefix}.intents", f"{prefix}.results"):
            await channel.exchange_delete(name)
        await connection.close()


async def connect(broker: Broker) -> IntentClient:
    return await IntentClient.connect(
        AMQP_URL,
        intents_exchange=broker.intents_exchange,
        results_exchange=broker.results_exchange,
    )


def refund(action_id: str) -> Intent:
    return Intent("north-shop", action_id, "refund", {"order": "o-1", "amount_cents": 100})


def header(message: aio_pika.abc.AbstractIncomingMessage, name: str) -> str | None:
    value = message.headers.get(name)
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class Recorder:
    provider: TracerProvider
    exporter: InMemorySpanExporter

    def spans(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name == name]


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    """An SDK tracer provider recording into memory, used by ``trace.get_tracer`` for the
    test only (the process-wide provider can be set once and is left alone)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    def get_tracer(name: str, *args: Any, **kwargs: Any) -> trace.Tracer:
        return provider.get_tracer(name)

    monkeypatch.setattr(trace, "get_tracer", get_tracer)
    yield Recorder(provider, exporter)
    provider.shutdown()


async def test_a_publish_inside_a_span_carries_its_trace(
    broker: Broker, recorder: Recorder
) -> None:
    client = await connect(broker)
    try:
        tracer = recorder.provider.get_tracer("agent")
        with tracer.start_as_current_span("agent step") as step:
            await client.publish(refund("in-span"))
        message = await broker.next()
    finally:
        await client.close()
    (publish,) = recorder.spans("publish intents")
    step_context = step.get_span_context()
    assert publish.context is not None and publish.parent is not None
    sent = header(message, "traceparent")
    # The agent's trace; the parent named on the wire is the publish span, the step's child.
    assert ids(sent) == [f"{step_context.trace_id:032x}", f"{publish.context.span_id:016x}"]
    assert publish.parent.span_id == step_context.span_id
    assert publish.kind is SpanKind.PRODUCER
    assert dict(publish.attributes or {}) == {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
        "messaging.destination.name": broker.intents_exchange,
        "messaging.rabbitmq.destination.routing_key": "north-shop",
        "messaging.message.id": "north-shop:in-span",
        "intent_worker.tenant": "north-shop",
        "intent_worker.action_id": "in-span",
        "intent_worker.tool": "refund",
    }
    assert publish.status.status_code is not StatusCode.ERROR


async def test_explicit_arguments_win_over_the_current_span(
    broker: Broker, recorder: Recorder
) -> None:
    client = await connect(broker)
    try:
        with recorder.provider.get_tracer("agent").start_as_current_span("agent step"):
            await client.publish(refund("explicit"), traceparent=GOOD, tracestate="rojo=1")
            # A value that does not parse is sent as given; the worker ignores it.
            await client.publish(refund("garbage"), traceparent="garbage")
            with pytest.raises(ValueError):
                await client.publish(refund("state-alone"), tracestate="rojo=1")
        explicit, garbage = await broker.next(), await broker.next()
        assert await broker.queue.get(no_ack=True, fail=False) is None
    finally:
        await client.close()
    publish = next(
        s
        for s in recorder.spans("publish intents")
        if (s.attributes or {}).get("intent_worker.action_id") == "explicit"
    )
    assert publish.context is not None and publish.parent is not None
    # The explicit context is the publish span's parent; the span's own context is sent.
    assert publish.parent.span_id == int("00f067aa0ba902b7", 16)
    assert ids(header(explicit, "traceparent")) == [GOOD_TRACE, f"{publish.context.span_id:016x}"]
    assert header(explicit, "tracestate") == "rojo=1"
    assert header(garbage, "traceparent") == "garbage"


async def test_with_the_api_alone_the_context_passes_through_unchanged(broker: Broker) -> None:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate

    client = await connect(broker)
    try:
        await client.publish(refund("none"))
        await client.publish(refund("explicit"), traceparent=GOOD, tracestate="rojo=1")
        # No SDK: the API's spans do not record, and the current context (here one extracted
        # from an incoming request) is what the message carries.
        token = otel_context.attach(
            propagate.extract({"traceparent": GOOD, "tracestate": "congo=2"})
        )
        try:
            await client.publish(refund("current"))
        finally:
            otel_context.detach(token)
        none, explicit, current = [await broker.next() for _ in range(3)]
    finally:
        await client.close()
    assert "traceparent" not in none.headers
    assert (header(explicit, "traceparent"), header(explicit, "tracestate")) == (GOOD, "rojo=1")
    assert (header(current, "traceparent"), header(current, "tracestate")) == (GOOD, "congo=2")


@pytest.fixture
def without_opentelemetry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The client as it runs where ``opentelemetry`` is not installed: every import of it fails
    while the fixture lasts, and the module is loaded again on both sides."""
    with monkeypatch.context() as patch:
        for name in [
            m for m in sys.modules if m == "opentelemetry" or m.startswith("opentelemetry.")
        ]:
            patch.setitem(sys.modules, name, None)
        patch.setitem(sys.modules, "opentelemetry", None)
        importlib.reload(trace_context)
        assert not trace_context.AVAILABLE
        yield
    importlib.reload(trace_context)
    assert trace_context.AVAILABLE


async def test_without_opentelemetry_nothing_breaks(
    broker: Broker, without_opentelemetry: None
) -> None:
    client = await connect(broker)
    try:
        await client.publish(refund("plain"))
        await client.publish(refund("explicit"), traceparent=GOOD)
        plain, explicit = await broker.next(), await broker.next()
    finally:
        await client.close()
    assert "traceparent" not in plain.headers
    assert header(explicit, "traceparent") == GOOD


def test_the_package_imports_without_opentelemetry() -> None:
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "import intent_worker_client as c\n"
        "assert not c.trace_context.AVAILABLE\n"
        "assert c.trace_context.current_headers(None, None) == {}\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_outbox_rows_keep_the_explicit_or_current_context(recorder: Recorder) -> None:
    name = f"pytrace_{uuid.uuid4().hex[:12]}"
    url = _create_database(name)
    try:
        with pg_connect(url) as conn:
            create_outbox(conn)
            enqueue(conn, refund("explicit"), traceparent=GOOD, tracestate="rojo=1")
            enqueue(conn, refund("none"))
            with recorder.provider.get_tracer("agent").start_as_current_span("step") as step:
                enqueue(conn, refund("current"))
            rows = conn.execute(
                "SELECT action_id, traceparent, tracestate FROM intent_outbox ORDER BY id"
            ).fetchall()
    finally:
        _drop_database(name)
    context = step.get_span_context()
    assert rows[:2] == [("explicit", GOOD, "rojo=1"), ("none", None, None)]
    assert rows[2][0] == "current" and rows[2][2] is None
    assert ids(rows[2][1]) == [f"{context.trace_id:032x}", f"{context.span_id:016x}"]

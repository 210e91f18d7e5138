"""The agent-side transactional outbox: ``enqueue`` inserts a validated intent into
``intent_outbox`` inside the caller's own psycopg 3 transaction, so the intent exists if and
only if the agent's own write commits. A relay (``publisher relay``) publishes the rows. The
table is a contract shared with the Rust publisher (clients/python/README.md, "Transactional outbox").

A row keeps the trace context the intent was enqueued in (``traceparent``, ``tracestate``): the
explicit one, else the current OpenTelemetry context with the ``otel`` extra
(:mod:`~intent_worker_client.trace_context`); the relay sends it as the message's headers.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection, Connection

from .intent import Intent
from .trace_context import TRACEPARENT, TRACESTATE, current_headers

OUTBOX_DDL = """\
CREATE TABLE IF NOT EXISTS intent_outbox (
    id              bigserial   PRIMARY KEY,
    tenant          text        NOT NULL,
    action_id       text        NOT NULL,
    body            text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text,
    sent_at         timestamptz
);
CREATE INDEX IF NOT EXISTS intent_outbox_due ON intent_outbox (next_attempt_at, id) WHERE sent_at IS NULL;
ALTER TABLE intent_outbox
    ADD COLUMN IF NOT EXISTS failed_at timestamptz,
    ADD COLUMN IF NOT EXISTS failure   text;
ALTER TABLE intent_outbox
    ADD COLUMN IF NOT EXISTS traceparent text,
    ADD COLUMN IF NOT EXISTS tracestate  text;
"""
"""The same DDL as ``publisher migrate`` (publisher/migrations/0001 to 0003); ``body`` is the
intent JSON exactly as published. A row the relay can never publish (its key over 255 bytes,
a body the worker's decoder refuses, a body whose key is not the row's) gets ``failed_at`` and
``failure`` and is skipped; :func:`enqueue` never inserts one. ``traceparent`` and
``tracestate`` (nullable) are the context the relay sends with the intent."""

_INSERT = (
    "INSERT INTO intent_outbox (tenant, action_id, body, traceparent, tracestate)"
    " VALUES (%s, %s, %s, %s, %s) RETURNING id"
)


def create_outbox(conn: Connection[Any]) -> None:
    """Creates ``intent_outbox`` if it does not exist (idempotent)."""
    conn.execute(OUTBOX_DDL)


def _row(
    intent: Intent, traceparent: str | None, tracestate: str | None
) -> tuple[str, str, str, str | None, str | None]:
    # The body column is text: the validated UTF-8 bytes, decoded back unchanged.
    body = intent.to_json().decode("utf-8")
    context = current_headers(traceparent, tracestate)
    return (
        intent.tenant,
        intent.action_id,
        body,
        context.get(TRACEPARENT),
        context.get(TRACESTATE),
    )


def enqueue(
    conn: Connection[Any],
    intent: Intent,
    *,
    traceparent: str | None = None,
    tracestate: str | None = None,
) -> int:
    """Validates ``intent`` as the worker will and inserts it in ``conn``'s current
    transaction; returns the row id. Nothing is published until that transaction commits and
    a relay picks the row up. Raises :class:`~intent_worker_client.InvalidIntent` (nothing
    inserted). The row keeps ``traceparent``/``tracestate`` when given, else the current
    OpenTelemetry context (``otel`` extra)."""
    row = conn.execute(_INSERT, _row(intent, traceparent, tracestate)).fetchone()
    assert row is not None
    return int(row[0])


async def enqueue_async(
    conn: AsyncConnection[Any],
    intent: Intent,
    *,
    traceparent: str | None = None,
    tracestate: str | None = None,
) -> int:
    """:func:`enqueue` for an ``AsyncConnection``."""
    cursor = await conn.execute(_INSERT, _row(intent, traceparent, tracestate))
    row = await cursor.fetchone()
    assert row is not None
    return int(row[0])

"""The agent-side transactional outbox: ``enqueue`` inserts a validated intent into
``intent_outbox`` inside the caller's own psycopg 3 transaction, so the intent exists if and
only if the agent's own write commits. A relay (``publisher relay``) publishes the rows. The
table is a contract shared with the Rust publisher (clients/python/README.md, "Transactional outbox").
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection, Connection

from .intent import Intent

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
"""
"""The same DDL as ``publisher migrate`` (publisher/migrations/0001 and 0002); ``body`` is the
intent JSON exactly as published. A row the relay can never publish (its key over 255 bytes,
a body the worker's decoder refuses, a body whose key is not the row's) gets ``failed_at`` and
``failure`` and is skipped; :func:`enqueue` never inserts one."""

_INSERT = "INSERT INTO intent_outbox (tenant, action_id, body) VALUES (%s, %s, %s) RETURNING id"


def create_outbox(conn: Connection[Any]) -> None:
    """Creates ``intent_outbox`` if it does not exist (idempotent)."""
    conn.execute(OUTBOX_DDL)


def _row(intent: Intent) -> tuple[str, str, str]:
    # The body column is text: the validated UTF-8 bytes, decoded back unchanged.
    return intent.tenant, intent.action_id, intent.to_json().decode("utf-8")


def enqueue(conn: Connection[Any], intent: Intent) -> int:
    """Validates ``intent`` as the worker will and inserts it in ``conn``'s current
    transaction; returns the row id. Nothing is published until that transaction commits and
    a relay picks the row up. Raises :class:`~intent_worker_client.InvalidIntent` (nothing
    inserted)."""
    row = conn.execute(_INSERT, _row(intent)).fetchone()
    assert row is not None
    return int(row[0])


async def enqueue_async(conn: AsyncConnection[Any], intent: Intent) -> int:
    """:func:`enqueue` for an ``AsyncConnection``."""
    cursor = await conn.execute(_INSERT, _row(intent))
    row = await cursor.fetchone()
    assert row is not None
    return int(row[0])

"""The action key ``<tenant>:<action_id>`` is the AMQP ``message_id``, at most 255 bytes, while
each field may be 200 characters. The client refuses a longer pair before anything is
published or inserted, with the worker's code ``key_too_long``; the longest pair that fits is
sent and answered like any other (a real worker, broker, Postgres and downstream)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import AMQP_URL, World, pg_connect

from intent_worker_client import (
    MAX_ACTION_KEY_BYTES,
    OUTBOX_DDL,
    Intent,
    IntentClient,
    InvalidIntent,
    Status,
    check_action_key,
    create_outbox,
    enqueue,
    result_routing_key,
)

TENANT = "T" * 200


def refund(tenant: str, action_id: str) -> Intent:
    return Intent(tenant, action_id, "refund", {"order": "order-731", "amount_cents": 4850})


def test_the_pair_is_bounded_not_only_each_field() -> None:
    check_action_key(TENANT, "b" * 54)
    with pytest.raises(InvalidIntent) as refused:
        check_action_key(TENANT, "b" * 55)
    assert refused.value.code == "key_too_long"
    assert "256 bytes" in refused.value.message
    with pytest.raises(InvalidIntent) as refused:
        refund(TENANT, "b" * 200).to_json()
    assert (refused.value.code, refused.value.field) == ("key_too_long", None)
    assert "401 bytes" in str(refused.value)
    # The per-field rules come first: a 201-character action_id is too_long, not key_too_long.
    with pytest.raises(InvalidIntent) as refused:
        refund(TENANT, "b" * 201).to_json()
    assert (refused.value.code, refused.value.field) == ("too_long", "action_id")


def test_a_result_routing_key_that_would_not_fit_falls_back_to_the_tenant() -> None:
    # The worker's protocol::result_routing_key: a routing key is a short string too.
    assert result_routing_key("north-shop", "agent-7") == "north-shop.@.agent-7"
    fits = "r" * (MAX_ACTION_KEY_BYTES - len(TENANT) - 3)
    assert result_routing_key(TENANT, fits) == f"{TENANT}.@.{fits}"
    assert result_routing_key(TENANT, fits + "r") == TENANT


async def test_a_key_over_255_bytes_is_refused_before_publishing_or_inserting(
    world: World, unique: str
) -> None:
    fits = refund(TENANT, (f"k-{unique}-" + "b" * 54)[:54])
    too_long = refund(TENANT, (f"k-{unique}-" + "b" * 55)[:55])
    assert len(fits.message_id) == MAX_ACTION_KEY_BYTES

    async with await IntentClient.connect(
        AMQP_URL,
        intents_exchange=world.intents_exchange,
        results_exchange=world.results_exchange,
    ) as client:
        with pytest.raises(InvalidIntent) as refused:
            await client.publish(too_long)
        assert refused.value.code == "key_too_long"
        body = (
            f'{{"tenant":"{TENANT}","action_id":"{too_long.action_id}","tool":"refund",'
            '"arguments":{}}'
        ).encode()
        with pytest.raises(InvalidIntent) as refused:
            await client.publish_body(body)
        assert refused.value.code == "key_too_long"
        # The longest pair that fits goes through the worker to the downstream, once.
        answer = await client.send_and_wait(fits, timeout=30)
    assert answer.status is Status.SUCCEEDED, answer
    assert world.mutations(fits.message_id) == 1
    assert world.mutations(too_long.message_id) == 0

    with pg_connect(world.db_url) as conn:
        create_outbox(conn)
        with pytest.raises(InvalidIntent) as refused:
            with conn.transaction():
                enqueue(conn, too_long)
        assert refused.value.code == "key_too_long"
        rows = conn.execute("SELECT count(*) FROM intent_outbox").fetchone()
        recorded = conn.execute(
            "SELECT count(*) FROM operations WHERE action_id = %s", (too_long.action_id,)
        ).fetchone()
    assert rows == (0,)
    assert recorded == (0,)


def test_the_outbox_ddl_is_the_publishers_migrations() -> None:
    # create_outbox makes the same table as `publisher migrate`, failed_at and failure included
    # (so `publisher relay`, which skips rows marked failed, can run against it) and the trace
    # context columns the relay reads.
    def statements(sql: str) -> list[str]:
        sql = re.sub(r"--[^\n]*", "", sql)
        return [" ".join(s.split()) for s in sql.split(";") if s.strip()]

    migrations = sorted((Path(__file__).resolve().parents[3] / "publisher/migrations").iterdir())
    assert [m.name[:4] for m in migrations] == ["0001", "0002", "0003"]
    expected = [s for m in migrations for s in statements(m.read_text())]
    assert statements(OUTBOX_DDL) == expected

"""The client against a real worker, RabbitMQ, Postgres and the reference downstream. Counts
of real writes come from the downstream's own table, never from logs."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from conftest import AMQP_URL, World, WorldFactory, pg_connect
from jsonschema import Draft202012Validator, FormatChecker

from intent_worker_client import (
    Intent,
    IntentClient,
    InvalidIntent,
    MissingActionId,
    NoAnswer,
    PublishError,
    RejectReason,
    ResultEvent,
    Status,
    action_scope,
    create_outbox,
    decode_intent,
    enqueue,
    intent_tool,
    result_routing_key,
)
from intent_worker_client.tool import answer_for

RESULT_SCHEMA = Draft202012Validator(
    json.loads(
        (Path(__file__).resolve().parents[3] / "docs/schema/result.schema.json").read_text()
    ),
    format_checker=FormatChecker(),
)


async def connect(world: World, **kwargs: Any) -> IntentClient:
    # bind_tenant: until the worker routes by <tenant>.@.<reply_to>, its events carry the
    # plain tenant key; the client filters those by action, so the tests hold for both.
    options: dict[str, Any] = {
        "intents_exchange": world.intents_exchange,
        "results_exchange": world.results_exchange,
        "bind_tenant": True,
    }
    options.update(kwargs)
    return await IntentClient.connect(AMQP_URL, **options)


def refund(world: World, action_id: str, amount: int = 4850, **kw: Any) -> Intent:
    return Intent(
        tenant=world.tenant,
        action_id=action_id,
        tool="refund",
        arguments={"order": "order-731", "amount_cents": amount, "currency": "USD"},
        **kw,
    )


async def test_send_and_wait_returns_the_receipt(world: World, unique: str) -> None:
    # An action id a URL or a shell would mangle: braces, quotes, slash, percent, question mark.
    action_id = f'refund/{{"n":1}}?%20&\'{unique}'
    async with await connect(world) as client:
        answer = await client.send_and_wait(refund(world, action_id), timeout=20)
    assert answer.status is Status.SUCCEEDED, answer
    RESULT_SCHEMA.validate(answer.to_dict())
    assert answer.receipt["idempotency_key"] == f"{world.tenant}:{action_id}"
    assert world.mutations(f"{world.tenant}:{action_id}") == 1


async def test_a_repeat_is_answered_from_the_ledger_not_dispatched(
    world: World, unique: str
) -> None:
    action_id = f"refund-{unique}"
    async with await connect(world) as client:
        first = await client.send_and_wait(refund(world, action_id, call_id="model-1"), 20)
        # The model "tries again" with a new call id and reordered arguments.
        again = Intent(
            world.tenant,
            action_id,
            "refund",
            {"currency": "USD", "amount_cents": 4850, "order": "order-731"},
            call_id="model-2",
        )
        second = await client.send_and_wait(again, 20)
        conflict = await client.send_and_wait(refund(world, action_id, amount=99999), 20)
    assert first.status is second.status is Status.SUCCEEDED
    assert second.receipt == first.receipt
    assert conflict.status is Status.REJECTED and conflict.reason is RejectReason.INTENT_CONFLICT
    RESULT_SCHEMA.validate(conflict.to_dict())
    assert world.mutations(f"{world.tenant}:{action_id}") == 1


async def test_lost_reply_is_pending_and_the_tool_says_do_not_retry(
    world: World, unique: str
) -> None:
    action_id = f"deploy-{unique}"
    key = f"{world.tenant}:{action_id}"
    # The downstream commits the deploy, then drops the connection: the outcome is unknown and
    # `deploy` has no recovery (none), so the worker must say pending and never resend.
    urllib.request.urlopen(
        urllib.request.Request(
            f"{world.downstream_url}/_control/faults",
            data=json.dumps({"kind": "drop_after_commit", "key": key}).encode(),
            headers={"content-type": "application/json"},
        ),
        timeout=5,
    ).read()

    async with await connect(world) as client:

        @intent_tool(client, tenant=world.tenant, timeout=4)
        async def deploy(service: str, version: str) -> None:
            """Deploy a service version."""

        with action_scope(action_id, call_id="call-1"):
            answer = await deploy(service="api", version="1.2.3")
            # The model insists; the application's action id keeps it one action.
            again = await deploy("api", "1.2.3")
    assert answer.status is Status.PENDING, answer
    assert answer.outcome_unknown
    assert "OUTCOME UNKNOWN" in str(answer) and "Do NOT retry" in str(answer)
    assert again.outcome_unknown
    RESULT_SCHEMA.validate(answer.event.to_dict())  # type: ignore[union-attr]
    assert world.mutations(key) == 1


async def test_tool_answer_and_action_id_come_from_the_application(
    world: World, unique: str
) -> None:
    async with await connect(world) as client:

        @intent_tool(client, tenant=world.tenant, name="refund", timeout=20)
        async def refund_order(order: str, amount_cents: int, currency: str = "USD") -> None:
            """Refund part of an order."""

        assert refund_order.tool_schema["required"] == ["order", "amount_cents"]  # type: ignore[attr-defined]
        assert "action_id" not in refund_order.tool_schema["properties"]  # type: ignore[attr-defined]
        with pytest.raises(MissingActionId):
            await refund_order("order-731", 100)
        with pytest.raises(TypeError):
            await refund_order("order-731", 100, action_id="model-chosen")
        with action_scope(f"refund-{unique}"):
            answer = await refund_order("order-731", 100)
    assert answer.status is Status.SUCCEEDED and str(answer).startswith("SUCCEEDED.")
    assert world.mutations(f"{world.tenant}:refund-{unique}") == 1

    with pytest.raises(TypeError):

        @intent_tool(client, tenant=world.tenant)
        async def sneaky(order: str, action_id: str) -> None: ...


async def test_invalid_intent_is_refused_before_anything_is_sent(world: World, unique: str) -> None:
    async with await connect(world) as client:
        with pytest.raises(InvalidIntent) as refused:
            await client.publish(Intent("north:shop", f"x-{unique}", "refund", {}))
        assert refused.value.code == "invalid_characters"
        # An unknown exchange is a clear error, not a hang.
    with pytest.raises(Exception) as missing:
        await IntentClient.connect(AMQP_URL, intents_exchange=f"nope-{unique}")
    assert "start a worker first" in str(missing.value)
    with pg_connect(world.db_url) as conn:
        row = conn.execute("SELECT count(*) FROM operations").fetchone()
    assert row == (0,)


async def test_restarted_agent_learns_the_answer_from_the_status_api(
    world: World, unique: str
) -> None:
    # Every character a URL path treats specially, so the status API call must quote it.
    action_id = f'r/{unique}?q=1#frag%2F{{"x"}}\\;+'
    async with await connect(world) as first:
        sent = await first.publish(refund(world, action_id))
        await first.wait_for(world.tenant, action_id, 20)
    # A new process: its queue never saw the event. Without the status API it hears nothing.
    async with await connect(world, reply_to=sent.reply_to) as restarted:
        with pytest.raises(NoAnswer):
            await restarted.wait_for(world.tenant, action_id, timeout=1)
    async with await connect(
        world,
        reply_to=sent.reply_to,
        status_url=world.admin_url,
        status_token=world.tenant_token,
    ) as restarted:
        answer = await restarted.wait_for(world.tenant, action_id, timeout=5)
        assert await restarted.status(world.tenant, f"never-{unique}") is None
    assert answer.status is Status.SUCCEEDED
    RESULT_SCHEMA.validate(answer.to_dict())
    assert world.mutations(f"{world.tenant}:{action_id}") == 1


async def test_outbox_rollback_publishes_nothing_and_commit_publishes_once(
    world: World, unique: str
) -> None:
    agent_db = world.db_url  # the agent's own database; here the same server, own table
    with pg_connect(agent_db) as conn:
        create_outbox(conn)
        create_outbox(conn)  # idempotent
        conn.execute("CREATE TABLE refunds_requested (order_id text PRIMARY KEY)")
        conn.commit()
        # The agent's own write and the intent, one transaction; rolled back: neither exists.
        with pytest.raises(RuntimeError):
            with conn.transaction():
                conn.execute("INSERT INTO refunds_requested VALUES ('order-1')")
                enqueue(conn, refund(world, f"rolled-back-{unique}", reply_to="agent-a"))
                raise RuntimeError("agent crashed before commit")
        with conn.transaction():
            conn.execute("INSERT INTO refunds_requested VALUES ('order-2')")
            enqueue(conn, refund(world, f"committed-{unique}", reply_to="agent-a"))
        with pytest.raises(InvalidIntent):
            with conn.transaction():
                enqueue(conn, Intent(world.tenant, "bad id", "refund", {}))
        rows = conn.execute(
            "SELECT id, body FROM intent_outbox WHERE sent_at IS NULL ORDER BY id"
        ).fetchall()
    assert [decode_intent(body.encode()).action_id for _, body in rows] == [f"committed-{unique}"]

    async with await connect(world, reply_to="agent-a") as client:
        await client._bind(world.tenant)  # bound before the relay publishes
        # A stand-in for `publisher relay`: publish each unsent body byte for byte, then mark.
        for row_id, body in rows:
            await client.publish_body(body.encode())
            with pg_connect(agent_db) as conn:
                conn.execute(
                    "UPDATE intent_outbox SET sent_at = now() WHERE id = %s AND sent_at IS NULL",
                    (row_id,),
                )
        answer = await client.wait_for(world.tenant, f"committed-{unique}", 20)
    assert answer.status is Status.SUCCEEDED
    assert world.mutations(f"{world.tenant}:committed-{unique}") == 1
    assert world.mutations(f"{world.tenant}:rolled-back-{unique}") == 0


async def test_results_for_another_agent_are_not_taken(world: World, unique: str) -> None:
    """Per-agent routing (<tenant>.@.<reply_to>): events are published by hand to the
    results exchange, so this holds whatever routing the worker build in use has."""
    tenant = world.tenant
    a = await IntentClient.connect(
        AMQP_URL,
        intents_exchange=world.intents_exchange,
        results_exchange=world.results_exchange,
        reply_to=f"a-{unique}",
    )
    b = await IntentClient.connect(
        AMQP_URL,
        intents_exchange=world.intents_exchange,
        results_exchange=world.results_exchange,
        reply_to=f"b-{unique}",
    )
    try:
        await a._bind(tenant)
        await b._bind(tenant)
        connection = await aio_pika.connect(AMQP_URL)
        channel = await connection.channel()
        exchange = await channel.get_exchange(world.results_exchange)

        def event(action_id: str, status: str, event_id: str) -> aio_pika.Message:
            body = {
                "tenant": tenant,
                "action_id": action_id,
                "tool": "refund",
                "status": status,
                "receipt": {"receipt_id": "r"} if status == "succeeded" else None,
                "next_action": "check_status" if status == "pending" else None,
                "attempts": 1,
                "message": "m",
                "fingerprint": None,
                "event_id": event_id,
                "occurred_at": "2025-01-01T00:00:00.000Z",
            }
            RESULT_SCHEMA.validate(body)
            return aio_pika.Message(json.dumps(body).encode(), content_type="application/json")

        for_a = result_routing_key(tenant, f"a-{unique}")
        await exchange.publish(event("x1", "pending", "e1"), routing_key=for_a)
        await exchange.publish(event("x1", "succeeded", "e2"), routing_key=for_a)
        await exchange.publish(event("x1", "pending", "e1"), routing_key=for_a)  # late repeat
        # A tenant "north-shop.@" could not exist; "north-shop.x" is another tenant's key space.
        await exchange.publish(
            event("x2", "succeeded", "e3"), routing_key=f"{tenant}x.@.a-{unique}"
        )
        await connection.close()

        got = await a.wait_for(tenant, "x1", timeout=5)
        assert got.status is Status.SUCCEEDED and got.event_id == "e2"
        with pytest.raises(NoAnswer):
            await b.wait_for(tenant, "x1", timeout=1)
        with pytest.raises(NoAnswer):
            await a.wait_for(tenant, "x2", timeout=1)
    finally:
        await a.close()
        await b.close()


async def test_unroutable_publish_is_an_error(world: World, unique: str) -> None:
    # An intents exchange with no queue bound: the mandatory publish comes back.
    connection = await aio_pika.connect(AMQP_URL)
    channel = await connection.channel()
    name = f"py-unbound-{unique}"
    await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC, auto_delete=True)
    try:
        async with await IntentClient.connect(
            AMQP_URL, intents_exchange=name, results_exchange=world.results_exchange
        ) as client:
            with pytest.raises(PublishError):
                await client.publish(refund(world, f"lost-{unique}"), timeout=10)
    finally:
        await channel.exchange_delete(name)
        await connection.close()


async def test_user_id_is_the_connection_user(world: World, unique: str) -> None:
    """The AMQP user_id is set (RabbitMQ refuses a publish whose user_id is not the
    connection's user, so a wrong one would fail here)."""
    seen: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
    connection = await aio_pika.connect(AMQP_URL)
    channel = await connection.channel()
    probe = await channel.declare_queue(exclusive=True)
    await probe.bind(world.intents_exchange, routing_key=world.tenant)
    await probe.consume(seen.put, no_ack=True)
    try:
        async with await connect(world) as client:
            sent = await client.publish(refund(world, f"uid-{unique}"))
        message = await asyncio.wait_for(seen.get(), 10)
        assert message.user_id == "guest"
        assert message.message_id == f"{world.tenant}:uid-{unique}"
        assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert message.content_type == "application/json"
        assert decode_intent(message.body) == sent and sent.reply_to == client.reply_to
    finally:
        await connection.close()


ALICE = "alice-approver-token-1234"
APPROVED_REFUND = """
[tools.approved_refund]
url = "{base}/replay/refunds"
recovery = "replay"
replay_window_secs = 3600
replay_safety_margin_secs = 60
approval = "required"
{common}
"""
REFUND_REVERSAL = """
[tools.refund_reversal]
url = "{base}/replay/refund-reversals"
recovery = "replay"
replay_window_secs = 3600
replay_safety_margin_secs = 60
compensation_for = ["refund"]
{common}
"""


def decide(world: World, action_id: str, verdict: str, fingerprint: str, reason: str) -> int:
    """``approve`` or ``reject`` as the approver alice; the HTTP status."""
    request = urllib.request.Request(
        f"{world.admin_url}/v1/operations/{world.tenant}/{action_id}/{verdict}",
        data=json.dumps(
            {"fingerprint": fingerprint, "reason": reason, "request_id": f"{verdict}-{action_id}"}
        ).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {ALICE}"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return int(response.status)


async def test_an_intent_awaiting_approval_is_not_sent_and_a_rejection_fails_it(
    make_world: WorldFactory, unique: str
) -> None:
    world = await make_world(
        tools=APPROVED_REFUND, env={"WORKER_APPROVER_TOKENS": f"alice={ALICE}"}
    )
    action_id = f"big-{unique}"
    key = f"{world.tenant}:{action_id}"
    async with await connect(world) as client:

        @intent_tool(client, tenant=world.tenant, name="approved_refund", timeout=10)
        async def approved_refund(order: str, amount_cents: int, currency: str = "USD") -> None:
            """Refund part of an order once a person approves it."""

        with action_scope(action_id):
            waiting = await approved_refund("order-731", 4850)
            # The model insists: the same row answers, still waiting, still nothing sent.
            again = await approved_refund("order-731", 4850)
        assert waiting.status is Status.PENDING and waiting.awaiting_approval, waiting
        assert str(waiting).startswith("AWAITING APPROVAL.") and "nothing has been sent" in str(
            waiting
        )
        assert waiting.outcome_unknown and again.awaiting_approval
        assert world.mutations(key) == 0
        event = waiting.event
        assert event is not None and event.fingerprint is not None

        assert decide(world, action_id, "reject", event.fingerprint, "not this week") == 200
        failed = await client.wait_for(world.tenant, action_id, 20, fingerprint=event.fingerprint)
    assert failed.status is Status.FAILED, failed
    assert (failed.detail, failed.verified_by, failed.operator) == (
        "not_approved",
        "operator",
        "alice",
    )
    text = str(answer_for(failed, "approved_refund", action_id))
    assert text.startswith("NOT APPROVED (nothing was sent"), text
    assert world.mutations(key) == 0


async def test_a_compensation_undoes_a_succeeded_action_once(
    make_world: WorldFactory, unique: str
) -> None:
    world = await make_world(tools=REFUND_REVERSAL)
    original, undo = f"refund-{unique}", f"undo-{unique}"
    async with await connect(
        world, status_url=world.admin_url, status_token=world.tenant_token
    ) as client:
        # Nothing to undo yet.
        missing = await client.compensate(
            original,
            "refund_reversal",
            {"reverses": original},
            tenant=world.tenant,
            action_id=f"early-{unique}",
            timeout=20,
        )
        assert missing.status is Status.REJECTED, missing
        assert missing.reason is RejectReason.ORIGINAL_NOT_FOUND
        assert missing.compensates == original

        done = await client.send_and_wait(refund(world, original), timeout=20)
        assert done.status is Status.SUCCEEDED, done
        undone = await client.compensate(
            original,
            "refund_reversal",
            {"reverses": original},
            tenant=world.tenant,
            action_id=undo,
            call_id="model-7",
            timeout=20,
        )
        assert undone.status is Status.SUCCEEDED, undone
        assert undone.compensates == original
        assert "undid action" in str(answer_for(undone, "refund_reversal", undo))
        # A second compensation of the same original is refused, naming the first.
        twice = await client.compensate(
            original,
            "refund_reversal",
            {"reverses": original},
            tenant=world.tenant,
            action_id=f"undo-again-{unique}",
            timeout=20,
        )
        assert twice.status is Status.REJECTED, twice
        assert (twice.reason, twice.detail) == (RejectReason.ALREADY_COMPENSATED, undo)
        # The original keeps its state and receipt, and says what undid it.
        status = await client.status(world.tenant, original)
        assert status is not None and status.status is Status.SUCCEEDED
        assert status.compensated_by == undo
        assert status.fingerprint == done.fingerprint

        # The original's agent (this client's reply_to) is told on its queue as well.
        async def told() -> ResultEvent:
            while True:
                for event in client._answers.get((world.tenant, original), []):
                    if event.compensated_by == undo:
                        return event
                await asyncio.sleep(0.1)

        again = await asyncio.wait_for(told(), 20)
    assert again.status is Status.SUCCEEDED and again.receipt == done.receipt
    assert world.mutations(f"{world.tenant}:{original}") == 1
    assert world.mutations(f"{world.tenant}:{undo}") == 1

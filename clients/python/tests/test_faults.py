"""The client when things go wrong around it: its broker link is cut mid-wait, and the worker
runs with tenant proof (``[auth] mode = "user_id"``) against a second RabbitMQ user."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
import urllib.parse
import uuid
from collections.abc import Iterator

import pytest
from conftest import AMQP_URL, FaultProxy, World, WorldFactory

from intent_worker_client import (
    Intent,
    IntentClient,
    NoAnswer,
    PublishError,
    PublishInDoubt,
    Status,
)


def refund(tenant: str, action_id: str) -> Intent:
    return Intent(
        tenant, action_id, "refund", {"order": "o-1", "amount_cents": 100, "currency": "USD"}
    )


async def test_broker_link_cut_mid_wait_still_yields_the_answer(world: World) -> None:
    host = urllib.parse.urlsplit(AMQP_URL)
    proxy = await FaultProxy(host.hostname or "127.0.0.1", host.port or 5672).start()
    unique = uuid.uuid4().hex[:8]
    try:
        client = await IntentClient.connect(
            proxy.amqp_url(),
            intents_exchange=world.intents_exchange,
            results_exchange=world.results_exchange,
            status_url=world.admin_url,
            status_token=world.tenant_token,
            bind_tenant=True,
        )
        try:
            sent = await client.publish(refund(world.tenant, f"cut-{unique}"))
            # The link dies right after the confirm: the exclusive results queue dies with it,
            # so the event is lost; the status API must still give the answer.
            proxy.cut()
            answer = await client.wait_for(
                world.tenant, sent.action_id, timeout=15, fingerprint=sent.fingerprint()
            )
            assert answer.status is Status.SUCCEEDED

            # While the link is down, a publish fails clearly instead of hanging.
            started = time.monotonic()
            with pytest.raises(PublishError):
                await client.publish(refund(world.tenant, f"during-{unique}"), timeout=3)
            assert time.monotonic() - started < 10

            # Back up: the robust connection re-declares the queue and its bindings, and the
            # next answer arrives through the queue.
            proxy.restore()
            deadline = time.monotonic() + 30
            while True:
                try:
                    again = await client.publish(refund(world.tenant, f"after-{unique}"), timeout=3)
                    break
                except PublishError:
                    assert time.monotonic() < deadline, "client did not reconnect"
                    await asyncio.sleep(0.5)
            answer = await client.wait_for(
                world.tenant,
                again.action_id,
                timeout=30,
                fingerprint=again.fingerprint(),
                poll_interval=60,
            )
            assert answer.status is Status.SUCCEEDED
            # It came through the re-declared queue (status API answers are not recorded there).
            heard = client._heard((world.tenant, again.action_id), again.fingerprint())
            assert heard is not None and heard.status is Status.SUCCEEDED
        finally:
            await client.close()
    finally:
        await proxy.close()
    for action in (f"cut-{unique}", f"after-{unique}"):
        assert world.mutations(f"{world.tenant}:{action}") == 1
    # The intent published while the link was down either never arrived or arrived once.
    assert world.mutations(f"{world.tenant}:during-{unique}") <= 1


async def test_a_node_list_connects_to_a_live_node_whatever_the_order(world: World) -> None:
    """One URL per node: a dead node in the list is skipped, as a list or comma-separated."""
    dead = AMQP_URL.replace(
        f"@{urllib.parse.urlsplit(AMQP_URL).netloc.rsplit('@', 1)[-1]}", "@127.0.0.1:1"
    )
    unique = uuid.uuid4().hex[:8]
    for i, urls in enumerate([[dead, AMQP_URL], f"{AMQP_URL},{dead}", [AMQP_URL, dead]] * 2):
        client = await IntentClient.connect(
            urls,
            intents_exchange=world.intents_exchange,
            results_exchange=world.results_exchange,
            bind_tenant=True,
        )
        try:
            sent = await client.publish(refund(world.tenant, f"list-{unique}-{i}"))
            answer = await client.wait_for(world.tenant, sent.action_id, timeout=30)
            assert answer.status is Status.SUCCEEDED
        finally:
            await client.close()


async def test_a_publish_cut_off_before_its_confirm_is_in_doubt_and_safe_to_send_again(
    world: World,
) -> None:
    host = urllib.parse.urlsplit(AMQP_URL)
    proxy = await FaultProxy(host.hostname or "127.0.0.1", host.port or 5672).start()
    unique = uuid.uuid4().hex[:8]
    intent = refund(world.tenant, f"doubt-{unique}")
    try:
        client = await IntentClient.connect(
            proxy.amqp_url(),
            intents_exchange=world.intents_exchange,
            results_exchange=world.results_exchange,
        )
        try:
            # Bind the results key first (a publish does on its tenant's first intent): the
            # stall must meet the publish itself.
            warm = await client.publish(refund(world.tenant, f"warm-{unique}"))
            assert warm.action_id
            # The link goes silent while the publish waits for its confirm, then dies.
            proxy.stall()
            publish = asyncio.create_task(client.publish(intent, timeout=20))
            await asyncio.sleep(0.5)
            proxy.cut()
            with pytest.raises(PublishInDoubt, match="safe"):
                await publish
        finally:
            await client.close()
    finally:
        await proxy.close()
    # Sent again under the same key, on a healthy link: done once.
    again = await IntentClient.connect(
        AMQP_URL,
        intents_exchange=world.intents_exchange,
        results_exchange=world.results_exchange,
        bind_tenant=True,
    )
    try:
        sent = await again.publish(intent)
        answer = await again.wait_for(world.tenant, sent.action_id, timeout=30)
        assert answer.status is Status.SUCCEEDED
    finally:
        await again.close()
    assert world.mutations(f"{world.tenant}:{intent.action_id}") == 1


def _rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def second_user() -> Iterator[tuple[str, str]]:
    """A RabbitMQ user of its own (unique name), deleted afterwards."""
    host = urllib.parse.urlsplit(AMQP_URL).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        pytest.skip(f"TEST_AMQP_URL is remote ({host}); rabbitmqctl cannot add a user there")
    if shutil.which("rabbitmqctl") is None:
        pytest.fail("rabbitmqctl not found; it is needed to add a second RabbitMQ user")
    name, password = f"py-agent-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    _rabbitmqctl("add_user", name, password)
    try:
        _rabbitmqctl("set_permissions", "-p", "/", name, ".*", ".*", ".*")
        yield name, password
    finally:
        _rabbitmqctl("delete_user", name)


async def test_user_id_tenant_proof_with_a_second_broker_user(
    make_world: WorldFactory, second_user: tuple[str, str]
) -> None:
    user, password = second_user
    world = await make_world(
        f'\n[auth]\nmode = "user_id"\nusers = {{ "{user}" = ["north-shop"] }}\n'
    )
    parts = urllib.parse.urlsplit(AMQP_URL)
    url = parts._replace(
        netloc=f"{urllib.parse.quote(user)}:{password}@{parts.hostname}:{parts.port or 5672}"
    ).geturl()
    unique = uuid.uuid4().hex[:8]
    common = {
        "intents_exchange": world.intents_exchange,
        "results_exchange": world.results_exchange,
        "bind_tenant": True,
    }
    async with await IntentClient.connect(url, **common) as client:
        answer = await client.send_and_wait(refund("north-shop", f"own-{unique}"), timeout=20)
        assert answer.status is Status.SUCCEEDED
        # Another tenant's name: dead-lettered as tenant_mismatch, no result for it, no write.
        with pytest.raises(NoAnswer):
            await client.send_and_wait(refund("south-shop", f"foreign-{unique}"), timeout=3)
    # Without user_id the worker cannot prove the tenant either.
    async with await IntentClient.connect(url, user_id=False, **common) as client:
        with pytest.raises(NoAnswer):
            await client.send_and_wait(refund("north-shop", f"anonymous-{unique}"), timeout=3)
    assert world.mutations(f"north-shop:own-{unique}") == 1
    assert world.mutations(f"south-shop:foreign-{unique}") == 0
    assert world.mutations(f"north-shop:anonymous-{unique}") == 0


async def test_closing_over_a_link_that_went_silent_returns_within_the_close_bound(
    world: World,
) -> None:
    """A link that goes silent (no reset, no bytes) does not hold up the end of the session:
    ``close`` returns within its bound instead of waiting for heartbeats to notice."""
    host = urllib.parse.urlsplit(AMQP_URL)
    proxy = await FaultProxy(host.hostname or "127.0.0.1", host.port or 5672).start()
    try:
        client = await IntentClient.connect(
            proxy.amqp_url(),
            intents_exchange=world.intents_exchange,
            results_exchange=world.results_exchange,
            bind_tenant=True,
        )
        proxy.stall()
        started = time.monotonic()
        await asyncio.wait_for(client.close(), 60)
        took = time.monotonic() - started
        assert took < 10, f"close over a silent link took {took:.1f} s"
    finally:
        await proxy.close()

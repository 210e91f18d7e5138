"""The AMQP side of an agent: publish intents (persistent, mandatory, publisher confirms, the
worker's own validation first) and wait for one action's answer on a results queue that only
this agent's events are routed to (``<tenant>.@.<reply_to>``), with the worker's status API as
the fallback for answers the queue missed (an agent that restarted, a queue bound too late).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import random
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)
from aio_pika.exceptions import AMQPError, ChannelInvalidStateError, DeliveryError

from .intent import Intent, InvalidIntent, decode_intent
from .result import InvalidResultEvent, RejectReason, ResultEvent
from .trace_context import explicit_headers, publish_span

log = logging.getLogger(__name__)

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2f"
REPLY_WORD = "@"
"""Separates a tenant from a reply_to in a result routing key; never a word of a tenant."""

_ANSWERS_KEPT = 10_000
_EVENT_IDS_KEPT = 50_000
_EVENTS_PER_ACTION = 16


def _answers_intent(event: ResultEvent, fingerprint: str | None) -> bool:
    """Whether ``event`` answers the intent with ``fingerprint`` (any, if ``None``). An
    ``expired`` rejection answers every intent of its key: the action is gone."""
    return (
        fingerprint is None
        or event.fingerprint == fingerprint
        or event.reason is RejectReason.EXPIRED
    )


_LINK_ERRORS = (AMQPError, ChannelInvalidStateError, asyncio.TimeoutError, ConnectionError)
"""What a broker call raises when the link or the broker fails it (a nack or a return is a
``DeliveryError``, caught before these where it matters)."""

MAX_ROUTING_KEY_BYTES = 255
"""The longest AMQP routing key (a short string), in bytes."""


def result_routing_key(tenant: str, reply_to: str | None) -> str:
    """The results routing key of an intent: ``<tenant>`` without ``reply_to``,
    ``<tenant>.@.<reply_to>`` with it (the worker's ``protocol::result_routing_key``). When
    that would be over :data:`MAX_ROUTING_KEY_BYTES` (``tenant`` and ``reply_to`` may each be
    200 characters), the worker routes the event ``<tenant>``, and so does this."""
    if reply_to is None:
        return tenant
    key = f"{tenant}.{REPLY_WORD}.{reply_to}"
    return key if len(key.encode("utf-8")) <= MAX_ROUTING_KEY_BYTES else tenant


class ClientError(Exception):
    """Base of the client's own errors."""


class PublishError(ClientError):
    """The broker did not take the intent: it was nacked, unroutable (no worker has declared
    the topology), or the connection failed before the confirm. The intent may or may not have
    reached a queue only in the last case; publishing it again is safe either way (the worker's
    inbox answers a repeat from the ledger)."""


class PublishInDoubt(PublishError):
    """The intent was handed to the broker but its confirm never arrived (the connection or its
    node died, or the confirm timed out): it may or may not be queued. Publishing it again under
    the same key is safe (the worker's inbox answers a repeat from the ledger); never send it
    under a new action id."""


class TopologyMissing(ClientError):
    """An exchange does not exist: no worker has started against this broker and names yet."""


class StatusApiError(ClientError):
    """The status API refused the request (bad token) or could not be reached."""


class NoAnswer(ClientError, TimeoutError):
    """Nothing at all was heard about the action before the timeout: not even ``pending``.
    Treat the outcome as unknown and do not submit the action again under a new id."""


def _url_list(amqp_url: str | Sequence[str]) -> list[str]:
    """One URL, a comma-separated list, or a sequence of URLs (one per cluster node)."""
    items = amqp_url.split(",") if isinstance(amqp_url, str) else list(amqp_url)
    urls = [u.strip() for u in items if u.strip()]
    if not urls:
        raise ValueError("no AMQP URL given")
    return urls


async def _connect_any(urls: list[str], **kwargs: Any) -> AbstractRobustConnection:
    """A robust connection to the first node, in a random order, that accepts. The connection
    reconnects to that node; a client whose node is gone for good connects again."""
    order = random.sample(urls, len(urls))
    last: BaseException | None = None
    for url in order:
        try:
            connection: AbstractRobustConnection = await aio_pika.connect_robust(url, **kwargs)
            return connection
        except (AMQPError, ConnectionError, OSError, asyncio.TimeoutError) as e:
            log.warning(
                "RabbitMQ node %s not reachable: %r",
                urllib.parse.urlsplit(url).netloc.rsplit("@", 1)[-1],
                e,
            )
            last = e
    assert last is not None
    raise last


class IntentClient:
    """One agent's connection. ``reply_to`` names this agent's results queue binding; each
    running agent of a tenant should have its own. Use :meth:`connect`::

        async with await IntentClient.connect(url, reply_to="agent-7") as client:
            answer = await client.send_and_wait(Intent(...), timeout=30)
    """

    def __init__(
        self,
        connection: AbstractRobustConnection,
        publish_channel: AbstractChannel,
        results_channel: AbstractChannel,
        intents: AbstractExchange,
        results_exchange: str,
        results_queue: AbstractQueue,
        *,
        reply_to: str,
        user_id: str | None,
        status_url: str | None,
        status_token: str | None,
        bind_tenant: bool,
    ) -> None:
        self._connection = connection
        self._publish_channel = publish_channel
        self._results_channel = results_channel
        self._intents = intents
        self._results_exchange = results_exchange
        self._queue = results_queue
        self.reply_to = reply_to
        self.user_id = user_id
        self._status_url = status_url.rstrip("/") if status_url else None
        self._status_token = status_token
        self._bind_tenant = bind_tenant
        self._bound: set[str] = set()
        self._bind_lock = asyncio.Lock()
        self._answers: collections.OrderedDict[tuple[str, str], list[ResultEvent]] = (
            collections.OrderedDict()
        )
        self._version = 0
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._changed = asyncio.Condition()

    @classmethod
    async def connect(
        cls,
        amqp_url: str | Sequence[str] = DEFAULT_AMQP_URL,
        *,
        reply_to: str | None = None,
        intents_exchange: str = "intents",
        results_exchange: str = "results",
        user_id: bool | str = True,
        status_url: str | None = None,
        status_token: str | None = None,
        bind_tenant: bool = False,
    ) -> IntentClient:
        """Connects and opens this agent's results queue (exclusive, deleted with the
        connection; the status API covers what happened while no queue existed).

        ``user_id``: ``True`` sets the AMQP ``user_id`` of every intent to the URL's user
        (RabbitMQ checks it; the worker's ``[auth] mode = "user_id"`` maps it to the tenant), a
        string sets that value, ``False`` leaves it out. ``status_url`` and ``status_token`` (a
        tenant token from ``WORKER_TENANT_TOKENS``) enable the status API fallback.
        ``bind_tenant`` also binds the plain ``<tenant>`` key, for workers that route every
        result by tenant; those events are filtered by action, but the queue then receives all
        of the tenant's results."""
        reply_to = reply_to or f"agent-{uuid.uuid4().hex[:12]}"
        # Validate reply_to with the contract's own rules before anything is declared.
        Intent("t", "a", "x", {}, reply_to=reply_to).to_json()
        urls = _url_list(amqp_url)
        if user_id is True:
            parsed = urllib.parse.urlsplit(urls[0])
            user: str | None = urllib.parse.unquote(parsed.username or "guest")
        elif user_id is False:
            user = None
        else:
            user = user_id
        connection = await _connect_any(
            urls, client_properties={"connection_name": f"intent-worker-client {reply_to}"}
        )
        try:
            publish_channel = await connection.channel(
                publisher_confirms=True, on_return_raises=True
            )
            try:
                intents = await publish_channel.get_exchange(intents_exchange, ensure=True)
            except AMQPError as e:
                raise TopologyMissing(
                    f"intents exchange {intents_exchange!r} not found: start a worker first ({e})"
                ) from e
            results_channel = await connection.channel()
            await results_channel.set_qos(prefetch_count=256)
            try:
                await results_channel.get_exchange(results_exchange, ensure=True)
            except AMQPError as e:
                raise TopologyMissing(
                    f"results exchange {results_exchange!r} not found: start a worker first ({e})"
                ) from e
            queue = await results_channel.declare_queue(exclusive=True, auto_delete=True)
        except BaseException:
            await connection.close()
            raise
        client = cls(
            connection,
            publish_channel,
            results_channel,
            intents,
            results_exchange,
            queue,
            reply_to=reply_to,
            user_id=user,
            status_url=status_url,
            status_token=status_token,
            bind_tenant=bind_tenant,
        )
        await queue.consume(client._on_message)
        return client

    async def close(self) -> None:
        await self._connection.close()

    async def __aenter__(self) -> IntentClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ---- publishing ---------------------------------------------------------------------------

    async def publish(
        self,
        intent: Intent,
        *,
        timeout: float | None = 30.0,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> Intent:
        """Validates the intent as the worker will, binds this agent's results key for its
        tenant (before publishing, so the answer cannot come first), and publishes it with
        confirms. An intent without ``reply_to`` gets this client's. Returns the intent as
        sent. Raises :class:`InvalidIntent` (nothing sent) or :class:`PublishError`.

        Trace context (:mod:`~intent_worker_client.trace_context`): ``traceparent`` and
        ``tracestate`` are sent as the message's headers when given; otherwise, with the
        ``otel`` extra, the current OpenTelemetry context is."""
        explicit_headers(traceparent, tracestate)  # a tracestate alone: before anything is sent
        if intent.reply_to is None:
            intent = replace(intent, reply_to=self.reply_to)
        body = intent.to_json()
        if intent.reply_to == self.reply_to:
            try:
                await asyncio.wait_for(self._bind(intent.tenant), timeout)
            except _LINK_ERRORS as e:
                # Nothing was published yet.
                raise PublishError(
                    f"intent {intent.message_id} was not sent: binding its results key "
                    f"failed ({e!r})"
                ) from e
        await self._publish_body(intent, body, timeout, traceparent, tracestate)
        return intent

    async def publish_body(
        self,
        body: bytes,
        *,
        timeout: float | None = 30.0,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> Intent:
        """Publishes an already serialized intent (an outbox row's ``body``) byte for byte,
        after validating it, with the row's trace context when given. For relays; agents use
        :meth:`publish`."""
        intent = decode_intent(body)
        await self._publish_body(intent, body, timeout, traceparent, tracestate)
        return intent

    async def _publish_body(
        self,
        intent: Intent,
        body: bytes,
        timeout: float | None,
        traceparent: str | None,
        tracestate: str | None,
    ) -> None:
        with publish_span(
            exchange=self._intents.name,
            tenant=intent.tenant,
            action_id=intent.action_id,
            tool=intent.tool,
            traceparent=traceparent,
            tracestate=tracestate,
        ) as headers:
            await self._send(intent, body, timeout, headers)

    async def _send(
        self, intent: Intent, body: bytes, timeout: float | None, headers: dict[str, str]
    ) -> None:
        message = aio_pika.Message(
            body,
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=intent.message_id,
            user_id=self.user_id,
            headers=dict(headers) or None,
        )
        try:
            # The outer bound also covers a robust channel that is still reconnecting.
            await asyncio.wait_for(
                self._intents.publish(
                    message, routing_key=intent.tenant, mandatory=True, timeout=timeout
                ),
                timeout,
            )
        except DeliveryError as e:
            # A nack or a return: the broker answered, and did not queue it.
            raise PublishError(
                f"intent {intent.message_id} was not accepted by the broker: {e!r}"
            ) from e
        except _LINK_ERRORS as e:
            raise PublishInDoubt(
                f"intent {intent.message_id}: the broker's confirm never arrived ({e!r}); it may "
                "or may not be queued, and publishing it again under the same key is safe"
            ) from e

    async def send_and_wait(
        self,
        intent: Intent,
        timeout: float = 30.0,
        *,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> ResultEvent:
        """:meth:`publish` (with the trace context, as there) then :meth:`wait_for` the same
        action."""
        sent = await self.publish(intent, traceparent=traceparent, tracestate=tracestate)
        return await self.wait_for(
            sent.tenant, sent.action_id, timeout, fingerprint=sent.fingerprint()
        )

    async def compensate(
        self,
        original_action_id: str,
        tool: str,
        arguments: Mapping[str, Any],
        *,
        tenant: str,
        action_id: str,
        call_id: str | None = None,
        timeout: float = 30.0,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> ResultEvent:
        """Undoes the ``succeeded`` action ``original_action_id`` of ``tenant``: sends the
        intent ``(tenant, action_id, tool, arguments)`` with ``compensates`` set to it, as
        :meth:`send_and_wait` does, and returns its answer.

        ``action_id`` is the compensation's own key, chosen by the application like any other
        (the same on every retry of this compensation, never the original's); ``tool`` must list
        the original's tool in its ``compensation_for``. The worker admits it only while the
        original is ``succeeded``; otherwise the answer is ``rejected`` with
        ``original_unresolved`` (``detail``: the original's state; reconcile it first),
        ``original_not_applied``, ``original_not_found``, ``already_compensated`` (``detail``:
        the live compensation's action id) or ``compensation_not_allowed``. Once the
        compensation succeeds, the original's ``reply_to`` also gets a ``succeeded`` event about
        the original with ``compensated_by``. Every answer about the compensation carries
        ``compensates``. To publish without waiting, :meth:`publish` an
        ``Intent(..., compensates=original_action_id)``."""
        intent = Intent(
            tenant=tenant,
            action_id=action_id,
            tool=tool,
            arguments=arguments,
            call_id=call_id,
            compensates=original_action_id,
        )
        return await self.send_and_wait(
            intent, timeout, traceparent=traceparent, tracestate=tracestate
        )

    # ---- results ------------------------------------------------------------------------------

    async def _bind(self, tenant: str) -> None:
        async with self._bind_lock:
            if tenant in self._bound:
                return
            await self._queue.bind(
                self._results_exchange, routing_key=result_routing_key(tenant, self.reply_to)
            )
            if self._bind_tenant:
                await self._queue.bind(self._results_exchange, routing_key=tenant)
            self._bound.add(tenant)

    def _accepts(self, routing_key: str, event: ResultEvent) -> bool:
        if event.tenant not in self._bound:
            return False
        if routing_key == result_routing_key(event.tenant, self.reply_to):
            return True
        return self._bind_tenant and routing_key == event.tenant

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        async with message.process(ignore_processed=True):
            try:
                event = ResultEvent.from_json(message.body)
            except InvalidResultEvent as e:
                log.warning("dropping a message that is not a result event: %s", e)
                return
            if not self._accepts(message.routing_key or "", event):
                return
            await self._record(event)

    async def _record(self, event: ResultEvent) -> None:
        if event.event_id in self._seen:
            return
        self._seen[event.event_id] = None
        if len(self._seen) > _EVENT_IDS_KEPT:
            self._seen.popitem(last=False)
        key = (event.tenant, event.action_id)
        events = self._answers.setdefault(key, [])
        events.append(event)
        del events[:-_EVENTS_PER_ACTION]
        self._answers.move_to_end(key)
        if len(self._answers) > _ANSWERS_KEPT:
            self._answers.popitem(last=False)
        async with self._changed:
            self._version += 1
            self._changed.notify_all()

    def _changed_since(self, version: int) -> bool:
        return self._version != version

    def _heard(self, key: tuple[str, str], fingerprint: str | None) -> ResultEvent | None:
        """The first final answer heard for the action (for the intent with ``fingerprint``,
        when given), else the latest pending, else ``None``."""
        events = [e for e in self._answers.get(key, ()) if _answers_intent(e, fingerprint)]
        final = next((e for e in events if e.is_final), None)
        return final or (events[-1] if events else None)

    async def wait_for(
        self,
        tenant: str,
        action_id: str,
        timeout: float = 30.0,
        *,
        fingerprint: str | None = None,
        poll_interval: float = 2.0,
    ) -> ResultEvent:
        """The first final answer (``succeeded``, ``failed``, ``rejected``) for the action, or,
        at the timeout, the latest ``pending``. Listens on this agent's results queue and, when
        the status API is configured, asks it every ``poll_interval`` seconds and once more at
        the timeout. With ``fingerprint`` (:meth:`Intent.fingerprint`) only answers to that
        intent count: a repeat of an action id with other arguments is answered
        ``intent_conflict``, while the stored operation keeps its own answer. Raises
        :class:`NoAnswer` if nothing was heard at all."""
        await self._bind(tenant)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        next_poll = loop.time() + min(poll_interval, timeout / 2)
        key = (tenant, action_id)
        latest: ResultEvent | None = None
        status_error: Exception | None = None
        while True:
            version = self._version
            heard = self._heard(key, fingerprint)
            if heard is not None:
                if heard.is_final:
                    return heard
                latest = heard
            now = loop.time()
            if now >= deadline:
                break
            if self._status_url and now >= next_poll:
                polled, status_error = await self._poll(
                    tenant, action_id, fingerprint, status_error
                )
                if polled is not None:
                    if polled.is_final:
                        return polled
                    latest = polled
                next_poll = loop.time() + poll_interval
            wake = min(deadline, next_poll) if self._status_url else deadline
            async with self._changed:
                try:
                    await asyncio.wait_for(
                        self._changed.wait_for(functools.partial(self._changed_since, version)),
                        timeout=max(0.0, wake - loop.time()),
                    )
                except asyncio.TimeoutError:
                    pass
        if self._status_url:
            polled, status_error = await self._poll(tenant, action_id, fingerprint, status_error)
            if polled is not None and (polled.is_final or latest is None):
                return polled
        if latest is not None:
            return latest
        raise NoAnswer(
            f"no answer for {tenant}:{action_id} within {timeout}s; the outcome is unknown, do "
            "not submit it again under a new action id"
            + (f" (status API: {status_error})" if status_error else "")
        )

    async def _poll(
        self,
        tenant: str,
        action_id: str,
        fingerprint: str | None,
        error: Exception | None,
    ) -> tuple[ResultEvent | None, Exception | None]:
        try:
            polled = await self.status(tenant, action_id)
        except StatusApiError as e:
            return None, e
        if polled is not None and not _answers_intent(polled, fingerprint):
            # The stored operation is another intent's: its answer is not ours.
            return None, error
        return polled, error

    async def status(self, tenant: str, action_id: str) -> ResultEvent | None:
        """The action's current answer from the worker's status API
        (``GET /v1/operations/{tenant}/{action_id}``), or ``None`` if the worker has no such
        action (yet). Needs ``status_url`` and a token."""
        if not self._status_url or not self._status_token:
            raise StatusApiError("status API not configured (status_url and status_token)")
        return await asyncio.to_thread(
            fetch_status, self._status_url, self._status_token, tenant, action_id
        )


def fetch_status(
    base_url: str, token: str, tenant: str, action_id: str, timeout: float = 5.0
) -> ResultEvent | None:
    """Blocking status API call (stdlib only): the current answer, or ``None`` on 404."""
    url = "{}/v1/operations/{}/{}".format(
        base_url.rstrip("/"),
        urllib.parse.quote(tenant, safe=""),
        urllib.parse.quote(action_id, safe=""),
    )
    request = urllib.request.Request(
        url, headers={"Authorization": f"Bearer {token}", "Accept": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body: Any = json.loads(response.read())
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise StatusApiError(f"status API answered {e.code} for {url}") from e
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise StatusApiError(f"status API request to {url} failed: {e}") from e
    try:
        return ResultEvent.from_json(body)
    except InvalidResultEvent as e:
        raise StatusApiError(f"status API returned something that is not a result: {e}") from e


__all__ = [
    "ClientError",
    "IntentClient",
    "InvalidIntent",
    "NoAnswer",
    "PublishError",
    "PublishInDoubt",
    "StatusApiError",
    "TopologyMissing",
    "fetch_status",
    "result_routing_key",
]

"""A decorator that turns a Python function signature into an intent-backed tool for an agent
framework. The model supplies the arguments; the application supplies the action id (from a
context set around the model's turn, or a callable), so a model that "tries again" reaches
the same ledger row instead of a new action. The return value is the worker's answer, worded
for the model: ``pending`` (and silence) reads as "outcome unknown, do not retry"; a ``pending``
that waits for a person's approval as "awaiting approval, nothing sent, do not retry".
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import types
import typing
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Union

from .client import IntentClient, NoAnswer
from .intent import Intent
from .result import ResultEvent, Status

_ACTION: ContextVar[tuple[str, str | None] | None] = ContextVar("intent_action", default=None)

# Names an intent-backed tool may not take as parameters: they are the application's to set.
RESERVED_PARAMETERS = ("tenant", "action_id", "call_id", "reply_to")


class MissingActionId(LookupError):
    """A tool was called outside :func:`action_scope` and without an ``action_id`` callable.
    The client never invents an action id: a fresh id per call is how duplicates happen."""


@contextlib.contextmanager
def action_scope(action_id: str, call_id: str | None = None) -> Iterator[None]:
    """Sets the action id (and optionally the model call id) for the tool calls made inside,
    e.g. around one model turn::

        with action_scope(f"refund-{order.id}", call_id=tool_call.id):
            answer = await refund(**tool_call.arguments)
    """
    token = _ACTION.set((action_id, call_id))
    try:
        yield
    finally:
        _ACTION.reset(token)


def action_from_scope(tool: str, arguments: Mapping[str, Any]) -> str:
    """The default action id source: the innermost :func:`action_scope`."""
    current = _ACTION.get()
    if current is None:
        raise MissingActionId(
            f"tool {tool!r} called without an action id: wrap the call in action_scope(...) or "
            "pass action_id=<callable> to intent_tool"
        )
    return current[0]


UNKNOWN_OUTCOME = (
    "OUTCOME UNKNOWN. The request for {tool} (action {action_id}) was recorded but its result "
    "is not known yet; it may still complete. Do NOT retry or resubmit it, and do not tell the "
    "user it failed. Its status can be checked later."
)

AWAITING_APPROVAL = (
    "AWAITING APPROVAL. The request for {tool} (action {action_id}) was recorded and waits for a "
    "person to approve these exact arguments; nothing has been sent. Do NOT retry or resubmit "
    "it, and do not call again under another action id. Tell the user it waits for approval; "
    "it runs once approved, or fails if it is rejected or not approved in time. Its status can "
    "be checked later."
)

NOT_APPROVED = (
    "NOT APPROVED (nothing was sent, and it will not be). A person rejected the request for "
    "{tool} (action {action_id})."
)

APPROVAL_EXPIRED = (
    "APPROVAL EXPIRED (nothing was sent, and it will not be). Nobody approved the request for "
    "{tool} (action {action_id}) before its wait ended."
)

NOT_APPROVED_ADVICE = (
    " Tell the user; do not call again under another action id to get around the decision."
)

IN_PROGRESS = (
    "ACCEPTED, IN PROGRESS. The downstream accepted the request for {tool} (action {action_id})"
    "{operation} and is still working on it; the worker checks its status until it is done. Do "
    "NOT retry or resubmit it, and do not tell the user it failed. Its status can be checked "
    "later."
)


@dataclass(frozen=True)
class ToolAnswer:
    """What an intent-backed tool returns. ``str(answer)`` is the text for the model;
    ``status`` is ``None`` when nothing was heard before the timeout (treated as pending)."""

    status: Status | None
    text: str
    event: ResultEvent | None

    @property
    def outcome_unknown(self) -> bool:
        """Not final: ``pending``, or nothing heard before the timeout. Whatever the reason
        (the write may or may not have happened, it is in progress, or it awaits a person's
        approval), the action must not be submitted again, and never under a new action id.
        :attr:`awaiting_approval` tells apart the one case in which nothing was sent."""
        return self.status is None or self.status is Status.PENDING

    @property
    def awaiting_approval(self) -> bool:
        """``pending`` with ``uncertainty`` ``awaiting_approval``: recorded, nothing sent, and
        nothing will be unless a person approves these exact arguments before the wait ends.
        :attr:`outcome_unknown` is true as well (the answer is not final)."""
        return self.event is not None and self.event.awaiting_approval

    @property
    def not_approved(self) -> bool:
        """``failed`` without being sent because its approval did not come: a person rejected it
        (``detail`` ``not_approved``) or its wait ended (``approval_expired``)."""
        return (
            self.event is not None
            and self.event.status is Status.FAILED
            and self.event.detail in ("not_approved", "approval_expired")
        )

    def __str__(self) -> str:
        return self.text


def answer_for(event: ResultEvent | None, tool: str, action_id: str) -> ToolAnswer:
    """Words an answer for the model."""
    if event is not None and event.awaiting_approval:
        text = AWAITING_APPROVAL.format(tool=tool, action_id=action_id)
        return ToolAnswer(event.status, text + f" Worker says: {event.message}", event)
    if (
        event is not None
        and event.status is Status.PENDING
        and event.uncertainty == "in_progress"
        and event.remote_id
    ):
        operation = f" as operation {event.remote_id}"
        text = IN_PROGRESS.format(tool=tool, action_id=action_id, operation=operation)
        return ToolAnswer(event.status, text + f" Worker says: {event.message}", event)
    if event is None or event.status is Status.PENDING:
        text = UNKNOWN_OUTCOME.format(tool=tool, action_id=action_id)
        if event is not None:
            text += f" Worker says: {event.message}"
        return ToolAnswer(None if event is None else event.status, text, event)
    if event.status is Status.SUCCEEDED:
        receipt = json.dumps(event.receipt, ensure_ascii=False, sort_keys=True)
        text = f"SUCCEEDED. {event.message} Receipt: {receipt}"
        if event.compensates:
            text += f" This undid action {event.compensates}."
        if event.compensated_by:
            text += f" It has since been undone by action {event.compensated_by}."
    elif event.status is Status.FAILED and event.detail == "not_approved":
        text = NOT_APPROVED.format(tool=tool, action_id=action_id)
        text += f" {event.message}{NOT_APPROVED_ADVICE}"
    elif event.status is Status.FAILED and event.detail == "approval_expired":
        text = APPROVAL_EXPIRED.format(tool=tool, action_id=action_id)
        text += f" {event.message}{NOT_APPROVED_ADVICE}"
    elif event.status is Status.FAILED:
        text = f"FAILED (it was not applied and will not be). {event.message}"
    else:
        reason = event.reason.value if event.reason else "rejected"
        text = f"REJECTED ({reason}; nothing was done). {event.message}"
        if event.detail:
            text += f" Detail: {event.detail}."
    return ToolAnswer(event.status, text, event)


ActionIdSource = Callable[[str, Mapping[str, Any]], str]
ClientSource = IntentClient | Callable[[], IntentClient]


def intent_tool(
    client: ClientSource,
    *,
    tenant: str | Callable[[], str],
    action_id: ActionIdSource = action_from_scope,
    name: str | None = None,
    timeout: float = 30.0,
) -> Callable[[Callable[..., Any]], Callable[..., Awaitable[ToolAnswer]]]:
    """Decorates a function whose signature (names, annotations, defaults, docstring)
    describes a tool. Calling the result publishes an intent (tool = ``name`` or the function's
    name, arguments = the bound parameters) and returns the worker's answer as a
    :class:`ToolAnswer`; the function's body is never run: the worker performs the action.

    ``action_id(tool, arguments)`` supplies the action id (default: :func:`action_scope`); the
    tool's parameters may not include ``tenant``, ``action_id``, ``call_id`` or ``reply_to``.
    Invalid arguments raise :class:`~intent_worker_client.InvalidIntent`, an unconfirmed
    publish raises :class:`~intent_worker_client.PublishError`; both before any answer."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Awaitable[ToolAnswer]]:
        signature = inspect.signature(fn)
        for parameter in signature.parameters.values():
            if parameter.name in RESERVED_PARAMETERS:
                raise TypeError(
                    f"{fn.__name__}: parameter {parameter.name!r} is set by the application, "
                    "never by the model; remove it from the tool's signature"
                )
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                raise TypeError(f"{fn.__name__}: *args/**kwargs cannot become named arguments")
        tool = name or fn.__name__

        @functools.wraps(fn)
        async def call(*args: Any, **kwargs: Any) -> ToolAnswer:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            key = action_id(tool, arguments)
            scope = _ACTION.get()
            call_id = scope[1] if scope is not None and scope[0] == key else None
            agent = client if isinstance(client, IntentClient) else client()
            intent = Intent(
                tenant=tenant if isinstance(tenant, str) else tenant(),
                action_id=key,
                tool=tool,
                arguments=arguments,
                call_id=call_id,
            )
            sent = await agent.publish(intent)
            try:
                event: ResultEvent | None = await agent.wait_for(
                    sent.tenant, sent.action_id, timeout, fingerprint=sent.fingerprint()
                )
            except NoAnswer:
                event = None
            return answer_for(event, tool, key)

        call.__signature__ = signature.replace(return_annotation=ToolAnswer)  # type: ignore[attr-defined]
        call.tool_schema = parameters_schema(fn)  # type: ignore[attr-defined]
        return call

    return decorate


_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}


def _json_type(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(options) == 1:
            return _json_type(options[0])
        return {}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(annotation))}
    kind = _JSON_TYPES.get(origin or annotation)
    return {"type": kind} if kind else {}


def parameters_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """A JSON Schema of the function's parameters, for frameworks that describe tools to the
    model that way (OpenAI-style function calling). Unknown annotations become ``{}``."""
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for parameter in inspect.signature(fn).parameters.values():
        properties[parameter.name] = _json_type(hints.get(parameter.name, Any))
        if parameter.default is inspect.Parameter.empty:
            required.append(parameter.name)
        else:
            properties[parameter.name]["default"] = parameter.default
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    if fn.__doc__:
        schema["description"] = inspect.cleandoc(fn.__doc__)
    return schema

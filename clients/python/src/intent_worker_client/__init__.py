"""Python client for the intent worker (message contract version 1).

- :class:`Intent`, :func:`decode_intent`, :class:`InvalidIntent`: the intent and a validator
  that mirrors the worker's strict decoder (rules, order, error codes).
- :func:`fingerprint`, :func:`canonical_json`: the worker's intent fingerprint.
- :class:`ResultEvent`, :class:`Status`, :class:`RejectReason`: the answer.
- :class:`IntentClient`: ``publish``, ``wait_for``, ``send_and_wait``, ``compensate`` (an
  intent that undoes a succeeded action) over RabbitMQ, with the status API
  (``GET /v1/operations/{tenant}/{action_id}``) as fallback.
- :func:`enqueue`, :func:`create_outbox`: the agent-side transactional outbox (psycopg 3).
- :mod:`~intent_worker_client.trace_context`: the W3C trace context every publish and outbox
  row carries (explicit ``traceparent=``/``tracestate=``, else the current OpenTelemetry
  context with the ``otel`` extra).
- :func:`intent_tool`, :func:`action_scope`: tools for agent frameworks.
"""

from . import trace_context
from .client import (
    ClientError,
    IntentClient,
    NoAnswer,
    PublishError,
    PublishInDoubt,
    StatusApiError,
    TopologyMissing,
    fetch_status,
    result_routing_key,
)
from .fingerprint import canonical_json, fingerprint
from .intent import (
    MAX_ACTION_KEY_BYTES,
    MAX_INTENT_BYTES,
    MAX_KEY_LEN,
    MAX_TOOL_LEN,
    Intent,
    InvalidIntent,
    action_key,
    check_action_key,
    decode_intent,
)
from .outbox import OUTBOX_DDL, create_outbox, enqueue, enqueue_async
from .result import InvalidResultEvent, RejectReason, ResultEvent, Status
from .tool import (
    MissingActionId,
    ToolAnswer,
    action_from_scope,
    action_scope,
    answer_for,
    intent_tool,
    parameters_schema,
)

__all__ = [
    "MAX_ACTION_KEY_BYTES",
    "MAX_INTENT_BYTES",
    "MAX_KEY_LEN",
    "MAX_TOOL_LEN",
    "OUTBOX_DDL",
    "ClientError",
    "Intent",
    "IntentClient",
    "InvalidIntent",
    "InvalidResultEvent",
    "MissingActionId",
    "NoAnswer",
    "PublishError",
    "PublishInDoubt",
    "RejectReason",
    "ResultEvent",
    "Status",
    "StatusApiError",
    "ToolAnswer",
    "TopologyMissing",
    "action_from_scope",
    "action_key",
    "action_scope",
    "answer_for",
    "canonical_json",
    "check_action_key",
    "create_outbox",
    "decode_intent",
    "enqueue",
    "enqueue_async",
    "fetch_status",
    "fingerprint",
    "intent_tool",
    "parameters_schema",
    "result_routing_key",
    "trace_context",
]

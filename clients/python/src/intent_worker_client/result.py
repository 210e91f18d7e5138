"""The result event the worker sends back (message contract version 1) as a dataclass. Decoding
is lenient in the same places as the worker's own reader (unknown fields ignored, absent
optional fields read as ``None``) so the contract can grow, and strict where it is not (status,
reason, attempts), so a reader never guesses what an answer means.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any


class Status(str, Enum):
    """What the agent should believe about the action."""

    SUCCEEDED = "succeeded"
    """Done; ``receipt`` is the downstream's original proof."""
    PENDING = "pending"
    """Not final: the outcome is unknown or still coming, or (``uncertainty``
    ``awaiting_approval``) nothing was sent and a person must approve it first. Either way, do
    not submit the action again; check its status later."""
    FAILED = "failed"
    """The downstream proved it did not and will not apply it, or it was never sent because its
    approval did not come (``detail``); evidence in ``message``."""
    REJECTED = "rejected"
    """Refused before any dispatch; see ``reason`` and ``detail``."""

    @property
    def is_final(self) -> bool:
        return self is not Status.PENDING


class RejectReason(str, Enum):
    """Why an intent was rejected."""

    INTENT_CONFLICT = "intent_conflict"
    INVALID_MESSAGE = "invalid_message"
    UNKNOWN_TOOL = "unknown_tool"
    TENANT_MISMATCH = "tenant_mismatch"
    EXPIRED = "expired"
    ORIGINAL_UNRESOLVED = "original_unresolved"
    """A compensation whose original is not settled yet (its state in ``detail``): undoing it
    now could make a second unintended effect. It must be reconciled first."""
    ORIGINAL_NOT_APPLIED = "original_not_applied"
    """A compensation whose original ``failed``: nothing was applied, nothing to undo."""
    ORIGINAL_NOT_FOUND = "original_not_found"
    """A compensation naming an action this tenant does not have."""
    ALREADY_COMPENSATED = "already_compensated"
    """The original already has a live compensation (its ``action_id`` in ``detail``)."""
    COMPENSATION_NOT_ALLOWED = "compensation_not_allowed"
    """The tool may not compensate that action (its ``compensation_for`` does not list the
    original's tool), or the intent names itself."""


class InvalidResultEvent(ValueError):
    """A body that is not a result event of this contract."""


@dataclass(frozen=True)
class ResultEvent:
    """One answer for ``(tenant, action_id)``. Events may arrive more than once: drop
    repeated copies by ``event_id``."""

    tenant: str
    action_id: str
    tool: str
    status: Status
    receipt: Any
    next_action: str | None
    attempts: int
    message: str
    fingerprint: str | None
    event_id: str
    occurred_at: str
    reason: RejectReason | None = None
    detail: str | None = None
    """On ``rejected``: the decode error code for ``invalid_message``, the final state for
    ``expired`` and ``original_unresolved``, the live compensation's action id for
    ``already_compensated``. On a ``failed`` that was never sent because its approval did not come:
    ``not_approved`` (a person rejected it) or ``approval_expired`` (its wait ended)."""
    verified_by: str | None = None
    """On ``succeeded`` and ``failed``: how the answer is known (``dispatch``, ``replay``,
    ``lookup``, ``poll``, ``callback``, ``late_receipt``, ``operator``, ``expiry``: an intent
    whose wait for approval ended, never sent); a newer worker may add values."""
    operator: str | None = None
    """The operator who settled the action, when ``verified_by`` is ``operator``."""
    remote_id: str | None = None
    """The downstream's identifier: the receipt id on ``succeeded``, its operation id once it
    accepted a long-running write."""
    uncertainty: str | None = None
    """On ``pending``: ``unknown_outcome``, ``in_progress``, ``held`` or ``awaiting_approval``
    (nothing sent: a person must approve these exact arguments first); a newer worker may add
    values."""
    retry_after_ms: int | None = None
    """On ``pending``: when the worker looks again, in milliseconds from ``occurred_at``."""
    compensates: str | None = None
    """On every event about a compensation: the ``action_id`` of the original it undoes."""
    compensated_by: str | None = None
    """On the ``succeeded`` event about an original, sent again when its compensation
    succeeded: the compensation's ``action_id``. The original keeps its state and receipt."""

    @property
    def awaiting_approval(self) -> bool:
        """``pending`` because a person must approve this exact intent first: nothing was sent,
        and nothing will be unless it is approved before its wait ends."""
        return self.status is Status.PENDING and self.uncertainty == "awaiting_approval"

    @property
    def is_final(self) -> bool:
        """``succeeded``, ``failed`` or ``rejected``: this answer will not change."""
        return self.status.is_final

    @classmethod
    def from_json(cls, body: bytes | str | Mapping[str, Any]) -> ResultEvent:
        """Reads an event from the results exchange or the status API."""
        if isinstance(body, Mapping):
            value: Any = body
        else:
            try:
                value = json.loads(body)
            except ValueError as e:
                raise InvalidResultEvent(f"result event is not JSON: {e}") from None
        if not isinstance(value, Mapping):
            raise InvalidResultEvent("result event must be a JSON object")
        try:
            status = Status(_required(value, "status", str))
            reason_text = _optional(value, "reason", str)
            reason = RejectReason(reason_text) if reason_text is not None else None
        except ValueError as e:
            raise InvalidResultEvent(str(e)) from None
        attempts = _required(value, "attempts", int)
        if isinstance(attempts, bool) or not 0 <= attempts <= 0xFFFF_FFFF:
            raise InvalidResultEvent(
                f"attempts must be an unsigned 32-bit integer, got {attempts!r}"
            )
        retry_after_ms = _optional(value, "retry_after_ms", int)
        if retry_after_ms is not None and (isinstance(retry_after_ms, bool) or retry_after_ms < 0):
            raise InvalidResultEvent(
                f"retry_after_ms must be a count of milliseconds, got {retry_after_ms!r}"
            )
        return cls(
            tenant=_required(value, "tenant", str),
            action_id=_required(value, "action_id", str),
            tool=_required(value, "tool", str),
            status=status,
            receipt=value.get("receipt"),
            next_action=_optional(value, "next_action", str),
            attempts=attempts,
            message=_required(value, "message", str),
            fingerprint=_optional(value, "fingerprint", str),
            event_id=_required(value, "event_id", str),
            occurred_at=_required(value, "occurred_at", str),
            reason=reason,
            detail=_optional(value, "detail", str),
            verified_by=_optional(value, "verified_by", str),
            operator=_optional(value, "operator", str),
            remote_id=_optional(value, "remote_id", str),
            uncertainty=_optional(value, "uncertainty", str),
            retry_after_ms=retry_after_ms,
            compensates=_optional(value, "compensates", str),
            compensated_by=_optional(value, "compensated_by", str),
        )

    def to_dict(self) -> dict[str, Any]:
        """The event in its wire shape (``reason`` and ``detail`` only when set)."""
        out: dict[str, Any] = {
            "tenant": self.tenant,
            "action_id": self.action_id,
            "tool": self.tool,
            "status": self.status.value,
            "receipt": self.receipt,
            "next_action": self.next_action,
            "attempts": self.attempts,
            "message": self.message,
            "fingerprint": self.fingerprint,
            "event_id": self.event_id,
            "occurred_at": self.occurred_at,
        }
        if self.reason is not None:
            out["reason"] = self.reason.value
        if self.detail is not None:
            out["detail"] = self.detail
        return out


def _required(value: Mapping[str, Any], name: str, kind: type) -> Any:
    if name not in value:
        raise InvalidResultEvent(f"result event has no {name!r}")
    item = value[name]
    if not isinstance(item, kind):
        raise InvalidResultEvent(f"result event field {name!r} must be {kind.__name__}")
    return item


def _optional(value: Mapping[str, Any], name: str, kind: type) -> Any:
    item = value.get(name)
    if item is not None and not isinstance(item, kind):
        raise InvalidResultEvent(f"result event field {name!r} must be {kind.__name__} or null")
    return item

"""Approval and compensation on the agent's side, without a broker: the fingerprint of a
compensation (pinned to the Rust ``protocol`` crate's value), the ``compensates`` field's rules,
the new result fields and reject reasons, the texts a model reads, and ``compensate``."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from intent_worker_client import (
    Intent,
    IntentClient,
    InvalidIntent,
    RejectReason,
    ResultEvent,
    Status,
    canonical_json,
    decode_intent,
    fingerprint,
)
from intent_worker_client.tool import answer_for

ARGUMENTS = {"order": "order-731", "amount_cents": 4850, "note": "café 😀"}

# Computed by the Rust protocol crate (`decode_intent` of the body below, then
# `Intent::fingerprint`, and `fingerprint_canonical_compensating("refund", "{}", "a\"b\\c")`).
COMPENSATING = "539053324a111818cc503853e13c70eafaced07b3de9cc0e34fd340835b412ca"
PLAIN = "509102ee3055d79eac27c555992e7e50aec874099feb249f4a621f209c4bcd0a"
ESCAPED_ORIGINAL = "c3398ec7fe5f058c86ba937e70953d8ca8376e5a37ff3fcf97301c48aab2e887"
BODY = (
    b'{"tenant":"north-shop","action_id":"refund-731-undo","tool":"cancel_refund",'
    b'"arguments":{"order":"order-731","amount_cents":4850,"note":"caf\\u00e9 \\ud83d\\ude00"},'
    b'"compensates":"refund-731"}'
)


def test_a_compensation_fingerprint_covers_the_original_as_rust_computes_it() -> None:
    intent = decode_intent(BODY)
    assert intent.compensates == "refund-731"
    assert intent.fingerprint() == COMPENSATING
    assert fingerprint("cancel_refund", ARGUMENTS, "refund-731") == COMPENSATING
    # The documented canonical form: the wrapper object with its keys in canonical order.
    wrapper = {"arguments": ARGUMENTS, "compensates": "refund-731", "tool": "cancel_refund"}
    text = canonical_json(wrapper)
    assert text.startswith('{"arguments":{') and ',"compensates":"refund-731","tool":' in text
    assert hashlib.sha256(text.encode()).hexdigest() == COMPENSATING
    # Without the field, the key is left out: an ordinary intent's fingerprint is unchanged.
    plain = Intent("north-shop", "refund-731-undo", "cancel_refund", ARGUMENTS)
    assert plain.fingerprint() == fingerprint("cancel_refund", ARGUMENTS) == PLAIN
    assert fingerprint("cancel_refund", ARGUMENTS, None) == PLAIN
    # Escaping of the original's id as JCS writes it.
    assert fingerprint("refund", {}, 'a"b\\c') == ESCAPED_ORIGINAL
    # Another original under the same key is another intent.
    assert fingerprint("cancel_refund", ARGUMENTS, "refund-732") != COMPENSATING


def test_compensates_travels_in_the_body_and_follows_the_action_id_rule() -> None:
    intent = Intent("north-shop", "undo-1", "cancel_refund", {"order": "o-1"}, compensates="r-1")
    body = json.loads(intent.to_json())
    assert body["compensates"] == "r-1"
    assert decode_intent(intent.to_json()) == intent
    assert "compensates" not in json.loads(Intent("t", "a", "x", {}).to_json())
    # null counts as absent, as for call_id and reply_to.
    assert (
        decode_intent(
            b'{"tenant":"t","action_id":"a","tool":"x","arguments":{},"compensates":null}'
        ).compensates
        is None
    )
    cases: list[tuple[Any, str]] = [
        ("", "empty_field"),
        ("refund 731", "invalid_characters"),
        ("r\u00e9fund", "invalid_characters"),
        ("r" * 201, "too_long"),
        (7, "wrong_type"),
    ]
    for value, code in cases:
        with pytest.raises(InvalidIntent) as refused:
            Intent("t", "a", "x", {}, compensates=value).to_json()
        assert (refused.value.code, refused.value.field) == (code, "compensates"), value
    assert Intent("t", "a", "x", {}, compensates="r" * 200).to_json()
    # One rule kind at a time across all fields, as the worker checks them.
    with pytest.raises(InvalidIntent) as refused:
        Intent("t", "a", "x", {}, reply_to="a b", compensates="").to_json()
    assert (refused.value.code, refused.value.field) == ("empty_field", "compensates")


def event(**fields: Any) -> ResultEvent:
    base: dict[str, Any] = {
        "tenant": "north-shop",
        "action_id": "refund-205",
        "tool": "refund",
        "status": "pending",
        "receipt": None,
        "next_action": "check_status",
        "attempts": 0,
        "message": "The refund waits for a person to approve these exact arguments.",
        "fingerprint": "ab" * 32,
        "event_id": "e-1",
        "occurred_at": "2026-01-01T00:00:00.000Z",
    }
    base.update(fields)
    return ResultEvent.from_json(base)


def test_new_result_fields_and_reject_reasons_are_read() -> None:
    undo = event(
        action_id="undo-1",
        status="succeeded",
        next_action=None,
        receipt={"receipt_id": "c-9"},
        compensates="refund-205",
    )
    assert (undo.compensates, undo.compensated_by) == ("refund-205", None)
    original = event(status="succeeded", next_action=None, compensated_by="undo-1")
    assert original.compensated_by == "undo-1"
    for reason in (
        "original_unresolved",
        "original_not_applied",
        "original_not_found",
        "already_compensated",
        "compensation_not_allowed",
    ):
        rejected = event(status="rejected", next_action=None, reason=reason, compensates="r-1")
        assert rejected.reason is RejectReason(reason) and rejected.is_final
    expired = event(status="failed", detail="approval_expired", verified_by="expiry")
    assert (expired.verified_by, expired.detail) == ("expiry", "approval_expired")
    assert event(uncertainty="awaiting_approval").awaiting_approval
    assert not event(uncertainty="unknown_outcome").awaiting_approval


def test_awaiting_approval_reads_nothing_sent_do_not_retry() -> None:
    answer = answer_for(event(uncertainty="awaiting_approval"), "refund", "refund-205")
    text = str(answer)
    assert text.startswith("AWAITING APPROVAL."), text
    assert "nothing has been sent" in text and "Do NOT retry" in text
    assert "under another action id" in text and "refund-205" in text
    assert "OUTCOME UNKNOWN" not in text
    assert answer.awaiting_approval and answer.status is Status.PENDING
    # Not final: never a reason to resubmit, whatever a caller checks.
    assert answer.outcome_unknown and not answer.not_approved
    unknown = answer_for(event(uncertainty="unknown_outcome"), "refund", "refund-205")
    assert str(unknown).startswith("OUTCOME UNKNOWN") and not unknown.awaiting_approval
    assert not answer_for(None, "refund", "refund-205").awaiting_approval


def test_a_request_not_approved_reads_as_never_sent() -> None:
    rejected = event(
        status="failed",
        next_action=None,
        detail="not_approved",
        verified_by="operator",
        operator="alice",
        message="alice rejected it: not this customer.",
    )
    answer = answer_for(rejected, "refund", "refund-205")
    text = str(answer)
    assert text.startswith("NOT APPROVED (nothing was sent"), text
    assert "alice rejected it" in text and "another action id" in text
    assert answer.not_approved and not answer.outcome_unknown
    expired = event(
        status="failed", next_action=None, detail="approval_expired", verified_by="expiry"
    )
    text = str(answer_for(expired, "refund", "refund-205"))
    assert text.startswith("APPROVAL EXPIRED (nothing was sent"), text
    assert "before its wait ended" in text
    # An ordinary failure keeps its wording.
    failed = event(status="failed", next_action=None, verified_by="dispatch")
    assert str(answer_for(failed, "refund", "refund-205")).startswith("FAILED (")
    assert not answer_for(failed, "refund", "refund-205").not_approved


def test_compensation_answers_name_both_actions() -> None:
    done = event(
        action_id="undo-1",
        status="succeeded",
        next_action=None,
        receipt={"receipt_id": "c-9"},
        compensates="refund-205",
    )
    assert "undid action refund-205" in str(answer_for(done, "cancel_refund", "undo-1"))
    original = event(status="succeeded", next_action=None, compensated_by="undo-1")
    assert "undone by action undo-1" in str(answer_for(original, "refund", "refund-205"))
    refused = event(
        action_id="undo-2",
        status="rejected",
        next_action=None,
        reason="already_compensated",
        detail="undo-1",
        compensates="refund-205",
    )
    text = str(answer_for(refused, "cancel_refund", "undo-2"))
    assert text.startswith("REJECTED (already_compensated; nothing was done)") and "undo-1" in text


async def test_compensate_sends_the_intent_with_compensates_and_waits() -> None:
    sent: list[tuple[Intent, float, dict[str, Any]]] = []
    answer = event(action_id="undo-1", status="succeeded", compensates="r-1")

    async def send_and_wait(intent: Intent, timeout: float, **kwargs: Any) -> ResultEvent:
        sent.append((intent, timeout, kwargs))
        return answer

    client = object.__new__(IntentClient)
    client.send_and_wait = send_and_wait  # type: ignore[method-assign]
    got = await client.compensate(
        "r-1",
        "cancel_refund",
        {"order": "o-1"},
        tenant="north-shop",
        action_id="undo-1",
        call_id="model-9",
        timeout=5,
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )
    assert got is answer
    [(intent, timeout, kwargs)] = sent
    assert intent == Intent(
        "north-shop", "undo-1", "cancel_refund", {"order": "o-1"}, "model-9", compensates="r-1"
    )
    assert timeout == 5 and kwargs["traceparent"].startswith("00-0af7")
    assert intent.fingerprint() == fingerprint("cancel_refund", {"order": "o-1"}, "r-1")

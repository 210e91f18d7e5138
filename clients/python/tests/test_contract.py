"""The machine-readable contract: the shared fixtures (docs/schema/fixtures, also decoded by
the Rust worker's decoder in protocol/tests/schema_fixtures.rs) against the JSON Schemas and
against this client's validator, and docs/schema/asyncapi.yaml against the official AsyncAPI
3.0.0 JSON Schema."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from jsonschema import Draft7Validator, Draft202012Validator, FormatChecker

from intent_worker_client import (
    Intent,
    InvalidIntent,
    InvalidResultEvent,
    ResultEvent,
    canonical_json,
    decode_intent,
    fingerprint,
)
from intent_worker_client.intent import CODES, parse_json

SCHEMA_DIR = Path(__file__).resolve().parents[3] / "docs" / "schema"
FIXTURES = SCHEMA_DIR / "fixtures"


def load_cases(kind: str) -> dict[str, Any]:
    cases: dict[str, Any] = json.loads((FIXTURES / kind / "cases.json").read_text())
    return cases


def body_of(kind: str, case: dict[str, Any]) -> bytes:
    if "file" in case:
        return (FIXTURES / kind / case["file"]).read_bytes()
    g = case["generated"]
    n = (g["bytes"] - len(g["prefix"]) - len(g["suffix"])) // len(g["fill"])
    body = (g["prefix"] + g["fill"] * n + g["suffix"]).encode()
    assert len(body) == g["bytes"]
    return body


def validator(name: str) -> Draft202012Validator:
    schema = json.loads((SCHEMA_DIR / name).read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema, format_checker=FormatChecker())


INTENT = load_cases("intent")
RESULT = load_cases("result")


def ids(cases: list[dict[str, Any]]) -> list[str]:
    return [c["name"] for c in cases]


def test_every_fixture_file_is_listed() -> None:
    for kind, cases in (("intent", INTENT), ("result", RESULT)):
        for folder in ("accepted", "rejected"):
            on_disk = {f"{folder}/{p.name}" for p in (FIXTURES / kind / folder).iterdir()}
            listed = {c["file"] for c in cases[folder] if "file" in c}
            assert on_disk == listed, (kind, folder)
    # Every rule of the decoder has at least one rejected fixture.
    codes = {c["code"] for c in INTENT["rejected"]}
    assert codes == set(CODES) and len(INTENT["accepted"]) >= 10


@pytest.mark.parametrize("case", INTENT["accepted"], ids=ids(INTENT["accepted"]))
def test_accepted_intent(case: dict[str, Any]) -> None:
    body = body_of("intent", case)
    intent = decode_intent(body)
    validator("intent.schema.json").validate(json.loads(body))
    # Re-serialising what was decoded gives a body the worker accepts, with the same fields.
    again = decode_intent(intent.to_json())
    assert again == intent


@pytest.mark.parametrize("case", INTENT["rejected"], ids=ids(INTENT["rejected"]))
def test_rejected_intent(case: dict[str, Any]) -> None:
    body = body_of("intent", case)
    with pytest.raises(InvalidIntent) as refused:
        decode_intent(body)
    assert (refused.value.code, refused.value.field) == (case["code"], case.get("field"))

    schema = validator("intent.schema.json")
    marker = case["schema"]
    if marker == "unparseable":
        # Not strict JSON: no schema applies; the decoder above is what refuses it.
        assert refused.value.code in ("not_json", "too_large")
        return
    parsed = json.loads(body)  # last key wins, like most JSON Schema tooling
    if marker == "rejects":
        assert not schema.is_valid(parsed), "the schema must refuse it too"
    elif marker == "not_expressible":
        assert schema.is_valid(parsed), "marked not_expressible, but the schema refuses it"
    else:
        pytest.fail(f"unknown schema marker {marker!r}")


@pytest.mark.parametrize("case", RESULT["accepted"], ids=ids(RESULT["accepted"]))
def test_accepted_result(case: dict[str, Any]) -> None:
    body = body_of("result", case)
    validator("result.schema.json").validate(json.loads(body))
    event = ResultEvent.from_json(body)
    wire = json.loads(body)
    for name, value in event.to_dict().items():
        assert wire[name] == value, name


@pytest.mark.parametrize("case", RESULT["rejected"], ids=ids(RESULT["rejected"]))
def test_rejected_result(case: dict[str, Any]) -> None:
    body = body_of("result", case)
    assert not validator("result.schema.json").is_valid(json.loads(body))
    # The Python reader is exactly as lenient as the Rust one.
    if case["rust_decoder"] == "rejects":
        with pytest.raises(InvalidResultEvent):
            ResultEvent.from_json(body)
    else:
        ResultEvent.from_json(body)


FINGERPRINTS = json.loads((FIXTURES / "fingerprint" / "cases.json").read_text())["cases"]


@pytest.mark.parametrize("case", FINGERPRINTS, ids=ids(FINGERPRINTS))
def test_fingerprint_vector(case: dict[str, Any]) -> None:
    arguments = parse_json(case["arguments"].encode())
    assert canonical_json({"arguments": arguments, "tool": case["tool"]}) == case["canonical"]
    assert fingerprint(case["tool"], arguments) == case["fingerprint"]
    intent = Intent("t", "a", case["tool"], arguments, call_id="c", reply_to="r")
    if "\\u0000" in case["arguments"]:
        # The fingerprint is defined for any JSON, but the worker refuses such an intent.
        with pytest.raises(InvalidIntent) as refused:
            intent.fingerprint()
        assert refused.value.code == "nul_character"
        return
    assert intent.fingerprint() == case["fingerprint"]


def test_client_refuses_what_the_worker_would() -> None:
    cases = [
        (Intent("north:shop", "a", "refund", {}), "invalid_characters", "tenant"),
        (Intent("t", "refund 204", "refund", {}), "invalid_characters", "action_id"),
        (Intent("t", "a" * 201, "refund", {}), "too_long", "action_id"),
        (Intent("t", "a", "refund", {"amount": float("nan")}), "not_json", None),
        (Intent("t", "a", "refund", {"x": object()}), "not_json", None),
        (Intent("t", "a", "refund", {"s": "\ud800"}), "not_json", None),
        (Intent("t", "a", "refund", {"pad": "x" * 262_144}), "too_large", None),
        (Intent("t", "a", "refund", [1, 2]), "wrong_type", "arguments"),  # type: ignore[arg-type]
        (Intent("t", "a", "refund", {}, call_id=""), "empty_field", "call_id"),
        (Intent("t", "a", "refund", {}, reply_to="agent#1"), "invalid_characters", "reply_to"),
    ]
    for intent, code, field in cases:
        with pytest.raises(InvalidIntent) as refused:
            intent.to_json()
        assert (refused.value.code, refused.value.field) == (code, field), intent


def test_asyncapi_document_is_valid_asyncapi_3() -> None:
    official = json.loads((SCHEMA_DIR / "vendor" / "asyncapi-3.0.0.schema.json").read_text())
    doc = yaml.safe_load((SCHEMA_DIR / "asyncapi.yaml").read_text())
    errors = list(Draft7Validator(official).iter_errors(doc))
    assert not errors, [f"{list(e.path)}: {e.message[:200]}" for e in errors]
    assert doc["asyncapi"] == "3.0.0"
    assert set(doc["channels"]) == {"intents", "results"}

    # The validator does notice a broken document (this test can fail).
    broken = json.loads(json.dumps(doc))
    broken["operations"]["publishIntent"]["action"] = "publish"
    assert list(Draft7Validator(official).iter_errors(broken))


def test_asyncapi_references_resolve() -> None:
    doc = yaml.safe_load((SCHEMA_DIR / "asyncapi.yaml").read_text())
    refs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.append(node["$ref"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    assert refs
    for ref in refs:
        if ref.startswith("#/"):
            node: Any = doc
            for part in ref[2:].split("/"):
                node = node[part.replace("~1", "/").replace("~0", "~")]
        else:
            schema = json.loads((SCHEMA_DIR / ref).read_text())
            Draft202012Validator.check_schema(schema)
    # The examples in the document satisfy the payload schemas.
    for message, schema_file in (
        ("intent", "intent.schema.json"),
        ("result", "result.schema.json"),
    ):
        for example in doc["components"]["messages"][message]["examples"]:
            validator(schema_file).validate(example["payload"])
    intent_example = doc["components"]["messages"]["intent"]["examples"][0]["payload"]
    decode_intent(json.dumps(intent_example).encode())


def test_docs_document_the_schemas() -> None:
    root = SCHEMA_DIR.parents[1]
    contract = (root / "docs" / "contract.md").read_text()
    for path in (
        "docs/schema/intent.schema.json",
        "docs/schema/result.schema.json",
        "docs/schema/asyncapi.yaml",
    ):
        assert path in contract, path
    # The client's guide is this package's README (what PyPI shows), linked from the repository's
    # README and from the agents guide, and it points at the contract.
    guide = (root / "clients" / "python" / "README.md").read_text()
    assert re.search(r"^# intent-worker-client", guide, re.M)
    assert "docs/contract.md" in guide
    for page in (root / "README.md", root / "docs" / "agents.md"):
        assert "clients/python/README.md" in page.read_text(), page


def test_jsonschema_is_the_real_library() -> None:
    # Guards against a stub module shadowing the validator in the test environment.
    assert hasattr(jsonschema, "Draft202012Validator")


def test_the_completion_report_is_read_and_worded_for_the_model() -> None:
    from intent_worker_client.tool import answer_for

    body = (FIXTURES / "result" / "accepted" / "pending_in_progress.json").read_text()
    event = ResultEvent.from_json(body)
    assert (event.uncertainty, event.remote_id, event.retry_after_ms) == (
        "in_progress",
        "op-41",
        2000,
    )
    text = str(answer_for(event, "deploy", "deploy-9"))
    assert text.startswith("ACCEPTED, IN PROGRESS") and "op-41" in text and "Do NOT retry" in text
    done = ResultEvent.from_json(
        (FIXTURES / "result" / "accepted" / "succeeded_by_poll.json").read_text()
    )
    assert (done.verified_by, done.remote_id) == ("poll", "dep-12")
    by_hand = ResultEvent.from_json(
        (FIXTURES / "result" / "accepted" / "failed_by_operator.json").read_text()
    )
    assert (by_hand.verified_by, by_hand.operator) == ("operator", "alice")
    with pytest.raises(InvalidResultEvent):
        ResultEvent.from_json(
            (FIXTURES / "result" / "rejected" / "negative_retry_after.json").read_text()
        )

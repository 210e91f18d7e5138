"""The intent (message contract version 1) and a strict decoder that mirrors the worker's
(Rust ``protocol::decode_intent``): same rules, same order, same error codes. The client runs
it on the exact bytes it is about to publish or enqueue, so a body the worker would dead-letter
as ``invalid_message`` is refused here, before it leaves the process. The shared fixtures in
docs/schema/fixtures keep both decoders in agreement.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .fingerprint import fingerprint

MAX_INTENT_BYTES = 256 * 1024
"""Largest accepted intent body, in bytes of UTF-8."""
MAX_KEY_LEN = 200
"""Longest ``tenant``, ``action_id``, ``call_id``, ``reply_to`` and ``compensates``, in
characters."""
MAX_TOOL_LEN = 64
"""Longest ``tool``, in characters."""
MAX_ACTION_KEY_BYTES = 255
"""Longest action key ``<tenant>:<action_id>``, in bytes: it is the AMQP ``message_id``, a short
string. Each field may be :data:`MAX_KEY_LEN` characters, but the pair must fit this bound."""

_I64_MIN = -(2**63)
_U64_MAX = 2**64 - 1

KNOWN_FIELDS = (
    "tenant",
    "action_id",
    "tool",
    "arguments",
    "call_id",
    "reply_to",
    "compensates",
)
# The optional string fields, in the order the worker checks them.
_OPTIONAL = ("call_id", "reply_to", "compensates")
_REQUIRED = ("tenant", "action_id", "tool", "arguments")

# serde_json refuses documents nested deeper than this (its recursion limit).
_MAX_DEPTH = 128
_MAX_ECHOED_NAME = 64

_NAME = re.compile(r"[A-Za-z0-9._-]+")
_NAME_CHARS = "ASCII letters, digits, '-', '_' and '.'"


def _is_name(value: str) -> bool:
    return _NAME.fullmatch(value) is not None


def _is_visible_ascii(value: str) -> bool:
    return all("\x21" <= c <= "\x7e" for c in value)


def _has_no_control(value: str) -> bool:
    # Rust's char::is_control: general category Cc, i.e. C0, DEL and C1.
    return not any(c <= "\x1f" or "\x7f" <= c <= "\x9f" for c in value)


_VISIBLE_ASCII = "visible ASCII characters (0x21 to 0x7E), no spaces or control characters"

_RULES = {
    "tenant": (MAX_KEY_LEN, _is_name, _NAME_CHARS),
    "action_id": (MAX_KEY_LEN, _is_visible_ascii, _VISIBLE_ASCII),
    "tool": (MAX_TOOL_LEN, _is_name, _NAME_CHARS),
    "call_id": (MAX_KEY_LEN, _has_no_control, "characters other than control characters"),
    "reply_to": (MAX_KEY_LEN, _is_name, _NAME_CHARS),
    # The action a compensation undoes: an action_id of the same tenant, by the same rule.
    "compensates": (MAX_KEY_LEN, _is_visible_ascii, _VISIBLE_ASCII),
}


CODES = (
    "too_large",
    "not_json",
    "not_an_object",
    "duplicate_field",
    "unknown_field",
    "missing_field",
    "wrong_type",
    "empty_field",
    "too_long",
    "invalid_characters",
    "key_too_long",
    "nul_character",
)
"""Every decode error code, in the order the worker checks the rules
(Rust ``protocol::DecodeError::CODES``)."""


def action_key(tenant: str, action_id: str) -> str:
    """The logical action key ``<tenant>:<action_id>``: the AMQP ``message_id`` of the intent
    and the downstream idempotency key."""
    return f"{tenant}:{action_id}"


def check_action_key(tenant: str, action_id: str) -> None:
    """Raises :class:`InvalidIntent` (``key_too_long``) when ``<tenant>:<action_id>`` is over
    :data:`MAX_ACTION_KEY_BYTES`; :func:`decode_intent` checks it with the other rules."""
    size = len(action_key(tenant, action_id).encode("utf-8", "surrogatepass"))
    if size > MAX_ACTION_KEY_BYTES:
        raise InvalidIntent(
            "key_too_long",
            f'tenant and action_id make an action key ("<tenant>:<action_id>") of {size} bytes, '
            f"over the {MAX_ACTION_KEY_BYTES}-byte limit of an AMQP message id",
        )


class InvalidIntent(ValueError):
    """A body or intent broke a rule of the wire contract. ``code`` is the worker's stable
    decode error code (:data:`CODES`: ``too_large``, ``not_json``, ``not_an_object``,
    ``duplicate_field``, ``unknown_field``, ``missing_field``, ``wrong_type``, ``empty_field``,
    ``too_long``, ``invalid_characters``, ``key_too_long``, ``nul_character``); ``field`` names
    the field where the rule is about one."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field
        self.message = message

    def __repr__(self) -> str:
        return f"InvalidIntent(code={self.code!r}, field={self.field!r}, message={self.message!r})"


@dataclass(frozen=True)
class Intent:
    """A request for one side effect. ``(tenant, action_id)`` is the logical action key, chosen
    by the application (never by the model); ``tool`` and ``arguments`` are what the worker's
    fingerprint covers. ``reply_to`` routes the results to one agent's queue.

    ``compensates`` makes the intent a compensation: the ``action_id`` (same tenant) of a
    ``succeeded`` action that this one undoes. The worker admits it only while that original is
    ``succeeded`` and the tool lists the original's tool in its ``compensation_for``; otherwise
    it is ``rejected`` (``original_unresolved``, ``original_not_applied``,
    ``original_not_found``, ``already_compensated``, ``compensation_not_allowed``). It is part
    of the fingerprint."""

    tenant: str
    action_id: str
    tool: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    call_id: str | None = None
    reply_to: str | None = None
    compensates: str | None = None

    def to_json(self) -> bytes:
        """The body to publish, validated by decoding it exactly as the worker will.

        Raises :class:`InvalidIntent` if the worker would refuse it."""
        body: dict[str, Any] = {
            "tenant": self.tenant,
            "action_id": self.action_id,
            "tool": self.tool,
            # Any Mapping is sent as an object; anything else is left for the decoder to refuse.
            "arguments": (
                dict(self.arguments) if isinstance(self.arguments, Mapping) else self.arguments
            ),
        }
        if self.call_id is not None:
            body["call_id"] = self.call_id
        if self.reply_to is not None:
            body["reply_to"] = self.reply_to
        if self.compensates is not None:
            body["compensates"] = self.compensates
        try:
            text = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise InvalidIntent("not_json", f"intent is not valid JSON: {e}") from e
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidIntent("not_json", f"intent is not valid JSON: {e}") from e
        decode_intent(data)
        return data

    def fingerprint(self) -> str:
        """The worker's fingerprint of ``tool`` and ``arguments``, and ``compensates`` when set
        (call_id and reply_to never change it); result events carry it."""
        decoded = decode_intent(self.to_json())
        return fingerprint(decoded.tool, decoded.arguments, decoded.compensates)

    @property
    def message_id(self) -> str:
        """The AMQP message_id and the downstream idempotency key: ``<tenant>:<action_id>``."""
        return action_key(self.tenant, self.action_id)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _Object(dict[str, Any]):
    """A parsed JSON object that remembers its entries in order, duplicates included."""

    pairs: list[tuple[str, Any]]


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object(pairs)
    obj.pairs = pairs
    return obj


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _shorten(literal: str) -> str:
    # A literal short enough to echo (a 100 KB run of zeros must not travel in a result).
    return literal if len(literal) <= 40 else literal[:40] + "…"


class _Numbers:
    """``json.loads`` hooks that read numbers as serde_json does (an integer beyond 64 bits
    becomes the nearest double, a decimal below the double range becomes 0) and remember the
    first literal, in document order, whose value that reading changes: the worker refuses it
    (``not_json``) rather than store another number than the agent sent."""

    def __init__(self) -> None:
        self.changed: str | None = None

    def _note(self, literal: str, why: str) -> None:
        if self.changed is None:
            self.changed = f"number {_shorten(literal)} {why}; send it as a string"

    def parse_float(self, text: str) -> float:
        value = float(text)
        if math.isinf(value):
            raise ValueError(f"number out of range: {text[:40]}")
        mantissa = text.partition("e")[0].partition("E")[0]
        if value == 0.0 and any(c in "123456789" for c in mantissa):
            self._note(text, "is too small for a double and would become 0")
        return value

    def parse_int(self, text: str) -> int | float:
        # One beyond the double range is an error in serde_json, so it must be one here.
        if len(text) > 19 and math.isinf(float(text)):
            raise ValueError(f"number out of range: {text[:40]}")
        value = int(text)
        if _I64_MIN <= value <= _U64_MAX:
            return value
        self._note(
            text, "is outside the 64-bit integer range (-2^63 to 2^64-1) and would be rounded"
        )
        return float(text)


def _check_strings(value: Any, depth: int) -> None:
    """Refuses lone surrogates (not Unicode scalar values) and nesting deeper than
    serde_json allows, both of which Python's json module accepts. ``depth`` counts the
    arrays and objects around ``value``."""
    if isinstance(value, (dict, list)):
        depth += 1
        if depth >= _MAX_DEPTH:
            raise ValueError("recursion limit exceeded")
    if isinstance(value, str):
        if not _encodable(value):
            raise ValueError("lone surrogate in a string")
    elif isinstance(value, dict):
        for key, item in value.pairs if isinstance(value, _Object) else value.items():
            if not _encodable(key):
                raise ValueError("lone surrogate in a key")
            _check_strings(item, depth)
    elif isinstance(value, list):
        for item in value:
            _check_strings(item, depth)


def _echo(name: str) -> str:
    return name if len(name) <= _MAX_ECHOED_NAME else name[:_MAX_ECHOED_NAME] + "…"


def parse_json(body: bytes) -> Any:
    """Parses strict RFC 8259 JSON in UTF-8 the way the worker's JSON parser does (numbers
    included: see :class:`_Numbers`); raises :class:`InvalidIntent` with code ``not_json``
    otherwise. Objects keep their entries (``.pairs``) so repeated keys stay visible."""
    return _parse(body, _Numbers())


def _parse(body: bytes, numbers: _Numbers) -> Any:
    try:
        text = body.decode("utf-8")
        value = json.loads(
            text,
            object_pairs_hook=_object,
            parse_constant=_constant,
            parse_float=numbers.parse_float,
            parse_int=numbers.parse_int,
        )
        _check_strings(value, 0)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InvalidIntent("not_json", f"intent is not valid JSON: {e}") from None
    return value


def _nul_path(value: Any, at: str) -> str | None:
    """Where the first U+0000 in ``value`` (a string or an object key) is, as a path such as
    ``arguments.a[1].b``, visiting object keys in the worker's order (sorted by UTF-8 bytes).
    A downstream keeping JSON in Postgres ``jsonb`` cannot store it."""
    if isinstance(value, str):
        return at if "\0" in value else None
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _nul_path(item, f"{at}[{i}]")
            if found is not None:
                return found
    elif isinstance(value, dict):
        for key in sorted(value, key=lambda k: k.encode("utf-8")):
            if "\0" in key:
                return at
            found = _nul_path(value[key], f"{at}.{_echo(key)}")
            if found is not None:
                return found
    return None


def decode_intent(body: bytes) -> Intent:
    """Decodes and validates an intent body, reporting the first broken rule in the
    worker's order (docs/contract.md, "Strict decoding")."""
    if len(body) > MAX_INTENT_BYTES:
        raise InvalidIntent(
            "too_large", f"intent is {len(body)} bytes, over the {MAX_INTENT_BYTES}-byte limit"
        )
    if body.lstrip(_WS)[:1] == b"[":
        # The worker only skips over an array's contents before refusing it.
        if _array_syntax_ok(body):
            raise InvalidIntent("not_an_object", "intent must be a JSON object")
        raise InvalidIntent("not_json", "intent is not valid JSON")
    numbers = _Numbers()
    value = _parse(body, numbers)
    if not isinstance(value, _Object):
        raise InvalidIntent("not_an_object", "intent must be a JSON object")
    if numbers.changed is not None:
        raise InvalidIntent("not_json", f"intent is not valid JSON: {numbers.changed}")
    seen: set[str] = set()
    for name, _ in value.pairs:
        if name in seen:
            raise InvalidIntent(
                "duplicate_field", f"field {_echo(name)!r} appears more than once", _echo(name)
            )
        seen.add(name)
    for name, _ in value.pairs:
        if name not in KNOWN_FIELDS:
            raise InvalidIntent(
                "unknown_field",
                f"unknown field {_echo(name)!r}; allowed fields are tenant, action_id, tool, "
                "arguments, call_id, reply_to and compensates",
                _echo(name),
            )
    for name in _REQUIRED:
        if name not in value:
            raise InvalidIntent("missing_field", f"required field {name!r} is missing", name)
    for name in ("tenant", "action_id", "tool"):
        if not isinstance(value[name], str):
            raise InvalidIntent("wrong_type", f"field {name!r} must be a string", name)
    if not isinstance(value["arguments"], dict):
        raise InvalidIntent("wrong_type", "field 'arguments' must be a JSON object", "arguments")
    for name in _OPTIONAL:
        if value.get(name) is not None and not isinstance(value[name], str):
            raise InvalidIntent("wrong_type", f"field {name!r} must be a string or null", name)

    checked = [(name, value[name]) for name in ("tenant", "action_id", "tool")]
    checked += [(n, value[n]) for n in _OPTIONAL if value.get(n) is not None]
    _check_rules(checked)
    check_action_key(value["tenant"], value["action_id"])
    at = _nul_path(value["arguments"], "arguments")
    if at is not None:
        raise InvalidIntent(
            "nul_character",
            f"{at} contains U+0000 (NUL), which a downstream keeping JSON in Postgres jsonb "
            "cannot store; remove it or encode the value (e.g. base64)",
        )
    return Intent(
        tenant=value["tenant"],
        action_id=value["action_id"],
        tool=value["tool"],
        arguments=dict(value["arguments"]),
        call_id=value.get("call_id"),
        reply_to=value.get("reply_to"),
        compensates=value.get("compensates"),
    )


def _check_rules(fields: list[tuple[str, str]]) -> None:
    # One rule kind at a time across all fields, as the worker does.
    for name, text in fields:
        if not text:
            raise InvalidIntent("empty_field", f"field {name!r} must not be empty", name)
    for name, text in fields:
        limit = _RULES[name][0]
        if len(text) > limit:
            raise InvalidIntent(
                "too_long",
                f"field {name!r} is {len(text)} characters long, over the {limit}-character limit",
                name,
            )
    for name, text in fields:
        _, accepts, allowed = _RULES[name]
        if not accepts(text):
            raise InvalidIntent(
                "invalid_characters", f"field {name!r} may contain only {allowed}", name
            )


_WS = b" \t\n\r"
_ESCAPES_OK = b'"\\/bfnrtu'
_HEX = b"0123456789abcdefABCDEF"


def _array_syntax_ok(data: bytes) -> bool:
    """Whether ``data`` is a syntactically valid JSON array, judged like serde_json skips a
    value it ignores: syntax only (string escapes, control characters, number grammar,
    literals, nesting), without UTF-8, lone-surrogate, number-range or depth checks. The
    worker's decoder reads a top-level array that way before refusing it as
    ``not_an_object``. Iterative, so any depth is fine."""
    n = len(data)
    i = 0

    def skip_ws(i: int) -> int:
        while i < n and data[i] in _WS:
            i += 1
        return i

    def scalar(i: int) -> int:
        """End of the string, number or literal at ``i``, or -1."""
        c = data[i]
        if c == 0x22:  # string
            i += 1
            while i < n:
                b = data[i]
                if b == 0x22:
                    return i + 1
                if b == 0x5C:
                    if i + 1 >= n or data[i + 1] not in _ESCAPES_OK:
                        return -1
                    if data[i + 1] == 0x75:  # \uXXXX
                        if i + 6 > n or any(h not in _HEX for h in data[i + 2 : i + 6]):
                            return -1
                        i += 6
                    else:
                        i += 2
                elif b < 0x20:
                    return -1
                else:
                    i += 1
            return -1
        if c == 0x2D or 0x30 <= c <= 0x39:  # number
            if c == 0x2D:
                i += 1
            if i >= n or not 0x30 <= data[i] <= 0x39:
                return -1
            if data[i] == 0x30:
                i += 1
            else:
                while i < n and 0x30 <= data[i] <= 0x39:
                    i += 1
            if i < n and data[i] == 0x2E:
                i += 1
                start = i
                while i < n and 0x30 <= data[i] <= 0x39:
                    i += 1
                if i == start:
                    return -1
            if i < n and data[i] in b"eE":
                i += 1
                if i < n and data[i] in b"+-":
                    i += 1
                start = i
                while i < n and 0x30 <= data[i] <= 0x39:
                    i += 1
                if i == start:
                    return -1
            # A digit right after a leading zero ("01") is an invalid number.
            if i < n and 0x30 <= data[i] <= 0x39:
                return -1
            return i
        for word in (b"true", b"false", b"null"):
            if data.startswith(word, i):
                return i + len(word)
        return -1

    i = skip_ws(i)
    if i >= n or data[i] != 0x5B:
        return False
    stack: list[int] = []  # open containers: 0x5B '[' or 0x7B '{'
    expect_value = True
    while True:
        i = skip_ws(i)
        if i >= n:
            return False
        c = data[i]
        if expect_value:
            if c in (0x5B, 0x7B):
                stack.append(c)
                i = skip_ws(i + 1)
                if i < n and data[i] == (0x5D if c == 0x5B else 0x7D):
                    stack.pop()
                    i += 1
                    expect_value = False
                    if not stack:
                        break
                    continue
                if c == 0x7B:
                    # An object member: a string key, ':' then the value.
                    if i >= n or data[i] != 0x22:
                        return False
                    i = scalar(i)
                    if i < 0:
                        return False
                    i = skip_ws(i)
                    if i >= n or data[i] != 0x3A:
                        return False
                    i += 1
                continue
            i = scalar(i)
            if i < 0:
                return False
            expect_value = False
            if not stack:
                break
            continue
        # After a value: ',' or the closing bracket of the innermost container.
        top = stack[-1]
        if c == 0x2C:
            i = skip_ws(i + 1)
            if top == 0x7B:
                if i >= n or data[i] != 0x22:
                    return False
                i = scalar(i)
                if i < 0:
                    return False
                i = skip_ws(i)
                if i >= n or data[i] != 0x3A:
                    return False
                i += 1
            expect_value = True
        elif c == (0x5D if top == 0x5B else 0x7D):
            stack.pop()
            i += 1
            if not stack:
                break
        else:
            return False
    return skip_ws(i) == n

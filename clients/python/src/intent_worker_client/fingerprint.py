"""The worker's intent fingerprint: lowercase hex SHA-256 of the RFC 8785 (JCS) canonical JSON
of ``{"arguments": ..., "tool": ...}`` (``{"arguments": ..., "compensates": ..., "tool": ...}``
for a compensation, so the same key naming another original is another intent), with the
worker's one departure (integers that fit i64/u64 are written exactly). The client needs it to
tell the answer to *its* intent from the answer to another intent under the same action id (an
``intent_conflict`` carries the new intent's fingerprint; the status API answers with the stored
one). Shared test vectors: docs/schema/fixtures/fingerprint/cases.json.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}


def canonical_json(value: Any) -> str:
    """``value`` (as decoded from JSON) in JCS canonical form."""
    out: list[str] = []
    _write(out, value)
    return "".join(out)


def fingerprint(tool: str, arguments: Any, compensates: str | None = None) -> str:
    """The fingerprint the worker computes for ``tool`` and ``arguments``, and for a compensation
    the ``action_id`` it undoes (Rust ``protocol::fingerprint_canonical_compensating``); without
    ``compensates`` the key is left out, so an ordinary intent's fingerprint is unchanged."""
    wrapper: dict[str, Any] = {"arguments": arguments, "tool": tool}
    if compensates is not None:
        wrapper["compensates"] = compensates
    text = canonical_json(wrapper)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _write(out: list[str], value: Any) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        if -(2**63) <= value < 2**64:
            out.append(str(value))
        else:
            # The worker's JSON parser reads such an integer as a double.
            out.append(_es_number(float(value)))
    elif isinstance(value, float):
        out.append(_es_number(value))
    elif isinstance(value, str):
        _write_string(out, value)
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _write(out, item)
        out.append("]")
    elif isinstance(value, dict):
        # JCS orders keys by UTF-16 code units.
        keys = sorted(value, key=lambda k: k.encode("utf-16-be"))
        out.append("{")
        for i, key in enumerate(keys):
            if i:
                out.append(",")
            _write_string(out, key)
            out.append(":")
            _write(out, value[key])
        out.append("}")
    else:
        raise TypeError(f"not a JSON value: {type(value).__name__}")


def _write_string(out: list[str], text: str) -> None:
    out.append('"')
    for c in text:
        escaped = _ESCAPES.get(c)
        if escaped is not None:
            out.append(escaped)
        elif c < "\x20":
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    out.append('"')


def _es_number(x: float) -> str:
    """ECMAScript ``Number::toString`` for a finite double (ECMA-262 6.1.6.1.20)."""
    if not math.isfinite(x):
        return "null"
    if x == 0:
        return "0"
    sign = "-" if x < 0 else ""
    # repr gives the shortest digits that read back as x, nearest on a tie, like ECMAScript.
    mantissa, _, exp = f"{abs(x)!r}".partition("e")
    int_part, _, frac_part = mantissa.partition(".")
    digits = (int_part + frac_part).lstrip("0")
    # Decimal exponent of the first significant digit.
    point = len(int_part) + (int(exp) if exp else 0)
    leading_zeros = len(int_part + frac_part) - len((int_part + frac_part).lstrip("0"))
    n = point - leading_zeros
    digits = digits.rstrip("0") or "0"
    k = len(digits)
    if k <= n <= 21:
        body = digits + "0" * (n - k)
    elif 0 < n <= 21:
        body = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        body = "0." + "0" * (-n) + digits
    else:
        e = n - 1
        body = digits[0] + ("." + digits[1:] if k > 1 else "") + f"e{'-' if e < 0 else '+'}{abs(e)}"
    return sign + body

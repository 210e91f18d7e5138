"""The client's validator against the worker's decoder on thousands of generated bodies: both
must give the same verdict (accepted, or the same error code naming the same field). The Rust
side is protocol/examples/decode_hex.rs, built here with cargo."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

from conftest import REPO

from intent_worker_client import InvalidIntent, decode_intent

NAMES = ["tenant", "action_id", "tool", "arguments", "call_id", "reply_to", "compensates"]
ODD_NAMES = ["Tenant", "action-id", "x", "", "ténant", "a" * 70]
STRINGS = [
    '""',
    '"t"',
    '"north-shop"',
    '"eu.north_shop-2"',
    '"north:shop"',
    '"north shop"',
    '"north.*"',
    '"#"',
    '"n\\u00f6rth"',
    '"caf\\u00e9"',
    '"\\ud83d\\ude00"',
    '"\\ud800"',
    '"line\\nbreak"',
    '"next\\u0085line"',
    '"del\\u007f"',
    '"\\u2028"',
    '"{\\"id\\":1}"',
    '"a\\\\b"',
    '"%2F?#"',
    '"a b"',
    '"~!@$^&()"',
    "\"'quoted'\"",
]
OTHERS = [
    "null",
    "true",
    "0",
    "-1",
    "4.85e3",
    "18446744073709551616",
    "18446744073709551615",
    "-9223372036854775809",
    "1e400",
    "1e-400",
    "0e-400",
    "5e-324",
    "NaN",
    "[]",
    "[1,2]",
    "{}",
    '{"a":1}',
    '{"a":1,"a":2}',
    '{"n":1e308}',
    '"\\u0000"',
]


def long_string(rng: random.Random) -> str:
    n = rng.choice([63, 64, 65, 199, 200, 201])
    char = rng.choice(["a", "\\u00e9", "*", "\\ud83d\\ude42", " "])
    return '"' + char * n + '"'


def nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def value(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.55:
        return rng.choice(STRINGS)
    if roll < 0.7:
        return long_string(rng)
    if roll < 0.95:
        return rng.choice(OTHERS)
    return '{"deep":' + nested(rng.choice([124, 125, 126, 127])) + "}"


# Valid fields, and pairs at the edge of the action key limit (<tenant>:<action_id> at most
# 255 bytes): tenant 200 with action_id 54 fits, 55 does not; tenant 54 fits any action_id.
GOOD = {
    "tenant": [
        '"north-shop"',
        '"eu.north_shop-2"',
        '"' + "t" * 200 + '"',
        '"' + "t" * 54 + '"',
        '"' + "t" * 55 + '"',
    ],
    "action_id": [
        '"refund-204"',
        '"{\\"id\\":\'x\'}%/?#"',
        '"' + "a" * 200 + '"',
        '"' + "b" * 54 + '"',
        '"' + "b" * 55 + '"',
    ],
    "tool": ['"refund"', '"' + "x" * 64 + '"'],
    "arguments": [
        '{"order":"o-1"}',
        "{}",
        '{"a":{"b":[1,2.5e3,null]},"a":0}',
        '{"big":18446744073709551615,"neg":-9223372036854775808,"tiny":5e-324}',
        '{"n":1e-400}',
        '{"n":[0,{"m":18446744073709551616}]}',
        '{"note":"a\\u0000b"}',
        '{"a":[1,{"k\\u0000":2}],"b":"\\u0000"}',
        '{"escaped":"\\\\u0000 is text"}',
    ],
    "call_id": ["null", '"model-9f2"', '"\\u00e9\\ud83d\\ude00 \\u2028"', '"' + "é" * 200 + '"'],
    "reply_to": ["null", '"agent-7"', '"a.b"'],
    "compensates": ["null", '"refund-204"', '"{\\"id\\":\'x\'}%/?#"', '"' + "c" * 200 + '"'],
}


def body(rng: random.Random) -> bytes:
    entries = []
    for name in NAMES:
        if rng.random() < 0.93:
            if rng.random() < 0.8:
                entries.append((name, rng.choice(GOOD[name])))
            else:
                entries.append((name, value(rng)))
    if rng.random() < 0.1:
        entries.append((rng.choice(ODD_NAMES), value(rng)))
    if rng.random() < 0.1 and entries:
        entries.append(rng.choice(entries))
    rng.shuffle(entries)
    text = "{" + ",".join(f'"{k}":{v}' for k, v in entries) + "}"
    roll = rng.random()
    if roll < 0.02:
        text = text[: rng.randrange(len(text))]
    elif roll < 0.04:
        text = "\ufeff" + text
    elif roll < 0.06:
        text = "[" + text + "]"
    elif roll < 0.08:
        text = text + " x"
    elif roll < 0.11:
        # Around the 256 KiB limit.
        pad = 262_144 - len(text.encode()) - 9 + rng.choice([-1, 0, 1, 2, 1000])
        text = '{"pad":"' + "p" * max(pad, 0) + '",' + text[1:] if len(text) > 2 else text
    data = text.encode("utf-8", errors="surrogatepass")
    if rng.random() < 0.01:
        data = data.replace(b"o", b"\xff", 1)
    return data


# Top-level arrays: the worker's decoder only checks their syntax before refusing them.
DIRECTED = [
    b'["\xff"]',
    b'["\\ud800"]',
    b"[1e400]",
    b"[" * 3000 + b"]" * 3000,
    b'["a\tb"]',
    b'["\\x"]',
    b"[NaN]",
    b'["\\u12"]',
    b"[-]",
    b"[01]",
    b"[1.]",
    b"[1e]",
    b"[1,]",
    b'[{"a":[1,{}],"b":-0.5e+3}, true, null ]  ',
    b'[{"a" 1}]',
    b"[] x",
    b" \n[{}]",
    b'[{"a":1,}]',
    b"[tru]",
    b'["\\/\\b"]',
    b"[-0]",
    b"[0.0e0]",
    b"[1E+2]",
    b"[{,}]",
    b'"\\ud800"',
    b"1e400",
    b'{"tenant":"t"}  \xff',
    b"\xef\xbb\xbf[]",
    # A number a double or a 64-bit integer cannot hold: refused inside an object (before
    # duplicate and unknown fields), but a top-level scalar or array is just not an object.
    b"1e-400",
    b"18446744073709551616",
    b"[1e-400, -9223372036854775809]",
    b'{"tenant":"t","tenant":"t","n":1e-400}',
    b'{"x":18446744073709551616}',
    b'{"tenant":"t","action_id":"a","tool":"x","arguments":{},"call_id":18446744073709551616}',
]


def python_verdict(data: bytes) -> str:
    try:
        decode_intent(data)
    except InvalidIntent as e:
        return f"{e.code} {e.field.encode().hex() if e.field is not None else '-'}"
    return "ok"


def rust_decoder() -> Path:
    # A decoder built beforehand (scripts/test.sh stages one beside the binaries it tests, so this
    # step needs no cargo while cargo builds the test binaries).
    staged = os.environ.get("INTENT_BIN_DIR")
    if staged and (Path(staged) / "decode_hex").exists():
        return Path(staged) / "decode_hex"
    target = Path(os.environ.get("CARGO_TARGET_DIR") or "target")
    target = target if target.is_absolute() else REPO / target
    subprocess.run(
        ["cargo", "build", "-q", "-p", "intent-protocol", "--example", "decode_hex"],
        cwd=REPO,
        check=True,
        env={**os.environ, "CARGO_TARGET_DIR": str(target)},
        timeout=600,
    )
    return target / "debug" / "examples" / "decode_hex"


def test_python_validator_agrees_with_the_rust_decoder() -> None:
    rng = random.Random(20261201)
    bodies = [body(rng) for _ in range(4000)] + DIRECTED
    done = subprocess.run(
        [str(rust_decoder())],
        input="".join(b.hex() + "\n" for b in bodies),
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    rust = done.stdout.splitlines()
    assert len(rust) == len(bodies)
    mismatches = [
        (b[:160], r, p) for b, r in zip(bodies, rust, strict=True) if r != (p := python_verdict(b))
    ]
    assert not mismatches, mismatches[:5]
    verdicts = {r.split()[0] for r in rust}
    # The generator reaches every rule (so agreement is not agreement on one easy case).
    assert verdicts >= {
        "ok",
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
    }, verdicts

// The client's validator against the worker's decoder on thousands of generated bodies: both must
// give the same verdict (accepted, or the same code naming the same field). The Rust side is
// protocol/examples/decode_hex.rs (scripts/test.sh stages it in INTENT_BIN_DIR), as for the
// Python client's tests/test_differential.py, whose generator this mirrors.
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { test } from "node:test";
import { decodeIntent, InvalidIntentError } from "../../src/index.js";
import { binary } from "../support/paths.js";

function rng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const NAMES = ["tenant", "action_id", "tool", "arguments", "call_id", "reply_to", "compensates"];
const ODD_NAMES = ["Tenant", "action-id", "x", "", "ténant", "a".repeat(70)];
const STRINGS = [
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
];
const OTHERS = [
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
];
const GOOD: Record<string, string[]> = {
  tenant: [
    '"north-shop"',
    '"eu.north_shop-2"',
    `"${"t".repeat(200)}"`,
    `"${"t".repeat(54)}"`,
    `"${"t".repeat(55)}"`,
  ],
  action_id: [
    '"refund-204"',
    '"{\\"id\\":\'x\'}%/?#"',
    `"${"a".repeat(200)}"`,
    `"${"b".repeat(54)}"`,
    `"${"b".repeat(55)}"`,
  ],
  tool: ['"refund"', `"${"x".repeat(64)}"`],
  arguments: [
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
  call_id: ["null", '"model-9f2"', '"\\u00e9\\ud83d\\ude00 \\u2028"', `"${"é".repeat(200)}"`],
  reply_to: ["null", '"agent-7"', '"a.b"'],
  compensates: ["null", '"refund-204"', '"{\\"id\\":\'x\'}%/?#"', `"${"c".repeat(200)}"`],
};

const DIRECTED: Buffer[] = [
  Buffer.from([0x5b, 0x22, 0xff, 0x22, 0x5d]),
  Buffer.from('["\\ud800"]'),
  Buffer.from("[1e400]"),
  Buffer.from(`${"[".repeat(3000)}${"]".repeat(3000)}`),
  Buffer.from('["a\tb"]'),
  Buffer.from('["\\x"]'),
  Buffer.from("[NaN]"),
  Buffer.from('["\\u12"]'),
  Buffer.from("[-]"),
  Buffer.from("[01]"),
  Buffer.from("[1.]"),
  Buffer.from("[1e]"),
  Buffer.from("[1,]"),
  Buffer.from('[{"a":[1,{}],"b":-0.5e+3}, true, null ]  '),
  Buffer.from('[{"a" 1}]'),
  Buffer.from("[] x"),
  Buffer.from(" \n[{}]"),
  Buffer.from('[{"a":1,}]'),
  Buffer.from("[tru]"),
  Buffer.from('["\\/\\b"]'),
  Buffer.from("[-0]"),
  Buffer.from("[0.0e0]"),
  Buffer.from("[1E+2]"),
  Buffer.from("[{,}]"),
  Buffer.from('"\\ud800"'),
  Buffer.from("1e400"),
  Buffer.concat([Buffer.from('{"tenant":"t"}  '), Buffer.from([0xff])]),
  Buffer.concat([Buffer.from([0xef, 0xbb, 0xbf]), Buffer.from("[]")]),
  Buffer.from("1e-400"),
  Buffer.from("18446744073709551616"),
  Buffer.from("[1e-400, -9223372036854775809]"),
  Buffer.from('{"tenant":"t","tenant":"t","n":1e-400}'),
  Buffer.from('{"x":18446744073709551616}'),
  Buffer.from(
    '{"tenant":"t","action_id":"a","tool":"x","arguments":{},"call_id":18446744073709551616}',
  ),
];

function generate(count: number, seed: number): Buffer[] {
  const r = rng(seed);
  const pick = <T>(items: readonly T[]): T => items[Math.floor(r() * items.length)] as T;
  const value = (): string => {
    const roll = r();
    if (roll < 0.55) return pick(STRINGS);
    if (roll < 0.7)
      return `"${pick(["a", "\\u00e9", "*", "\\ud83d\\ude42", " "]).repeat(pick([63, 64, 65, 199, 200, 201]))}"`;
    if (roll < 0.95) return pick(OTHERS);
    const d = pick([124, 125, 126, 127]);
    return `{"deep":${"[".repeat(d)}1${"]".repeat(d)}}`;
  };
  const out: Buffer[] = [];
  for (let n = 0; n < count; n++) {
    const entries: [string, string][] = [];
    for (const name of NAMES) {
      if (r() < 0.93) entries.push([name, r() < 0.8 ? pick(GOOD[name] as string[]) : value()]);
    }
    if (r() < 0.1) entries.push([pick(ODD_NAMES), value()]);
    if (r() < 0.1 && entries.length > 0) entries.push(pick(entries));
    for (let i = entries.length - 1; i > 0; i--) {
      const j = Math.floor(r() * (i + 1));
      [entries[i], entries[j]] = [entries[j] as [string, string], entries[i] as [string, string]];
    }
    let text = `{${entries.map(([k, v]) => `"${k}":${v}`).join(",")}}`;
    const roll = r();
    if (roll < 0.02) text = text.slice(0, Math.floor(r() * text.length));
    else if (roll < 0.04) text = `\ufeff${text}`;
    else if (roll < 0.06) text = `[${text}]`;
    else if (roll < 0.08) text = `${text} x`;
    else if (roll < 0.11 && text.length > 2) {
      const pad = 262_144 - Buffer.byteLength(text) - 9 + pick([-1, 0, 1, 2, 1000]);
      text = `{"pad":"${"p".repeat(Math.max(pad, 0))}",${text.slice(1)}`;
    }
    let data = Buffer.from(text, "utf8");
    if (r() < 0.01) {
      const at = data.indexOf(0x6f);
      if (at >= 0)
        data = Buffer.concat([data.subarray(0, at), Buffer.from([0xff]), data.subarray(at + 1)]);
    }
    out.push(data);
  }
  return out;
}

function verdict(body: Uint8Array): string {
  try {
    decodeIntent(body);
    return "ok";
  } catch (e) {
    assert.ok(e instanceof InvalidIntentError);
    return `${e.code} ${e.field === undefined ? "-" : Buffer.from(e.field).toString("hex")}`;
  }
}

test("the validator agrees with the worker's decoder (protocol decode_hex)", () => {
  const bodies = [...generate(4000, 20261201), ...DIRECTED];
  const done = spawnSync(binary("decode_hex"), {
    input: bodies.map((b) => `${b.toString("hex")}\n`).join(""),
    maxBuffer: 64 * 1024 * 1024,
    encoding: "utf8",
    timeout: 300_000,
  });
  assert.equal(done.status, 0, done.stderr);
  const rust = done.stdout.split("\n").filter((l) => l.length > 0);
  assert.equal(rust.length, bodies.length);
  const mismatches = bodies
    .map((b, i) => [b.subarray(0, 160).toString(), rust[i], verdict(b)] as const)
    .filter(([, r, mine]) => r !== mine);
  assert.deepEqual(mismatches.slice(0, 5), []);
  const verdicts = new Set(rust.map((r) => r.split(" ")[0]));
  for (const code of [
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
  ]) {
    assert.ok(verdicts.has(code), `the generator never reached ${code}`);
  }
});

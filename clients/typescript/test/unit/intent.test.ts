import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import {
  CODES,
  decodeIntent,
  fingerprint,
  fingerprintCanonical,
  type Intent,
  InvalidIntentError,
  InvalidResultEventError,
  isFinal,
  MAX_INTENT_BYTES,
  parseResultEvent,
  resultRoutingKey,
  traceHeaders,
  validateIntent,
} from "../../src/index.js";

const enc = new TextEncoder();

function verdict(body: string | Uint8Array): string {
  try {
    decodeIntent(typeof body === "string" ? enc.encode(body) : body);
    return "ok";
  } catch (e) {
    assert.ok(e instanceof InvalidIntentError);
    return e.field === undefined ? e.code : `${e.code} ${e.field}`;
  }
}

const ok = '"tenant":"t","action_id":"a","tool":"x","arguments":{}';

test("every code, in the worker's order", () => {
  const cases: [string | Uint8Array, string][] = [
    [`{${ok},"pad":"${"p".repeat(MAX_INTENT_BYTES)}"}`, "too_large"],
    [`{${ok}`, "not_json"],
    [new Uint8Array([0x7b, 0xff, 0x7d]), "not_json"],
    ['{"a":"\\ud800"}', "not_json"],
    ["\ufeff{}", "not_json"],
    [`{${ok},"n":NaN}`, "not_json"],
    ["[1,2]", "not_an_object"],
    ['["\\x"]', "not_json"],
    ["1e-400", "not_an_object"],
    ['"s"', "not_an_object"],
    ['{"tenant":"t","tenant":"t","n":1e-400}', "not_json"],
    [`{${ok},"tenant":"u","zzz":1}`, "duplicate_field tenant"],
    [`{${ok},"zzz":1}`, "unknown_field zzz"],
    ['{"tenant":"t","action_id":"a","tool":"x"}', "missing_field arguments"],
    ['{"arguments":{},"tool":"x"}', "missing_field tenant"],
    ['{"tenant":1,"action_id":"a","tool":"x","arguments":[]}', "wrong_type tenant"],
    ['{"tenant":"t","action_id":"a","tool":"x","arguments":[]}', "wrong_type arguments"],
    [`{${ok},"call_id":5}`, "wrong_type call_id"],
    ['{"tenant":"t","action_id":"","tool":"x","arguments":{}}', "empty_field action_id"],
    [
      `{"tenant":"t","action_id":"${"a".repeat(201)}","tool":"","arguments":{}}`,
      "empty_field tool",
    ],
    [`{"tenant":"t","action_id":"a b","tool":"${"x".repeat(65)}","arguments":{}}`, "too_long tool"],
    ['{"tenant":"t:1","action_id":"a b","tool":"x","arguments":{}}', "invalid_characters tenant"],
    [
      `{"tenant":"t","action_id":"a","tool":"x","arguments":{},"reply_to":"a b"}`,
      "invalid_characters reply_to",
    ],
    [
      `{"tenant":"t","action_id":"a","tool":"x","arguments":{},"compensates":"a b"}`,
      "invalid_characters compensates",
    ],
    [
      `{"tenant":"${"t".repeat(200)}","action_id":"${"a".repeat(55)}","tool":"x","arguments":{}}`,
      "key_too_long",
    ],
    [`{"tenant":"t","action_id":"a","tool":"x","arguments":{"a":["\\u0000"]}}`, "nul_character"],
    [
      `{"tenant":"t","action_id":"a","tool":"x","arguments":{"deep":${"[".repeat(125)}1${"]".repeat(125)}}}`,
      "ok",
    ],
    [
      `{"tenant":"t","action_id":"a","tool":"x","arguments":{"deep":${"[".repeat(126)}1${"]".repeat(126)}}}`,
      "not_json",
    ],
    [`{${ok},"call_id":null,"reply_to":null,"compensates":null}`, "ok"],
    [`{"tenant":"t","action_id":"a","tool":"x","arguments":{"n":18446744073709551615}}`, "ok"],
    [
      `{"tenant":"t","action_id":"a","tool":"x","arguments":{"n":18446744073709551616}}`,
      "not_json",
    ],
  ];
  const codes = new Set<string>();
  for (const [body, expected] of cases) {
    assert.equal(verdict(body), expected, String(body).slice(0, 120));
    codes.add(expected.split(" ")[0] as string);
  }
  for (const code of CODES) assert.ok(codes.has(code), code);
});

test("validateIntent checks the exact bytes that will be sent", () => {
  const intent: Intent = {
    tenant: "north-shop",
    action_id: "refund-1",
    tool: "refund",
    arguments: { order: "o-1", amount_cents: 4850, big: 12345678901234567890n },
    call_id: "c-1",
  };
  const { intent: decoded, body } = validateIntent(intent);
  assert.equal(
    new TextDecoder().decode(body),
    '{"tenant":"north-shop","action_id":"refund-1","tool":"refund","arguments":{"order":"o-1","amount_cents":4850,"big":12345678901234567890},"call_id":"c-1"}',
  );
  assert.equal(decoded.arguments.big, 12345678901234567890n);
  const bad = (i: Intent, code: string): void =>
    assert.throws(
      () => validateIntent(i),
      (e: unknown) => e instanceof InvalidIntentError && e.code === code,
    );
  bad({ ...intent, arguments: { n: Number.NaN } }, "not_json");
  bad({ ...intent, arguments: { n: 2 ** 64 } }, "not_json");
  bad({ ...intent, arguments: { s: "\ud800" } }, "not_json");
  bad({ ...intent, tenant: "north shop" }, "invalid_characters");
  bad({ ...intent, action_id: "" }, "empty_field");
  bad({ ...intent, compensates: "é" }, "invalid_characters");
});

test("fingerprint: RFC 8785 with exact 64-bit integers and compensates", () => {
  // Expected values computed by the Python client (clients/python fingerprint.py).
  assert.equal(
    fingerprintCanonical(
      "refund_reversal",
      { reverses: "refund-1", n: [1, 2.5, null, true] },
      "refund-1",
    ),
    '{"arguments":{"n":[1,2.5,null,true],"reverses":"refund-1"},"compensates":"refund-1","tool":"refund_reversal"}',
  );
  assert.equal(
    fingerprint("refund_reversal", { reverses: "refund-1", n: [1, 2.5, null, true] }, "refund-1"),
    "b61d6579a5515b377689a1fb7f45fac7691efce5275c042b50819d9a50c8fc3e",
  );
  assert.equal(
    fingerprint("t", {
      big: 12345678901234567890n,
      neg: -9223372036854775808n,
      f: 1e21,
      s: "é\u001f\u2028",
      "\u{1F600}": 1,
      "\uff61": 2,
    }),
    "fef786fa03e5087f755bc8dc9326b08591273ee8abab534944e8828ceedb4629",
  );
  // call_id and reply_to never change it; compensates does.
  assert.notEqual(fingerprint("t", {}), fingerprint("t", {}, "x"));
  assert.equal(fingerprint("t", {}, null), fingerprint("t", {}));
});

test("result routing keys", () => {
  assert.equal(resultRoutingKey("north-shop"), "north-shop");
  assert.equal(resultRoutingKey("north-shop", null), "north-shop");
  assert.equal(resultRoutingKey("north-shop", "agent-7"), "north-shop.@.agent-7");
  // Over 255 bytes: the worker routes by tenant.
  assert.equal(
    resultRoutingKey("t".repeat(200), "r".repeat(52)),
    `${"t".repeat(200)}.@.${"r".repeat(52)}`,
  );
  assert.equal(resultRoutingKey("t".repeat(200), "r".repeat(53)), "t".repeat(200));
});

test("trace context headers: as given, tracestate only with a traceparent", () => {
  const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  assert.deepEqual(traceHeaders({}), {});
  assert.deepEqual(traceHeaders({ traceparent }), { traceparent });
  assert.deepEqual(traceHeaders({ traceparent, tracestate: "k=v" }), {
    traceparent,
    tracestate: "k=v",
  });
  assert.throws(() => traceHeaders({ tracestate: "k=v" }), TypeError);
});

test("without @opentelemetry/api: no import error, explicit headers only", async () => {
  const guard = fileURLToPath(new URL("../support/framework-guard.js", import.meta.url));
  const trace = fileURLToPath(new URL("../../src/trace.js", import.meta.url));
  const script = `
    const t = await import(${JSON.stringify(trace)});
    const target = { exchange: "x", tenant: "t", actionId: "a" };
    const given = { traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" };
    console.log(JSON.stringify({
      api: await import("@opentelemetry/api").then(() => "present", () => "absent"),
      explicit: await t.inPublishSpan(target, given, async (h) => h),
      none: await t.inPublishSpan(target, {}, async (h) => h),
      outbox: await t.currentTraceHeaders({}),
    }));`;
  const { stdout } = await promisify(execFile)(
    process.execPath,
    ["--import", guard, "--input-type=module", "-e", script],
    { env: { ...process.env, HIDE_PACKAGES: "@opentelemetry/api" } },
  );
  assert.deepEqual(JSON.parse(stdout), {
    api: "absent",
    explicit: { traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" },
    none: {},
    outbox: {},
  });
});

test("result events: strict where the worker's reader is", () => {
  const base = {
    tenant: "t",
    action_id: "a",
    tool: "x",
    status: "pending",
    receipt: null,
    next_action: "check_status",
    attempts: 1,
    message: "m",
    fingerprint: null,
    event_id: "e",
    occurred_at: "2025-01-01T00:00:00.000Z",
  };
  const event = parseResultEvent(JSON.stringify({ ...base, uncertainty: "held", extra: 1 }));
  assert.equal(event.status, "pending");
  assert.equal(event.uncertainty, "held");
  assert.equal(event.verified_by, null);
  assert.equal(isFinal(event), false);
  for (const bad of [
    { ...base, status: "done" },
    { ...base, attempts: -1 },
    { ...base, reason: "because" },
    { ...base, retry_after_ms: -5 },
    { ...base, event_id: undefined },
  ]) {
    assert.throws(() => parseResultEvent(JSON.stringify(bad)), InvalidResultEventError);
  }
  assert.throws(() => parseResultEvent("[]"), InvalidResultEventError);
});

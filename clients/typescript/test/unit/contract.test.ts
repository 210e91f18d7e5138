// The shared fixtures (docs/schema/fixtures, also checked by the Rust decoder in
// protocol/tests/schema_fixtures.rs and by the Python client): same verdicts, same fingerprints.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import path from "node:path";
import { test } from "node:test";
import {
  decodeIntent,
  fingerprint,
  fingerprintCanonical,
  InvalidIntentError,
  InvalidResultEventError,
  parseResultEvent,
} from "../../src/index.js";
import { parseJson } from "../../src/json.js";
import { FIXTURES } from "../support/paths.js";

interface Generated {
  prefix: string;
  fill: string;
  suffix: string;
  bytes: number;
}
interface Case {
  name: string;
  file?: string;
  generated?: Generated;
  code?: string;
  field?: string;
}

function read(kind: string): { accepted: Case[]; rejected: Case[] } {
  return JSON.parse(readFileSync(path.join(FIXTURES, kind, "cases.json"), "utf8"));
}

function bodyOf(kind: string, c: Case): Uint8Array {
  if (c.file !== undefined) return readFileSync(path.join(FIXTURES, kind, c.file));
  const g = c.generated as Generated;
  const head = Buffer.from(g.prefix + g.suffix);
  const fill = Buffer.from(g.fill);
  const count = (g.bytes - head.length) / fill.length;
  const body = Buffer.from(g.prefix + g.fill.repeat(count) + g.suffix);
  assert.equal(body.length, g.bytes, c.name);
  return body;
}

const intents = read("intent");

test("every accepted intent fixture decodes", () => {
  assert.ok(intents.accepted.length > 5);
  for (const c of intents.accepted) {
    assert.doesNotThrow(() => decodeIntent(bodyOf("intent", c)), c.name);
  }
});

test("every rejected intent fixture is refused with its code and field", () => {
  assert.ok(intents.rejected.length > 20);
  for (const c of intents.rejected) {
    let error: unknown;
    try {
      decodeIntent(bodyOf("intent", c));
    } catch (e) {
      error = e;
    }
    assert.ok(error instanceof InvalidIntentError, `${c.name}: accepted`);
    assert.equal(error.code, c.code, c.name);
    assert.equal(error.field, c.field, c.name);
  }
});

interface FingerprintCase {
  name: string;
  tool: string;
  arguments: string;
  canonical: string;
  fingerprint: string;
}

test("fingerprints equal the worker's on the shared table", () => {
  const { cases } = JSON.parse(
    readFileSync(path.join(FIXTURES, "fingerprint", "cases.json"), "utf8"),
  ) as { cases: FingerprintCase[] };
  assert.ok(cases.length >= 10);
  for (const c of cases) {
    const args = parseJson(c.arguments).value;
    assert.equal(fingerprintCanonical(c.tool, args), c.canonical, c.name);
    assert.equal(fingerprint(c.tool, args), c.fingerprint, c.name);
  }
});

interface ResultCase {
  name: string;
  file: string;
  rust_decoder?: "accepts" | "rejects";
}

test("result event fixtures read as the worker's reader reads them", () => {
  const { accepted, rejected } = JSON.parse(
    readFileSync(path.join(FIXTURES, "result", "cases.json"), "utf8"),
  ) as { accepted: ResultCase[]; rejected: ResultCase[] };
  assert.ok(accepted.length > 3 && rejected.length > 3);
  for (const c of accepted) {
    const body = readFileSync(path.join(FIXTURES, "result", c.file));
    const event = parseResultEvent(body);
    const raw = JSON.parse(body.toString()) as Record<string, unknown>;
    for (const [name, value] of Object.entries(raw)) {
      if (!(name in event)) {
        assert.equal(c.name, "unknown_fields_ignored", `${c.name}: ${name} was dropped`);
        continue;
      }
      assert.deepEqual(
        (event as unknown as Record<string, unknown>)[name],
        value,
        `${c.name}.${name}`,
      );
    }
  }
  for (const c of rejected) {
    const body = readFileSync(path.join(FIXTURES, "result", c.file));
    if (c.rust_decoder === "rejects") {
      assert.throws(() => parseResultEvent(body), InvalidResultEventError, c.name);
    } else {
      assert.doesNotThrow(() => parseResultEvent(body), c.name);
    }
  }
});

// The wording of answers for the model and the rules of intent-backed tools (no services).
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { aiSdkTool } from "../../src/adapters/ai.js";
import { langchainTool } from "../../src/adapters/langchain.js";
import {
  actionScope,
  answerFor,
  currentActionId,
  type IntentClient,
  intentTool,
  MissingActionIdError,
  parseResultEvent,
  type ResultEvent,
} from "../../src/index.js";

function event(fields: Record<string, unknown>): ResultEvent {
  return parseResultEvent({
    tenant: "north-shop",
    action_id: "refund-1",
    tool: "refund",
    attempts: 1,
    message: "msg.",
    event_id: "e-1",
    occurred_at: "2026-01-01T00:00:00Z",
    ...fields,
  });
}

const PARAMS = {
  type: "object",
  properties: { order: { type: "string" } },
  required: ["order"],
} as const;

test("silence and pending read as outcome unknown, never as a failure", () => {
  const silent = answerFor(null, "refund", "refund-1");
  assert.equal(silent.status, null);
  assert.ok(silent.outcomeUnknown);
  assert.match(
    silent.text,
    /^OUTCOME UNKNOWN\. .*refund \(action refund-1\).*Do NOT retry or resubmit it/,
  );
  const pending = answerFor(
    event({ status: "pending", uncertainty: "unknown_outcome" }),
    "refund",
    "refund-1",
  );
  assert.ok(pending.outcomeUnknown);
  assert.match(pending.text, /^OUTCOME UNKNOWN\..* Worker says: msg\.$/);
});

test("awaiting approval, in progress, not approved, expired", () => {
  const waiting = answerFor(
    event({ status: "pending", uncertainty: "awaiting_approval" }),
    "refund",
    "refund-1",
  );
  assert.ok(waiting.awaitingApproval && waiting.outcomeUnknown);
  assert.match(
    waiting.text,
    /^AWAITING APPROVAL\..*nothing has been sent\. Do NOT retry or resubmit/,
  );
  const running = answerFor(
    event({ status: "pending", uncertainty: "in_progress", remote_id: "op-9" }),
    "refund",
    "refund-1",
  );
  assert.match(
    running.text,
    /^ACCEPTED, IN PROGRESS\..*\(action refund-1\) as operation op-9 and is still/,
  );
  const rejected = answerFor(
    event({ status: "failed", detail: "not_approved" }),
    "refund",
    "refund-1",
  );
  assert.ok(rejected.notApproved && !rejected.outcomeUnknown);
  assert.match(
    rejected.text,
    /^NOT APPROVED \(nothing was sent.*msg\. Tell the user; do not call again/,
  );
  const expired = answerFor(
    event({ status: "failed", detail: "approval_expired" }),
    "refund",
    "refund-1",
  );
  assert.match(expired.text, /^APPROVAL EXPIRED \(nothing was sent/);
});

test("succeeded, failed, rejected and compensation mentions", () => {
  const done = answerFor(
    event({ status: "succeeded", receipt: { z: 1, a: "x" }, compensated_by: "undo-1" }),
    "refund",
    "refund-1",
  );
  assert.equal(
    done.text,
    'SUCCEEDED. msg. Receipt: {"a":"x","z":1} It has since been undone by action undo-1.',
  );
  const undo = answerFor(event({ status: "succeeded", compensates: "refund-0" }), "undo", "u-1");
  assert.match(undo.text, /This undid action refund-0\.$/);
  assert.equal(
    answerFor(event({ status: "failed" }), "refund", "refund-1").text,
    "FAILED (it was not applied and will not be). msg.",
  );
  assert.equal(
    answerFor(event({ status: "rejected", reason: "intent_conflict", detail: "d" }), "refund", "r")
      .text,
    "REJECTED (intent_conflict; nothing was done). msg. Detail: d.",
  );
});

test("a tool never invents an action id; reserved parameters are refused", async () => {
  const client = {} as IntentClient;
  const refund = intentTool({
    client,
    tenant: "north-shop",
    tool: "refund",
    description: "Refund an order",
    parameters: PARAMS,
  });
  await assert.rejects(refund.execute({ order: "o-1" }), MissingActionIdError);
  assert.throws(
    () =>
      intentTool({
        client,
        tenant: "north-shop",
        tool: "refund",
        description: "x",
        parameters: { type: "object", properties: { action_id: { type: "string" } } },
      }),
    /set by the application/,
  );
  assert.equal(currentActionId(), undefined);
  await actionScope("refund-1", async () => {
    await new Promise((r) => setTimeout(r, 1));
    assert.equal(currentActionId(), "refund-1");
  });
});

test("execute publishes under the scope's action id and call id, and words silence", async () => {
  const sent: unknown[] = [];
  const fake = {
    async publish(intent: unknown) {
      sent.push(intent);
      return intent;
    },
    async waitFor() {
      const { NoAnswerError } = await import("../../src/errors.js");
      throw new NoAnswerError("nothing");
    },
  } as unknown as IntentClient;
  const refund = intentTool({
    client: () => fake,
    tenant: () => "north-shop",
    tool: "refund",
    description: "Refund an order",
    parameters: PARAMS,
    timeoutMs: 10,
  });
  const text = await actionScope("refund-9", () => refund.execute({ order: "o-1" }), {
    callId: "call-1",
  });
  assert.match(text, /^OUTCOME UNKNOWN/);
  assert.deepEqual(sent, [
    {
      tenant: "north-shop",
      action_id: "refund-9",
      tool: "refund",
      arguments: { order: "o-1" },
      call_id: "call-1",
    },
  ]);
});

test("each adapter is its own entry point of the package", async () => {
  // By package name (self-reference through "exports"), as an application imports them; the
  // specifiers are variables so that type-checking does not need a build.
  const entries: Record<string, string> = {
    "intent-worker-client": "intentTool",
    "intent-worker-client/ai": "aiSdkTool",
    "intent-worker-client/langchain": "langchainTool",
    "intent-worker-client/openai-agents": "openAiAgentsTool",
  };
  for (const [specifier, name] of Object.entries(entries)) {
    const module = (await import(specifier)) as Record<string, unknown>;
    assert.equal(typeof module[name], "function", specifier);
  }
  const main = (await import(Object.keys(entries)[0] as string)) as Record<string, unknown>;
  assert.equal(main.aiSdkTool, undefined);
});

test("the main entry point loads no framework; an adapter loads its own", async () => {
  const guard = fileURLToPath(new URL("../support/framework-guard.js", import.meta.url));
  const load = (specifier: string, allowed: string) =>
    promisify(execFile)(
      process.execPath,
      [
        "--import",
        guard,
        "--input-type=module",
        "-e",
        `await import(${JSON.stringify(specifier)})`,
      ],
      { env: { ...process.env, FRAMEWORK_ALLOWED: allowed } },
    );
  await Promise.all([
    load("intent-worker-client", ""),
    load("intent-worker-client/ai", "ai"),
    // The guard works: the AI SDK entry may not load without its framework.
    assert.rejects(load("intent-worker-client/ai", "@openai/"), /forbidden import of ai/),
  ]);
});

test("the call id: the framework's tool call id, else the scope's; ignored when unusable", async () => {
  const sent: { call_id?: string }[] = [];
  const fake = {
    async publish(intent: { call_id?: string }) {
      sent.push(intent);
      return intent;
    },
    async waitFor() {
      return parseResultEvent({
        tenant: "north-shop",
        action_id: "refund-9",
        tool: "refund",
        status: "failed",
        attempts: 1,
        message: "no.",
        event_id: "e",
        occurred_at: "2026-01-01T00:00:00Z",
      });
    },
  } as unknown as IntentClient;
  const refund = intentTool({
    client: fake,
    tenant: "north-shop",
    tool: "refund",
    description: "Refund an order",
    parameters: PARAMS,
  });
  await actionScope(
    "refund-9",
    async () => {
      await refund.execute({ order: "o-1" }, { callId: "tool-call-1" });
      await refund.execute({ order: "o-1" }, { callId: "bad\nid" });
      await refund.execute({ order: "o-1" });
      await aiSdkTool(refund).execute?.({ order: "o-1" }, { toolCallId: "ai-1", messages: [] });
      await langchainTool(refund).invoke({
        id: "lc-1",
        name: "refund",
        args: { order: "o-1" },
        type: "tool_call",
      });
    },
    { callId: "scope-call" },
  );
  assert.deepEqual(
    sent.map((i) => i.call_id),
    ["tool-call-1", "scope-call", "scope-call", "ai-1", "lc-1"],
  );
});

test("compensate sends the intent with compensates set, and waits as sendAndWait does", async () => {
  const calls: unknown[] = [];
  const fake = {
    async sendAndWait(intent: unknown, options: unknown) {
      calls.push([intent, options]);
      return "answer";
    },
  };
  const { IntentClient } = await import("../../src/index.js");
  const answer = await IntentClient.prototype.compensate.call(
    fake as unknown as IntentClient,
    "refund-1",
    { tenant: "north-shop", action_id: "undo-refund-1", tool: "reverse", arguments: { a: 1 } },
    { timeoutMs: 5 },
  );
  assert.equal(answer, "answer");
  assert.deepEqual(calls, [
    [
      {
        tenant: "north-shop",
        action_id: "undo-refund-1",
        tool: "reverse",
        arguments: { a: 1 },
        compensates: "refund-1",
      },
      { timeoutMs: 5 },
    ],
  ]);
});

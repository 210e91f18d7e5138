// The framework adapters driven by each framework's own tool-calling loop, with scripted models,
// against a real worker: the model calls the tool twice (reordered keys, another call id) inside
// one actionScope, and the downstream sees ONE write (its own table, never logs). And the agent
// example of this package's guide (README.md, "Tools for agents"), type-checked and run as
// written, as clients/python/tests/test_readme.py does for Python.
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { randomUUID } from "node:crypto";
import { mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import path from "node:path";
import { after, before, test } from "node:test";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { BaseChatModel } from "@langchain/core/language_models/chat_models";
import { AIMessage, type BaseMessage, HumanMessage, ToolMessage } from "@langchain/core/messages";
import type { ChatResult } from "@langchain/core/outputs";
import {
  Agent,
  type Model,
  type ModelRequest,
  type ModelResponse,
  run,
  setTracingDisabled,
  Usage,
} from "@openai/agents";
import { generateText, stepCountIs } from "ai";
import { MockLanguageModelV2 } from "ai/test";
import ts from "typescript";
import { aiSdkTools } from "../../src/adapters/ai.js";
import { langchainTool } from "../../src/adapters/langchain.js";
import { openAiAgentsTool } from "../../src/adapters/openai-agents.js";
import { actionScope, IntentClient, type IntentTool, intentTool } from "../../src/index.js";
import { AMQP_URL, World } from "../support/world.js";

/** clients/typescript (this file is dist/test/integration/readme.test.js). */
const PACKAGE = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../../..");
/** Inside the package, so `intent-worker-client` resolves to itself (its "exports"). */
const SCRATCH = path.join(PACKAGE, "dist", "readme-example");

function agentExample(): string {
  const readme = readFileSync(path.join(PACKAGE, "README.md"), "utf8");
  const section = readme.slice(readme.indexOf("## Tools for agents"));
  const block = /```ts\n([\s\S]*?)```/.exec(section);
  assert.ok(block?.[1], "README.md has no ts block under 'Tools for agents'");
  return block[1];
}

let world: World;
let client: IntentClient;
let refund: IntentTool;
before(async () => {
  setTracingDisabled(true);
  world = await World.start();
  client = await IntentClient.connect(AMQP_URL, {
    intentsExchange: world.intentsExchange,
    resultsExchange: world.resultsExchange,
    bindTenant: true,
  });
  refund = intentTool({
    client,
    tenant: world.tenant,
    tool: "refund",
    description: "Refund an order to the customer's card.",
    parameters: {
      type: "object",
      properties: {
        order: { type: "string" },
        amount_cents: { type: "integer" },
        currency: { type: "string" },
      },
      required: ["order", "amount_cents", "currency"],
      additionalProperties: false,
    },
    timeoutMs: 20_000,
  });
});
after(async () => {
  await client?.close();
  await world?.stop();
  rmSync(SCRATCH, { recursive: true, force: true });
});

const unique = (): string => `refund-${randomUUID().slice(0, 10)}`;
const FIRST = '{"order":"order-731","amount_cents":4850,"currency":"USD"}';
const AGAIN = '{"currency":"USD","order":"order-731","amount_cents":4850}';

/** The repeat reached the worker and was answered from its ledger (its own event, the same
 * receipt), and the downstream applied the action once. */
async function assertOneWrite(actionId: string): Promise<void> {
  const deadline = Date.now() + 10_000;
  let heard = client.heard(world.tenant, actionId);
  while (heard.length < 2 && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 50));
    heard = client.heard(world.tenant, actionId);
  }
  assert.equal(heard.length, 2, JSON.stringify(heard));
  assert.notEqual(heard[0]?.event_id, heard[1]?.event_id);
  assert.deepEqual(heard[1]?.receipt, heard[0]?.receipt);
  assert.equal(await world.mutations(`${world.tenant}:${actionId}`), 1);
}

function assertAnsweredOnce(texts: string[]): void {
  assert.equal(texts.length, 2, JSON.stringify(texts));
  for (const text of texts) assert.match(text, /^SUCCEEDED\. /);
  // The second call reached the same ledger row: the same receipt, no second write.
  const receipt = (t: string): string => t.slice(t.indexOf("Receipt: "));
  assert.equal(receipt(texts[1] as string), receipt(texts[0] as string));
}

test("Vercel AI SDK: generateText's tool loop, two calls, one write", async () => {
  const actionId = unique();
  const usage = { inputTokens: 1, outputTokens: 1, totalTokens: 2 };
  const call = (id: string, input: string) => ({
    content: [{ type: "tool-call" as const, toolCallId: id, toolName: "refund", input }],
    finishReason: "tool-calls" as const,
    usage,
    warnings: [],
  });
  const model = new MockLanguageModelV2({
    doGenerate: [
      call("call-1", FIRST),
      call("call-2", AGAIN),
      { content: [{ type: "text", text: "Refunded." }], finishReason: "stop", usage, warnings: [] },
    ],
  });
  const result = await actionScope(actionId, () =>
    generateText({
      model,
      tools: aiSdkTools(refund),
      prompt: "Refund order 731",
      stopWhen: stepCountIs(5),
    }),
  );
  assert.equal(result.text, "Refunded.");
  const outputs = result.steps.flatMap((s) => s.toolResults.map((r) => String(r.output)));
  assertAnsweredOnce(outputs);
  await assertOneWrite(actionId);
});

test("OpenAI Agents SDK: run() with a scripted Model, two calls, one write", async () => {
  const actionId = unique();
  const script: ModelResponse["output"][] = [
    [
      {
        type: "function_call",
        callId: "fc-1",
        name: "refund",
        arguments: FIRST,
        status: "completed",
      },
    ],
    [
      {
        type: "function_call",
        callId: "fc-2",
        name: "refund",
        arguments: AGAIN,
        status: "completed",
      },
    ],
    [
      {
        type: "message",
        role: "assistant",
        status: "completed",
        content: [{ type: "output_text", text: "Refunded." }],
      },
    ],
  ];
  const seen: ModelRequest[] = [];
  const model: Model = {
    async getResponse(request: ModelRequest): Promise<ModelResponse> {
      seen.push(request);
      const output = script.shift();
      if (output === undefined) throw new Error("the script is over");
      return { usage: new Usage(), output };
    },
    // biome-ignore lint/correctness/useYield: never streamed in this test
    async *getStreamedResponse() {
      throw new Error("not streamed");
    },
  };
  const agent = new Agent({
    name: "refunds",
    instructions: "Refund orders.",
    model,
    tools: [openAiAgentsTool(refund)],
  });
  const result = await actionScope(actionId, () => run(agent, "Refund order 731"));
  assert.equal(result.finalOutput, "Refunded.");
  const outputs = result.newItems
    .filter((i) => i.type === "tool_call_output_item")
    .map((i) => String((i as { output: unknown }).output));
  assertAnsweredOnce(outputs);
  assert.equal(seen.length, 3);
  await assertOneWrite(actionId);
});

/** A scripted tool-calling chat model: answers turn by turn, whatever it is sent. */
class ScriptedChatModel extends BaseChatModel {
  readonly sent: BaseMessage[][] = [];
  constructor(readonly turns: AIMessage[]) {
    super({});
  }
  _llmType(): string {
    return "scripted";
  }
  override bindTools(): this {
    return this;
  }
  async _generate(messages: BaseMessage[]): Promise<ChatResult> {
    this.sent.push([...messages]);
    const message = this.turns.shift();
    if (message === undefined) throw new Error("the script is over");
    return { generations: [{ text: String(message.content), message }] };
  }
}

test("LangChain.js: a chat model's tool calls through tool.invoke(toolCall), one write", async () => {
  const actionId = unique();
  const lc = langchainTool(refund);
  const model = new ScriptedChatModel([
    new AIMessage({
      content: "",
      tool_calls: [{ id: "lc-1", name: "refund", args: JSON.parse(FIRST), type: "tool_call" }],
    }),
    new AIMessage({
      content: "",
      tool_calls: [{ id: "lc-2", name: "refund", args: JSON.parse(AGAIN), type: "tool_call" }],
    }),
    new AIMessage("Refunded."),
  ]).bindTools();
  const tools = new Map([[lc.name, lc]]);
  const messages: BaseMessage[] = [new HumanMessage("Refund order 731")];
  const outputs: string[] = [];
  // The agent loop (what a ToolNode does): model -> tool calls -> ToolMessages -> model.
  const final = await actionScope(actionId, async () => {
    for (let step = 0; step < 5; step++) {
      const reply = (await model.invoke(messages)) as AIMessage;
      messages.push(reply);
      if (!reply.tool_calls?.length) return reply;
      for (const toolCall of reply.tool_calls) {
        const message = (await tools.get(toolCall.name)?.invoke(toolCall)) as ToolMessage;
        assert.ok(message instanceof ToolMessage);
        assert.equal(message.tool_call_id, toolCall.id);
        outputs.push(String(message.content));
        messages.push(message);
      }
    }
    throw new Error("no final answer");
  });
  assert.equal(final.content, "Refunded.");
  assertAnsweredOnce(outputs);
  await assertOneWrite(actionId);
});

test("the README's agent example type-checks (strict) and runs as written", async () => {
  mkdirSync(SCRATCH, { recursive: true });
  const source = path.join(SCRATCH, "example.mts");
  writeFileSync(source, agentExample());
  const program = ts.createProgram([source], {
    strict: true,
    noEmit: true,
    target: ts.ScriptTarget.ES2022,
    module: ts.ModuleKind.NodeNext,
    moduleResolution: ts.ModuleResolutionKind.NodeNext,
    types: ["node"],
    skipLibCheck: true,
  });
  const problems = ts
    .getPreEmitDiagnostics(program)
    .map((d) => ts.flattenDiagnosticMessageText(d.messageText, "\n"));
  assert.deepEqual(problems, []);
  const js = ts.transpileModule(agentExample(), {
    compilerOptions: { target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.ESNext },
  }).outputText;
  const script = path.join(SCRATCH, "example.mjs");
  writeFileSync(script, js);
  const env = {
    ...process.env,
    AMQP_URL,
    INTENTS_EXCHANGE: world.intentsExchange,
    RESULTS_EXCHANGE: world.resultsExchange,
    STATUS_URL: world.adminUrl,
    STATUS_TOKEN: world.tenantToken,
  };
  const runIt = async (): Promise<string> =>
    (await promisify(execFile)(process.execPath, [script], { env, timeout: 60_000 })).stdout;
  const first = await runIt();
  assert.match(first, /^SUCCEEDED\. /, first);
  // Run again (a restarted agent): the same action, answered from the ledger, still one write.
  const second = await runIt();
  assert.match(second, /^SUCCEEDED\. /, second);
  assert.equal(await world.mutations("north-shop:refund-order-731"), 1);
});

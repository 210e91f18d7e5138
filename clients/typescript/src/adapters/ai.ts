/**
 * The Vercel AI SDK (`ai`, v5) adapter: `import { aiSdkTool } from "intent-worker-client/ai"`.
 * `ai` is an optional peer dependency, needed only by this entry point.
 */
import { jsonSchema, type Tool, tool } from "ai";
import type { IntentTool } from "../tool.js";

/** An AI SDK tool (`tool({ description, inputSchema, execute })`) running `intentTool`; its
 * JSON Schema is wrapped with `jsonSchema()` (no zod needed). Put it in `tools` under
 * `intentTool.name`, or use {@link aiSdkTools}. */
export function aiSdkTool(intentTool: IntentTool): Tool<unknown, string> {
  return tool<unknown, string>({
    description: intentTool.description,
    inputSchema: jsonSchema<unknown>(intentTool.parameters as Parameters<typeof jsonSchema>[0]),
    execute: (input: unknown, { toolCallId }) => intentTool.execute(input, { callId: toolCallId }),
  });
}

/** `{ [name]: aiSdkTool(t) }` for each tool, ready for `generateText({ tools })`. */
export function aiSdkTools(...intentTools: IntentTool[]): Record<string, Tool<unknown, string>> {
  return Object.fromEntries(intentTools.map((t) => [t.name, aiSdkTool(t)]));
}

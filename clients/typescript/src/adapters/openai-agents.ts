/**
 * The OpenAI Agents SDK (`@openai/agents`) adapter:
 * `import { openAiAgentsTool } from "intent-worker-client/openai-agents"`.
 * `@openai/agents` is an optional peer dependency, needed only by this entry point.
 */
import { type FunctionTool, tool } from "@openai/agents";
import type { IntentTool } from "../tool.js";

type JsonParameters = Extract<
  Parameters<typeof tool>[0]["parameters"],
  { additionalProperties: true }
>;

/** A function tool (`tool({ name, description, parameters, strict: false, execute })`) running
 * `intentTool`; its JSON Schema is passed as is (non-strict: the schema need not meet the
 * strict-mode rules). */
export function openAiAgentsTool(intentTool: IntentTool): FunctionTool {
  return tool({
    name: intentTool.name,
    description: intentTool.description,
    parameters: intentTool.parameters as unknown as JsonParameters,
    strict: false,
    execute: (input: unknown, _context, details) =>
      intentTool.execute(input, { callId: details?.toolCall?.callId }),
  }) as unknown as FunctionTool;
}

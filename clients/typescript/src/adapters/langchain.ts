/**
 * The LangChain.js (`@langchain/core`) adapter:
 * `import { langchainTool } from "intent-worker-client/langchain"`.
 * `@langchain/core` is an optional peer dependency, needed only by this entry point.
 */
import { type DynamicStructuredTool, tool } from "@langchain/core/tools";
import type { IntentTool } from "../tool.js";

type JsonSchemaParameter = Extract<Parameters<typeof tool>[1]["schema"], { type?: unknown }>;

/** A structured tool (`tool()` of `@langchain/core/tools`, JSON Schema input) running
 * `intentTool`; bind it to a chat model (`model.bindTools([...])`) and invoke it with the
 * model's tool calls (`tool.invoke(toolCall)` gives a ToolMessage). */
export function langchainTool(intentTool: IntentTool): DynamicStructuredTool {
  return tool(
    (input: unknown, config) => intentTool.execute(input, { callId: config?.toolCall?.id }),
    {
      name: intentTool.name,
      description: intentTool.description,
      schema: intentTool.parameters as unknown as JsonSchemaParameter,
    },
  ) as unknown as DynamicStructuredTool;
}

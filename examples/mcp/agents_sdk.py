"""The OpenAI Agents SDK calling `publisher mcp`: the application supplies the action id
through `tool_meta_resolver`, so the model never names (or renames) the action.

    MCP_URL=http://127.0.0.1:9470/mcp MCP_TOKEN=... python agents_sdk.py          # no model
    OPENAI_API_KEY=... MCP_URL=... MCP_TOKEN=... python agents_sdk.py --run "Refund order 731"

Without `--run` it drives the same SDK objects without a model: it connects the MCP server
object, lists the tools the model would see, and invokes `refund` through the SDK's own tool
invocation path (`MCPUtil.invoke_mcp_tool`), which calls the meta resolver exactly as an agent
run does. The test command runs that part.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass

from agents import Agent, RunContextWrapper, Runner
from agents.mcp import MCPServerStreamableHttp, MCPUtil
from agents.mcp.util import MCPToolMetaContext

ACTION_ID_META = "io.intent-worker/action_id"


@dataclass
class Conversation:
    """The application's state for one run: it decides the action ids."""

    case_id: str

    def action_id(self, tool: str, arguments: dict[str, object] | None) -> str:
        # One logical action per (case, tool, order): a retried or repeated model call maps
        # to the same key, a different order to a different one.
        order = (arguments or {}).get("order", "")
        return f"{self.case_id}:{tool}:{order}"


def resolve_action_id(ctx: MCPToolMetaContext) -> dict[str, str]:
    conversation: Conversation = ctx.run_context.context
    return {ACTION_ID_META: conversation.action_id(ctx.tool_name, ctx.arguments)}


def gateway(url: str, token: str) -> MCPServerStreamableHttp:
    return MCPServerStreamableHttp(
        params={"url": url, "headers": {"Authorization": f"Bearer {token}"}, "timeout": 30},
        name="intent-worker",
        cache_tools_list=True,
        use_structured_content=True,
        tool_meta_resolver=resolve_action_id,
        # The gateway's "outcome unknown" text must reach the model unchanged: no SDK retries
        # (a retry is the same key anyway, but the model should read the first answer).
        max_retry_attempts=0,
    )


def agent(server: MCPServerStreamableHttp) -> Agent[Conversation]:
    return Agent[Conversation](
        name="refunds",
        instructions=(
            "You handle refunds. If a tool answers OUTCOME UNKNOWN, tell the user the refund "
            "is being checked; never call the tool again for it."
        ),
        mcp_servers=[server],
    )


async def without_model(url: str, token: str, case_id: str) -> None:
    async with gateway(url, token) as server:
        tools = await server.list_tools()
        names = sorted(t.name for t in tools)
        print("tools:", names)
        assert "refund" in names, names
        refund = next(t for t in tools if t.name == "refund")
        context = RunContextWrapper(Conversation(case_id=case_id))
        arguments = json.dumps({"order": "order-731", "amount_cents": 4850})
        first = await MCPUtil.invoke_mcp_tool(server, refund, context, arguments)
        print("first:", first)
        assert "succeeded" in str(first), first
        again = await MCPUtil.invoke_mcp_tool(server, refund, context, arguments)
        assert str(again) == str(first) or "rcpt-" in str(again), again
        print("ok")


async def with_model(url: str, token: str, case_id: str, prompt: str) -> None:
    async with gateway(url, token) as server:
        result = await Runner.run(agent(server), prompt, context=Conversation(case_id=case_id))
        print(result.final_output)


if __name__ == "__main__":
    url, token = os.environ["MCP_URL"], os.environ["MCP_TOKEN"]
    case_id = os.environ.get("CASE_ID", "case-42")
    if len(sys.argv) > 2 and sys.argv[1] == "--run":
        asyncio.run(with_model(url, token, case_id, sys.argv[2]))
    else:
        asyncio.run(without_model(url, token, case_id))

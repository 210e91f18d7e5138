"""A plain MCP client (the `mcp` package) calling `publisher mcp` over streamable HTTP.

The application, not the model, names the action: the action id goes in the request's
`_meta` under `io.intent-worker/action_id`; the bearer token decides the tenant.

    MCP_URL=http://127.0.0.1:9470/mcp MCP_TOKEN=... ACTION_ID=refund-order-731 python mcp_client.py

Exits non-zero if an answer is not what the gateway promises (the test command runs it).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

ACTION_ID_META = "io.intent-worker/action_id"


def text_of(result: object) -> str:
    return "\n".join(getattr(c, "text", "") for c in getattr(result, "content", []))


async def main() -> int:
    url = os.environ["MCP_URL"]
    token = os.environ["MCP_TOKEN"]
    action_id = os.environ.get("ACTION_ID", "refund-order-731")
    headers = {"Authorization": f"Bearer {token}"}
    async with create_mcp_http_client(headers=headers) as http:
        async with streamable_http_client(url, http_client=http) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                tools = await session.list_tools()
                names = sorted(t.name for t in tools.tools)
                print("tools:", names)
                assert "refund" in names and "get_action_status" in names, names

                arguments = {"order": "order-731", "amount_cents": 4850}
                meta = {ACTION_ID_META: action_id}
                first = await session.call_tool("refund", arguments, meta=meta)
                assert not first.is_error, text_of(first)
                event = first.structured_content or {}
                assert event.get("status") == "succeeded", event
                print("receipt:", json.dumps(event["receipt"]))

                # A retry (a broken stream, a repeating model) under the same key: same receipt.
                again = await session.call_tool("refund", arguments, meta=meta)
                assert (again.structured_content or {}).get("receipt") == event["receipt"]

                # Without the action id nothing is sent, and the message says how to supply it.
                refused = await session.call_tool("refund", arguments)
                assert refused.is_error and ACTION_ID_META in text_of(refused), text_of(refused)
                print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

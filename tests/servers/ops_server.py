"""A small operations tool server over MCP stdio, for the tests of approval gates: it records every call.

    python tests/servers/ops_server.py --calls-log PATH

Tools: restart_service (changes something; its service must be a lowercase name, force a boolean),
status (read-only) and restart_slowly (changes something; sleeps an hour, for a call cut off in flight).
Each tools/call appends one JSON line {"tool", "arguments"} to the log before the tool acts.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

SERVICE = {"type": "string", "pattern": "^[a-z][a-z0-9-]*$", "description": "The service's name."}
RESTART_IN = {"type": "object", "required": ["service"], "additionalProperties": False,
              "properties": {"service": SERVICE, "force": {"type": "boolean", "description": "Kill it if it hangs."}}}
# name -> (description, input schema, read-only?)
TOOL_SPECS: dict[str, tuple[str, dict, bool]] = {
    "restart_service": ("Restart a service.", RESTART_IN, False),
    "status": ("How a service is.", {"type": "object", "required": ["service"], "additionalProperties": False,
                                     "properties": {"service": SERVICE}}, True),
    "restart_slowly": ("Restart a service, taking an hour.", RESTART_IN, False),
}


def make_server(calls_log: str | None) -> Any:
    import anyio
    from mcp import MCPError
    from mcp.server import Server, ServerRequestContext
    from mcp.types import (INVALID_PARAMS, CallToolRequestParams, CallToolResult, ListToolsResult,
                           PaginatedRequestParams, TextContent, Tool, ToolAnnotations)

    tools = [Tool(name=name, description=desc, input_schema=schema,
                  annotations=ToolAnnotations(read_only_hint=ro, destructive_hint=None if ro else True))
             for name, (desc, schema, ro) in TOOL_SPECS.items()]

    def data(d: dict) -> CallToolResult:
        return CallToolResult(content=[TextContent(type="text", text=json.dumps(d))], structured_content=d)

    async def list_tools(ctx: ServerRequestContext, params: PaginatedRequestParams | None) -> ListToolsResult:
        return ListToolsResult(tools=tools)

    async def call_tool(ctx: ServerRequestContext, params: CallToolRequestParams) -> CallToolResult:
        name, args = params.name, params.arguments or {}
        if calls_log:
            with open(calls_log, "a") as f:
                f.write(json.dumps({"tool": name, "arguments": args}) + "\n")
        if name == "restart_service":
            return data({"status": f"restarted {args.get('service')}", "force": bool(args.get("force"))})
        if name == "status":
            return data({"status": f"{args.get('service')} is running"})
        if name == "restart_slowly":
            await anyio.sleep(3600)
            return data({"status": "restarted late"})
        raise MCPError(INVALID_PARAMS, f"Unknown tool: {name}")

    return Server("ops", version="0.1.0", on_list_tools=list_tools, on_call_tool=call_tool)


async def serve(server: Any) -> None:
    from mcp.server.stdio import stdio_server
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls-log", metavar="PATH", help="append one JSON line per tools/call")
    a = p.parse_args()
    import anyio
    anyio.run(serve, make_server(a.calls_log))
    return 0


if __name__ == "__main__":
    sys.exit(main())

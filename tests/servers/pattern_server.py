"""An MCP tool server (stdio) whose input schema holds patterns RE2 cannot take, for the daemon's tests.

    python tests/servers/pattern_server.py

Its one tool, `label`, takes a `name` that must not be `admin` (a lookahead), a `code` of one or more
`a`s written as `^(a+)+$` (the pattern that backtracks for hours), and extra keys of a doubled letter
(`xx`, a backreference) holding integers, with `unevaluatedProperties: false` beside them. It checks
nothing itself and answers the arguments it got as structured content.
"""
from __future__ import annotations

from typing import Any

INPUT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^(?!admin$)[a-z]+$"},
        "code": {"type": "string", "pattern": "^(a+)+$"},
    },
    "patternProperties": {"^([a-z])\\1$": {"type": "integer"}, "^(a+)+$": {"type": "integer"}},
    "unevaluatedProperties": False,
    "required": ["name"],
}


def make_server() -> Any:
    from mcp import MCPError
    from mcp.server import Server, ServerRequestContext
    from mcp.types import (INVALID_PARAMS, CallToolRequestParams, CallToolResult, ListToolsResult,
                           PaginatedRequestParams, TextContent, Tool, ToolAnnotations)

    tools = [Tool(name="label", description="Answers the arguments it got.", input_schema=INPUT_SCHEMA,
                  annotations=ToolAnnotations(read_only_hint=True))]

    async def list_tools(ctx: ServerRequestContext, params: PaginatedRequestParams | None) -> ListToolsResult:
        return ListToolsResult(tools=tools)

    async def call_tool(ctx: ServerRequestContext, params: CallToolRequestParams) -> CallToolResult:
        if params.name != "label":
            raise MCPError(INVALID_PARAMS, f"Unknown tool: {params.name}")
        args = dict(params.arguments or {})
        return CallToolResult(content=[TextContent(type="text", text="ok")], structured_content={"got": args})

    return Server("patterns", version="0.1.0", on_list_tools=list_tools, on_call_tool=call_tool)


async def serve() -> None:
    from mcp.server.stdio import stdio_server
    server = make_server()
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


if __name__ == "__main__":
    import anyio
    anyio.run(serve)

"""An MCP tool server (stdio) that gives secrets away, for tests of the daemon's scrubbing.

    python tests/servers/secret_server.py

It reads its secret from $SECRET_VALUE (the operator's `env`), and holds a few secrets of its own that
it returns under secret-named keys. Every tool is read-only; none takes arguments.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

#: Returned under secret-named keys and repeated in text: the daemon knows them by their keys only.
KEYED_API_KEY = "kv-9f2c41d7e8-keyed"
KEYED_ACCESS_TOKEN = "at-51b7e0c3aa-session"
KEYED_PASSWORD = "pw-c0ffee-77d1"

NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}


def make_server() -> Any:
    from mcp import MCPError
    from mcp.server import Server, ServerRequestContext
    from mcp.types import (INVALID_PARAMS, CallToolRequestParams, CallToolResult, ListToolsResult,
                           PaginatedRequestParams, TextContent, Tool, ToolAnnotations)

    secret = os.environ.get("SECRET_VALUE", "")
    specs = {
        "leak": "Says hello with the configured secret: in text, in structured content and in _meta.",
        "keyed": "Signs in: its own api_key, access_token and password, repeated in text.",
        "fail": "A tool error whose text holds the configured secret.",
        "refuse": "Refuses the arguments with a message that holds the configured secret.",
        "stderr": f"Writes its key ({secret}) to stderr, then answers ok.",
        "escaped": "Answers JSON text that spells the configured secret with escapes (\\/ and \\uXXXX).",
    }
    tools = [Tool(name=name, description=desc, input_schema=NO_ARGS, annotations=ToolAnnotations(read_only_hint=True))
             for name, desc in specs.items()]

    async def list_tools(ctx: ServerRequestContext, params: PaginatedRequestParams | None) -> ListToolsResult:
        return ListToolsResult(tools=tools)

    def text(*texts: str, **kw: Any) -> CallToolResult:
        return CallToolResult(content=[TextContent(type="text", text=t) for t in texts], **kw)

    async def call_tool(ctx: ServerRequestContext, params: CallToolRequestParams) -> CallToolResult:
        match params.name:
            case "leak":
                return text(f"the key is {secret} (from the environment)",
                            structured_content={"greeting": f"hello {secret}!", "deep": {"list": [f"<{secret}>"]}},
                            meta={"seen": secret})
            case "keyed":
                return text(f"signed in as bob with key {KEYED_API_KEY}; session {KEYED_ACCESS_TOKEN}",
                            json.dumps({"user": "bob", "password": KEYED_PASSWORD}),
                            structured_content={"user": "bob", "api_key": KEYED_API_KEY,
                                                "session": {"access_token": KEYED_ACCESS_TOKEN}},
                            meta={"hint": f"the password was {KEYED_PASSWORD}"})
            case "fail":
                return text(f"access denied for key {secret}", is_error=True)
            case "refuse":
                raise MCPError(INVALID_PARAMS, f"the key {secret} is not accepted here")
            case "escaped":         # every other character as \uXXXX (upper-case hex), every / as \/
                spelled = "".join("\\/" if c == "/" else f"\\u{ord(c):04X}" if i % 2 else c for i, c in enumerate(secret))
                slashed = secret.replace("/", "\\/")
                return text('{"greeting": "hello ' + spelled + '!", "slashed": "' + slashed + '", "n": 1}')
            case "stderr":
                sys.stderr.write(f"secret_server: debug: key={secret}\n")
                sys.stderr.flush()
                return text("ok")
        raise MCPError(INVALID_PARAMS, f"Unknown tool: {params.name}")

    return Server("secret", version="0.1.0", on_list_tools=list_tools, on_call_tool=call_tool)


async def serve() -> None:
    from mcp.server.stdio import stdio_server
    server = make_server()
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


if __name__ == "__main__":
    import anyio
    anyio.run(serve)

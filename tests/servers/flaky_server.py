"""An MCP tool server that misbehaves on purpose, for failure tests of MCP clients.

    python tests/servers/flaky_server.py [--http PORT [--http-429 N]] [--slow-start S] [--exit-at-start]
                                         [--calls-log PATH]

stdio by default; --http serves streamable HTTP at http://127.0.0.1:PORT/mcp, and --http-429 N answers the
first N POSTs to /mcp with 429 + `Retry-After: 2`. --slow-start sleeps S seconds before serving,
--exit-at-start exits with code 1 at once. --calls-log appends one JSON line {"tool", "arguments"} per
tools/call, written before the tool acts (so a crash or hang still leaves its trace).

Arguments are deliberately NOT validated here, so a client's own argument checks are observable.
The tool names say what they do; *_ro tools carry read_only_hint=True, *_rw ones read_only_hint=False.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from typing import Any

BIG_BYTES = 1_310_720          # 1.25 MiB of payload in structured content


def _in(props: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


def _out(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props)}


TEXT = {"type": "string", "description": "Any text."}
OPT_TEXT = _in({"text": TEXT})
# name -> (description, input schema, output schema or None, read-only?)
TOOL_SPECS: dict[str, tuple[str, dict, dict | None, bool]] = {
    "echo": ("Echo the text (and n) back as structured content.",
             _in({"text": TEXT, "n": {"type": "integer", "minimum": 0, "description": "Any number."}}, ("text",)),
             _out({"echo": {"type": "string"}, "n": {"type": ["integer", "null"]}}), True),
    "write": ("Pretend to write the text somewhere (not read-only).", _in({"text": TEXT}, ("text",)),
              _out({"written": {"type": "string"}}), False),
    "text_json": ("Only a text block holding JSON; no structured content.", OPT_TEXT, None, True),
    "plain_text": ("Only a text block that is not JSON.", _in({}), None, True),
    "empty": ("A result with no content at all.", _in({}), None, True),
    "fail_ro": ("Always a tool error (is_error).", _in({"text": TEXT}, ("text",)), None, True),
    "fail_rw": ("Always a tool error (is_error).", _in({"text": TEXT}, ("text",)), None, False),
    "hang_ro": ("Sleeps for an hour.", OPT_TEXT, None, True),
    "hang_rw": ("Sleeps for an hour.", OPT_TEXT, None, False),
    "crash_ro": ("The server process exits (code 3) during the call.", OPT_TEXT, None, True),
    "crash_rw": ("The server process exits (code 3) during the call.", OPT_TEXT, None, False),
    "invalid_params": ("Answers with the JSON-RPC error -32602 (invalid params).",
                       _in({"x": {"description": "Anything."}}, ("x",)), None, True),
    "big": (f"Structured content of `size` bytes of payload (default {BIG_BYTES}).",
            _in({"size": {"type": "integer", "minimum": 0, "description": "Payload bytes."}}),
            _out({"size": {"type": "integer"}, "data": {"type": "string"}}), True),
    "secret_echo": ("Echo the arguments plus the value of $FLAKY_SECRET.", _in({"text": TEXT}, ("text",)),
                    _out({"args": {"type": "object"}, "secret": {"type": ["string", "null"]}}), True),
    "retry_after": ("A tool error carrying _meta.retry_after_ms = ms.",
                    _in({"ms": {"type": "integer", "minimum": 0, "description": "Milliseconds."}}, ("ms",)), None, True),
}


def make_server(calls_log: str | None = None) -> Any:
    import anyio
    from mcp import MCPError
    from mcp.server import Server, ServerRequestContext
    from mcp.types import (INVALID_PARAMS, CallToolRequestParams, CallToolResult, ListToolsResult,
                           PaginatedRequestParams, TextContent, Tool, ToolAnnotations)

    tools = [Tool(name=name, description=desc, input_schema=ins, output_schema=outs,
                  annotations=ToolAnnotations(read_only_hint=ro, destructive_hint=None if ro else False))
             for name, (desc, ins, outs, ro) in TOOL_SPECS.items()]

    def text(t: str, *, is_error: bool = False, meta: dict | None = None, data: dict | None = None) -> CallToolResult:
        return CallToolResult(content=[TextContent(type="text", text=t)], is_error=is_error, meta=meta,
                              structured_content=data)

    def data(d: dict) -> CallToolResult:
        return text(json.dumps(d), data=d)

    async def list_tools(ctx: ServerRequestContext, params: PaginatedRequestParams | None) -> ListToolsResult:
        return ListToolsResult(tools=tools)

    async def call_tool(ctx: ServerRequestContext, params: CallToolRequestParams) -> CallToolResult:
        name, args = params.name, params.arguments or {}
        if calls_log:
            with open(calls_log, "a") as f:
                f.write(json.dumps({"tool": name, "arguments": args}) + "\n")
        match name:
            case "echo":
                return data({"echo": args.get("text"), "n": args.get("n")})
            case "write":
                return data({"written": args.get("text")})
            case "text_json":
                return text(json.dumps({"text": args.get("text"), "kind": "text_json"}))
            case "plain_text":
                return text("this is plain text, not JSON")
            case "empty":
                return CallToolResult(content=[])
            case "fail_ro" | "fail_rw":
                return text(f"{name} failed on purpose: {args.get('text')}", is_error=True)
            case "hang_ro" | "hang_rw":
                await anyio.sleep(3600)
                return text("woke up")
            case "crash_ro" | "crash_rw":
                sys.stderr.write(f"flaky_server: {name}: exiting\n")
                sys.stderr.flush()
                os._exit(3)
            case "invalid_params":
                raise MCPError(INVALID_PARAMS, f"invalid x: {args.get('x')!r}", {"field": "x"})
            case "big":
                size = args.get("size", BIG_BYTES)
                return text(f"{size} bytes in structured content", data={"size": size, "data": "x" * size})
            case "secret_echo":
                return data({"args": args, "secret": os.environ.get("FLAKY_SECRET")})
            case "retry_after":
                d = {"error": "throttled", "retry_after_ms": args.get("ms")}
                return text(json.dumps(d), is_error=True, meta={"retry_after_ms": args.get("ms")}, data=d)
        raise MCPError(INVALID_PARAMS, f"Unknown tool: {name}")

    return Server("flaky", version="0.1.0", on_list_tools=list_tools, on_call_tool=call_tool)


class TooManyRequests:
    """ASGI middleware: the first `n` POSTs to `path` get 429 with `Retry-After: 2`."""

    def __init__(self, app, n: int, path: str = "/mcp"):
        self.app, self.left, self.path = app, n, path

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == self.path and self.left > 0:
            self.left -= 1
            await send({"type": "http.response.start", "status": 429,
                        "headers": [(b"retry-after", b"2"), (b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"too many requests"})
            return
        await self.app(scope, receive, send)


async def serve(server: Any, http_port: int | None, http_429: int = 0) -> None:
    if http_port is None:
        from mcp.server.stdio import stdio_server
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
        return
    import uvicorn
    app = TooManyRequests(server.streamable_http_app(host="127.0.0.1"), http_429)
    await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=http_port, log_level="warning")).serve()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT/mcp")
    p.add_argument("--http-429", type=int, default=0, metavar="N", help="first N POSTs to /mcp answer 429")
    p.add_argument("--slow-start", type=float, default=0, metavar="S", help="sleep S seconds before serving")
    p.add_argument("--exit-at-start", action="store_true", help="exit with code 1 at once")
    p.add_argument("--calls-log", metavar="PATH", help="append one JSON line per tools/call")
    a = p.parse_args()
    if a.exit_at_start:
        sys.stderr.write("flaky_server: exiting at start as asked\n")
        return 1
    if a.slow_start:
        time.sleep(a.slow_start)
    import anyio
    anyio.run(serve, make_server(a.calls_log), a.http, a.http_429)
    return 0


if __name__ == "__main__":
    sys.exit(main())
